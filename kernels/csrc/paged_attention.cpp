// Paged attention on CPU, straight from the KV blocks (fp32): causal rounds and token trees.
//
// kernels/paged_attention.py's reference gathers every sequence's blocks into a padded copy,
// builds a mask and calls SDPA, in every layer; a step that mixes one-token sequences with a
// verify chunk runs that twice (one group per shape). At 4 sessions of SmolLM2-135M the
// gather and the groups were 2-5 ms of a 16-23 ms step: a price of batching, not of the
// arithmetic. Here each query row reads its keys through the block table where they lie.
//
// Sequence b has q_len = cu[b+1] - cu[b] new rows ending at context length seq_len; its row i
// sits at position seq_len - q_len + i and sees keys 0..that position (a tree row: the
// context and the new tokens new_visible names). One task is one row, all its heads (GQA:
// each key's KV heads are loaded once for all the query heads): the scores, the softmax
// (max, exp, sum) and the values' sum.
//
// Every row is computed alone, in the same order of keys and lanes, whatever else is in the
// batch (decode step, verify chunk, prefill, beside longer sequences): with the int8 GEMM,
// which is row-invariant too, a token's numbers do not depend on the batch it runs in.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include <immintrin.h>

namespace {

// Flush-to-zero and denormals-are-zero on this thread while in scope.
struct DenormalsFlushed {
  unsigned saved = _mm_getcsr();
  DenormalsFlushed() { _mm_setcsr(saved | 0x8040); }
  ~DenormalsFlushed() { _mm_setcsr(saved); }
};

struct Layout {
  const float* k;
  const float* v;
  const int64_t* tables;
  int64_t max_blocks, block_size, kv_heads, dim, heads;
  float scale;
};

#if defined(__AVX512F__)
constexpr bool kBuilt = true;

// exp(x) for x <= 0 (a score minus its row's max), 16 at a time: Cody-Waite reduction by
// ln 2 and the classic degree-7 polynomial (about 1 ulp); libm's expf is a call per score.
// Under -87 (a masked key's -inf included) it is 0.
inline __m512 exp_neg(__m512 x) {
  const __mmask16 live = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_GE_OQ);
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(
      _mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
      _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  const __m512i e = _mm512_slli_epi32(
      _mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_maskz_mul_ps(live, p, _mm512_castsi512_ps(e));
}

// s[j] = exp(s[j] - mx) for j < n (s padded to a multiple of 16); returns their sum, lanes
// in a fixed order.
inline float exp_sum(float* s, int64_t n, float mx) {
  __m512 acc = _mm512_setzero_ps();
  const __m512 m = _mm512_set1_ps(mx);
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 live = n - j >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (n - j)) - 1);
    const __m512 e = _mm512_maskz_mov_ps(live, exp_neg(_mm512_sub_ps(_mm512_loadu_ps(s + j), m)));
    _mm512_storeu_ps(s + j, e);
    acc = _mm512_add_ps(acc, e);
  }
  return _mm512_reduce_add_ps(acc);
}

// q . k over d (a multiple of 16) in two chains; the same bits wherever the operands lie.
inline float dot(const float* q, const float* k, int64_t d) {
  __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 32 <= d; i += 32) {
    a0 = _mm512_fmadd_ps(_mm512_loadu_ps(q + i), _mm512_loadu_ps(k + i), a0);
    a1 = _mm512_fmadd_ps(_mm512_loadu_ps(q + i + 16), _mm512_loadu_ps(k + i + 16), a1);
  }
  if (i < d) a0 = _mm512_fmadd_ps(_mm512_loadu_ps(q + i), _mm512_loadu_ps(k + i), a0);
  return _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
}

// Where each of a sequence's first `keys` keys lies in a cache, in floats (all its KV heads
// contiguous there), from its block table: once per row, not a division per key and head.
void key_offsets(const Layout& L, const int64_t* table, int64_t keys,
                 std::vector<int64_t>& offs) {
  offs.resize(keys);
  const int64_t row = L.kv_heads * L.dim;
  for (int64_t j0 = 0, b = 0; j0 < keys; j0 += L.block_size, ++b) {
    const int64_t base = table[b] * L.block_size * row;
    for (int64_t i = 0; i < L.block_size && j0 + i < keys; ++i) offs[j0 + i] = base + i * row;
  }
}

// Asks for the key one block on (its KV heads' lines) while key j is read: blocks lie
// anywhere, so the hardware's stream prefetcher loses the scan at every block's end (on
// caches out of L2 the kernel ran at a fifth of its in-cache speed).
inline void prefetch_ahead(const Layout& L, const float* cache, const int64_t* offs,
                           int64_t j, int64_t keys) {
  if (j + L.block_size >= keys) return;
  const char* p = reinterpret_cast<const char*>(cache + offs[j + L.block_size]);
  for (int64_t b = 0; b < L.kv_heads * L.dim * 4; b += 64) __builtin_prefetch(p + b, 0, 3);
}

inline float row_max(const float* s, int64_t n) {
  __m512 m = _mm512_set1_ps(-INFINITY);
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 live = n - j >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (n - j)) - 1);
    m = _mm512_max_ps(m, _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), live, s + j));
  }
  return _mm512_reduce_max_ps(m);
}

// out[0, 16 C) = inv * sum_j w[j] v_j[off, off + 16 C): C accumulators kept in registers
// over all the keys (a loop over lanes in memory was a load and a store per key and lane).
template <int C>
void weigh_values(const float* v, const int64_t* offs, const float* w, int64_t keys,
                  int64_t off, float inv, float* out) {
  __m512 acc[C];
  for (int c = 0; c < C; ++c) acc[c] = _mm512_setzero_ps();
  for (int64_t j = 0; j < keys; ++j) {
    if (w[j] == 0.0f) continue;  // a key whose weight underflowed: adds nothing
    const __m512 b = _mm512_set1_ps(w[j]);
    const float* vp = v + offs[j] + off;
    for (int c = 0; c < C; ++c) acc[c] = _mm512_fmadd_ps(b, _mm512_loadu_ps(vp + 16 * c), acc[c]);
  }
  for (int c = 0; c < C; ++c) _mm512_storeu_ps(out + 16 * c, _mm512_mul_ps(acc[c], _mm512_set1_ps(inv)));
}

// One head's output from its softmax weights: 64 lanes at a time (the rest 16 at a time).
void head_output(const Layout& L, const int64_t* offs, const float* w, int64_t keys,
                 int64_t g, float inv, float* out) {
  const float* v = L.v + g * L.dim;
  int64_t d = 0;
  for (; d + 64 <= L.dim; d += 64) weigh_values<4>(v, offs, w, keys, d, inv, out + d);
  for (; d < L.dim; d += 16) weigh_values<1>(v, offs, w, keys, d, inv, out + d);
}

struct Scratch {
  std::vector<float> scores;
  std::vector<int64_t> offs;
};

// One row of one sequence, all its heads (each key's KV heads are read once, for the query
// heads of their group): the softmax of its `keys` scores, then the values' sum into out.
// `seen`, for a tree, says which of the sequence's `num_new` new tokens (the last keys) this
// row sees. The others are dropped from its key list, not masked: a masked key would still
// hold a lane of the softmax's sum, so a row on a branch (siblings between its ancestors)
// summed in another grouping than the chain of the keys it sees, and differed from that
// chain's row in the last bit, which bf16 activations (int8-bf16) then magnified into text.
// Compacted, a tree row gives the bits of the chain row over the same keys.
void attend_row(const Layout& L, const float* q, float* out, const int64_t* table,
                int64_t keys, const bool* seen, int64_t num_new, Scratch& scratch) {
  const int64_t H = L.heads, group = L.heads / L.kv_heads, D = L.dim;
  key_offsets(L, table, keys, scratch.offs);
  if (seen != nullptr) {
    const int64_t first = keys - num_new;
    int64_t kept = first;
    for (int64_t n = 0; n < num_new; ++n)
      if (seen[n]) scratch.offs[kept++] = scratch.offs[first + n];
    keys = kept;
  }
  const int64_t stride = (keys + 15) / 16 * 16;
  const int64_t* offs = scratch.offs.data();
  scratch.scores.resize(H * stride);
  float* scores = scratch.scores.data();
  for (int64_t j = 0; j < keys; ++j) {
    prefetch_ahead(L, L.k, offs, j, keys);
    const float* kp = L.k + offs[j];
    for (int64_t h = 0; h < H; ++h)
      scores[h * stride + j] = dot(q + h * D, kp + h / group * D, D) * L.scale;
  }
  for (int64_t h = 0; h < H; ++h) {
    float* s = scores + h * stride;
    const float inv = 1.0f / exp_sum(s, keys, row_max(s, keys));
    head_output(L, offs, s, keys, h / group, inv, out + h * D);
  }
}

#else
constexpr bool kBuilt = false;  // without AVX-512 the torch reference is the faster path
struct Scratch {};
void attend_row(const Layout&, const float*, float*, const int64_t*, int64_t, const bool*,
                int64_t, Scratch&) {}
#endif

}  // namespace

torch::Tensor paged_attention(torch::Tensor query,        // [T, H, D] float32
                              torch::Tensor key_cache,    // [NB, BS, KVH, D] float32
                              torch::Tensor value_cache,  // [NB, BS, KVH, D] float32
                              torch::Tensor block_tables, // [B, MB] int64
                              torch::Tensor seq_lens,     // [B] int64
                              torch::Tensor cu_seqlens_q, // [B + 1] int64
                              torch::Tensor new_visible,  // [T, max_q] bool, or [0, 0]: causal
                              double scale) {
  TORCH_CHECK(query.dim() == 3 && query.scalar_type() == torch::kFloat32 &&
                  query.is_contiguous(), "query must be contiguous float32 [T, H, D]");
  for (const auto& c : {key_cache, value_cache})
    TORCH_CHECK(c.dim() == 4 && c.scalar_type() == torch::kFloat32 && c.is_contiguous() &&
                    c.size(3) == query.size(2), "caches must be contiguous float32 [NB, BS, KVH, D]");
  for (const auto& t : {block_tables, seq_lens, cu_seqlens_q})
    TORCH_CHECK(t.scalar_type() == torch::kInt64 && t.is_contiguous(), "layout must be int64");
  const int64_t T = query.size(0), H = query.size(1), D = query.size(2);
  const int64_t KVH = key_cache.size(2), B = seq_lens.size(0);
  TORCH_CHECK(kBuilt, "built without AVX-512: use the torch reference");
  TORCH_CHECK(D % 16 == 0, "head_dim must be a multiple of 16");
  TORCH_CHECK(KVH > 0 && H % KVH == 0, "num_heads must be a multiple of num_kv_heads");
  TORCH_CHECK(cu_seqlens_q.size(0) == B + 1 && block_tables.size(0) == B, "batch mismatch");
  const int64_t* cu = cu_seqlens_q.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  TORCH_CHECK(cu[B] == T, "cu_seqlens_q must end at the number of query rows");
  const Layout L{key_cache.data_ptr<float>(), value_cache.data_ptr<float>(),
                 block_tables.data_ptr<int64_t>(), block_tables.size(1), key_cache.size(1),
                 KVH, D, H, static_cast<float>(scale)};
  const int64_t num_blocks = key_cache.size(0);
  TORCH_CHECK(value_cache.sizes() == key_cache.sizes(), "key and value caches differ in shape");
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(cu[b + 1] >= cu[b] && lens[b] >= cu[b + 1] - cu[b] &&
                    lens[b] <= L.max_blocks * L.block_size, "sequence ", b, ": bad lengths");
    for (int64_t i = 0; i * L.block_size < lens[b]; ++i) {  // the blocks its keys lie in
      const int64_t block = L.tables[b * L.max_blocks + i];
      TORCH_CHECK(block >= 0 && block < num_blocks, "sequence ", b, ": block ", block,
                  " is outside the cache");
    }
  }
  const bool tree = new_visible.numel() > 0;
  TORCH_CHECK(new_visible.scalar_type() == torch::kBool && new_visible.is_contiguous() &&
                  (!tree || (new_visible.dim() == 2 && new_visible.size(0) == T)),
              "new_visible must be contiguous bool [T, max_q] (or empty)");
  const int64_t max_q = tree ? new_visible.size(1) : 0;
  for (int64_t b = 0; tree && b < B; ++b)
    TORCH_CHECK(cu[b + 1] - cu[b] <= max_q, "sequence ", b, ": more new rows than new_visible");
  const bool* vis = tree ? new_visible.data_ptr<bool>() : nullptr;
  auto out = torch::empty_like(query);
  if (T == 0) return out;
  std::vector<int64_t> row_seq(T);  // each flat row's sequence
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = cu[b]; t < cu[b + 1]; ++t) row_seq[t] = b;
  const float* qp = query.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, T, 1, [&](int64_t t0, int64_t t1) {
    // Flush denormals for this thread's rows: a trained model's softmax puts many keys at
    // weights that small, and each denormal multiply costs ~100 cycles.
    const DenormalsFlushed flushed;
    Scratch scratch;
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t b = row_seq[t];
      const int64_t num_new = cu[b + 1] - cu[b];
      // A chain row sees the keys up to its own position; a tree row sees all the context
      // and, of the new tokens, those new_visible names.
      const int64_t keys = vis ? lens[b] : lens[b] - (cu[b + 1] - t) + 1;
      attend_row(L, qp + t * H * D, op + t * H * D, L.tables + b * L.max_blocks, keys,
                 vis ? vis + t * max_q : nullptr, num_new, scratch);
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.attr("built") = kBuilt;  // false without AVX-512: callers keep the reference
  // Without the GIL, like the int8 GEMM: it touches no Python object.
  m.def("paged_attention", &paged_attention,
        "causal attention of each sequence's new rows over its paged KV cache (fp32)",
        pybind11::call_guard<pybind11::gil_scoped_release>());
}
