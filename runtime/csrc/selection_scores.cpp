// The default selection head's scores on the CPU: lagged queries of the retrieval layers over
// their written keys, one call per step.
//
// What it computes (runtime/scorers.py, lagged_query_score; SpeContext, arXiv 2512.00722,
// section 4, the GQA rule): for each (batch row b, KV head h) and position p of the store,
//   out[b][h][p] = sum over the L retrieval layers l of max over the G query heads g of the
//                  group of softmax_p(q_l[g] . k_l[p]), over the positions p < length[b] that
//                  are visible (visible[b][p]); 0 elsewhere.
// Only the written positions' keys are read (the store's capacity may be far larger). Phase 1
// splits (layer, batch row, KV head, positions) between the threads: each key row read once
// for the group's heads, 16 rows at a time, the next 16 prefetched (and rows 128 ahead into
// L2), each logit's exponential against its split's maximum written to scratch with the split's
// maximum and sum; phase 2
// splits (batch row, KV head, positions): each layer's log-sum-exp merged from its splits, the
// exponentials scaled by one factor per split (no second exponential per position: 2.5 -> 1.7
// ms a step for 8 layers of 8K fp32 keys, 2.2 -> 1.4 bf16, scratch timing), then summed.
// float32, bfloat16 or float16 stores with the float32 query taken as given (the callers round
// it to the store's dtype, as the torch body does; a bfloat16 store's keys then go through the
// CPU's bfloat16 dot products where it has them, else they are widened as loaded); or int8
// stores (levels and one float32 scale per row, an entry point of its own: option
// selection_keys), whose query rows are rounded to int8 levels here too, so that the logits are
// integer dot products (AVX-512 VNNI where the CPU has it). float32 accumulation and output. Written for specontext
// (issue 51); built and loaded by runtime/cpu_selection.py.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "cpu_common.h"

using namespace specontext_cpu;

namespace {

// calls whose visibility mask hid no written slot, run without it (cpu_common.h, needed_mask)
std::atomic<int64_t> masks_dropped{0};

constexpr int PREFETCH = 16;  // rows ahead prefetched into L1
constexpr int FAR = 128;      // rows ahead prefetched into L2 (cpu_common.h, prefetch_row_l2)
constexpr int MAX_GROUP = 16;
constexpr int MAX_DIM = 256;
constexpr int MAX_LAYERS = 64;
constexpr float NEG = -std::numeric_limits<float>::infinity();

template <typename T>
struct Scores {
  const float* query;        // [L, B, KV, G, D], scaled
  const T* const* keys;      // L stores [B, KV, C, D]
  const int64_t* lengths;    // [B] or [1] (stride 0)
  int64_t length_stride;
  const uint8_t* visible;    // [B, C] or [1, C] (stride 0) or nullptr
  int64_t visible_stride;
  float* out;                // [B, KV, C]
  int64_t L, B, KV, G, C, D, S;  // S: phase 1's splits of the written positions
  int64_t S2;                  // phase 2's splits of the capacity (its own: phase 1 has L x more units)
  float* logits;             // [L, B * KV, G, C]
  float* stats;              // [L, B * KV, S, G, 2]: each split's maximum and sum of exp(l - max)
  const float* const* scales;  // int8 stores: L rows of scales [B, KV, C] (a key is level * scale); else nullptr
  // int8 stores: the query's rows as int8 levels [L, B * KV, G, D], each row's scale and level sum
  // [L, B * KV, G] (query_levels); `query` then holds their dequantized values
  const int8_t* query8;
  const float* query_scale;
  const int32_t* query_sum;

  int64_t limit(int64_t b) const { return std::min(std::max<int64_t>(lengths[b * length_stride], 0), C); }
  bool hidden(int64_t b, int64_t pos) const { return visible && !visible[b * visible_stride + pos]; }
};

// The split's statistics (split_stats) with each logit replaced by its exponential
// exp(l - split maximum) (0 for -inf): phase 2 scales them by one factor per split instead of
// taking an exponential per position again.
inline void split_exponentials(float* row, int64_t lo, int64_t hi, float* st) {
  const float m = row_max(row, lo, hi);
  float z = 0.f;
  if (m == NEG) {
    for (int64_t i = lo; i < hi; ++i) row[i] = 0.f;
  } else {
#pragma omp simd reduction(+ : z)
    for (int64_t i = lo; i < hi; ++i) {
      row[i] = exp_nonpositive(row[i] - m);
      z += row[i];
    }
  }
  st[0] = m;
  st[1] = z;
}

// group_logits16_int8 (int8 keys and query rows, VPDPBUSD): cpu_common.h, shared with the vLLM plugin

std::atomic<int64_t> int8_dot_calls{0};  // calls that took the int8 dot products

// Phase 1: layer l's logits of positions [lo, hi) for item bh, as exponentials, and the split's statistics.
template <typename T, int G_, int D_, bool DOT>
void layer_logits(const Scores<T>& p, int64_t l, int64_t bh, int64_t split, int64_t lo, int64_t hi) {
  const int64_t G = G_ > 0 ? G_ : p.G;
  const int64_t D = D_ > 0 ? D_ : p.D;
  const int64_t b = bh / p.KV, items = p.B * p.KV;
  const T* k = p.keys[l] + bh * p.C * D;
  const float* q = p.query + (l * items + bh) * G * D;
  float* lg = p.logits + (l * items + bh) * G * p.C;
  int64_t j = lo;
#ifdef __AVX512F__
  if constexpr (G_ > 0 && D_ > 0 && D_ % 16 == 0) {
    for (; j + 16 <= hi; j += 16) {
      const T* rows[16];
      for (int jj = 0; jj < 16; ++jj) {
        rows[jj] = k + (j + jj) * D_;
        if (j + PREFETCH + jj < hi) prefetch_row<T, D_>(k + (j + PREFETCH + jj) * D_);
        if (j + FAR + jj < hi) prefetch_row_l2<T, D_>(k + (j + FAR + jj) * D_);
      }
#ifdef SPECONTEXT_INT8_DOT
      if constexpr (std::is_same_v<T, int8_t> && D_ % 64 == 0) {
        const int64_t row = (l * items + bh) * G;
        group_logits16_int8<G_, D_>(p.query8 + row * D, p.query_scale + row, p.query_sum + row, rows, lg + j, p.C);
        continue;
      }
#endif
      group_logits16<T, G_, D_, DOT>(q, rows, lg + j, p.C);
    }
  }
#endif
  for (; j < hi; ++j) {
    const T* kr = k + j * D;
    for (int64_t g = 0; g < G; ++g) {
      const float* qg = q + g * D;
      lg[g * p.C + j] = dot_row(qg, kr, D);
    }
  }
  if (p.scales) {  // an int8 store: q . (level * scale) = (q . level) * scale, the row's scale
    const float* sc = p.scales[l] + bh * p.C;
    for (int64_t g = 0; g < G; ++g) {
      float* row = lg + g * p.C;
#pragma omp simd
      for (int64_t i = lo; i < hi; ++i) row[i] *= sc[i];
    }
  }
  if (p.visible)
    for (int64_t i = lo; i < hi; ++i)
      if (p.hidden(b, i))
        for (int64_t g = 0; g < G; ++g) lg[g * p.C + i] = NEG;
  float* st = p.stats + ((l * items + bh) * p.S + split) * G * 2;
  for (int64_t g = 0; g < G; ++g) split_exponentials(lg + g * p.C, lo, hi, st + 2 * g);
}

// Phase 2: the scores of positions [lo, hi) of item bh (0 past the written length): each
// layer's softmax weight of position i is its phase-1 exponential exp(l_i - m_s) times
// exp(m_s - M) / Z, one factor per phase-1 split s (M, Z: the layer's maximum and sum over
// every split).
template <typename T>
void sum_weights(const Scores<T>& p, int64_t bh, int64_t lo, int64_t hi, int64_t limit) {
  const int64_t G = p.G, items = p.B * p.KV;
  float* o = p.out + bh * p.C;
  for (int64_t i = lo; i < hi; ++i) o[i] = 0.f;
  const int64_t end = std::min(hi, limit);
  const int64_t per = std::max<int64_t>((limit + p.S - 1) / p.S, 1);  // phase 1's split of [0, limit)
  std::vector<float> best(std::max<int64_t>(end - lo, 0));
  for (int64_t l = 0; l < p.L; ++l) {
    std::fill(best.begin(), best.end(), 0.f);
    for (int64_t g = 0; g < G; ++g) {
      float m = NEG, z = 0.f;
      const float* st = p.stats + (l * items + bh) * p.S * G * 2;
      for (int64_t s = 0; s < p.S; ++s) m = std::max(m, st[(s * G + g) * 2]);
      if (m == NEG) continue;  // the head sees no position: weight 0 everywhere
      for (int64_t s = 0; s < p.S; ++s)
        if (st[(s * G + g) * 2] != NEG) z += st[(s * G + g) * 2 + 1] * exp_nonpositive(st[(s * G + g) * 2] - m);
      const float inv = 1.f / z;
      const float* row = p.logits + ((l * items + bh) * G + g) * p.C;
      float* bp = best.data() - lo;
      for (int64_t s = lo / per; s * per < end; ++s) {
        const float ms = st[(s * G + g) * 2];
        const float f = ms == NEG ? 0.f : exp_nonpositive(ms - m) * inv;
        const int64_t a = std::max(lo, s * per), e = std::min(end, (s + 1) * per);
#pragma omp simd
        for (int64_t i = a; i < e; ++i) bp[i] = std::max(bp[i], row[i] * f);
      }
    }
    const float* bp = best.data() - lo;
#pragma omp simd
    for (int64_t i = lo; i < end; ++i) o[i] += bp[i];
  }
}

// splits of `n` positions of each of `units` (layer, item) pairs: at least 16 units for the
// threads, each of at least `least` positions
int64_t splits(int64_t units, int64_t n, int64_t least) {
  return std::max<int64_t>(1, std::min<int64_t>((16 + units - 1) / std::max<int64_t>(units, 1), n / least));
}

std::atomic<int64_t> dot_calls{0};  // calls that took the bfloat16 dot products

template <typename T, int G_, int D_, bool DOT>
void run(const Scores<T>& p) {
  if constexpr (DOT && uses_bf16_dot<T, G_, D_>()) dot_calls.fetch_add(1, std::memory_order_relaxed);
#ifdef SPECONTEXT_INT8_DOT
  if constexpr (std::is_same_v<T, int8_t> && G_ > 0 && D_ > 0 && D_ % 64 == 0)
    int8_dot_calls.fetch_add(1, std::memory_order_relaxed);
#endif
  const int64_t items = p.B * p.KV;
#pragma omp parallel
  {
#pragma omp for schedule(static)
    for (int64_t unit = 0; unit < p.L * items * p.S; ++unit) {
      const int64_t s = unit % p.S, bh = (unit / p.S) % items, l = unit / (p.S * items);
      const int64_t limit = p.limit(bh / p.KV);
      const int64_t per = (limit + p.S - 1) / p.S;
      const int64_t lo = std::min(s * per, limit), hi = std::min(lo + per, limit);
      layer_logits<T, G_, D_, DOT>(p, l, bh, s, lo, hi);
    }
#pragma omp for schedule(static)
    for (int64_t unit = 0; unit < items * p.S2; ++unit) {
      const int64_t s = unit % p.S2, bh = unit / p.S2;
      const int64_t per = (p.C + p.S2 - 1) / p.S2;
      const int64_t lo = std::min(s * per, p.C), hi = std::min(lo + per, p.C);
      sum_weights<T>(p, bh, lo, hi, p.limit(bh / p.KV));
    }
  }
}

// Rows of n floats as int8 levels and one scale each, as runtime/int8_keys.py's quantize_rows
// rounds keys: scale = max(max |x|, smallest normal float32) / 127, level = x / scale rounded to
// the nearest integer (ties to even), clamped to -127..127; with each row's level sum and its
// dequantized values (level * scale).
inline void query_levels(const float* q, int64_t rows, int64_t n, int8_t* levels, float* scale, int32_t* sum,
                         float* values) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* x = q + r * n;
    float peak = 0.f;
    for (int64_t i = 0; i < n; ++i) peak = std::max(peak, std::fabs(x[i]));
    const float s = std::max(peak, std::numeric_limits<float>::min()) / 127.f;
    int32_t total = 0;
    for (int64_t i = 0; i < n; ++i) {
      const float level = std::min(127.f, std::max(-127.f, std::nearbyint(x[i] / s)));
      levels[r * n + i] = static_cast<int8_t>(level);
      values[r * n + i] = level * s;
      total += static_cast<int32_t>(level);
    }
    scale[r] = s;
    sum[r] = total;
  }
}

template <typename T>
int selection_scores(const float* query, const T* const* keys, const float* const* scales, const int64_t* lengths,
                     int64_t length_stride, const uint8_t* visible, int64_t visible_stride, float* out, int64_t L,
                     int64_t B, int64_t KV, int64_t G, int64_t C, int64_t D) {
  if (L < 1 || L > MAX_LAYERS || G < 1 || G > MAX_GROUP || D < 1 || D > MAX_DIM || C < 1 || B < 1 || KV < 1) return 1;
  static thread_local std::vector<float> logits, stats;  // kept between steps: no allocation per call
  if (visible && !(visible = needed_mask(visible, visible_stride, lengths, length_stride, B, C)))
    masks_dropped.fetch_add(1, std::memory_order_relaxed);
  int64_t longest = 0;
  for (int64_t b = 0; b < B; ++b) longest = std::max(longest, std::min(std::max<int64_t>(lengths[b * length_stride], 0), C));
  const int64_t S = splits(L * B * KV, std::max<int64_t>(longest, 1), 256);
  logits.resize(L * B * KV * G * C);
  stats.resize(L * B * KV * S * G * 2);
  // phase 2 splits the capacity for itself: with phase 1's splits (one per item when the
  // layers give the threads enough units), SmolLM2's 3 KV heads left one of 2 threads idle for
  // a third of it (issue 51)
  const int64_t S2 = splits(B * KV, C, 256);
  Scores<T> p{query, keys, lengths, length_stride, visible, visible_stride, out, L, B, KV, G, C, D, S, S2,
              logits.data(), stats.data(), scales, nullptr, nullptr, nullptr};
  // int8 keys: the query's rows as int8 levels too (each with its own scale), so that the key
  // logits are integer dot products (VPDPBUSD where the CPU has it); the other paths read the
  // same levels dequantized, so every position of a call sees one query
  static thread_local std::vector<int8_t> query8;
  static thread_local std::vector<float> query_scale, query_values;
  static thread_local std::vector<int32_t> query_sum;
  if constexpr (std::is_same_v<T, int8_t>) {
    const int64_t rows = L * B * KV * G;
    query8.resize(rows * D);
    query_values.resize(rows * D);
    query_scale.resize(rows);
    query_sum.resize(rows);
    query_levels(query, rows, D, query8.data(), query_scale.data(), query_sum.data(), query_values.data());
    p.query = query_values.data();
    p.query8 = query8.data();
    p.query_scale = query_scale.data();
    p.query_sum = query_sum.data();
  }
  // the bfloat16 dot products take the query only where it holds bfloat16 values already
  if (holds_store_values(query, L * B * KV * G * D, T{}))
    with_shape(G, D, [&p](auto g, auto d) { run<T, decltype(g)::value, decltype(d)::value, true>(p); });
  else
    with_shape(G, D, [&p](auto g, auto d) { run<T, decltype(g)::value, decltype(d)::value, false>(p); });
  return 0;
}

}  // namespace

// One entry point per store dtype (float; bfloat16 and float16 as their raw 16-bit patterns), float32
// query and output; runtime/cpu_selection.py picks it (cpu_kernels.entry).
#define SPECONTEXT_SELECTION_ENTRY(name, T)                                                                     \
  extern "C" int name(const float* query, const T* const* keys, const int64_t* lengths, int64_t length_stride,   \
                      const uint8_t* visible, int64_t visible_stride, float* out, int64_t L, int64_t B,          \
                      int64_t KV, int64_t G, int64_t C, int64_t D) {                                             \
    return selection_scores<T>(query, keys, nullptr, lengths, length_stride, visible, visible_stride, out, L, B, \
                               KV, G, C, D);                                                                     \
  }

SPECONTEXT_SELECTION_ENTRY(specontext_selection_scores, float)
SPECONTEXT_SELECTION_ENTRY(specontext_selection_scores_bf16, uint16_t)
SPECONTEXT_SELECTION_ENTRY(specontext_selection_scores_fp16, half_t)

// int8 stores: each key row is its levels (int8) times its own float32 scale (scales: L
// pointers to [B, KV, C]; runtime/int8_keys.py quantizes them), so the logit is the levels' dot
// product times the row's scale: a quarter of a float32 store's key bytes plus 4 bytes a row
// (at head_dim 64, 68 bytes a row against 256 and 128).
extern "C" int specontext_selection_scores_int8(const float* query, const int8_t* const* keys,
                                                const float* const* scales, const int64_t* lengths,
                                                int64_t length_stride, const uint8_t* visible, int64_t visible_stride,
                                                float* out, int64_t L, int64_t B, int64_t KV, int64_t G, int64_t C,
                                                int64_t D) {
  if (!scales) return 1;
  for (int64_t l = 0; l < L; ++l)
    if (!scales[l]) return 1;
  return selection_scores<int8_t>(query, keys, scales, lengths, length_stride, visible, visible_stride, out, L, B,
                                  KV, G, C, D);
}

// Calls in this process that took the int8 dot products (VPDPBUSD).
extern "C" int64_t specontext_selection_scores_int8_dot_calls() { return int8_dot_calls.load(std::memory_order_relaxed); }

// Calls in this process that took the bfloat16 dot products (the rest widened the keys).
extern "C" int64_t specontext_selection_scores_bf16_dot_calls() { return dot_calls.load(std::memory_order_relaxed); }

// Calls in this process whose visibility mask hid no written slot (run without it: the path a test asserts).
extern "C" int64_t specontext_selection_scores_masks_dropped() { return masks_dropped.load(std::memory_order_relaxed); }
