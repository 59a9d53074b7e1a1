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
#include <algorithm>
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
    for (int64_t g = 0; g < groups; ++g) {
      float* row = logits + g * width;
      float m = -__builtin_inff();
      for (int64_t t = 0; t < n; ++t) m = std::max(m, row[t]);
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
        for (int64_t t = 0; t < n; ++t) logits[t] = std::max(logits[t], row[t] * s);
      }
    }
#pragma omp simd
    for (int64_t t = 0; t < n; ++t) out[t] += logits[t];
  }
}

template <typename T>
int lagged_scores(const int64_t* caches, int64_t layers, const int32_t* table, int64_t table_stride,
                  const float* q, const int64_t* past, float* out, int64_t rows, int64_t kv, int64_t groups,
                  int64_t blocks, int64_t bs, int64_t d, int form) {
  if (bs > kMaxBlock || bs <= 0 || d <= 0 || groups <= 0 || layers <= 0 ||
      (form == 1 && (bs % 16 != 0 || d % 2 != 0)))
    return 1;
  const int64_t width = blocks * bs;
  for (int64_t r = 0; r < rows; ++r)
    if (past[r] > width) return 1;  // a past position outside the blocks read
#pragma omp parallel
  {
    std::vector<float> logits(groups * width), inv(groups);  // per thread, once per call
#pragma omp for collapse(2) schedule(static)
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t h = 0; h < kv; ++h) {
        float* o = out + (r * kv + h) * width;
        std::fill(o, o + width, 0.f);
        if (past[r] <= 0) continue;  // nothing to weigh: zeros, as the torch softmax's masked rows
        lagged_unit<T>(caches, layers, table + r * table_stride, q + (r * kv + h) * groups * d, rows * kv * groups * d,
                       past[r], o, logits.data(), inv.data(), kv, h, groups, bs, d, width, form);
      }
  }
  return 0;
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
