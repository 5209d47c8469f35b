// Weight-only int8 GEMM for few rows (decode, verify, short prefill) on CPU.
//
// W[n, k] = scale[n, g] * q[n, k] + zero[n, g] for g = k / G: asymmetric uint8 codes with one
// fp32 scale and zero (the group's minimum) per G inputs of an output channel. The weight is
// packed in blocks of 8 output channels, group by group, input by input:
//   q     [N/8][K/G][G][8]  uint8     (N padded to a multiple of 8)
//   scale [N/8][K/G][8]     float32   (zero alike)
// so the 8 channels' codes of one input are 8 adjacent bytes: one load, one conversion and one
// FMA with the group's scale and zero vectors give the 8 weights as a vector.
//
// The product is an outer product per input: out[m][n..n+8] += x[m][k] (broadcast) * w_k. A
// register tile holds MR rows x NB blocks; each dequantized vector feeds MR rows and each
// broadcast NB blocks, so the weights are read and converted once per tile of rows, and no
// dequantized copy of the weight is ever written. (Dot products along k, with a dequantized
// buffer, ran at 40-55 GFLOP/s here from 4 rows on; this at 1.2-1.3x that on the target.)
//
// With AVX-512 a tile is two blocks (16 channels) in one zmm register by up to 12 rows: each
// dequantized vector then feeds 12 rows of 16 FMAs instead of 3 of 8,
// (one layer's products and the LM head of SmolLM2-135M, 1 thread: 1.7x faster at 16 rows,
// 2.4-2.8x at 32-48; bit for bit the same outputs).
//
// Without AVX-512, up to kNarrowRows rows (decode, a verify of a few drafts) a tile is one
// block by all the rows in ymm registers: the weight then streams from memory as a single
// row's does (measured with AVX-512 before the prefetch: 2 rows 1.0x one row's time, 4 rows
// 1.4x; the two-block tiles took 1.45x and 1.9x, they stalled the stream).
//
// Every output sums its even inputs and its odd inputs in two FMA chains, each in k order,
// then adds the two: the same arithmetic whatever the tile, row count or thread split
// (threads split only over channel blocks). So a token's numbers do not depend on the batch
// it runs in, and greedy output stays batch-invariant. Compiled on the serving machine with
// -march=native (kernels/int8_cpu.py).
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kBlock = 8;  // output channels per packed block
// Rows per tile: 3 rows x 2 blocks is 12 accumulators of each parity (24 registers); more
// spilled on this host (AVX-512VL's 32 ymm registers).
constexpr int64_t kTileRows = 3;
constexpr int64_t kNarrowRows = 5;  // 10 accumulators + 2 weight vectors + 2 broadcasts
// A wide tile asks for the codes this many bytes ahead of the ones it reads (about two tiles
// on): with two blocks in flight the hardware prefetcher fell behind, and 6-16 rows ran
// 10-30% slower from memory than from cache. A prefetch never faults past the end.
constexpr int64_t kPrefetchAhead = 8192;

inline void prefetch(const uint8_t* p, int64_t bytes) {
  for (int64_t l = 0; l < bytes; l += 64) __builtin_prefetch(p + l, 0, 3);
}

#if defined(__AVX2__) && defined(__FMA__)
inline __m256 dequant8(const uint8_t* q, __m256 scale, __m256 zero) {
  const __m256i qi = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q)));
  return _mm256_fmadd_ps(_mm256_cvtepi32_ps(qi), scale, zero);
}

// out[m * ldo + 8 * b + j] = x[m] . W[8 * (b0 + b) + j] for MR rows and NB blocks.
template <int MR, int NB>
inline void tile(const float* x, int64_t ldx, const uint8_t* q, const float* scale,
                 const float* zero, int64_t groups, int64_t group, int64_t b0, float* out,
                 int64_t ldo) {
  __m256 even[MR][NB], odd[MR][NB];
  for (int m = 0; m < MR; ++m)
    for (int b = 0; b < NB; ++b) even[m][b] = odd[m][b] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m256 s[NB], z[NB];
    const uint8_t* qg[NB];
    for (int b = 0; b < NB; ++b) {
      const int64_t at = (b0 + b) * groups + g;
      s[b] = _mm256_loadu_ps(scale + at * kBlock);
      z[b] = _mm256_loadu_ps(zero + at * kBlock);
      qg[b] = q + at * group * kBlock;
    }
    const float* xg = x + g * group;
    for (int64_t i = 0; i < group; i += 2) {
      __m256 w0[NB], w1[NB];
      for (int b = 0; b < NB; ++b) {
        w0[b] = dequant8(qg[b] + i * kBlock, s[b], z[b]);
        w1[b] = dequant8(qg[b] + (i + 1) * kBlock, s[b], z[b]);
      }
      for (int m = 0; m < MR; ++m) {
        const __m256 x0 = _mm256_broadcast_ss(xg + m * ldx + i);
        const __m256 x1 = _mm256_broadcast_ss(xg + m * ldx + i + 1);
        for (int b = 0; b < NB; ++b) {
          even[m][b] = _mm256_fmadd_ps(x0, w0[b], even[m][b]);
          odd[m][b] = _mm256_fmadd_ps(x1, w1[b], odd[m][b]);
        }
      }
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int b = 0; b < NB; ++b)
      _mm256_storeu_ps(out + m * ldo + b * kBlock, _mm256_add_ps(even[m][b], odd[m][b]));
}
#else
// Portable fallback (no AVX2/FMA): the same layout and the same two chains per output.
template <int MR, int NB>
inline void tile(const float* x, int64_t ldx, const uint8_t* q, const float* scale,
                 const float* zero, int64_t groups, int64_t group, int64_t b0, float* out,
                 int64_t ldo) {
  for (int m = 0; m < MR; ++m)
    for (int b = 0; b < NB; ++b)
      for (int64_t j = 0; j < kBlock; ++j) {
        float even = 0.f, odd = 0.f;
        for (int64_t g = 0; g < groups; ++g) {
          const int64_t at = (b0 + b) * groups + g;
          const float s = scale[at * kBlock + j], z = zero[at * kBlock + j];
          for (int64_t i = 0; i < group; ++i) {
            const float w = s * static_cast<float>(q[(at * group + i) * kBlock + j]) + z;
            (i % 2 ? odd : even) += x[m * ldx + g * group + i] * w;
          }
        }
        out[m * ldo + b * kBlock + j] = even + odd;
      }
}
#endif


#if defined(__AVX512F__)
// Two blocks (16 channels) in one zmm: lanes 0-7 block b0, 8-15 block b0 + 1. Each lane runs
// exactly the arithmetic of tile<>() above (the weight as fma(code, scale, zero), then an even
// and an odd FMA chain in k order, added at the end), so a row's outputs are bit for bit the
// same on either path, whatever the row count.
inline __m512 pair_of(const float* a, const float* b) {
  return _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(a)), _mm256_loadu_ps(b), 1);
}

template <int MR>
inline void tile16(const float* x, int64_t ldx, const uint8_t* q, const float* scale,
                   const float* zero, int64_t groups, int64_t group, int64_t b0, float* out,
                   int64_t ldo) {
  __m512 even[MR], odd[MR];
  for (int m = 0; m < MR; ++m) even[m] = odd[m] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t a0 = b0 * groups + g, a1 = (b0 + 1) * groups + g;
    const __m512 s = pair_of(scale + a0 * kBlock, scale + a1 * kBlock);
    const __m512 z = pair_of(zero + a0 * kBlock, zero + a1 * kBlock);
    const uint8_t* qa = q + a0 * group * kBlock;
    const uint8_t* qb = q + a1 * group * kBlock;
    const float* xg = x + g * group;
    prefetch(qa + kPrefetchAhead, group * kBlock);
    prefetch(qb + kPrefetchAhead, group * kBlock);
    for (int64_t i = 0; i < group; i += 2) {
      // 16 bytes of each block: its 8 channels' codes of inputs i and i + 1
      const __m128i ca = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qa + i * kBlock));
      const __m128i cb = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qb + i * kBlock));
      const __m512 w0 = _mm512_fmadd_ps(
          _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_unpacklo_epi64(ca, cb))), s, z);
      const __m512 w1 = _mm512_fmadd_ps(
          _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_unpackhi_epi64(ca, cb))), s, z);
      for (int m = 0; m < MR; ++m) {
        even[m] = _mm512_fmadd_ps(_mm512_set1_ps(xg[m * ldx + i]), w0, even[m]);
        odd[m] = _mm512_fmadd_ps(_mm512_set1_ps(xg[m * ldx + i + 1]), w1, odd[m]);
      }
    }
  }
  for (int m = 0; m < MR; ++m) _mm512_storeu_ps(out + m * ldo, _mm512_add_ps(even[m], odd[m]));
}

constexpr int64_t kWideRows = 12;  // rows per zmm tile: 24 accumulators of 32 registers

inline void rows16(const float* x, int64_t ldx, int64_t rows, const uint8_t* q,
                   const float* scale, const float* zero, int64_t groups, int64_t group,
                   int64_t b0, float* out, int64_t ldo) {
  switch (rows) {
#define TANDEM_ROWS16(R) \
    case R: tile16<R>(x, ldx, q, scale, zero, groups, group, b0, out, ldo); break;
    TANDEM_ROWS16(1) TANDEM_ROWS16(2) TANDEM_ROWS16(3) TANDEM_ROWS16(4) TANDEM_ROWS16(5)
    TANDEM_ROWS16(6) TANDEM_ROWS16(7) TANDEM_ROWS16(8) TANDEM_ROWS16(9) TANDEM_ROWS16(10)
    TANDEM_ROWS16(11)
#undef TANDEM_ROWS16
    default: tile16<kWideRows>(x, ldx, q, scale, zero, groups, group, b0, out, ldo);
  }
}
#define TANDEM_WIDE 1
#else
#define TANDEM_WIDE 0
#endif

template <int NB>
inline void rows_tile(const float* x, int64_t ldx, int64_t rows, const uint8_t* q,
                      const float* scale, const float* zero, int64_t groups, int64_t group,
                      int64_t b0, float* out, int64_t ldo) {
  switch (rows) {
    case 1: tile<1, NB>(x, ldx, q, scale, zero, groups, group, b0, out, ldo); break;
    case 2: tile<2, NB>(x, ldx, q, scale, zero, groups, group, b0, out, ldo); break;
    default: tile<kTileRows, NB>(x, ldx, q, scale, zero, groups, group, b0, out, ldo);
  }
}

// All `rows` (<= kNarrowRows) of x against one block.
inline void narrow_tile(const float* x, int64_t ldx, int64_t rows, const uint8_t* q,
                        const float* scale, const float* zero, int64_t groups, int64_t group,
                        int64_t b0, float* out, int64_t ldo) {
  switch (rows) {
#define TANDEM_NARROW(R) \
    case R: tile<R, 1>(x, ldx, q, scale, zero, groups, group, b0, out, ldo); break;
    TANDEM_NARROW(1) TANDEM_NARROW(2) TANDEM_NARROW(3) TANDEM_NARROW(4)
#undef TANDEM_NARROW
    default: tile<kNarrowRows, 1>(x, ldx, q, scale, zero, groups, group, b0, out, ldo);
  }
}

}  // namespace

// x [M, K] fp32; q [N8/8, K/G, G, 8] uint8; scale, zero [N8/8, K/G, 8] fp32 -> [M, N] fp32
torch::Tensor int8_gemm(torch::Tensor x, torch::Tensor q, torch::Tensor scale,
                        torch::Tensor zero, int64_t out_features) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.is_contiguous(),
              "x must be a contiguous 2-D float32 tensor");
  TORCH_CHECK(q.dim() == 4 && q.scalar_type() == torch::kByte && q.is_contiguous() &&
                  q.size(3) == kBlock,
              "q must be contiguous uint8 [N/8, K/G, G, 8]");
  const int64_t M = x.size(0), K = x.size(1), N = out_features;
  const int64_t blocks = q.size(0), groups = q.size(1), group = q.size(2);
  TORCH_CHECK(group % 2 == 0 && groups * group == K, "q's groups (", groups, " x ", group,
              ") must cover x's ", K, " inputs in groups of an even size");
  TORCH_CHECK(N > 0 && N <= blocks * kBlock && N > (blocks - 1) * kBlock,
              "out_features ", N, " does not fit ", blocks, " blocks");
  for (const auto& t : {scale, zero}) {
    TORCH_CHECK(t.scalar_type() == torch::kFloat && t.is_contiguous() && t.dim() == 3 &&
                    t.size(0) == blocks && t.size(1) == groups && t.size(2) == kBlock,
                "scale and zero must be contiguous float32 [N/8, K/G, 8]");
  }
  auto out = torch::empty({M, N}, x.options());
  if (M == 0) return out;  // no rows (a prefill chunk with no logits): nothing to read
  const float* xp = x.data_ptr<float>();
  const uint8_t* qp = q.data_ptr<uint8_t>();
  const float* sp = scale.data_ptr<float>();
  const float* zp = zero.data_ptr<float>();
  float* op = out.data_ptr<float>();
#if TANDEM_WIDE
  // With AVX-512 the prefetched wide tiles beat these from one row on (30 layers' projections
  // and the LM head from memory, 1 thread: 1 row 7.8 ms against 9.9, 4 rows 10.2 against 14.2).
  constexpr int64_t narrow_rows = 0;
#else
  constexpr int64_t narrow_rows = kNarrowRows;
#endif
  if (M <= narrow_rows) {  // a block at a time, every row at once: bound by memory
    at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
      float buf[kNarrowRows * kBlock];
      for (int64_t b = b0; b < b1; ++b) {
        const int64_t n0 = b * kBlock, R = std::min(kBlock, N - n0);
        if (b + 1 < blocks) prefetch(qp + (b + 1) * K * kBlock, K * kBlock);  // the next block
        narrow_tile(xp, K, M, qp, sp, zp, groups, group, b, buf, kBlock);
        for (int64_t i = 0; i < M; ++i)
          std::copy(buf + i * kBlock, buf + i * kBlock + R, op + i * N + n0);
      }
    });
    return out;
  }
  const int64_t nb = 2;  // more rows: two blocks per tile
  const int64_t tiles = (blocks + nb - 1) / nb;
#if TANDEM_WIDE
  {  // zmm tiles of up to kWideRows rows (an odd last block: ymm)
    at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
      float buf[kWideRows * 2 * kBlock];
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t n0 = t * 2 * kBlock, R = std::min(2 * kBlock, N - n0);
        const bool pair = 2 * t + 1 < blocks;
        for (int64_t m = 0; m < M; m += pair ? kWideRows : kTileRows) {
          const int64_t rows = std::min(pair ? kWideRows : kTileRows, M - m);
          if (pair) {
            rows16(xp + m * K, K, rows, qp, sp, zp, groups, group, 2 * t, buf, 2 * kBlock);
          } else {
            rows_tile<1>(xp + m * K, K, rows, qp, sp, zp, groups, group, 2 * t, buf, 2 * kBlock);
          }
          for (int64_t i = 0; i < rows; ++i)
            std::copy(buf + i * 2 * kBlock, buf + i * 2 * kBlock + R, op + (m + i) * N + n0);
        }
      }
    });
    return out;
  }
#endif
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    float buf[kTileRows * 2 * kBlock];
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t b0 = t * nb, nblk = std::min(nb, blocks - b0);
      const int64_t n0 = b0 * kBlock, R = std::min(nblk * kBlock, N - n0);
      const int64_t ldo = nblk * kBlock;
      for (int64_t m = 0; m < M; m += kTileRows) {
        const int64_t rows = std::min(kTileRows, M - m);
        const float* xm = xp + m * K;
        if (nblk == 2) {
          rows_tile<2>(xm, K, rows, qp, sp, zp, groups, group, b0, buf, ldo);
        } else {
          rows_tile<1>(xm, K, rows, qp, sp, zp, groups, group, b0, buf, ldo);
        }
        for (int64_t i = 0; i < rows; ++i)
          std::copy(buf + i * ldo, buf + i * ldo + R, op + (m + i) * N + n0);
      }
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // Without the GIL: the product touches no Python object, and holding it stalled the rest of
  // the process for every GEMM (a colocated layer-skip draft worker, the event loop's gRPC).
  m.def("int8_gemm", &int8_gemm, "x @ W.T for packed weight-only int8 W, few rows of x",
        pybind11::call_guard<pybind11::gil_scoped_release>());
}
