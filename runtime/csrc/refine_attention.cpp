// The two-stage selection's per-layer refinement and the attention over what it keeps, for one
// decode row per head on the CPU (the CPU body of runtime/aten_step.refine_and_attend).
//
// For each (batch row, KV head): the group's query rows score every candidate's key, read in
// place from the store (no gathered copy); each candidate's rank is the largest softmax weight
// a query head of the group gives it among the candidates (SpeContext's GQA rule, section 4),
// the first `sinks` valid candidates and the recent window rank first, and the `budget` best
// candidates are kept (nth_element: no sort); the attention is then the softmax over the kept
// candidates' logits (the same logits, not recomputed) times their values, each value row read
// once for the whole group. float32 in, float32 accumulation, float32 out. Written for
// specontext (issue 51: the step at its floor); built and loaded by runtime/cpu_kernels.py.
#include <algorithm>
#include <cstdint>
#include <limits>
#include <numeric>
#include <vector>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

#include "vector_math.h"

using specontext::exp_nonpositive;
using specontext::MAX_DIM;
using specontext::MAX_GROUP;

namespace {

struct RefineArgs {
  const float* query;        // [B, KV, G, D], already multiplied by the softmax scale
  const float* keys;         // [B, KV, C, D]
  const float* values;       // [B, KV, C, D]
  const int64_t* candidates; // [B, KV, S]: store positions, -1 = no candidate
  const int64_t* lengths;    // [B] (or [1] with length_stride 0): tokens written, this step's included
  int64_t length_stride;
  const uint8_t* visible;    // bool [B, C] (or [1, C] with visible_stride 0), or nullptr
  int64_t visible_stride;
  float* out;                // [B, KV, G, D]
  int64_t KV, G, C, D, S, budget, sinks, recent;
};

constexpr float NEG = -std::numeric_limits<float>::infinity();
constexpr float POS = std::numeric_limits<float>::infinity();
constexpr int64_t PREFETCH = 16;  // candidates ahead whose key (or value) row is prefetched: rows are scattered

// dots[g] = q[g] . key for the group's G query rows of D floats.
template <int G_, int D_>
inline void group_dots(const float* __restrict q, const float* __restrict key, int64_t G_rt, int64_t D_rt,
                       float* __restrict dots) {
#ifdef __AVX512F__
  if constexpr (G_ > 0 && D_ > 0 && D_ % 16 == 0) {  // G_ independent accumulators, one reduction each
    __m512 acc[G_];
    for (int g = 0; g < G_; ++g) acc[g] = _mm512_setzero_ps();
    for (int d = 0; d < D_; d += 16) {
      const __m512 kv = _mm512_loadu_ps(key + d);
      for (int g = 0; g < G_; ++g) acc[g] = _mm512_fmadd_ps(_mm512_loadu_ps(q + g * D_ + d), kv, acc[g]);
    }
    for (int g = 0; g < G_; ++g) dots[g] = _mm512_reduce_add_ps(acc[g]);
    return;
  }
#endif
  const int64_t G = G_ > 0 ? G_ : G_rt;
  const int64_t D = D_ > 0 ? D_ : D_rt;
  for (int64_t g = 0; g < G; ++g) {
    const float* qg = q + g * D;
    float dot = 0.f;
#pragma omp simd reduction(+ : dot)
    for (int64_t d = 0; d < D; ++d) dot += qg[d] * key[d];
    dots[g] = dot;
  }
}

// Start loading a row of D floats into the cache (every 64-byte line of it): the candidates'
// rows are scattered, so the hardware prefetcher does not see them coming.
inline void prefetch_row(const float* row, int64_t D) {
  const char* bytes = reinterpret_cast<const char*>(row);
  for (int64_t offset = 0; offset < D * 4; offset += 64) __builtin_prefetch(bytes + offset);
}

#ifdef __AVX512F__
// out[j] = the sum of acc[j]'s 16 lanes, for 16 vectors at once (a transposing tree of adds:
// 15 adds and 31 shuffles where 16 horizontal sums take 16 x 8 dependent operations).
inline __m512 sum_lanes16(const __m512* acc) {
  __m512 c[8], e[4];
  for (int i = 0; i < 8; ++i)  // 128-bit lanes: [a0+a2, a1+a3, b0+b2, b1+b3]
    c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(acc[2 * i], acc[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(acc[2 * i], acc[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i)  // lane l of e[i]: vector 4i + l, four partial sums
    e[i] = _mm512_add_ps(_mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0xDD));
  const __m512 f0 = _mm512_add_ps(_mm512_unpacklo_ps(e[0], e[1]), _mm512_unpackhi_ps(e[0], e[1]));
  const __m512 f1 = _mm512_add_ps(_mm512_unpacklo_ps(e[2], e[3]), _mm512_unpackhi_ps(e[2], e[3]));
  const __m512d f0d = _mm512_castps_pd(f0), f1d = _mm512_castps_pd(f1);
  const __m512 h = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(f0d, f1d)),
                                 _mm512_castpd_ps(_mm512_unpackhi_pd(f0d, f1d)));  // h[4l + m] = vector 4m + l
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(order, h);
}

// The logits of 16 candidates' key rows (rows[j]; a hidden one points at zeros and is masked
// with -inf by `seen`) for the group's G_ query rows, written to logit[g * S + j]: the 16 rows'
// loads are independent, so their cache misses overlap.
template <int G_, int D_>
inline void block_logits(const float* __restrict q, const float* const* rows, __mmask16 seen, int64_t S,
                         float* __restrict logit) {
  for (int g = 0; g < G_; ++g) {
    __m512 acc[16];
    for (int j = 0; j < 16; ++j) acc[j] = _mm512_setzero_ps();
    for (int d = 0; d < D_; d += 16) {
      const __m512 qv = _mm512_loadu_ps(q + g * D_ + d);
      for (int j = 0; j < 16; ++j) acc[j] = _mm512_fmadd_ps(qv, _mm512_loadu_ps(rows[j] + d), acc[j]);
    }
    const __m512 sums = _mm512_mask_blend_ps(seen, _mm512_set1_ps(NEG), sum_lanes16(acc));
    _mm512_storeu_ps(logit + g * S, sums);
  }
}
#endif

// The group's logits for every candidate, [G][S]: -inf where the candidate is padding, past
// the causal limit, outside the store or hidden by the mask (its key is then never read).
// Only the slots [lo, hi) are written (the item's slots may be split between threads).
template <int G_, int D_>
void candidate_logits(const RefineArgs& a, int64_t bh, int64_t limit, const uint8_t* vis, int64_t lo, int64_t hi,
                      float* logit) {
  const int64_t G = G_ > 0 ? G_ : a.G;
  const int64_t D = D_ > 0 ? D_ : a.D;
  const float* q = a.query + bh * G * D;
  const float* k = a.keys + bh * a.C * D;
  const int64_t* cand = a.candidates + bh * a.S;
  int64_t s = lo;
#ifdef __AVX512F__
  if constexpr (G_ > 0 && D_ > 0 && D_ % 16 == 0) {
    alignas(64) static const float zeros[D_ > 0 ? D_ : 1] = {};
    for (; s + 16 <= hi; s += 16) {
      const float* rows[16];
      __mmask16 seen = 0;
      for (int j = 0; j < 16; ++j) {
        const int64_t c = cand[s + j];
        const bool ok = c >= 0 && c < limit && (!vis || vis[c]);
        rows[j] = ok ? k + c * D : zeros;
        seen |= static_cast<__mmask16>(ok) << j;
      }
      for (int64_t j = s + PREFETCH; j < std::min(s + PREFETCH + 16, hi); ++j)  // the next rows' misses start now
        if (cand[j] >= 0 && cand[j] < limit) prefetch_row(k + cand[j] * D, D);
      block_logits<G_, D_>(q, rows, seen, a.S, logit + s);
    }
  }
#endif
  for (; s < hi; ++s) {
    const int64_t c = cand[s];
    if (c < 0 || c >= limit || (vis && !vis[c])) {
      for (int64_t g = 0; g < G; ++g) logit[g * a.S + s] = NEG;
      continue;
    }
    if (s + PREFETCH < hi && cand[s + PREFETCH] >= 0 && cand[s + PREFETCH] < limit)
      prefetch_row(k + cand[s + PREFETCH] * D, D);
    float dots[MAX_GROUP];
    group_dots<G_, D_>(q, k + c * D, G, D, dots);
    for (int64_t g = 0; g < G; ++g) logit[g * a.S + s] = dots[g];
  }
}

// Each candidate's rank: +inf for the forced ones (the first `sinks` valid candidates, and
// positions >= length - recent), else the group's largest softmax weight among the candidates
// (0 for a valid candidate no row sees), -inf for padding. expd[g][s] = exp(logit - max_g), each
// head's maximum over the candidates in head_max[g] (kept_weights reuses both).
void candidate_ranks(const RefineArgs& a, int64_t bh, int64_t length, const float* __restrict logit,
                     float* __restrict expd, float* __restrict head_max, float* __restrict rank) {
  const int64_t G = a.G, S = a.S;
  const int64_t* cand = a.candidates + bh * S;
  std::fill(rank, rank + S, 0.f);
  for (int64_t g = 0; g < G; ++g) {  // rank = max over the group of the softmax weight
    const float* lg = logit + g * S;
    float* eg = expd + g * S;
    float m = NEG;
#pragma omp simd reduction(max : m)
    for (int64_t s = 0; s < S; ++s) m = std::max(m, lg[s]);
    head_max[g] = m;
    if (m == NEG) {  // no row of this head sees a candidate: weight 0
      std::fill(eg, eg + S, 0.f);
      continue;
    }
    float z = 0.f;
#pragma omp simd reduction(+ : z)
    for (int64_t s = 0; s < S; ++s) {
      eg[s] = exp_nonpositive(lg[s] - m);
      z += eg[s];
    }
    const float inv = 1.f / z;
#pragma omp simd
    for (int64_t s = 0; s < S; ++s) {
      const float w = eg[s] * inv;
      rank[s] = w > rank[s] ? w : rank[s];
    }
  }
  int64_t valid_seen = 0;
  for (int64_t s = 0; s < S; ++s) {
    const int64_t c = cand[s];
    if (c < 0) {
      rank[s] = NEG;
      continue;
    }
    ++valid_seen;
    if (valid_seen <= a.sinks || c >= length - a.recent) rank[s] = POS;
  }
}

// Which candidates are kept: the `budget` highest ranks (ties broken arbitrarily), 1 = kept.
// Ranks are >= 0 or +-inf, so a rank's float bits order as integers (-inf mapped below 0.0): a
// radix select on those bits, 8 at a time from the top, finds the budget-th largest in a few
// passes over the ranks, without a sort.
void keep_top(const RefineArgs& a, const float* rank, uint8_t* kept) {
  const int64_t S = a.S;
  if (a.budget >= S) {
    for (int64_t s = 0; s < S; ++s) kept[s] = rank[s] != NEG;
    return;
  }
  std::vector<uint32_t> key(S);
  for (int64_t s = 0; s < S; ++s) {
    uint32_t bits;
    __builtin_memcpy(&bits, &rank[s], sizeof(bits));
    key[s] = rank[s] == NEG ? 0u : bits + 1u;  // +inf (0x7f800000) stays the largest
  }
  // find the threshold t: the budget-th largest key; `need` = how many keys equal to t to keep
  uint32_t prefix = 0, mask = 0;
  int64_t need = a.budget;
  for (int shift = 24; shift >= 0; shift -= 8) {
    int64_t count[256] = {};
    for (int64_t s = 0; s < S; ++s)
      if ((key[s] & mask) == prefix) ++count[(key[s] >> shift) & 0xff];
    int digit = 255;
    for (; digit > 0 && count[digit] < need; --digit) need -= count[digit];
    prefix |= static_cast<uint32_t>(digit) << shift;
    mask |= 0xffu << shift;
  }
  for (int64_t s = 0; s < S; ++s) {
    const bool above = key[s] > prefix;
    const bool tie = key[s] == prefix && need > 0;
    need -= tie;
    kept[s] = (above || tie) && key[s] != 0;
  }
}

// The kept candidates' softmax numerators ([G][S], 0 for a candidate not kept) and each head's
// denominator sums[g] (0: the row sees none of them): expd as it is where the head's maximum is
// kept (the usual case), else exp(logit - the kept maximum).
void kept_weights(const RefineArgs& a, const uint8_t* __restrict kept, const float* __restrict logit,
                  const float* __restrict head_max, float* __restrict expd, float* sums) {
  const int64_t S = a.S;
  for (int64_t g = 0; g < a.G; ++g) {
    const float* lg = logit + g * S;
    float* eg = expd + g * S;
    float m = NEG;
#pragma omp simd reduction(max : m)
    for (int64_t s = 0; s < S; ++s) m = std::max(m, kept[s] ? lg[s] : NEG);
    float sum = 0.f;
    if (m == NEG) {
      std::fill(eg, eg + S, 0.f);
    } else if (m == head_max[g]) {
#pragma omp simd reduction(+ : sum)
      for (int64_t s = 0; s < S; ++s) {
        const float w = kept[s] ? eg[s] : 0.f;
        eg[s] = w;
        sum += w;
      }
    } else {
#pragma omp simd reduction(+ : sum)
      for (int64_t s = 0; s < S; ++s) {
        const float w = kept[s] ? exp_nonpositive(lg[s] - m) : 0.f;
        eg[s] = w;
        sum += w;
      }
    }
    sums[g] = sum;
  }
}

// acc[g][:] = sum over the kept candidates in slots [lo, hi) of weight * value row (each value
// row read once for the group; a candidate without weight is never read).
template <int G_, int D_>
void kept_values(const RefineArgs& a, int64_t bh, const float* weight, const uint8_t* kept, int64_t lo, int64_t hi,
                 float* out) {
  const int64_t G = G_ > 0 ? G_ : a.G;
  const int64_t D = D_ > 0 ? D_ : a.D;
  const int64_t S = a.S;
  const float* v = a.values + bh * a.C * D;
  const int64_t* cand = a.candidates + bh * S;
  std::vector<int32_t> rows;  // the slots whose value row is read, in order: prefetched ahead
  rows.reserve(hi - lo);
  for (int64_t s = lo; s < hi; ++s) {
    if (!kept[s]) continue;
    bool any = false;
    for (int64_t g = 0; g < G; ++g) any = any || weight[g * S + s] != 0.f;
    if (any) rows.push_back(static_cast<int32_t>(s));
  }
  alignas(64) float acc[G_ > 0 ? G_ : MAX_GROUP][D_ > 0 ? D_ : MAX_DIM];  // in registers for the common shapes
  for (int64_t g = 0; g < G; ++g)
    for (int64_t d = 0; d < D; ++d) acc[g][d] = 0.f;
  const int64_t n = static_cast<int64_t>(rows.size());
  for (int64_t i = 0; i < std::min<int64_t>(PREFETCH, n); ++i) prefetch_row(v + cand[rows[i]] * D, D);
  for (int64_t i = 0; i < n; ++i) {
    if (i + PREFETCH < n) prefetch_row(v + cand[rows[i + PREFETCH]] * D, D);
    const int64_t s = rows[i];
    const float* vr = v + cand[s] * D;
    for (int64_t g = 0; g < G; ++g) {
      const float w = weight[g * S + s];
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) acc[g][d] += w * vr[d];
    }
  }
  for (int64_t g = 0; g < G; ++g)
    for (int64_t d = 0; d < D; ++d) out[g * D + d] = acc[g][d];
}

// The item's slots [lo, hi) of split `split` out of `splits`.
inline void split_range(int64_t S, int64_t splits, int64_t split, int64_t* lo, int64_t* hi) {
  const int64_t per = (S + splits - 1) / splits;
  *lo = std::min(S, split * per);
  *hi = std::min(S, *lo + per);
}

struct Item {  // where an item's length, causal limit and mask row are
  int64_t length, limit;
  const uint8_t* vis;
};

inline Item item_of(const RefineArgs& a, int64_t bh) {
  const int64_t b = bh / a.KV;
  const int64_t length = a.lengths[b * a.length_stride];
  return {length, std::min<int64_t>(std::max<int64_t>(length, 0), a.C),
          a.visible ? a.visible + b * a.visible_stride : nullptr};
}

// out[g][:] = (sum of the splits' acc[g][:]) / sums[g], zeros where sums[g] is 0.
void merge_splits(const RefineArgs& a, int64_t bh, const float* acc, int64_t splits, const float* sums) {
  const int64_t G = a.G, D = a.D;
  float* o = a.out + bh * G * D;
  for (int64_t g = 0; g < G; ++g) {
    const float inv = sums[g] > 0.f ? 1.f / sums[g] : 0.f;
    for (int64_t d = 0; d < D; ++d) {
      float total = 0.f;
      for (int64_t sp = 0; sp < splits; ++sp) total += acc[(sp * G + g) * D + d];
      o[g * D + d] = total * inv;
    }
  }
}

// Function pointers of one (G, D) specialisation.
struct Kernels {
  void (*logits)(const RefineArgs&, int64_t, int64_t, const uint8_t*, int64_t, int64_t, float*);
  void (*values)(const RefineArgs&, int64_t, const float*, const uint8_t*, int64_t, int64_t, float*);
};

template <int G_, int D_>
constexpr Kernels kernels_for() {
  return {&candidate_logits<G_, D_>, &kept_values<G_, D_>};
}

Kernels pick_kernels(int64_t G, int64_t D) {
  // compile-time group and head sizes for the common shapes (unrolled, vectorised loops)
  if (G == 3 && D == 64) return kernels_for<3, 64>();
  if (G == 4 && D == 64) return kernels_for<4, 64>();
  if (G == 4 && D == 128) return kernels_for<4, 128>();
  if (G == 8 && D == 128) return kernels_for<8, 128>();
  return kernels_for<0, 0>();
}

}  // namespace

// The slots of an item are split between work items (`splits` of them) when there are fewer
// items than twice the threads (batch 1: 3 KV heads on 2 threads): the logits and the values'
// sums run per split, the ranking and the top-k per item, in between.
extern "C" int specontext_refine_attention(
    const float* query, const float* keys, const float* values, const int64_t* candidates,
    const int64_t* lengths, int64_t length_stride, const uint8_t* visible, int64_t visible_stride, float* out,
    int64_t B, int64_t KV, int64_t G, int64_t C, int64_t D, int64_t S, int64_t budget, int64_t sinks,
    int64_t recent, int64_t splits) {
  if (G > MAX_GROUP || D > MAX_DIM || S < 1 || budget < 0 || splits < 1) return 1;
  const RefineArgs a{query, keys, values, candidates, lengths, length_stride, visible, visible_stride, out,
                     KV, G, C, D, S, budget, sinks, recent};
  const Kernels k = pick_kernels(G, D);
  const int64_t items = B * KV;
  if (splits == 1) {  // many items: one per thread at a time, scratch per thread
#pragma omp parallel
    {
      std::vector<float> logit(S * G), expd(S * G), rank(S), acc(G * D), sums(G), head_max(G);
      std::vector<uint8_t> kept(S);
#pragma omp for schedule(dynamic, 1)
      for (int64_t bh = 0; bh < items; ++bh) {
        const Item it = item_of(a, bh);
        k.logits(a, bh, it.limit, it.vis, 0, S, logit.data());
        candidate_ranks(a, bh, it.length, logit.data(), expd.data(), head_max.data(), rank.data());
        keep_top(a, rank.data(), kept.data());
        kept_weights(a, kept.data(), logit.data(), head_max.data(), expd.data(), sums.data());
        k.values(a, bh, expd.data(), kept.data(), 0, S, acc.data());
        merge_splits(a, bh, acc.data(), 1, sums.data());
      }
    }
    return 0;
  }
  std::vector<float> logit(items * G * S), expd(items * G * S), rank(items * S), acc(items * splits * G * D),
      sums(items * G), head_max(items * G);
  std::vector<uint8_t> kept(items * S);
#pragma omp parallel
  {
#pragma omp for schedule(static)
    for (int64_t unit = 0; unit < items * splits; ++unit) {
      const int64_t bh = unit / splits;
      int64_t lo, hi;
      split_range(S, splits, unit % splits, &lo, &hi);
      const Item it = item_of(a, bh);
      k.logits(a, bh, it.limit, it.vis, lo, hi, logit.data() + bh * G * S);
    }
#pragma omp for schedule(dynamic, 1)
    for (int64_t bh = 0; bh < items; ++bh) {
      candidate_ranks(a, bh, item_of(a, bh).length, logit.data() + bh * G * S, expd.data() + bh * G * S,
                      head_max.data() + bh * G, rank.data() + bh * S);
      keep_top(a, rank.data() + bh * S, kept.data() + bh * S);
      kept_weights(a, kept.data() + bh * S, logit.data() + bh * G * S, head_max.data() + bh * G,
                   expd.data() + bh * G * S, sums.data() + bh * G);
    }
#pragma omp for schedule(static)
    for (int64_t unit = 0; unit < items * splits; ++unit) {
      const int64_t bh = unit / splits;
      int64_t lo, hi;
      split_range(S, splits, unit % splits, &lo, &hi);
      k.values(a, bh, expd.data() + bh * G * S, kept.data() + bh * S, lo, hi, acc.data() + unit * G * D);
    }
#pragma omp for schedule(static)
    for (int64_t bh = 0; bh < items; ++bh) merge_splits(a, bh, acc.data() + bh * splits * G * D, splits, sums.data() + bh * G);
  }
  return 0;
}
