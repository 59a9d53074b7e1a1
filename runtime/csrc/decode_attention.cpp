// Dense decode attention over a contiguous KV store on the CPU: one query row per head.
//
// For each (batch row, KV head) the group's query heads share every key and value load: a
// block of slots is scored against all of the group's rows while the keys are in L1, then
// the block's values are added with the rows' weights (online softmax, one rescale per
// block). The slots of a KV head are split between work items so that both threads of a
// 2-core machine stay busy when batch * kv_heads is small; a second pass merges the splits.
// float32 or bfloat16 stores (a bfloat16 element widened to float32 as it is loaded), float32
// query, accumulation and output. Written for specontext (issue 51: the step
// at its floor); built and loaded by runtime/cpu_kernels.py.
#include <cstdint>
#include <algorithm>
#include <atomic>
#include <limits>
#include <type_traits>
#include <vector>

#include "cpu_common.h"

namespace {

// calls whose visibility mask hid no written slot, run without it (cpu_common.h, needed_mask)
std::atomic<int64_t> masks_dropped{0};

constexpr int BLOCK = 128;      // slots scored before their values are added (32 before the far prefetch)
constexpr int PREFETCH = 16;   // slots ahead whose keys and values are prefetched into L1 (16 and 32 on par)
constexpr int FAR = 128;       // slots ahead prefetched into L2 (64 to 192 on par, cpu_common.h)
constexpr int MAX_GROUP = 16;   // query heads per KV head
constexpr int MAX_DIM = 256;    // head_dim

}  // namespace

using namespace specontext_cpu;

// One work item: the slots [lo, hi) of one (batch row, KV head), all G query rows.
template <typename T, int G_, int D_>
void attend_item(int64_t item, const float* query, const T* keys, const T* values, const int64_t* limits,
                 const uint8_t* visible, int64_t visible_stride, float* partial_acc, float* partial_stats, int64_t G_rt, int64_t C,
                 int64_t D_rt, int64_t S, int64_t KV) {
  const int64_t G = G_ > 0 ? G_ : G_rt;
  const int64_t D = D_ > 0 ? D_ : D_rt;
  const float NEG = -std::numeric_limits<float>::infinity();
  const int64_t s = item % S;
  const int64_t bh = item / S;
  const int64_t b = bh / KV;
  const int64_t limit = std::min<int64_t>(std::max<int64_t>(limits[b], 0), C);
  const int64_t per = (C + S - 1) / S;
  const int64_t lo = std::min<int64_t>(s * per, limit);
  const int64_t hi = std::min<int64_t>(lo + per, limit);
  const float* q = query + bh * G * D;
  const T* k = keys + bh * C * D;
  const T* v = values + bh * C * D;
  const uint8_t* vis = visible ? visible + b * visible_stride : nullptr;
  alignas(64) float acc[MAX_GROUP][MAX_DIM];
  float m[MAX_GROUP], l[MAX_GROUP];
  for (int64_t g = 0; g < G; ++g) {
    m[g] = NEG;
    l[g] = 0.f;
    for (int64_t d = 0; d < D; ++d) acc[g][d] = 0.f;
  }
  alignas(64) float logit[MAX_GROUP][BLOCK];
  for (int64_t start = lo; start < hi; start += BLOCK) {
    const int64_t n = std::min<int64_t>(BLOCK, hi - start);
    int64_t j = 0;
#ifdef __AVX512F__
    // 16 slots at a time (bfloat16 widened in registers), no horizontal sum per slot: 2.3x the
    // per-slot loop for bfloat16 on an AMD Zen 4; for float32 on par there and 1.03x on a Xeon,
    // where it carries the keys' prefetch (together 1.26x for the kernel alone, 1.09x for the
    // fp32 dense step: issue 51, docs/benchmarks.md, 2026-12-06)
    if constexpr (G_ > 0 && D_ > 0 && D_ % 16 == 0) {
      for (; j + 16 <= n; j += 16) {
        for (int jj = 0; jj < 16; ++jj) {
          if (start + PREFETCH + j + jj < hi) prefetch_row<T, D_>(k + (start + PREFETCH + j + jj) * D_);
          if (start + FAR + j + jj < hi) prefetch_row_l2<T, D_>(k + (start + FAR + j + jj) * D_);
        }
        for (int g = 0; g < G_; ++g) {
          __m512 sums[16];
          for (int jj = 0; jj < 16; ++jj) sums[jj] = _mm512_setzero_ps();
          for (int d = 0; d < D_; d += 16) {
            const __m512 qv = _mm512_loadu_ps(q + g * D_ + d);
            for (int jj = 0; jj < 16; ++jj)
              sums[jj] = _mm512_fmadd_ps(qv, load16(k + (start + j + jj) * D_ + d), sums[jj]);
          }
          _mm512_storeu_ps(&logit[g][j], sum_lanes16(sums));
        }
        if (vis)
          for (int jj = 0; jj < 16; ++jj)
            if (!vis[start + j + jj])
              for (int g = 0; g < G_; ++g) logit[g][j + jj] = NEG;
      }
    }
#endif
    for (; j < n; ++j) {
      const T* kr = k + (start + j) * D;
      const bool hidden = vis && !vis[start + j];
      for (int64_t g = 0; g < G; ++g) {
        const float* qg = q + g * D;
        const float dot = dot_row(qg, kr, D);
        logit[g][j] = hidden ? NEG : dot;
      }
    }
    for (int64_t g = 0; g < G; ++g) {
      float block_max = NEG;
      for (int64_t j = 0; j < n; ++j) block_max = std::max(block_max, logit[g][j]);
      const float new_max = std::max(m[g], block_max);
      if (new_max == NEG) continue;  // nothing visible yet
      const float rescale = m[g] == NEG ? 0.f : exp_nonpositive(m[g] - new_max);
      if (rescale != 1.f) {
        l[g] *= rescale;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) acc[g][d] *= rescale;
      }
      m[g] = new_max;
      float block_sum = 0.f;
#pragma omp simd reduction(+ : block_sum)
      for (int64_t j = 0; j < n; ++j) {
        const float p = exp_nonpositive(logit[g][j] - new_max);  // -inf - finite = -inf: 0
        logit[g][j] = p;
        block_sum += p;
      }
      l[g] += block_sum;
    }
#ifdef __AVX512F__
    // the group's sums in registers for the block, each value row widened once for all rows
    if constexpr (G_ > 0 && D_ > 0 && D_ % 16 == 0 && G_ * D_ / 16 <= 24) {
      constexpr int C_ = D_ / 16;
      __m512 sum[G_][C_];
      for (int g = 0; g < G_; ++g)
        for (int c = 0; c < C_; ++c) sum[g][c] = _mm512_load_ps(&acc[g][16 * c]);
      for (int64_t j = 0; j < n; ++j) {
        bool any = false;
        float p[G_];
        for (int g = 0; g < G_; ++g) {
          p[g] = m[g] == NEG ? 0.f : logit[g][j];
          any = any || p[g] != 0.f;
        }
        if (start + PREFETCH + j < hi) prefetch_row<T, D_>(v + (start + PREFETCH + j) * D_);
        if (start + FAR + j < hi) prefetch_row_l2<T, D_>(v + (start + FAR + j) * D_);
        if (!any) continue;  // a hidden slot (or no weight): its value is never read
        __m512 row[C_];
        for (int c = 0; c < C_; ++c) row[c] = load16(v + (start + j) * D_ + 16 * c);
        for (int g = 0; g < G_; ++g) {
          const __m512 pg = _mm512_set1_ps(p[g]);
          for (int c = 0; c < C_; ++c) sum[g][c] = _mm512_fmadd_ps(pg, row[c], sum[g][c]);
        }
      }
      for (int g = 0; g < G_; ++g)
        for (int c = 0; c < C_; ++c) _mm512_store_ps(&acc[g][16 * c], sum[g][c]);
      continue;
    }
#endif
    for (int64_t j = 0; j < n; ++j) {
      const T* vr = v + (start + j) * D;
      for (int64_t g = 0; g < G; ++g) {
        const float p = logit[g][j];
        if (m[g] == NEG || p == 0.f) continue;  // nothing seen yet, or a hidden slot: its value is never read
        add_row(acc[g], p, vr, D);
      }
    }
  }
  float* pa = partial_acc + item * G * D;
  float* ps = partial_stats + item * G * 2;
  for (int64_t g = 0; g < G; ++g) {
    ps[2 * g] = m[g];
    ps[2 * g + 1] = l[g];
    for (int64_t d = 0; d < D; ++d) pa[g * D + d] = acc[g][d];
  }
}

template <typename T>
int decode_attention(
    const float* query,      // [B, KV, G, D], already multiplied by the softmax scale
    const T* keys,           // [B, KV, C, D]
    const T* values,         // [B, KV, C, D]
    const int64_t* lengths,  // [B] (or [1] with length_stride 0): slots 0 .. length-1 are attended
    int64_t length_stride,
    const uint8_t* visible,  // bool [B, C] (or [1, C] with visible_stride 0), or nullptr: 0 hides a slot
    int64_t visible_stride,
    float* out,              // [B, KV, G, D]
    int64_t B, int64_t KV, int64_t G, int64_t C, int64_t D, int64_t S) {  // S: splits per row, < 1 = the default
  if (G > MAX_GROUP || D > MAX_DIM) return 1;
  if (visible && !(visible = needed_mask(visible, visible_stride, lengths, length_stride, B, C)))
    masks_dropped.fetch_add(1, std::memory_order_relaxed);
  // S < 1: the default split of each (batch row, KV head)'s slots: at least 32 work items for
  // the threads (11 splits for SmolLM2's 3 KV heads at batch 1), each of at least 256 slots
  if (S < 1) S = std::max<int64_t>(1, std::min<int64_t>((32 + B * KV - 1) / std::max<int64_t>(B * KV, 1), C / 256));
  std::vector<float> partial_acc(B * KV * S * G * D);  // [B, KV, S, G, D]
  std::vector<float> partial_stats(B * KV * S * G * 2);  // [B, KV, S, G, 2]: max, sum
  std::vector<int64_t> limits(B);
  for (int64_t b = 0; b < B; ++b) limits[b] = lengths[b * length_stride];
  const float NEG = -std::numeric_limits<float>::infinity();
  const int64_t items = B * KV * S;
#pragma omp parallel for schedule(static)
  for (int64_t item = 0; item < items; ++item) {
    // compile-time group and head sizes for the common shapes (unrolled, vectorised loops)
    if (G == 3 && D == 64) {
      attend_item<T, 3, 64>(item, query, keys, values, limits.data(), visible, visible_stride, partial_acc.data(), partial_stats.data(), G, C, D, S, KV);
    } else if (G == 4 && D == 64) {
      attend_item<T, 4, 64>(item, query, keys, values, limits.data(), visible, visible_stride, partial_acc.data(), partial_stats.data(), G, C, D, S, KV);
    } else if (G == 4 && D == 128) {
      attend_item<T, 4, 128>(item, query, keys, values, limits.data(), visible, visible_stride, partial_acc.data(), partial_stats.data(), G, C, D, S, KV);
    } else if (G == 8 && D == 128) {
      attend_item<T, 8, 128>(item, query, keys, values, limits.data(), visible, visible_stride, partial_acc.data(), partial_stats.data(), G, C, D, S, KV);
    } else {
      attend_item<T, 0, 0>(item, query, keys, values, limits.data(), visible, visible_stride, partial_acc.data(), partial_stats.data(), G, C, D, S, KV);
    }
  }
  // merge the splits: out = sum_s exp(m_s - M) acc_s / sum_s exp(m_s - M) l_s
#pragma omp parallel for schedule(static)
  for (int64_t bhg = 0; bhg < B * KV * G; ++bhg) {
    const int64_t bh = bhg / G, g = bhg % G;
    float top = NEG;
    for (int64_t s = 0; s < S; ++s) top = std::max(top, partial_stats.data()[((bh * S + s) * G + g) * 2]);
    float* o = out + bhg * D;
    for (int64_t d = 0; d < D; ++d) o[d] = 0.f;
    if (top == NEG) continue;  // a row that sees no slot: zeros
    float total = 0.f;
    for (int64_t s = 0; s < S; ++s) {
      const float* st = partial_stats.data() + ((bh * S + s) * G + g) * 2;
      if (st[0] == NEG) continue;
      const float w = exp_nonpositive(st[0] - top);
      total += w * st[1];
      const float* pa = partial_acc.data() + ((bh * S + s) * G + g) * D;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) o[d] += w * pa[d];
    }
    const float inv = 1.f / total;
    for (int64_t d = 0; d < D; ++d) o[d] *= inv;
  }
  return 0;
}

// One entry point per store dtype (float; bfloat16 and float16 as their raw 16-bit patterns), float32
// query and output; runtime/cpu_kernels.py entry() picks it.
#define SPECONTEXT_DECODE_ENTRY(name, T)                                                                        \
  extern "C" int name(const float* query, const T* keys, const T* values, const int64_t* lengths,              \
                      int64_t length_stride, const uint8_t* visible, int64_t visible_stride, float* out,         \
                      int64_t B, int64_t KV, int64_t G, int64_t C, int64_t D, int64_t S) {                       \
    return decode_attention<T>(query, keys, values, lengths, length_stride, visible, visible_stride, out, B, KV, \
                               G, C, D, S);                                                                      \
  }

SPECONTEXT_DECODE_ENTRY(specontext_decode_attention, float)
SPECONTEXT_DECODE_ENTRY(specontext_decode_attention_bf16, uint16_t)
SPECONTEXT_DECODE_ENTRY(specontext_decode_attention_fp16, half_t)

// Calls in this process whose visibility mask hid no written slot (run without it: the path a test asserts).
extern "C" int64_t specontext_decode_attention_masks_dropped() { return masks_dropped.load(std::memory_order_relaxed); }

#ifdef SPECONTEXT_TORCH_OPS
#include "torch_op.h"

namespace {

std::atomic<int64_t> op_calls{0};

// specontext::cpu_decode_attention's CPU kernel (schema and Python kernel: runtime/cpu_kernels.py).
specontext_op::Tensor decode_attention_op(specontext_op::Tensor query, specontext_op::Tensor key_cache,
                                          specontext_op::Tensor value_cache, specontext_op::Tensor length,
                                          std::optional<specontext_op::Tensor> visible) {
  using namespace specontext_op;
  check_store_inputs("cpu_decode_attention", query, key_cache, value_cache, length, visible, MAX_GROUP, MAX_DIM);
  op_calls.fetch_add(1, std::memory_order_relaxed);  // a call the kernel serves
  const int64_t b = query.size(0), heads = query.size(1), d = query.size(3);
  const int64_t kv = key_cache.size(1), capacity = key_cache.size(2);
  Tensor out = torch::stable::new_empty(query, {b, heads, 1, d}, ScalarType::Float);
  if (capacity == 0) {  // nothing to attend to: zeros, as for a row that sees no slot
    torch::stable::zero_(out);
    return out;
  }
  const Tensor q = dense(query), k = dense(key_cache), v = dense(value_cache), n = dense(length);
  std::optional<Tensor> vis;
  if (visible.has_value()) vis = dense(*visible);
  auto run = [&](auto element) {  // the store's element type (torch_op.h with_store_element)
    using T = decltype(element);
    return decode_attention<T>(static_cast<const float*>(q.data_ptr()), static_cast<const T*>(k.data_ptr()),
                               static_cast<const T*>(v.data_ptr()), static_cast<const int64_t*>(n.data_ptr()),
                               n.numel() > 1 ? 1 : 0, static_cast<const uint8_t*>(pointer(vis)),
                               visible_stride(vis, capacity), static_cast<float*>(out.data_ptr()), b, kv, heads / kv,
                               capacity, d, 0);
  };
  const int status = with_store_element(k.scalar_type(), run);
  STD_TORCH_CHECK(status == 0, "cpu_decode_attention rejected its inputs");
  return out;
}

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(specontext, CPU, m) { m.impl("cpu_decode_attention", TORCH_BOX(&decode_attention_op)); }

// Calls of the operator's C++ kernel in this process (runtime/cpu_kernels.py kernel_calls).
extern "C" int64_t specontext_decode_attention_op_calls() { return op_calls.load(std::memory_order_relaxed); }
#endif
