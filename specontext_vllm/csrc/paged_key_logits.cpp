// Query-key logits of decode rows over their blocks of vLLM's paged CPU KV cache, read in the
// cache's own packing (specontext_vllm/layout.py): one pass over each block's keys, no copy.
//
//   out[r][h][g][n * bs + t] = sum_j q[r][h][g][j] * key(block_table[r][n], h, t, j)
//
// cache: [num_blocks][kv][2][bs * d] (the key area first); q: float32 [rows][kv][groups][d]
// (already scaled); out: float32 [rows][kv][groups][blocks * bs]. Forms: 0 = transposed
// (key j of token t at j * bs + t: vLLM's vector path), 1 = AMX bf16 tiles (16-token tiles of
// [d / 2][16][2] pairs). Returns 0, or 1 for arguments the kernel does not take.
//
// Also the page rescue's Quest bounds over the same block tables (specontext_vllm/rescue.py):
//
//   out[r][h][n] = max_g sum_j max(q[r][h][g][j] * low(b, h, j), q[r][h][g][j] * high(b, h, j)),
//   b = block_table[r][n]
//
// low, high: float32 [num_blocks][kv][d] (each block's key minimum and maximum).
//
// And the lagged-query head's scores over several layers in one call (specontext_vllm/selection.py):
//
//   out[r][h][t] = sum_i max_g softmax_{t' < past[r]}(l_i[r][h][g][t'])[t] for t < past[r], else 0,
//   l_i = layer i's logits above (caches[i], q[i]),
//
// each (row, KV head)'s logits kept in a per-thread buffer (never written to memory whole).
// The same scores over the retrieval layers' int8 copies of their keys (option selection_keys =
// "int8", specontext_vllm/int8_keys.py): levels int8 [num_blocks + 1][kv][bs][d] and scales float32
// [num_blocks + 1][kv][bs], token-major rows, a key ~ levels * scale, and the query rows as int8
// levels too (as the backend's selection kernel takes them): the logit of token t is
// scale[t] * q_scale * (q_levels . levels[t]) (a quarter of a float32 cache's key bytes plus 4
// bytes a token).
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_common.h"  // runtime/csrc: exp_nonpositive
#include "paged_blocks.h"

namespace {

using namespace specontext_paged;

template <typename T>
int run(const T* cache, const int32_t* table, int64_t table_stride, const float* q, float* out, int64_t rows,
        int64_t kv, int64_t groups, int64_t blocks, int64_t bs, int64_t d, int form) {
  if (bs > kMaxBlock || bs <= 0 || d <= 0 || (form == 1 && (bs % 16 != 0 || d % 2 != 0))) return 1;
  const int64_t area = bs * d, width = blocks * bs;
#pragma omp parallel for collapse(3) schedule(static)
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t h = 0; h < kv; ++h)
      for (int64_t n = 0; n < blocks; ++n) {
        const int64_t block = table[r * table_stride + n];
        const T* keys = cache + (block * kv + h) * 2 * area;
        const float* qh = q + (r * kv + h) * groups * d;
        float* o = out + (r * kv + h) * groups * width + n * bs;
        const T* later = n + kBlocksAhead < blocks
                             ? cache + (table[r * table_stride + n + kBlocksAhead] * kv + h) * 2 * area
                             : nullptr;
        one_block(keys, qh, o, groups, bs, d, width, form, later);
      }
  return 0;
}

}  // namespace

extern "C" int specontext_paged_quest_bounds(const float* low, const float* high, const int32_t* table,
                                             int64_t table_stride, const float* q, float* out, int64_t rows,
                                             int64_t kv, int64_t groups, int64_t blocks, int64_t d) {
  if (d <= 0 || groups <= 0) return 1;
#pragma omp parallel for collapse(3) schedule(static)
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t h = 0; h < kv; ++h)
      for (int64_t n = 0; n < blocks; ++n) {
        const int64_t at = (static_cast<int64_t>(table[r * table_stride + n]) * kv + h) * d;
        const float* lo = low + at;
        const float* hi = high + at;
        float best = -__builtin_inff();
        for (int64_t g = 0; g < groups; ++g) {
          const float* qg = q + ((r * kv + h) * groups + g) * d;
          float sum = 0.f;
#pragma omp simd reduction(+ : sum)
          for (int64_t j = 0; j < d; ++j) {
            const float a = qg[j] * lo[j], b = qg[j] * hi[j];
            sum += a > b ? a : b;
          }
          best = sum > best ? sum : best;
        }
        out[(r * kv + h) * blocks + n] = best;
      }
  return 0;
}

extern "C" int specontext_paged_key_logits_f32(const float* cache, const int32_t* table, int64_t table_stride,
                                               const float* q, float* out, int64_t rows, int64_t kv, int64_t groups,
                                               int64_t blocks, int64_t bs, int64_t d, int form) {
  if (form != 0) return 1;
  return run(cache, table, table_stride, q, out, rows, kv, groups, blocks, bs, d, form);
}

extern "C" int specontext_paged_key_logits_bf16(const uint16_t* cache, const int32_t* table, int64_t table_stride,
                                                const float* q, float* out, int64_t rows, int64_t kv, int64_t groups,
                                                int64_t blocks, int64_t bs, int64_t d, int form) {
  return run(cache, table, table_stride, q, out, rows, kv, groups, blocks, bs, d, form);
}

namespace {

// One layer's part of the scores: each query head's softmax over the first n positions of its
// logits row (logits [groups][width]), the exponentials written over the logits, the group
// maximum of the normalised weights added to out[0, n).
inline void add_group_max(float* logits, float* inv, float* out, int64_t n, int64_t groups, int64_t width) {
  for (int64_t g = 0; g < groups; ++g) {
    float* row = logits + g * width;
    float m = -__builtin_inff();
#pragma omp simd reduction(max : m)
    for (int64_t t = 0; t < n; ++t) m = row[t] > m ? row[t] : m;  // (std::max stayed scalar: a fifth of the call)
    float z = 0.f;
#pragma omp simd reduction(+ : z)
    for (int64_t t = 0; t < n; ++t) {
      row[t] = specontext_cpu::exp_nonpositive(row[t] - m);
      z += row[t];
    }
    inv[g] = 1.f / z;  // z >= 1: the maximum's own term
  }
  for (int64_t g = 0; g < groups; ++g) {
    const float* row = logits + g * width;
    const float s = inv[g];
    if (g == 0) {
#pragma omp simd
      for (int64_t t = 0; t < n; ++t) logits[t] = row[t] * s;  // head 0's weights in place
    } else {
#pragma omp simd
      for (int64_t t = 0; t < n; ++t) {
        const float w = row[t] * s;
        logits[t] = w > logits[t] ? w : logits[t];
      }
    }
  }
#pragma omp simd
  for (int64_t t = 0; t < n; ++t) out[t] += logits[t];
}

// Layer after layer for each (row, KV head): its logits over the row's past blocks into
// `logits` [groups][width], then each head's softmax statistics over the past positions, the
// exponentials written over the logits (one per position and head), the group maximum of the
// normalised weights added to the row's scores.
template <typename T>
void lagged_unit(const int64_t* caches, int64_t layers, const int32_t* table_row, const float* q_unit,
                 int64_t q_layer_stride, int64_t n, float* out, float* logits, float* inv, int64_t kv, int64_t h,
                 int64_t groups, int64_t bs, int64_t d, int64_t width, int form) {
  const int64_t area = bs * d, used = (n + bs - 1) / bs;
  for (int64_t i = 0; i < layers; ++i) {
    const T* cache = reinterpret_cast<const T*>(caches[i]);
    const float* qh = q_unit + i * q_layer_stride;
    const auto keys_of = [&](int64_t blk) { return cache + (static_cast<int64_t>(table_row[blk]) * kv + h) * 2 * area; };
    for (int64_t blk = 0; blk < used && blk < kBlocksAhead; ++blk) request_block(keys_of(blk), bs, d);
    for (int64_t blk = 0; blk < used; ++blk)  // each block requested kBlocksAhead early (blocks are scattered)
      one_block(keys_of(blk), qh, logits + blk * bs, groups, bs, d, width, form,
                blk + kBlocksAhead < used ? keys_of(blk + kBlocksAhead) : nullptr);
    add_group_max(logits, inv, out, n, groups, width);
  }
}

// The (row, KV head) units of a scores call over the threads: unit(r, h, out row, logits
// buffer, inv buffer) for each row with a past, zeros for the others (as the torch softmax's
// masked rows). Returns 1 for a past position outside the `width` positions read.
template <typename Unit>
int each_unit(const int64_t* past, float* out, int64_t rows, int64_t kv, int64_t groups, int64_t width, Unit&& unit) {
  for (int64_t r = 0; r < rows; ++r)
    if (past[r] > width) return 1;
#pragma omp parallel
  {
    std::vector<float> logits(groups * width), inv(groups);  // per thread, once per call
#pragma omp for collapse(2) schedule(static)
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t h = 0; h < kv; ++h) {
        float* o = out + (r * kv + h) * width;
        std::fill(o, o + width, 0.f);
        if (past[r] > 0) unit(r, h, o, logits.data(), inv.data());
      }
  }
  return 0;
}

template <typename T>
int lagged_scores(const int64_t* caches, int64_t layers, const int32_t* table, int64_t table_stride,
                  const float* q, const int64_t* past, float* out, int64_t rows, int64_t kv, int64_t groups,
                  int64_t blocks, int64_t bs, int64_t d, int form) {
  if (bs > kMaxBlock || bs <= 0 || d <= 0 || groups <= 0 || layers <= 0 ||
      (form == 1 && (bs % 16 != 0 || d % 2 != 0)))
    return 1;
  const int64_t width = blocks * bs;
  return each_unit(past, out, rows, kv, groups, width, [&](int64_t r, int64_t h, float* o, float* logits, float* inv) {
    lagged_unit<T>(caches, layers, table + r * table_stride, q + (r * kv + h) * groups * d, rows * kv * groups * d,
                   past[r], o, logits, inv, kv, h, groups, bs, d, width, form);
  });
}

// The query rows of an int8 selection, as the backend's kernel takes them
// (runtime/csrc/selection_scores.cpp): each row's int8 levels, scale and level sum, and its
// dequantized values (level * scale) for the loops without the int8 dot products.
std::atomic<int64_t> int8_dot_calls{0};  // calls whose int8 copies took the int8 dot products

struct Query8 {
  const float* values;  // [layers][rows][kv][groups][d]
  const int8_t* levels; // [layers][rows][kv][groups][d]
  const float* scale;   // [layers][rows][kv][groups]
  const int32_t* sum;   // [layers][rows][kv][groups]
};

// One block's int8 rows (token-major, `d` levels a token) under one (layer, row, KV head)'s
// query rows (offset `at` into q's row arrays): out[g * stride + t] = scales[t] * (q[g] . levels[t])
// for its bs tokens and the `groups` query heads, with q the dequantized query rows; 16 tokens
// at a time through the int8 dot products (VPDPBUSD, exact in int32) for the common shapes
// where the CPU has them, the float loops otherwise.
template <int G_, int D_>
void int8_block(const int8_t* levels, const float* scales, const Query8& q, int64_t at, float* out, int64_t groups,
                int64_t bs, int64_t d, int64_t stride) {
  int64_t t = 0;
#ifdef SPECONTEXT_INT8_DOT
  if constexpr (G_ > 0 && D_ > 0 && D_ % 64 == 0) {
    for (; t + 16 <= bs; t += 16) {
      const int8_t* rows[16];
      for (int i = 0; i < 16; ++i) rows[i] = levels + (t + i) * D_;
      specontext_cpu::group_logits16_int8<G_, D_>(q.levels + at * D_, q.scale + at, q.sum + at, rows, out + t, stride);
      const __m512 s = _mm512_loadu_ps(scales + t);
      for (int g = 0; g < G_; ++g) _mm512_storeu_ps(out + g * stride + t, _mm512_mul_ps(_mm512_loadu_ps(out + g * stride + t), s));
    }
  }
#endif
  const float* values = q.values + at * d;
  for (; t < bs; ++t)
    for (int64_t g = 0; g < groups; ++g)
      out[g * stride + t] = scales[t] * specontext_cpu::dot_row(values + g * d, levels + t * d, d);
}

// lagged_unit over the layers' int8 copies (levels, scales: the layers' addresses).
template <int G_, int D_>
void lagged_unit_int8(const int64_t* levels, const int64_t* scales, int64_t layers, const int32_t* table_row,
                      const Query8& q, int64_t unit_row, int64_t layer_rows, int64_t n, float* out, float* logits,
                      float* inv, int64_t kv, int64_t h, int64_t groups, int64_t bs, int64_t d, int64_t width) {
  const int64_t used = (n + bs - 1) / bs;
  for (int64_t i = 0; i < layers; ++i) {
    const int8_t* level = reinterpret_cast<const int8_t*>(levels[i]);
    const float* scale = reinterpret_cast<const float*>(scales[i]);
    const auto first = [&](int64_t blk) { return (static_cast<int64_t>(table_row[blk]) * kv + h) * bs; };  // its first token
    for (int64_t blk = 0; blk < used && blk < kBlocksAhead; ++blk) request_block(level + first(blk) * d, bs, d);
    for (int64_t blk = 0; blk < used; ++blk) {  // each block requested kBlocksAhead early (blocks are scattered)
      if (blk + kBlocksAhead < used) {
        request_block(level + first(blk + kBlocksAhead) * d, bs, d);
        request_block(scale + first(blk + kBlocksAhead), bs, 1);
      }
      int8_block<G_, D_>(level + first(blk) * d, scale + first(blk), q, i * layer_rows + unit_row, logits + blk * bs,
                         groups, bs, d, width);
    }
    add_group_max(logits, inv, out, n, groups, width);
  }
}

}  // namespace

// caches: `layers` addresses of [num_blocks][kv][2][bs * d] caches (one dtype, one shape); q: float32
// [layers][rows][kv][groups][d] (scaled); past: int64 [rows] (positions < past[r] weighed,
// past[r] <= blocks * bs); out: float32 [rows][kv][blocks * bs].
extern "C" int specontext_paged_lagged_scores_f32(const int64_t* caches, int64_t layers, const int32_t* table,
                                                  int64_t table_stride, const float* q, const int64_t* past,
                                                  float* out, int64_t rows, int64_t kv, int64_t groups,
                                                  int64_t blocks, int64_t bs, int64_t d, int form) {
  if (form != 0) return 1;
  return lagged_scores<float>(caches, layers, table, table_stride, q, past, out, rows, kv, groups, blocks, bs, d,
                              form);
}

extern "C" int specontext_paged_lagged_scores_bf16(const int64_t* caches, int64_t layers, const int32_t* table,
                                                   int64_t table_stride, const float* q, const int64_t* past,
                                                   float* out, int64_t rows, int64_t kv, int64_t groups,
                                                   int64_t blocks, int64_t bs, int64_t d, int form) {
  return lagged_scores<uint16_t>(caches, layers, table, table_stride, q, past, out, rows, kv, groups, blocks, bs,
                                 d, form);
}

// levels, scales: `layers` addresses of the int8 copies (levels int8 [num_blocks + 1][kv][bs][d], scales
// float32 [num_blocks + 1][kv][bs], one shape); the query rows (already scaled) as int8 levels
// q8 [layers][rows][kv][groups][d] with their scales and level sums [layers][rows][kv][groups] and
// their dequantized values q; the rest as specontext_paged_lagged_scores_f32.
extern "C" int specontext_paged_lagged_scores_int8(const int64_t* levels, const int64_t* scales, int64_t layers,
                                                   const int32_t* table, int64_t table_stride, const float* q,
                                                   const int8_t* q8, const float* q_scale, const int32_t* q_sum,
                                                   const int64_t* past, float* out, int64_t rows, int64_t kv,
                                                   int64_t groups, int64_t blocks, int64_t bs, int64_t d) {
  if (bs <= 0 || d <= 0 || groups <= 0 || layers <= 0) return 1;
  const int64_t width = blocks * bs;
  const Query8 query{q, q8, q_scale, q_sum};
  int status = 0;
  specontext_cpu::with_shape(groups, d, [&](auto g, auto dd) {
    constexpr int G_ = decltype(g)::value, D_ = decltype(dd)::value;
#ifdef SPECONTEXT_INT8_DOT
    if constexpr (G_ > 0 && D_ > 0 && D_ % 64 == 0) int8_dot_calls.fetch_add(1, std::memory_order_relaxed);
#endif
    status = each_unit(past, out, rows, kv, groups, width, [&](int64_t r, int64_t h, float* o, float* logits, float* inv) {
      lagged_unit_int8<G_, D_>(levels, scales, layers, table + r * table_stride, query, (r * kv + h) * groups,
                               rows * kv * groups, past[r], o, logits, inv, kv, h, groups, bs, d, width);
    });
  });
  return status;
}

// Calls in this process whose int8 copies took the int8 dot products (the tests assert the path).
extern "C" int64_t specontext_paged_lagged_scores_int8_dot_calls() { return int8_dot_calls.load(std::memory_order_relaxed); }
