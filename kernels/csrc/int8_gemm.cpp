// Weight-only int8 GEMM for few rows (decode, verify, short prefill) on CPU.
//
// W[n, k] = scale[n, g] * q[n, k] + zero[n, g] for g = k / G: asymmetric uint8 codes with one
// fp32 scale and zero (the group's minimum) per G inputs of an output channel. The weight is
// packed in blocks of 8 output channels, group by group:
//   q     [N/8][K/G][8][G]  uint8     (N padded to a multiple of 8)
//   scale [N/8][K/G][8]     float32   (zero alike)
// so a block is one sequential stream (8 separate row streams ran at half the speed).
// Rows of x: up to three dot straight from the codes, each dequantized vector feeding every
// row from registers; more dequantize the block once into a cache-resident buffer first. Both run each out[m, n] in one fixed order (scale * q + zero as
// one FMA per weight, then 8-lane FMA chains down k, then the lanes), and threads split only
// over channel blocks: a token's numbers do not depend on the batch it runs in, so greedy
// output stays batch-invariant. Compiled on the serving machine with -march=native
// (kernels/int8_cpu.py).
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kBlock = 8;         // output channels per packed block
constexpr int64_t kFusedMaxRows = 3;  // beyond this, dequantizing once per block pays

#if defined(__AVX2__) && defined(__FMA__)
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_hadd_ps(s, s);
  return _mm_cvtss_f32(_mm_hadd_ps(s, s));
}

inline __m256 dequant8(const uint8_t* q, __m256 scale, __m256 zero) {
  const __m256i qi = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q)));
  return _mm256_fmadd_ps(_mm256_cvtepi32_ps(qi), scale, zero);
}

// out[r] = x . W[r] for the block's 8 channels, dequantizing on the fly (one row: the
// template below at MR = 1 compiles ~25% slower here).
inline void dot_fused1(const float* x, const uint8_t* q, const float* scale, const float* zero,
                       int64_t groups, int64_t group, float* out) {
  __m256 acc[kBlock];
  for (int r = 0; r < kBlock; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* qg = q + g * kBlock * group;
    const float* xg = x + g * group;
    for (int r = 0; r < kBlock; ++r) {
      const __m256 s = _mm256_set1_ps(scale[g * kBlock + r]);
      const __m256 z = _mm256_set1_ps(zero[g * kBlock + r]);
      for (int64_t i = 0; i < group; i += 8)
        acc[r] = _mm256_fmadd_ps(_mm256_loadu_ps(xg + i), dequant8(qg + r * group + i, s, z),
                                 acc[r]);
    }
  }
  for (int r = 0; r < kBlock; ++r) out[r] = hsum(acc[r]);
}

// out[m * 8 + r] = x[m] . W[r] for MR rows and the block's 8 channels, dequantizing on the
// fly: each dequantized vector feeds all MR rows from registers (MR * 8 accumulators;
// AVX-512VL's 32 registers hold them for MR <= 3; past that the buffered path is faster).
template <int MR>
inline void dot_fused(const float* x, int64_t k, const uint8_t* q, const float* scale,
                      const float* zero, int64_t groups, int64_t group, float* out) {
  __m256 acc[MR][kBlock];
  for (int m = 0; m < MR; ++m)
    for (int r = 0; r < kBlock; ++r) acc[m][r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* qg = q + g * kBlock * group;
    const float* xg = x + g * group;
    for (int r = 0; r < kBlock; ++r) {
      const __m256 s = _mm256_set1_ps(scale[g * kBlock + r]);
      const __m256 z = _mm256_set1_ps(zero[g * kBlock + r]);
      for (int64_t i = 0; i < group; i += 8) {
        const __m256 w = dequant8(qg + r * group + i, s, z);
        for (int m = 0; m < MR; ++m)
          acc[m][r] = _mm256_fmadd_ps(_mm256_loadu_ps(xg + m * k + i), w, acc[m][r]);
      }
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int r = 0; r < kBlock; ++r) out[m * kBlock + r] = hsum(acc[m][r]);
}

// The block's 8 channels as fp32 rows w[r * k + i].
inline void dequant_block(const uint8_t* q, const float* scale, const float* zero,
                          int64_t groups, int64_t group, float* w) {
  const int64_t k = groups * group;
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* qg = q + g * kBlock * group;
    for (int r = 0; r < kBlock; ++r) {
      const __m256 s = _mm256_set1_ps(scale[g * kBlock + r]);
      const __m256 z = _mm256_set1_ps(zero[g * kBlock + r]);
      for (int64_t i = 0; i < group; i += 8)
        _mm256_storeu_ps(w + r * k + g * group + i, dequant8(qg + r * group + i, s, z));
    }
  }
}

inline void dot_buffered(const float* x, const float* w, int64_t k, float* out) {
  __m256 acc[kBlock];
  for (int r = 0; r < kBlock; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t i = 0; i < k; i += 8) {
    const __m256 xv = _mm256_loadu_ps(x + i);
    for (int r = 0; r < kBlock; ++r)
      acc[r] = _mm256_fmadd_ps(xv, _mm256_loadu_ps(w + r * k + i), acc[r]);
  }
  for (int r = 0; r < kBlock; ++r) out[r] = hsum(acc[r]);
}
#else
// Portable fallback (no AVX2/FMA): the same layout, one fixed order per output too.
inline void dequant_block(const uint8_t* q, const float* scale, const float* zero,
                          int64_t groups, int64_t group, float* w) {
  const int64_t k = groups * group;
  for (int64_t g = 0; g < groups; ++g)
    for (int r = 0; r < kBlock; ++r)
      for (int64_t i = 0; i < group; ++i)
        w[r * k + g * group + i] =
            scale[g * kBlock + r] * static_cast<float>(q[(g * kBlock + r) * group + i]) +
            zero[g * kBlock + r];
}

inline void dot_buffered(const float* x, const float* w, int64_t k, float* out) {
  for (int r = 0; r < kBlock; ++r) {
    float sum = 0.f;
    for (int64_t i = 0; i < k; ++i) sum += x[i] * w[r * k + i];
    out[r] = sum;
  }
}

inline void dot_fused1(const float* x, const uint8_t* q, const float* scale, const float* zero,
                       int64_t groups, int64_t group, float* out) {
  std::vector<float> w(kBlock * groups * group);
  dequant_block(q, scale, zero, groups, group, w.data());
  dot_buffered(x, w.data(), groups * group, out);
}

template <int MR>
inline void dot_fused(const float* x, int64_t k, const uint8_t* q, const float* scale,
                      const float* zero, int64_t groups, int64_t group, float* out) {
  std::vector<float> w(kBlock * groups * group);
  dequant_block(q, scale, zero, groups, group, w.data());
  for (int m = 0; m < MR; ++m) dot_buffered(x + m * k, w.data(), k, out + m * kBlock);
}
#endif

}  // namespace

// x [M, K] fp32; q [N8/8, K/G, 8, G] uint8; scale, zero [N8/8, K/G, 8] fp32 -> [M, N] fp32
torch::Tensor int8_gemm(torch::Tensor x, torch::Tensor q, torch::Tensor scale,
                        torch::Tensor zero, int64_t out_features) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.is_contiguous(),
              "x must be a contiguous 2-D float32 tensor");
  TORCH_CHECK(q.dim() == 4 && q.scalar_type() == torch::kByte && q.is_contiguous() &&
                  q.size(2) == kBlock,
              "q must be contiguous uint8 [N/8, K/G, 8, G]");
  const int64_t M = x.size(0), K = x.size(1), N = out_features;
  const int64_t blocks = q.size(0), groups = q.size(1), group = q.size(3);
  TORCH_CHECK(group % 8 == 0 && groups * group == K, "q's groups (", groups, " x ", group,
              ") must cover x's ", K, " inputs in multiples of 8");
  TORCH_CHECK(N > 0 && N <= blocks * kBlock && N > (blocks - 1) * kBlock,
              "out_features ", N, " does not fit ", blocks, " blocks");
  for (const auto& t : {scale, zero}) {
    TORCH_CHECK(t.scalar_type() == torch::kFloat && t.is_contiguous() && t.dim() == 3 &&
                    t.size(0) == blocks && t.size(1) == groups && t.size(2) == kBlock,
                "scale and zero must be contiguous float32 [N/8, K/G, 8]");
  }
  auto out = torch::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const uint8_t* qp = q.data_ptr<uint8_t>();
  const float* sp = scale.data_ptr<float>();
  const float* zp = zero.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const bool fused = M <= kFusedMaxRows;
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    std::vector<float> w(fused ? 0 : kBlock * K);
    float dots[kFusedMaxRows * kBlock];
    for (int64_t b = b0; b < b1; ++b) {
      const uint8_t* qb = qp + b * K * kBlock;
      const float *sb = sp + b * groups * kBlock, *zb = zp + b * groups * kBlock;
      const int64_t n0 = b * kBlock, R = std::min(kBlock, N - n0);
      if (fused) {
        switch (M) {
          case 1: dot_fused1(xp, qb, sb, zb, groups, group, dots); break;
          case 2: dot_fused<2>(xp, K, qb, sb, zb, groups, group, dots); break;
          default: dot_fused<3>(xp, K, qb, sb, zb, groups, group, dots);
        }
        for (int64_t m = 0; m < M; ++m)
          for (int64_t r = 0; r < R; ++r) op[m * N + n0 + r] = dots[m * kBlock + r];
        continue;
      }
      dequant_block(qb, sb, zb, groups, group, w.data());
      for (int64_t m = 0; m < M; ++m) {
        dot_buffered(xp + m * K, w.data(), K, dots);
        for (int64_t r = 0; r < R; ++r) op[m * N + n0 + r] = dots[r];
      }
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("int8_gemm", &int8_gemm, "x @ W.T for packed weight-only int8 W, few rows of x");
}
