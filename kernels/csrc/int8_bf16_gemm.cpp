// Weight-only int8 GEMM with bf16 activations, for CPUs with AVX512-BF16 (--dtype int8-bf16).
//
// int8_gemm.cpp multiplies fp32 activations by dequantized weights: one fp32 FMA per weight and
// row, ~90 GFLOP/s on one core here, its peak. vdpbf16ps does two products per lane (exact:
// bf16 x bf16 fits fp32), so rounding the activations to bf16 doubles that peak. The weights'
// codes need no rounding: a code n < 128 is exactly the bf16 with bits 0x4300 | n (128 + n),
// so a code vector is one widening and one OR, with no conversion through fp32.
//
// W[n, k] = scale[n, g] * (code[n, k] - C) + zero[n, g] for g = k / G, codes < 128, C a
// per-weight center (so the rounding error of x meets codes of either sign). Per group and row:
//   acc = sum_k (128 + code) * bf16(x)           (fp32, vdpbf16ps in k order)
//   out += scale * (acc - (128 + C) * sum_k bf16(x)) + zero * sum_k x
// The zero term uses x itself, so only the codes' products see the rounding.
//
// Packed in tiles of 16 output channels, group by group, input pair by input pair:
//   q     [N/16][K/G][G/2][16][2]  uint8   (N padded to a multiple of 16)
//   scale [N/16][K/G][16]          float32 (zero alike)
// so one 32-byte load is 16 channels' codes for two inputs, one vdpbf16ps operand.
//
// A register tile is 16 channels by up to 12 rows; each row runs the same instructions in the
// same order whatever the row count or thread split (threads split only over channel tiles),
// so a token's numbers do not depend on its batch and greedy output stays batch-invariant.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>
#define TANDEM_BF16 1
#else
#define TANDEM_BF16 0
#endif

namespace {

constexpr int64_t kChannels = 16;  // output channels per packed tile
constexpr int64_t kRows = 12;      // rows per register tile: 24 of the 32 zmm registers
constexpr int64_t kPrefetchAhead = 8192;

#if TANDEM_BF16
inline __m512bh codes(const uint8_t* q) {  // 32 codes -> 32 bf16 of 128 + code
  const __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q));
  return (__m512bh)_mm512_or_si512(_mm512_cvtepu8_epi16(c), _mm512_set1_epi16(0x4300));
}

// out[m * ldo + j] for MR rows and one tile's 16 channels. xb [rows][K/2] bf16 pairs;
// off, sx [rows][groups]: (128 + C) * sum bf16(x) and sum x per group.
template <int MR>
inline void tile(const uint32_t* xb, int64_t ldx, const float* off, const float* sx,
                 int64_t lds, const uint8_t* q, const float* scale, const float* zero,
                 int64_t groups, int64_t group, float* out, int64_t ldo) {
  __m512 acc[MR], o[MR];
  for (int m = 0; m < MR; ++m) o[m] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* qg = q + g * group * kChannels;
    const uint32_t* xg = xb + g * (group / 2);
    for (int64_t l = 0; l < group * kChannels; l += 64)
      __builtin_prefetch(qg + kPrefetchAhead + l, 0, 3);
    for (int m = 0; m < MR; ++m) acc[m] = _mm512_setzero_ps();
    for (int64_t i = 0; i < group / 2; ++i) {
      const __m512bh w = codes(qg + i * 2 * kChannels);
      for (int m = 0; m < MR; ++m)
        acc[m] = _mm512_dpbf16_ps(acc[m], w, (__m512bh)_mm512_set1_epi32(xg[m * ldx + i]));
    }
    const __m512 s = _mm512_loadu_ps(scale + g * kChannels);
    const __m512 z = _mm512_loadu_ps(zero + g * kChannels);
    for (int m = 0; m < MR; ++m) {
      const __m512 t = _mm512_sub_ps(acc[m], _mm512_set1_ps(off[m * lds + g]));
      o[m] = _mm512_fmadd_ps(t, s, o[m]);
      o[m] = _mm512_fmadd_ps(z, _mm512_set1_ps(sx[m * lds + g]), o[m]);
    }
  }
  for (int m = 0; m < MR; ++m) _mm512_storeu_ps(out + m * ldo, o[m]);
}

inline void rows_tile(int64_t rows, const uint32_t* xb, int64_t ldx, const float* off,
                      const float* sx, int64_t lds, const uint8_t* q, const float* scale,
                      const float* zero, int64_t groups, int64_t group, float* out) {
  switch (rows) {
#define TANDEM_ROWS(R) \
    case R: tile<R>(xb, ldx, off, sx, lds, q, scale, zero, groups, group, out, kChannels); break;
    TANDEM_ROWS(1) TANDEM_ROWS(2) TANDEM_ROWS(3) TANDEM_ROWS(4) TANDEM_ROWS(5) TANDEM_ROWS(6)
    TANDEM_ROWS(7) TANDEM_ROWS(8) TANDEM_ROWS(9) TANDEM_ROWS(10) TANDEM_ROWS(11)
#undef TANDEM_ROWS
    default: tile<kRows>(xb, ldx, off, sx, lds, q, scale, zero, groups, group, out, kChannels);
  }
}

// Row m of x as bf16 pairs (round to nearest even), and per group the two sums, in k order.
void prepare(const float* x, int64_t K, int64_t groups, int64_t group, float center,
             uint32_t* xb, float* off, float* sx) {
  for (int64_t k = 0; k < K; k += 32) {
    const __m512 lo = _mm512_loadu_ps(x + k), hi = _mm512_loadu_ps(x + k + 16);
    _mm512_storeu_si512(xb + k / 2, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
  }
  const uint16_t* half = reinterpret_cast<const uint16_t*>(xb);
  for (int64_t g = 0; g < groups; ++g) {
    float exact = 0.f, rounded = 0.f;
    for (int64_t i = g * group; i < (g + 1) * group; ++i) {
      const uint32_t bits = static_cast<uint32_t>(half[i]) << 16;
      float v;
      std::memcpy(&v, &bits, sizeof v);
      exact += x[i];
      rounded += v;
    }
    sx[g] = exact;
    off[g] = (128.f + center) * rounded;
  }
}
#endif

}  // namespace

bool available() { return TANDEM_BF16; }

// x [M, K] fp32 -> [M, N] fp32; q [N16/16, K/G, G/2, 16, 2] uint8 (codes < 128);
// scale, zero [N16/16, K/G, 16] fp32 (zero for code C); center C.
torch::Tensor int8_bf16_gemm(torch::Tensor x, torch::Tensor q, torch::Tensor scale,
                             torch::Tensor zero, int64_t out_features, int64_t center) {
  TORCH_CHECK(TANDEM_BF16, "int8-bf16 needs a CPU with AVX512-BF16 (this one has none)");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.is_contiguous(),
              "x must be a contiguous 2-D float32 tensor");
  TORCH_CHECK(q.dim() == 5 && q.scalar_type() == torch::kByte && q.is_contiguous() &&
                  q.size(3) == kChannels && q.size(4) == 2,
              "q must be contiguous uint8 [N/16, K/G, G/2, 16, 2]");
  const int64_t M = x.size(0), K = x.size(1), N = out_features;
  const int64_t tiles = q.size(0), groups = q.size(1), group = 2 * q.size(2);
  TORCH_CHECK(groups * group == K && K % 32 == 0, "q's groups (", groups, " x ", group,
              ") must cover x's ", K, " inputs, a multiple of 32");
  TORCH_CHECK(N > 0 && N <= tiles * kChannels && N > (tiles - 1) * kChannels,
              "out_features ", N, " does not fit ", tiles, " tiles");
  for (const auto& t : {scale, zero}) {
    TORCH_CHECK(t.scalar_type() == torch::kFloat && t.is_contiguous() && t.dim() == 3 &&
                    t.size(0) == tiles && t.size(1) == groups && t.size(2) == kChannels,
                "scale and zero must be contiguous float32 [N/16, K/G, 16]");
  }
  auto out = torch::empty({M, N}, x.options());
#if TANDEM_BF16
  if (M == 0) return out;
  auto xb = torch::empty({M, K / 2}, torch::dtype(torch::kInt32));
  auto sums = torch::empty({2, M, groups}, x.options());
  const float* xp = x.data_ptr<float>();
  auto* xbp = reinterpret_cast<uint32_t*>(xb.data_ptr<int32_t>());
  float* off = sums.data_ptr<float>();
  float* sx = off + M * groups;
  for (int64_t m = 0; m < M; ++m)
    prepare(xp + m * K, K, groups, group, static_cast<float>(center), xbp + m * (K / 2),
            off + m * groups, sx + m * groups);
  const uint8_t* qp = q.data_ptr<uint8_t>();
  const float* sp = scale.data_ptr<float>();
  const float* zp = zero.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    float buf[kRows * kChannels];
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t n0 = t * kChannels, R = std::min(kChannels, N - n0);
      for (int64_t m = 0; m < M; m += kRows) {
        const int64_t rows = std::min(kRows, M - m);
        rows_tile(rows, xbp + m * (K / 2), K / 2, off + m * groups, sx + m * groups, groups,
                  qp + t * K * kChannels, sp + t * groups * kChannels,
                  zp + t * groups * kChannels, groups, group, buf);
        for (int64_t i = 0; i < rows; ++i)
          std::copy(buf + i * kChannels, buf + i * kChannels + R, op + (m + i) * N + n0);
      }
    }
  });
#endif
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("available", &available, "whether this build has the AVX512-BF16 kernel");
  // Without the GIL, as int8_gemm: the product touches no Python object.
  m.def("int8_bf16_gemm", &int8_bf16_gemm, "x @ W.T for packed int8 W, x rounded to bf16",
        pybind11::call_guard<pybind11::gil_scoped_release>());
}
