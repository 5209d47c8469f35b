// Weight-only int8 GEMM for few rows (decode and verify) on CPU.
//
// W[n, k] = scale[n, g] * q[n, k] + zero[n, g], with g = k / group: asymmetric uint8 codes,
// one fp32 scale and zero (the group's minimum) per `group` inputs of an output channel.
// Blocks of 8 output channels are dequantized into a cache-resident fp32 buffer, then dotted
// with every input row (8 independent FMA chains per row): int8 is read once per call whatever
// the row count. Every out[m, n] is computed by the same loop whatever M is, and threads split
// only over channel blocks, so a token's numbers do not depend on the batch it runs in (greedy
// output stays batch-invariant). Compiled on the
// serving machine with -march=native (kernels/int8_cpu.py).
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kBlock = 8;  // output channels dequantized and dotted together

// Every out[m, n] runs one fixed order: w = scale * q + zero (one FMA per weight), then 8
// lanes of FMA chains down k, then the lanes summed. The same for every blocking, for rows
// dotted from the dequantized buffer and for rows dotted straight from q, so the result does
// not depend on how many rows x has.
#if defined(__AVX2__) && defined(__FMA__)
constexpr bool kFused = true;

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_hadd_ps(s, s);
  return _mm_cvtss_f32(_mm_hadd_ps(s, s));
}

inline __m256 dequant8(const uint8_t* q, __m256 scale, __m256 zero) {
  const __m256i qi = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q)));
  return _mm256_fmadd_ps(_mm256_cvtepi32_ps(qi), scale, zero);
}

inline void dequant_row(const uint8_t* q, const float* scale, const float* zero, int64_t k,
                        int64_t group, float* out) {
  for (int64_t g0 = 0, g = 0; g0 < k; g0 += group, ++g) {
    const __m256 s = _mm256_set1_ps(scale[g]), z = _mm256_set1_ps(zero[g]);
    for (int64_t i = g0; i < g0 + group; i += 8) _mm256_storeu_ps(out + i, dequant8(q + i, s, z));
  }
}

// out[r] = x . w[r], w: R dequantized rows of k floats.
template <int R>
inline void dot_buffered(const float* x, const float* w, int64_t k, float* out) {
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t i = 0; i < k; i += 8) {
    const __m256 xv = _mm256_loadu_ps(x + i);
    for (int r = 0; r < R; ++r) acc[r] = _mm256_fmadd_ps(xv, _mm256_loadu_ps(w + r * k + i), acc[r]);
  }
  for (int r = 0; r < R; ++r) out[r] = hsum(acc[r]);
}

// The same sums dequantizing on the fly (one or two rows of x: no buffer round trip). G is
// the group size when known at compile time (32), else 0 and `group` is used.
template <int R, int G>
inline void dot_fused(const float* x, const uint8_t* q, const float* scale, const float* zero,
                      int64_t k, int64_t group, float* out) {
  const int64_t gs = G ? G : group, groups = k / gs;
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t g0 = 0, g = 0; g0 < k; g0 += gs, ++g) {
    for (int r = 0; r < R; ++r) {
      const __m256 s = _mm256_set1_ps(scale[r * groups + g]);
      const __m256 z = _mm256_set1_ps(zero[r * groups + g]);
      const uint8_t* qr = q + r * k;
      for (int64_t i = g0; i < g0 + gs; i += 8)
        acc[r] = _mm256_fmadd_ps(_mm256_loadu_ps(x + i), dequant8(qr + i, s, z), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) out[r] = hsum(acc[r]);
}

template <int R>
inline void dot_fused(const float* x, const uint8_t* q, const float* scale, const float* zero,
                      int64_t k, int64_t group, float* out) {
  if (group == 32) {
    dot_fused<R, 32>(x, q, scale, zero, k, group, out);
  } else {
    dot_fused<R, 0>(x, q, scale, zero, k, group, out);
  }
}
#else
constexpr bool kFused = false;

inline void dequant_row(const uint8_t* q, const float* scale, const float* zero, int64_t k,
                        int64_t group, float* out) {
  for (int64_t i = 0; i < k; ++i) out[i] = scale[i / group] * static_cast<float>(q[i]) + zero[i / group];
}

template <int R>
inline void dot_buffered(const float* x, const float* w, int64_t k, float* out) {
  for (int r = 0; r < R; ++r) {
    float sum = 0.f;
    for (int64_t i = 0; i < k; ++i) sum += x[i] * w[r * k + i];
    out[r] = sum;
  }
}

template <int R>
inline void dot_fused(const float*, const uint8_t*, const float*, const float*, int64_t, int64_t,
                      float*) {}
#endif

constexpr int64_t kFusedMaxRows = 2;  // beyond this, dequantizing once per block pays

}  // namespace

// x [M, K] fp32, q [N, K] uint8, scale/zero [N, K / group] fp32 -> [M, N] fp32
torch::Tensor int8_gemm(torch::Tensor x, torch::Tensor q, torch::Tensor scale,
                        torch::Tensor zero, int64_t group) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.is_contiguous(),
              "x must be a contiguous 2-D float32 tensor");
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == torch::kByte && q.is_contiguous(),
              "q must be a contiguous 2-D uint8 tensor");
  const int64_t M = x.size(0), K = x.size(1), N = q.size(0);
  TORCH_CHECK(q.size(1) == K, "q has ", q.size(1), " inputs, x has ", K);
  TORCH_CHECK(group > 0 && group % 8 == 0 && K % group == 0, "group ", group,
              " must be a multiple of 8 dividing ", K);
  for (const auto& t : {scale, zero}) {
    TORCH_CHECK(t.scalar_type() == torch::kFloat && t.is_contiguous() && t.dim() == 2 &&
                    t.size(0) == N && t.size(1) == K / group,
                "scale and zero must be contiguous float32 [N, K / group]");
  }
  auto out = torch::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const uint8_t* qp = q.data_ptr<uint8_t>();
  const float* sp = scale.data_ptr<float>();
  const float* zp = zero.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t groups = K / group;
  const int64_t blocks = (N + kBlock - 1) / kBlock;
  const bool fused = kFused && M <= kFusedMaxRows;
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    std::vector<float> w(fused ? 0 : kBlock * K);
    float dots[kBlock];
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n0 = b * kBlock, R = std::min(kBlock, N - n0);
      const uint8_t* qb = qp + n0 * K;
      const float *sb = sp + n0 * groups, *zb = zp + n0 * groups;
      if (!fused) {
        for (int64_t r = 0; r < R; ++r)
          dequant_row(qb + r * K, sb + r * groups, zb + r * groups, K, group, w.data() + r * K);
      }
      for (int64_t m = 0; m < M; ++m) {
        const float* xm = xp + m * K;
        if (fused && R == kBlock) {
          dot_fused<kBlock>(xm, qb, sb, zb, K, group, dots);
        } else if (fused) {
          for (int64_t r = 0; r < R; ++r)
            dot_fused<1>(xm, qb + r * K, sb + r * groups, zb + r * groups, K, group, dots + r);
        } else if (R == kBlock) {
          dot_buffered<kBlock>(xm, w.data(), K, dots);
        } else {
          for (int64_t r = 0; r < R; ++r) dot_buffered<1>(xm, w.data() + r * K, K, dots + r);
        }
        for (int64_t r = 0; r < R; ++r) op[m * N + n0 + r] = dots[r];
      }
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("int8_gemm", &int8_gemm, "x @ dequant(q, scale, zero).T for few rows of x");
}
