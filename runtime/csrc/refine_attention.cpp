// Refined sparse decode attention on the CPU: a layer's refinement of the two-stage selection
// and its attention over the tokens the refinement keeps, in one call, one query row per head.
//
// What it computes (runtime/aten_step.py, refine_and_attend with q_len = 1, a plain site: no
// soft cap, no sliding window; SpeContext, arXiv 2512.00722, section 4, the GQA rule):
//   0. with the page rescue (runtime/page_bounds.py), the selection's candidates are followed by
//      the tokens of the `rescue` pages with the highest Quest bound max_g sum_d max(q_d min_d,
//      q_d max_d) among the pages holding a visible written token; a rescued token is kept as a
//      candidate when it is visible, written, and not a candidate already (else -1);
//   for each (batch row b, KV head h), over the N candidate slots j (position c_j, -1 = empty):
//   1. logits l[g][j] = q[g] . k[c_j] for the G query heads of the group (q already scaled),
//      -inf where c_j is empty, not written yet (c_j >= length[b]) or hidden (visible[b][c_j] = 0);
//   2. rank[j] = max_g softmax_j(l[g])[j] (a head that sees nothing gives 0); +inf for the
//      forced slots: the first `sinks` non-empty candidates and the visible ones with
//      length - recent <= c_j < length;
//   3. the `budget` non-empty candidates of highest rank are kept (all of them when fewer);
//   4. out[g] = softmax over the kept slots of l[g], times their values (zeros when a head
//      sees none of them).
// Each key row is read once for all G heads, each kept value row once; the candidates' and the
// kept slots' work is split between the threads (SmolLM2 at batch 1 has 3 KV heads for 2
// cores). float32 or bfloat16 stores (bfloat16 keys through the CPU's bfloat16 dot products
// where it has them, values widened as loaded), float32 query, accumulation and output.
// Written for specontext (issue 51); built and loaded by runtime/cpu_refine.py.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <thread>
#include <vector>

#include "cpu_common.h"

using namespace specontext_cpu;

namespace {

// calls whose visibility mask hid no written slot, run without it (cpu_common.h, needed_mask)
std::atomic<int64_t> masks_dropped{0};

constexpr int PREFETCH = 16;  // candidates ahead whose key (value) rows are prefetched into L1
constexpr int FAR = 48;       // candidates ahead prefetched into L2 (32 to 64 on par, cpu_common.h)
constexpr int MAX_GROUP = 16;
constexpr int MAX_DIM = 256;
constexpr float NEG = -std::numeric_limits<float>::infinity();
constexpr float POS = std::numeric_limits<float>::infinity();

template <typename T>
struct Problem {
  const float* query;          // [B, KV, G, D], rounded to the store's dtype (the logits' query)
  const float* page_query;     // [B, KV, G, D], float32 (the page bounds' query)
  const T* keys;               // [B, KV, C, D]
  const T* values;             // [B, KV, C, D]
  const int64_t* candidates;   // [B, KV, N]: the selection's then the rescued (scratch) or the input
  const int64_t* selected;     // [B, KV, S]: the input candidates
  const T* gathered_keys;      // [B, KV, N, D] or nullptr: candidate j's key row (an offloaded layer's buffer)
  const T* gathered_values;    // [B, KV, N, D] or nullptr: candidate j's value row
  int64_t* union_out;          // [B, KV, N] or nullptr: write the candidates after the page rescue, then stop
  const T* page_min;           // [B, KV, PG, D] or nullptr (no page rescue)
  const T* page_max;           // [B, KV, PG, D]
  const int64_t* page_shift;   // [B] or nullptr
  const int64_t* lengths;      // [B] or [1]
  int64_t length_stride;
  const uint8_t* visible;      // [B, C] or [1, C] (stride 0) or nullptr
  int64_t visible_stride;
  float* out;                  // [B, KV, G, D]
  int64_t B, KV, G, C, D, N, budget, sinks, recent;
  int64_t S, PG, rescue, page_tokens;  // input candidates, pages, pages rescued, tokens per page
  // scratch
  int64_t* rescued;            // [B * KV, N] when rescuing (the candidates above)
  float* page_score;           // [B * KV, PG]
  int32_t* page_order;         // [B * KV, PG]
  uint8_t* member;             // [B * KV, C]: 1 at the input candidates' positions (cleared after use)
  float* logits;               // [B * KV, G, N]
  float* stats;                // [B * KV, SA, G, 2]: each candidate split's logit maximum and sum of exp(l - max)
  float* rank;                 // [B * KV, N]
  uint64_t* order;             // [B * KV, N]: the budget's edge bin (key, slot)
  uint16_t* bins;              // [B * KV, N]: the ranks' histogram bins (0 = an empty slot)
  uint32_t* hist;              // [B * KV, SA, BINS]
  float* weights;              // [B * KV, G, budget]: the kept slots' softmax numerators
  int32_t* kept;               // [B * KV, budget]
  int64_t* kept_count;         // [B * KV]
  float* kept_max;             // [B * KV, G]
  float* partial_acc;          // [B * KV, SC, G, D]
  float* partial_sum;          // [B * KV, SC, G]
  int64_t SA, SC, SP;          // splits of the candidates (phase 1), the kept slots (phase 3), the pages (phase 0)

  int64_t length(int64_t b) const { return lengths[b * length_stride]; }
  // candidate j (store position c) of item bh: its key and value rows, from the gathered
  // buffers when given, else from the stores
  const T* key_row(int64_t bh, int64_t j, int64_t c) const {
    return gathered_keys ? gathered_keys + (bh * N + j) * D : keys + (bh * C + c) * D;
  }
  const T* value_row(int64_t bh, int64_t j, int64_t c) const {
    return gathered_values ? gathered_values + (bh * N + j) * D : values + (bh * C + c) * D;
  }
  // whether candidate position c may be attended by row b
  bool usable(int64_t b, int64_t c) const {
    if (c < 0 || c >= C || c >= length(b)) return false;
    return !visible || visible[b * visible_stride + c];
  }
};

// Whether page `page` of row b holds a token row b may attend (visible and written).
template <typename T>
bool page_seen(const Problem<T>& p, int64_t b, int64_t page, int64_t shift, int64_t limit) {
  const int64_t first = page * p.page_tokens - shift;
  const int64_t from = std::max<int64_t>(first, 0), to = std::min(first + p.page_tokens, limit);
  if (!p.visible) return from < to;
  for (int64_t pos = from; pos < to; ++pos)
    if (p.visible[b * p.visible_stride + pos]) return true;
  return false;
}

// Phase 0a: the Quest bound of pages [lo, hi) of item bh (-inf for a page without a usable token).
template <typename T, int G_, int D_>
void score_pages(const Problem<T>& p, int64_t bh, int64_t lo, int64_t hi) {
  const int64_t G = G_ > 0 ? G_ : p.G;
  const int64_t D = D_ > 0 ? D_ : p.D;
  const int64_t b = bh / p.KV;
  const int64_t shift = p.page_shift ? p.page_shift[b] : 0;
  const int64_t limit = std::min(p.length(b), p.C);
  const float* q = p.page_query + bh * G * D;
  float* score = p.page_score + bh * p.PG;
  int64_t page = lo;
#ifdef __AVX512F__
  // 16 pages at a time: each page's G_ sums in vectors over the head dimension (the bounds'
  // rows widened once for all G_ heads), their lanes summed 16 pages at once (the scalar lane
  // sums per page and head were most of this phase for bfloat16 bounds)
  if constexpr (G_ > 0 && D_ > 0 && D_ % 16 == 0) {
    constexpr int CH = D_ / 16;
    __m512 qp[G_][CH], qn[G_][CH];
    for (int g = 0; g < G_; ++g)
      for (int c = 0; c < CH; ++c) {
        const __m512 v = _mm512_loadu_ps(q + g * D_ + 16 * c);
        qp[g][c] = _mm512_max_ps(v, _mm512_setzero_ps());
        qn[g][c] = _mm512_min_ps(v, _mm512_setzero_ps());
      }
    for (; page + 16 <= hi; page += 16) {
      __m512 sums[G_][16];
      for (int pp = 0; pp < 16; ++pp) {
        const T* mn = p.page_min + (bh * p.PG + page + pp) * D_;
        const T* mx = p.page_max + (bh * p.PG + page + pp) * D_;
        __m512 acc[G_];
        for (int g = 0; g < G_; ++g) acc[g] = _mm512_setzero_ps();
        for (int c = 0; c < CH; ++c) {
          const __m512 hi_v = load16(mx + 16 * c), lo_v = load16(mn + 16 * c);
          for (int g = 0; g < G_; ++g)
            acc[g] = _mm512_fmadd_ps(qn[g][c], lo_v, _mm512_fmadd_ps(qp[g][c], hi_v, acc[g]));
        }
        for (int g = 0; g < G_; ++g) sums[g][pp] = acc[g];
      }
      __m512 bound = sum_lanes16(sums[0]);
      for (int g = 1; g < G_; ++g) bound = _mm512_max_ps(bound, sum_lanes16(sums[g]));
      alignas(64) float out[16];
      _mm512_store_ps(out, bound);
      for (int pp = 0; pp < 16; ++pp) {
        const bool ok = std::isfinite(out[pp]) && page_seen(p, b, page + pp, shift, limit);
        score[page + pp] = ok ? out[pp] : NEG;  // as the torch body: a non-finite bound is no page
      }
    }
  }
#endif
  float qp[MAX_GROUP][MAX_DIM], qn[MAX_GROUP][MAX_DIM];
  for (int64_t g = 0; g < G; ++g)
    for (int64_t d = 0; d < D; ++d) {
      qp[g][d] = std::max(q[g * D + d], 0.f);
      qn[g][d] = std::min(q[g * D + d], 0.f);
    }
  for (; page < hi; ++page) {
    float bound = NEG;
    if (page_seen(p, b, page, shift, limit)) {
      const T* mn = p.page_min + (bh * p.PG + page) * D;
      const T* mx = p.page_max + (bh * p.PG + page) * D;
      for (int64_t g = 0; g < G; ++g) {
        bound = std::max(bound, dot_row(qp[g], mx, D) + dot_row(qn[g], mn, D));
      }
      if (!std::isfinite(bound)) bound = NEG;  // as the torch body: a non-finite bound is no page
    }
    score[page] = bound;
  }
}

// Phase 0b: item bh's candidates: the selection's, then every slot of the best `rescue` pages
// (-1 where the token is not usable or already a candidate; -1 for pages beyond those with a bound).
template <typename T>
void rescue_pages(const Problem<T>& p, int64_t bh) {
  const int64_t b = bh / p.KV;
  const int64_t shift = p.page_shift ? p.page_shift[b] : 0;
  const float* score = p.page_score + bh * p.PG;
  int32_t* order = p.page_order + bh * p.PG;
  int64_t count = 0;
  for (int64_t page = 0; page < p.PG; ++page)
    if (score[page] != NEG) order[count++] = static_cast<int32_t>(page);
  if (count > p.rescue) {
    std::nth_element(order, order + p.rescue, order + count, [score](int32_t x, int32_t y) {
      return score[x] > score[y] || (score[x] == score[y] && x < y);
    });
    count = p.rescue;
  }
  const int64_t* sel = p.selected + bh * p.S;
  int64_t* cand = p.rescued + bh * p.N;
  uint8_t* member = p.member + bh * p.C;
  for (int64_t j = 0; j < p.S; ++j) {
    cand[j] = sel[j];
    if (sel[j] >= 0 && sel[j] < p.C) member[sel[j]] = 1;
  }
  const int64_t written = std::min(p.length(b), p.C);
  for (int64_t k = 0; k < p.rescue; ++k) {
    int64_t* out = cand + p.S + k * p.page_tokens;
    if (k >= count) {
      std::fill(out, out + p.page_tokens, int64_t{-1});
      continue;
    }
    const int64_t first = order[k] * p.page_tokens - shift;
    if (!p.visible) {  // without a branch per token: written and not a candidate already
#pragma omp simd
      for (int64_t t = 0; t < p.page_tokens; ++t) {
        const int64_t pos = first + t;
        const bool in = pos >= 0 && pos < written;
        out[t] = in && !member[in ? pos : 0] ? pos : -1;
      }
    } else {
      for (int64_t t = 0; t < p.page_tokens; ++t) {
        const int64_t pos = first + t;
        out[t] = p.usable(b, pos) && !member[pos] ? pos : -1;
      }
    }
  }
  for (int64_t j = 0; j < p.S; ++j)
    if (sel[j] >= 0 && sel[j] < p.C) member[sel[j]] = 0;
}

// Phase 1: the logits of candidates [lo, hi) of item bh (a (batch row, KV head) pair).
template <typename T, int G_, int D_>
void score_candidates(const Problem<T>& p, int64_t bh, int64_t split, int64_t lo, int64_t hi) {
  const int64_t G = G_ > 0 ? G_ : p.G;
  const int64_t D = D_ > 0 ? D_ : p.D;
  const int64_t b = bh / p.KV;
  const int64_t* cand = p.candidates + bh * p.N;
  const float* q = p.query + bh * G * D;
  float* lg = p.logits + bh * G * p.N;
  int64_t j = lo;
#ifdef __AVX512F__
  if constexpr (G_ > 0 && D_ > 0 && D_ % 16 == 0) {
    // the rows 16 candidates at a time: which are usable as a vector mask (an unusable slot
    // scores row 0, then -inf by a masked store), the prefetch addresses without a branch per
    // row (a position clamped into the store: a prefetch of an empty slot's row 0 is harmless).
    // The per-row tests and stores were a fifth of this phase in cache (perf, issue 51).
    const int64_t written = std::min(p.length(b), p.C);
    const __m512i zero = _mm512_setzero_si512(), limit = _mm512_set1_epi64(written);
    // slot's key row, any slot (its position clamped into the store); p.key_row with the head
    // size a constant (its run-time multiply was 3% of the kernel in cache)
    const T* base = p.gathered_keys ? p.gathered_keys + bh * p.N * D_ : p.keys + bh * p.C * D_;
    const auto row_of = [&](int64_t slot) -> const T* {
      if (p.gathered_keys) return base + slot * D_;
      return base + std::min(std::max<int64_t>(cand[slot], 0), p.C - 1) * D_;
    };
    const int64_t last = hi - 1;
    for (; j + 16 <= hi; j += 16) {
      const __m512i c0 = _mm512_loadu_si512(cand + j), c1 = _mm512_loadu_si512(cand + j + 8);
      __mmask16 ok = static_cast<__mmask16>(
          (_mm512_cmpge_epi64_mask(c0, zero) & _mm512_cmplt_epi64_mask(c0, limit)) |
          ((_mm512_cmpge_epi64_mask(c1, zero) & _mm512_cmplt_epi64_mask(c1, limit)) << 8));
      if (p.visible)
        for (int jj = 0; jj < 16; ++jj)
          if ((ok >> jj) & 1u && !p.visible[b * p.visible_stride + cand[j + jj]]) ok &= static_cast<__mmask16>(~(1u << jj));
      const T* rows[16];
      for (int jj = 0; jj < 16; ++jj) {
        rows[jj] = row_of(j + jj);  // an unusable slot's logits are -inf below
        prefetch_row<T, D_>(row_of(std::min(j + PREFETCH + jj, last)));
        prefetch_row_l2<T, D_>(row_of(std::min(j + FAR + jj, last)));
      }
      group_logits16<T, G_, D_, true>(q, rows, lg + j, p.N);  // p.query is rounded to the store's dtype
      const __m512 neg = _mm512_set1_ps(NEG);
      for (int g = 0; g < G_; ++g) _mm512_mask_storeu_ps(lg + g * p.N + j, static_cast<__mmask16>(~ok), neg);
    }
  }
#endif
  for (; j < hi; ++j) {
    const int64_t c = cand[j];
    const bool ok = p.usable(b, c);
    for (int64_t g = 0; g < G; ++g) {
      float dot = 0.f;
      if (ok) {
        const float* qg = q + g * D;
        dot = dot_row(qg, p.key_row(bh, j, c), D);
      }
      lg[g * p.N + j] = ok ? dot : NEG;
    }
  }
  float* st = p.stats + (bh * p.SA + split) * G * 2;
  for (int64_t g = 0; g < G; ++g) split_stats(lg + g * p.N, lo, hi, st + 2 * g);
}

// An order-preserving unsigned key of a float (larger float, larger key; -inf the smallest).
inline uint32_t order_key(float x) {
  uint32_t bits;
  __builtin_memcpy(&bits, &x, sizeof(bits));
  return (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
}

// Phase 2a: the ranks of candidates [lo, hi) of item bh as histogram bins (0 for an empty slot)
// and order keys, and the split's histogram.
// softmax_j(l[g])[j] = exp(l[g][j] - c[g]) with c[g] = max_j l[g][j] + log(sum_j exp(l[g][j] -
// max)): ranking by r_j = max_g (l[g][j] - c[g]), a log-weight <= 0, keeps the same slots as
// ranking by the weights, without an exponential per slot (the splits' maxima and sums come
// from phase 1). The bins split [RANK_FLOOR, 0] evenly (a weight's relative step of 0.8%),
// with one bin below for -inf (no head sees the slot) and one above for the forced slots.
constexpr int BINS = 4096;
constexpr float RANK_FLOOR = -32.f;

// Non-decreasing in r; 0 is left for an empty slot. Branch-free (selects and a clamp before
// the conversion), so that the loop over a split's slots vectorises: the branchy form with
// std::min/max was a tenth of the kernel's in-cache time (perf, issue 51).
inline uint16_t rank_bin(float r) {
  const float top = r < 0.f ? r : 0.f;
  float at = (top - RANK_FLOOR) * (static_cast<float>(BINS - 4) / -RANK_FLOOR);
  at = at > 0.f ? at : 0.f;  // -inf and ranks below the floor: the lowest bin of a seen slot
  at = at < static_cast<float>(BINS - 4) ? at : static_cast<float>(BINS - 4);
  const int bin = 2 + static_cast<int>(at);
  return static_cast<uint16_t>(r == POS ? BINS - 1 : (r > NEG ? bin : 1));
}

template <typename T>
void rank_candidates(const Problem<T>& p, int64_t bh, int64_t split, int64_t lo, int64_t hi) {
  const int64_t G = p.G, N = p.N;
  const int64_t b = bh / p.KV;
  const int64_t* cand = p.candidates + bh * N;
  const float* lg = p.logits + bh * G * N;
  float* rank = p.rank + bh * N;
  for (int64_t j = lo; j < hi; ++j) rank[j] = NEG;
  for (int64_t g = 0; g < G; ++g) {
    float m = NEG, z = 0.f;
    for (int64_t s = 0; s < p.SA; ++s) m = std::max(m, p.stats[((bh * p.SA + s) * G + g) * 2]);
    if (m == NEG) continue;  // the head sees no candidate: weight 0 everywhere
    for (int64_t s = 0; s < p.SA; ++s) {
      const float* st = p.stats + ((bh * p.SA + s) * G + g) * 2;
      if (st[0] != NEG) z += st[1] * exp_nonpositive(st[0] - m);
    }
    const float c = m + std::log(z);
    const float* row = lg + g * N;
#pragma omp simd
    for (int64_t j = lo; j < hi; ++j) {
      const float r = row[j] - c;
      rank[j] = rank[j] > r ? rank[j] : r;  // not std::max: that loop did not vectorise
    }
  }
  int64_t seen = 0;  // non-empty candidates before this split, counted up to `sinks` (the sinks are the first ones)
  for (int64_t j = 0; j < lo && seen < p.sinks; ++j) seen += cand[j] >= 0;
  const int64_t recent_from = p.length(b) - p.recent;
  uint16_t* bin = p.bins + bh * N;
  int64_t j = lo;
  for (; j < hi && seen < p.sinks; ++j) {  // the split's slots up to the last sink, one by one
    if (cand[j] < 0) {  // an empty slot is never kept
      bin[j] = 0;
      continue;
    }
    ++seen;
    rank[j] = POS;
    bin[j] = rank_bin(POS);
  }
  if (!p.visible) {  // the rest without a branch per slot: a recent slot is one written and in the window
    const int64_t written = std::min(p.length(b), p.C);
#pragma omp simd
    for (int64_t i = j; i < hi; ++i) {
      const int64_t c = cand[i];
      const float r = c >= recent_from && c < written ? POS : rank[i];
      rank[i] = c >= 0 ? r : rank[i];
      bin[i] = c >= 0 ? rank_bin(r) : 0;
    }
  } else {
    for (int64_t i = j; i < hi; ++i) {
      const int64_t c = cand[i];
      if (c >= recent_from && p.usable(b, c)) rank[i] = POS;  // past the written length or hidden: not recent
      bin[i] = c >= 0 ? rank_bin(rank[i]) : 0;
    }
  }
  uint32_t* hist = p.hist + (bh * p.SA + split) * BINS;
  std::fill(hist, hist + BINS, 0u);
  for (int64_t i = lo; i < hi; ++i) ++hist[bin[i]];  // bin 0 (empty slots) is never read
}

// Phase 2b: the `budget` slots item bh keeps (all its non-empty ones when fewer): those in the
// bins above the bin where the count reaches the budget, then the best of that bin by rank
// (std::nth_element over it alone); their maximum logit per head.
template <typename T>
void keep_best(const Problem<T>& p, int64_t bh) {
  const int64_t G = p.G, N = p.N;
  const uint16_t* bin = p.bins + bh * N;
  const float* rank = p.rank + bh * N;
  uint32_t* hist = p.hist + bh * p.SA * BINS;  // the splits' histograms summed into the first
  for (int64_t s = 1; s < p.SA; ++s) {
    const uint32_t* other = hist + s * BINS;
#pragma omp simd
    for (int64_t i = 0; i < BINS; ++i) hist[i] += other[i];
  }
  int64_t edge_bin = 0, above = 0;  // edge_bin 0: no more non-empty candidates than the budget
  for (int64_t i = BINS - 1; i >= 1; --i) {
    if (above + hist[i] >= p.budget) {
      edge_bin = i;
      break;
    }
    above += hist[i];
  }
  int32_t* kept = p.kept + bh * p.budget;
  int64_t count = 0;
  uint64_t* edge = p.order + bh * N;
  int64_t edges = 0;
  int64_t j = 0;
#ifdef __AVX512F__
  // 16 slots at a time: those above the edge bin compressed into the kept list, those in it
  // (a few) one by one (the branch per slot was a third of this phase in cache, issue 51)
  const __m512i above_edge = _mm512_set1_epi32(static_cast<int>(edge_bin));
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  for (; j + 16 <= N; j += 16) {
    const __m512i bins16 = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(bin + j)));
    const __mmask16 up = _mm512_cmpgt_epi32_mask(bins16, above_edge);
    // compressed in a register, then a masked store (the compressing store to memory is
    // microcoded and slow on Zen 4); the mask keeps it within the list
    const int n = __builtin_popcount(up);
    const __m512i slots = _mm512_maskz_compress_epi32(up, _mm512_add_epi32(lane, _mm512_set1_epi32(static_cast<int>(j))));
    _mm512_mask_storeu_epi32(kept + count, static_cast<__mmask16>((1u << n) - 1u), slots);
    count += n;
    if (edge_bin > 0)
      for (unsigned at = _mm512_cmpeq_epi32_mask(bins16, above_edge); at; at &= at - 1) {
        const int64_t slot = j + __builtin_ctz(at);
        edge[edges++] = (static_cast<uint64_t>(order_key(rank[slot])) << 32) | static_cast<uint64_t>(slot);
      }
  }
#endif
  for (; j < N; ++j) {
    if (bin[j] > edge_bin) kept[count++] = static_cast<int32_t>(j);
    else if (bin[j] == edge_bin && edge_bin > 0)
      edge[edges++] = (static_cast<uint64_t>(order_key(rank[j])) << 32) | static_cast<uint64_t>(j);
  }
  if (edges > 0) {
    const int64_t need = p.budget - count;
    std::nth_element(edge, edge + need, edge + edges, std::greater<uint64_t>());
    for (int64_t t = 0; t < need; ++t) kept[count++] = static_cast<int32_t>(edge[t] & 0xffffffffu);
  }
  p.kept_count[bh] = count;
  const float* lg = p.logits + bh * G * N;
  for (int64_t g = 0; g < G; ++g) {
    float m = NEG;
    const float* row = lg + g * N;
#pragma omp simd reduction(max : m)
    for (int64_t t = 0; t < count; ++t) m = m > row[kept[t]] ? m : row[kept[t]];
    p.kept_max[bh * G + g] = m;
  }
}

// Phase 3: item bh's kept slots [lo, hi) of its kept list: weights and values summed.
template <typename T, int G_, int D_>
void add_values(const Problem<T>& p, int64_t bh, int64_t split) {
  const int64_t G = G_ > 0 ? G_ : p.G;
  const int64_t D = D_ > 0 ? D_ : p.D;
  const int64_t count = p.kept_count[bh];
  const int64_t per = (count + p.SC - 1) / p.SC;
  const int64_t lo = std::min(split * per, count), hi = std::min(lo + per, count);
  const int64_t* cand = p.candidates + bh * p.N;
  const int32_t* kept = p.kept + bh * p.budget;
  const float* lg = p.logits + bh * G * p.N;
  const float* m = p.kept_max + bh * G;
  alignas(64) float acc[MAX_GROUP][MAX_DIM];
  float sum[MAX_GROUP];
  // the kept slots' softmax numerators first, vectorised over the slots (an exponential per
  // slot and head in the loop below was a third of this phase)
  float* weight = p.weights + bh * G * p.budget;
  for (int64_t g = 0; g < G; ++g) {
    sum[g] = 0.f;
    for (int64_t d = 0; d < D; ++d) acc[g][d] = 0.f;
    float* wg = weight + g * p.budget;
    const float* row = lg + g * p.N;
    const float mg = m[g];
    if (mg == NEG) {
      for (int64_t t = lo; t < hi; ++t) wg[t] = 0.f;
      continue;
    }
    float total = 0.f;
#pragma omp simd reduction(+ : total)
    for (int64_t t = lo; t < hi; ++t) {
      wg[t] = exp_nonpositive(row[kept[t]] - mg);
      total += wg[t];
    }
    sum[g] = total;
  }
#ifdef __AVX512F__
  if constexpr (G_ > 0 && D_ > 0 && D_ % 16 == 0 && G_ * D_ / 16 <= 24) {
    constexpr int C_ = D_ / 16;
    __m512 reg[G_][C_];
    for (int g = 0; g < G_; ++g)
      for (int c = 0; c < C_; ++c) reg[g][c] = _mm512_setzero_ps();
    for (int64_t t = lo; t < hi; ++t) {
      if (t + PREFETCH < hi) prefetch_row<T, D_>(p.value_row(bh, kept[t + PREFETCH], cand[kept[t + PREFETCH]]));
      if (t + FAR < hi) prefetch_row_l2<T, D_>(p.value_row(bh, kept[t + FAR], cand[kept[t + FAR]]));
      const int64_t j = kept[t];
      float w[G_];
      bool any = false;
      for (int g = 0; g < G_; ++g) {
        w[g] = weight[g * p.budget + t];
        any = any || w[g] != 0.f;
      }
      if (!any) continue;  // a slot no head may see: its value is never read
      const T* row = p.value_row(bh, j, cand[j]);
      __m512 r[C_];
      for (int c = 0; c < C_; ++c) r[c] = load16(row + 16 * c);
      for (int g = 0; g < G_; ++g) {
        const __m512 wg = _mm512_set1_ps(w[g]);
        for (int c = 0; c < C_; ++c) reg[g][c] = _mm512_fmadd_ps(wg, r[c], reg[g][c]);
      }
    }
    for (int g = 0; g < G_; ++g)
      for (int c = 0; c < C_; ++c) _mm512_store_ps(&acc[g][16 * c], reg[g][c]);
  } else
#endif
  {
    for (int64_t t = lo; t < hi; ++t) {
      const int64_t j = kept[t];
      const T* row = p.value_row(bh, j, cand[j]);
      for (int64_t g = 0; g < G; ++g) {
        const float w = weight[g * p.budget + t];
        if (w == 0.f) continue;
        add_row(acc[g], w, row, D);
      }
    }
  }
  float* pa = p.partial_acc + (bh * p.SC + split) * G * D;
  float* ps = p.partial_sum + (bh * p.SC + split) * G;
  for (int64_t g = 0; g < G; ++g) {
    ps[g] = sum[g];
    for (int64_t d = 0; d < D; ++d) pa[g * D + d] = acc[g][d];
  }
}

// The output rows of item bh: its splits' sums merged, divided by their weights (zeros for a
// head that sees none of the kept slots).
template <typename T>
void merge_splits(const Problem<T>& p, int64_t bh, int64_t g) {
  float total = 0.f;
  float* o = p.out + (bh * p.G + g) * p.D;
  for (int64_t d = 0; d < p.D; ++d) o[d] = 0.f;
  for (int64_t s = 0; s < p.SC; ++s) {
    total += p.partial_sum[(bh * p.SC + s) * p.G + g];
    const float* pa = p.partial_acc + ((bh * p.SC + s) * p.G + g) * p.D;
#pragma omp simd
    for (int64_t d = 0; d < p.D; ++d) o[d] += pa[d];
  }
  if (total == 0.f) {
    for (int64_t d = 0; d < p.D; ++d) o[d] = 0.f;
    return;
  }
  const float inv = 1.f / total;
  for (int64_t d = 0; d < p.D; ++d) o[d] *= inv;
}

// The phases' order: a unit of a phase waits for every unit of the phase before it (of its item
// only: an item's phases depend on nothing of another item).
enum Phase { PAGES, RESCUE, UNION, SCORE, RANK, KEEP, VALUES, MERGE, PHASES };

// The units of one phase, unit = bh * per + s (s < per), taken in that order by whichever
// thread is free (a shared count per phase), each after the units of phase `after` of its item
// are done (`done[after][bh]` == `need`), counted done in done[phase][bh]. No barrier between
// phases and no fixed share per thread: with SmolLM2's 3 KV heads on 2 threads, a phase with one
// unit per item (the page rescue, the ranking's cut) left a thread idle for a third of it, and
// the barriers after the 7 phases were a fifth of the kernel's time (perf, issue 51); here a
// thread goes on to the next phase's units of the items that are ready. Deadlock-free: every
// thread takes the phases in the same order and a phase's units in order, so a unit waits only
// for units of earlier phases that some thread has already taken and will finish.
template <typename Fn>
void run_phase(int32_t* done, int32_t* next, int64_t items, Phase phase, int64_t per, int after, int64_t need,
               Fn&& fn) {
  const int64_t units = items * per;
  for (int64_t unit = __atomic_fetch_add(next + phase, 1, __ATOMIC_RELAXED); unit < units;
       unit = __atomic_fetch_add(next + phase, 1, __ATOMIC_RELAXED)) {
    const int64_t bh = unit / per;
    if (after >= 0) {
      const int32_t* ready = done + after * items + bh;
      for (int spins = 0; __atomic_load_n(ready, __ATOMIC_ACQUIRE) < need; ++spins) {
        if (spins < 4096) pause_cpu();
        else std::this_thread::yield();  // the other thread was descheduled: give it the core
      }
    }
    fn(bh, unit % per);
    __atomic_fetch_add(done + phase * items + bh, 1, __ATOMIC_RELEASE);
  }
}

std::atomic<int64_t> dot_calls{0};  // calls that took the bfloat16 dot products

template <typename T, int G_, int D_>
void run_phases(const Problem<T>& p, int32_t* done) {
  if constexpr (uses_bf16_dot<T, G_, D_>()) {
    if (!p.union_out) dot_calls.fetch_add(1, std::memory_order_relaxed);
  }
  const int64_t items = p.B * p.KV;
  int32_t* next = done + PHASES * items;  // each phase's next unit
  const auto span = [](int64_t s, int64_t splits, int64_t n) {
    const int64_t per = (n + splits - 1) / splits;
    const int64_t lo = std::min(s * per, n);
    return std::make_pair(lo, std::min(lo + per, n));
  };
#pragma omp parallel
  {
    int last = -1;  // the phase the next one waits for
    int64_t last_units = 0;
    if (p.rescue > 0) {
      run_phase(done, next, items, PAGES, p.SP, -1, 0, [&](int64_t bh, int64_t s) {
        const auto [lo, hi] = span(s, p.SP, p.PG);
        score_pages<T, G_, D_>(p, bh, lo, hi);
      });
      run_phase(done, next, items, RESCUE, 1, PAGES, p.SP, [&](int64_t bh, int64_t) { rescue_pages<T>(p, bh); });
      last = RESCUE;
      last_units = 1;
    }
    if (p.union_out) {  // the candidates only (an offloaded layer loads their rows, then calls again)
      run_phase(done, next, items, UNION, 1, last, last_units, [&](int64_t bh, int64_t) {
        std::copy(p.candidates + bh * p.N, p.candidates + (bh + 1) * p.N, p.union_out + bh * p.N);
      });
    } else {
      run_phase(done, next, items, SCORE, p.SA, last, last_units, [&](int64_t bh, int64_t s) {
        const auto [lo, hi] = span(s, p.SA, p.N);
        score_candidates<T, G_, D_>(p, bh, s, lo, hi);
      });
      run_phase(done, next, items, RANK, p.SA, SCORE, p.SA, [&](int64_t bh, int64_t s) {
        const auto [lo, hi] = span(s, p.SA, p.N);
        rank_candidates<T>(p, bh, s, lo, hi);
      });
      run_phase(done, next, items, KEEP, 1, RANK, p.SA, [&](int64_t bh, int64_t) { keep_best<T>(p, bh); });
      run_phase(done, next, items, VALUES, p.SC, KEEP, 1,
                [&](int64_t bh, int64_t s) { add_values<T, G_, D_>(p, bh, s); });
      run_phase(done, next, items, MERGE, p.G, VALUES, p.SC, [&](int64_t bh, int64_t g) { merge_splits<T>(p, bh, g); });
    }
  }
}

// splits of `n` slots of each of `items` items: at least 16 units for the threads, each of at
// least `least` slots
int64_t splits(int64_t items, int64_t n, int64_t least) {
  return std::max<int64_t>(1, std::min<int64_t>((16 + items - 1) / std::max<int64_t>(items, 1), n / least));
}

// v resized to n elements (kept between calls: grown once, never shrunk), its data
template <typename V>
typename V::value_type* sized(V& v, int64_t n) {
  v.resize(static_cast<size_t>(n));
  return v.data();
}

template <typename T>
int refine_attention(const float* query, const T* keys, const T* values, const int64_t* candidates,
                     const int64_t* lengths, int64_t length_stride, const uint8_t* visible, int64_t visible_stride,
                     const T* page_min, const T* page_max, const int64_t* page_shift, const T* gathered_keys,
                     const T* gathered_values, int64_t* union_out, float* out, int64_t B, int64_t KV, int64_t G,
                     int64_t C, int64_t D, int64_t S, int64_t PG, int64_t rescue, int64_t page_tokens, int64_t budget,
                     int64_t sinks, int64_t recent) {
  if (G < 1 || G > MAX_GROUP || D < 1 || D > MAX_DIM || S < 1 || C < 1 || budget < 1 || B < 1 || KV < 1) return 1;
  if (rescue < 0 || (rescue > 0 && (!page_min || !page_max || PG < 1 || page_tokens < 1))) return 1;
  rescue = std::min(rescue, PG);
  if (visible && !(visible = needed_mask(visible, visible_stride, lengths, length_stride, B, C)))
    masks_dropped.fetch_add(1, std::memory_order_relaxed);
  // scratch kept between calls (one layer after another reuses it; no allocation per call)
  static thread_local std::vector<float> rounded, logits, stats, rank, kept_max, partial_acc, partial_sum, page_score;
  static thread_local std::vector<uint64_t> order;
  static thread_local std::vector<uint32_t> hist;
  static thread_local std::vector<uint16_t> bins;
  static thread_local std::vector<float> weights;
  static thread_local std::vector<int32_t> kept, page_order;
  static thread_local std::vector<int64_t> kept_count, rescued;
  static thread_local std::vector<uint8_t> member;
  static thread_local std::vector<int32_t> done;  // the units done per phase and item, then each phase's next unit (run_phase)
  const int64_t items = B * KV;
  const int64_t N = S + rescue * page_tokens;
  rounded.resize(items * G * D);
  for (int64_t i = 0; i < items * G * D; ++i) rounded[i] = round_like(query[i], T{});
  Problem<T> p{rounded.data(), query, keys, values, candidates, candidates, gathered_keys, gathered_values, union_out,
               page_min, page_max, page_shift, lengths,
               length_stride, visible, visible_stride, out, B, KV, G, C, D, N, budget, sinks, recent, S, PG, rescue,
               page_tokens};
  if (rescue > 0) {
    p.rescued = sized(rescued, items * N);
    p.page_score = sized(page_score, items * PG);
    p.page_order = sized(page_order, items * PG);
    if (member.size() < static_cast<size_t>(items * C)) member.assign(items * C, 0);  // kept all zero between calls
    p.member = member.data();
    p.candidates = p.rescued;
  }
  p.SP = splits(items, PG, 64);
  p.SA = splits(items, N, 128);
  p.SC = splits(items, std::min(N, budget), 64);
  p.logits = sized(logits, items * G * N);
  p.stats = sized(stats, items * p.SA * G * 2);
  p.rank = sized(rank, items * N);
  p.order = sized(order, items * N);
  p.bins = sized(bins, items * N);
  p.hist = sized(hist, items * p.SA * BINS);
  p.weights = sized(weights, items * G * budget);
  p.kept = sized(kept, items * budget);
  p.kept_count = sized(kept_count, items);
  p.kept_max = sized(kept_max, items * G);
  p.partial_acc = sized(partial_acc, items * p.SC * G * D);
  p.partial_sum = sized(partial_sum, items * p.SC * G);
  done.assign(static_cast<size_t>(PHASES * items + PHASES), 0);
  with_shape(G, D, [&p](auto g, auto d) { run_phases<T, decltype(g)::value, decltype(d)::value>(p, done.data()); });
  return 0;
}

}  // namespace

// Arguments as refine_attention: gathered_keys / gathered_values ([B, KV, S + rescue * page_tokens, D]
// or null) hold candidate j's rows where the stores are not read (an offloaded layer's buffer);
// union_out (or null) takes the candidates after the page rescue and the call stops there.
// One entry point per store dtype (float; bfloat16 and float16 as their raw 16-bit patterns, also for the
// page bounds and gathered rows), float32 query and output; runtime/cpu_refine.py picks it.
#define SPECONTEXT_REFINE_ENTRY(name, T)                                                                          \
  extern "C" int name(const float* query, const T* keys, const T* values, const int64_t* candidates,             \
                      const int64_t* lengths, int64_t length_stride, const uint8_t* visible, int64_t visible_stride, \
                      const T* page_min, const T* page_max, const int64_t* page_shift, const T* gathered_keys,    \
                      const T* gathered_values, int64_t* union_out, float* out, int64_t B, int64_t KV, int64_t G, \
                      int64_t C, int64_t D, int64_t S, int64_t PG, int64_t rescue, int64_t page_tokens,           \
                      int64_t budget, int64_t sinks, int64_t recent) {                                            \
    return refine_attention<T>(query, keys, values, candidates, lengths, length_stride, visible, visible_stride,   \
                               page_min, page_max, page_shift, gathered_keys, gathered_values, union_out, out, B, \
                               KV, G, C, D, S, PG, rescue, page_tokens, budget, sinks, recent);                  \
  }

SPECONTEXT_REFINE_ENTRY(specontext_refine_attention, float)
SPECONTEXT_REFINE_ENTRY(specontext_refine_attention_bf16, uint16_t)
SPECONTEXT_REFINE_ENTRY(specontext_refine_attention_fp16, half_t)

// Calls in this process that took the bfloat16 dot products for the candidates' logits.
extern "C" int64_t specontext_refine_attention_bf16_dot_calls() { return dot_calls.load(std::memory_order_relaxed); }

// Calls in this process whose visibility mask hid no written slot (run without it: the path a test asserts).
extern "C" int64_t specontext_refine_attention_masks_dropped() { return masks_dropped.load(std::memory_order_relaxed); }

#ifdef SPECONTEXT_TORCH_OPS
#include "torch_op.h"

namespace {

std::atomic<int64_t> op_calls{0};

using specontext_op::ScalarType;
using specontext_op::Tensor;
using OptionalTensor = std::optional<specontext_op::Tensor>;

// The page rescue's and the gathered rows' inputs (runtime/cpu_refine.py _check_pages and
// _check_gathered); returns the pages rescued (0 when off).
int64_t check_rescue(const Tensor& keys, const Tensor& candidates, const OptionalTensor& page_min,
                     const OptionalTensor& page_max, const OptionalTensor& page_shift, const OptionalTensor& gathered_keys,
                     const OptionalTensor& gathered_values, int64_t rescue_pages, int64_t page_tokens) {
  const int64_t b = keys.size(0), kv = keys.size(1), d = keys.size(3);
  if (gathered_keys.has_value() || gathered_values.has_value()) {
    STD_TORCH_CHECK(rescue_pages == 0, "cpu_refine_attention: gathered rows take the rescued candidates, not the page rescue again");
    for (const OptionalTensor* t : {&gathered_keys, &gathered_values}) {
      STD_TORCH_CHECK(t->has_value() && (*t)->is_cpu() && (*t)->scalar_type() == keys.scalar_type() && (*t)->dim() == 4 &&
                          (*t)->size(0) == b && (*t)->size(1) == kv && (*t)->size(2) == candidates.size(2) &&
                          (*t)->size(3) == d,
                      "cpu_refine_attention: gathered_keys and gathered_values must both be [batch, num_kv_heads, slots, "
                      "head_dim] CPU tensors of the stores' dtype");
    }
  }
  if (rescue_pages == 0) return 0;
  STD_TORCH_CHECK(rescue_pages > 0 && page_tokens >= 1 && page_min.has_value() && page_max.has_value(),
                  "cpu_refine_attention: the page rescue needs page_min and page_max and rescue_pages, page_tokens >= 1");
  for (const OptionalTensor* t : {&page_min, &page_max}) {
    STD_TORCH_CHECK((*t)->is_cpu() && (*t)->scalar_type() == keys.scalar_type() && (*t)->dim() == 4 && (*t)->size(0) == b &&
                        (*t)->size(1) == kv && (*t)->size(2) >= 1 && (*t)->size(3) == d &&
                        (*t)->size(2) == page_min->size(2),
                    "cpu_refine_attention: page_min and page_max must be [batch, num_kv_heads, pages, head_dim] CPU "
                    "tensors of the stores' dtype, one shape");
  }
  STD_TORCH_CHECK(!page_shift.has_value() || (page_shift->is_cpu() && page_shift->scalar_type() == ScalarType::Long &&
                                              page_shift->numel() == b),
                  "cpu_refine_attention: page_shift must be int64 [batch] on the CPU or None");
  return std::min(rescue_pages, page_min->size(2));
}

template <typename T>
int run_refine(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& cand, const Tensor& n,
               const OptionalTensor& vis, const OptionalTensor& lo, const OptionalTensor& hi, const OptionalTensor& shift,
               const OptionalTensor& gk, const OptionalTensor& gv, Tensor& out, int64_t rescue, int64_t page_tokens,
               int64_t budget, int64_t sinks, int64_t recent) {
  const int64_t capacity = k.size(2), kv = k.size(1);
  return refine_attention<T>(
      static_cast<const float*>(q.data_ptr()), static_cast<const T*>(k.data_ptr()), static_cast<const T*>(v.data_ptr()),
      static_cast<const int64_t*>(cand.data_ptr()), static_cast<const int64_t*>(n.data_ptr()), n.numel() > 1 ? 1 : 0,
      static_cast<const uint8_t*>(specontext_op::pointer(vis)), specontext_op::visible_stride(vis, capacity),
      static_cast<const T*>(specontext_op::pointer(lo)), static_cast<const T*>(specontext_op::pointer(hi)),
      static_cast<const int64_t*>(specontext_op::pointer(shift)), static_cast<const T*>(specontext_op::pointer(gk)),
      static_cast<const T*>(specontext_op::pointer(gv)), nullptr, static_cast<float*>(out.data_ptr()), q.size(0), kv,
      q.size(1) / kv, capacity, q.size(3), cand.size(2), rescue ? lo->size(2) : 0, rescue, page_tokens, budget, sinks,
      recent);
}

OptionalTensor dense_or_none(const OptionalTensor& t) {
  return t.has_value() ? OptionalTensor(specontext_op::dense(*t)) : std::nullopt;
}

// specontext::cpu_refine_attention's CPU kernel (schema and Python kernel: runtime/cpu_refine.py).
Tensor refine_attention_op(Tensor query, Tensor key_cache, Tensor value_cache, Tensor candidates, Tensor length,
                           OptionalTensor visible, OptionalTensor page_min, OptionalTensor page_max,
                           OptionalTensor page_shift, OptionalTensor gathered_keys, OptionalTensor gathered_values,
                           int64_t budget, int64_t sinks, int64_t recent, int64_t rescue_pages, int64_t page_tokens) {
  using namespace specontext_op;
  check_store_inputs("cpu_refine_attention", query, key_cache, value_cache, length, visible, MAX_GROUP, MAX_DIM);
  STD_TORCH_CHECK(candidates.is_cpu() && candidates.scalar_type() == ScalarType::Long && candidates.dim() == 3 &&
                      candidates.size(0) == key_cache.size(0) && candidates.size(1) == key_cache.size(1) &&
                      candidates.size(2) > 0,
                  "cpu_refine_attention: candidates must be int64 [batch, num_kv_heads, slots > 0] on the CPU (got ",
                  specontext_op::shape(candidates), ", keys ", specontext_op::shape(key_cache), ")");
  STD_TORCH_CHECK(budget >= 1 && sinks >= 0 && recent >= 0,
                  "cpu_refine_attention: budget must be >= 1 and sinks, recent >= 0 (got budget ", budget, ", sinks ",
                  sinks, ", recent ", recent, ")");
  const int64_t rescue = check_rescue(key_cache, candidates, page_min, page_max, page_shift, gathered_keys,
                                      gathered_values, rescue_pages, page_tokens);
  op_calls.fetch_add(1, std::memory_order_relaxed);  // a call the kernel serves
  Tensor out = torch::stable::new_empty(query, {query.size(0), query.size(1), 1, query.size(3)}, ScalarType::Float);
  if (key_cache.size(2) == 0) {
    torch::stable::zero_(out);
    return out;
  }
  const Tensor q = dense(query), k = dense(key_cache), v = dense(value_cache), cand = dense(candidates), n = dense(length);
  const OptionalTensor vis = dense_or_none(visible), lo = dense_or_none(page_min), hi = dense_or_none(page_max),
                       shift = dense_or_none(page_shift), gk = dense_or_none(gathered_keys),
                       gv = dense_or_none(gathered_values);
  const int status = specontext_op::with_store_element(k.scalar_type(), [&](auto element) {
    return run_refine<decltype(element)>(q, k, v, cand, n, vis, lo, hi, shift, gk, gv, out, rescue, page_tokens, budget,
                                         sinks, recent);
  });
  STD_TORCH_CHECK(status == 0, "cpu_refine_attention rejected its inputs (budget ", budget, ")");
  return out;
}

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(specontext, CPU, m) { m.impl("cpu_refine_attention", TORCH_BOX(&refine_attention_op)); }

// Calls of the operator's C++ kernel in this process (runtime/cpu_kernels.py kernel_calls).
extern "C" int64_t specontext_refine_attention_op_calls() { return op_calls.load(std::memory_order_relaxed); }
#endif
