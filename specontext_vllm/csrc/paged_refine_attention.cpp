// The per-layer refinement of the vLLM plugin (specontext_vllm/refine.py), read from vLLM's
// paged CPU KV cache in its own packing (paged_blocks.h): per decode row r and KV head h (a
// unit u = r * kv + h), the candidates are the tokens of the unit's listed blocks (the step's
// shared selection and this layer's rescued blocks, ascending), the first lens[u] of them:
//
//   l[g][i]  = q[u][g] . key(i)                         (q already scaled)
//   rank[i]  = max_g softmax_i(l[g])[i]                  (the group-max probability)
//   rank[i]  = +inf for the first `sinks` candidates and those at positions >= row_len[r] - recent
//   kept     = the `budget` candidates of highest rank (all of them when there are no more)
//   out[u][g] = sum_{i in kept} softmax_{kept}(l[g])[i] * value(i)
//   coverage[u] = min_g sum_{i in kept} softmax_i(l[g])[i]   (the fidelity guard's estimate,
//                 runtime/aten_step.py refine_gathered: the kept share of the candidates' mass)
//
// as the backend's refinement does it (runtime/aten_step.py: ranked, attend_kept); every key
// is read once for the whole group, only the kept tokens' values are read, float32 throughout.
//
// cache: [num_blocks][kv][2][bs * d]; tables: int32 [units][width] physical blocks; logical:
// int64 [units][width] their logical blocks (a position is logical * bs + slot); lens: int32
// [units]; row_len: int64 [rows] (the row's tokens, this step's included); q, out: float32
// [units][groups][d]; coverage: float32 [units] or null (not computed). Returns 0, or 1 for
// arguments the kernel does not take.
#include <algorithm>
#include <cstdint>
#include <vector>

#include "cpu_common.h"  // runtime/csrc: exp_nonpositive
#include "paged_blocks.h"

namespace {

using namespace specontext_paged;

struct Refine {
  const int32_t* tables;
  const int64_t* logical;
  const int32_t* lens;
  const int64_t* row_len;
  const float* q;
  float* out;
  float* coverage;  // [units] or nullptr
  int64_t kv, groups, width, bs, d;
  int key_form, value_form;
  int64_t budget, sinks, recent;
  int bs_shift;  // log2(bs) when bs is a power of two, else -1
};

// Block and slot of candidate i (the block size a power of two in vLLM's CPU caches: a shift).
inline int64_t block_of(int64_t i, const Refine& p) { return p.bs_shift >= 0 ? i >> p.bs_shift : i / p.bs; }
inline int64_t slot_of(int64_t i, const Refine& p) { return p.bs_shift >= 0 ? i & (p.bs - 1) : i % p.bs; }

// The most tokens a unit keeps: the budget, or every candidate when the budget is larger (a
// budget above the context is how a user asks for exact attention: never allocate by it).
inline int64_t kept_capacity(const Refine& p) { return std::min(p.budget, p.width * p.bs); }

constexpr int kBinShift = 20;  // a rank's sign, exponent and 3 mantissa bits pick its bin
constexpr int64_t kBins = int64_t{1} << (32 - kBinShift);

// Per thread, reused across units.
struct Scratch {
  std::vector<float> logits, rank, order, stats, candidate_stats, acc, weights, kept_values;
  std::vector<int32_t> kept;
  std::vector<uint32_t> hist;
  Scratch(const Refine& p)
      : logits(p.groups * p.width * p.bs), rank(p.width * p.bs), order(p.width * p.bs), stats(2 * p.groups),
        candidate_stats(2 * p.groups),
        acc(p.groups * p.d), weights(p.groups * kept_capacity(p)),
        kept_values(p.value_form == 0 ? kept_capacity(p) * p.d : 0), kept(p.width * p.bs), hist(kBins) {}
};

// The group-max softmax probability of each candidate, forced ones +inf.
void rank_candidates(const Refine& p, int64_t u, int64_t n, Scratch& s) {
  const int64_t stride = p.width * p.bs;
  float* rank = s.rank.data();
  for (int64_t g = 0; g < p.groups; ++g) {
    float* row = s.logits.data() + g * stride;
    float m = -__builtin_inff();
    for (int64_t i = 0; i < n; ++i) m = std::max(m, row[i]);
    float z = 0.f;
#pragma omp simd reduction(+ : z)
    for (int64_t i = 0; i < n; ++i) z += specontext_cpu::exp_nonpositive(row[i] - m);
    s.candidate_stats[2 * g] = m;  // the candidates' softmax of head g: the guard's coverage reads it
    s.candidate_stats[2 * g + 1] = z;
    for (int64_t i = 0; i < n; ++i) {
      const float prob = specontext_cpu::exp_nonpositive(row[i] - m) / z;  // z >= 1
      rank[i] = g == 0 ? prob : std::max(rank[i], prob);
    }
  }
  const int64_t* logical = p.logical + u * p.width;
  const int64_t first_recent = p.row_len[u / p.kv] - p.recent;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t position = logical[block_of(i, p)] * p.bs + slot_of(i, p);
    if (i < p.sinks || position >= first_recent) rank[i] = __builtin_inff();
  }
}

// The kept candidates' indices into s.kept, ascending; returns how many. The cut (the
// budget-th highest rank) is found by a histogram of the ranks' top bits (ranks are
// non-negative floats or +inf, so their bits order as they do), then a selection among the
// candidates of the cut's bin only.
int64_t keep_best(const Refine& p, int64_t n, Scratch& s) {
  int32_t* kept = s.kept.data();
  if (n <= p.budget) {
    for (int64_t i = 0; i < n; ++i) kept[i] = static_cast<int32_t>(i);
    return n;
  }
  const float* rank = s.rank.data();
  const uint32_t* bits = reinterpret_cast<const uint32_t*>(rank);
  uint32_t* hist = s.hist.data();
  std::fill(hist, hist + kBins, 0u);
  for (int64_t i = 0; i < n; ++i) ++hist[bits[i] >> kBinShift];
  int64_t bin = kBins - 1, above = 0;  // candidates in bins above `bin`
  while (above + hist[bin] < p.budget) above += hist[bin--];
  float* order = s.order.data();
  int64_t in_bin = 0;
  for (int64_t i = 0; i < n; ++i)
    if ((bits[i] >> kBinShift) == static_cast<uint32_t>(bin)) order[in_bin++] = rank[i];
  const int64_t need = p.budget - above;  // from the cut's bin, 1..in_bin
  std::nth_element(order, order + (in_bin - need), order + in_bin);
  const float cut = order[in_bin - need];
  int64_t over_cut = 0;
  for (int64_t k = 0; k < in_bin; ++k) over_cut += order[k] > cut;
  int64_t at_cut = need - over_cut, count = 0;  // ties at the cut: the earliest candidates
  for (int64_t i = 0; i < n; ++i)
    if (rank[i] > cut || (rank[i] == cut && at_cut-- > 0)) kept[count++] = static_cast<int32_t>(i);
  return count;
}

template <typename T>
void attend_kept(const Refine& p, const T* cache, int64_t u, int64_t h, int64_t count, Scratch& s) {
  const int64_t stride = p.width * p.bs, area = p.bs * p.d;
  const int32_t* table = p.tables + u * p.width;
  const int32_t* kept = s.kept.data();
  float* z = s.stats.data();
  for (int64_t g = 0; g < p.groups; ++g) {  // each head's weights over the kept tokens
    const float* row = s.logits.data() + g * stride;
    float* w = s.weights.data() + g * kept_capacity(p);
    float best = -__builtin_inff();
    for (int64_t k = 0; k < count; ++k) {
      w[k] = row[kept[k]];
      best = std::max(best, w[k]);
    }
    float total = 0.f;
#pragma omp simd reduction(+ : total)
    for (int64_t k = 0; k < count; ++k) {
      w[k] = specontext_cpu::exp_nonpositive(w[k] - best);
      total += w[k];
    }
    z[g] = total;  // >= 1: the maximum's own term
  }
  if (p.coverage) {  // sum over kept of exp(l - m_g) / z_g = total * exp(best - m_g) / z_g, min over g
    float least = 1.f;
    for (int64_t g = 0; g < p.groups; ++g) {
      const float* row = s.logits.data() + g * stride;
      float best = -__builtin_inff();
      for (int64_t k = 0; k < count; ++k) best = std::max(best, row[kept[k]]);
      const float m = s.candidate_stats[2 * g], zc = s.candidate_stats[2 * g + 1];
      const float share = z[g] * specontext_cpu::exp_nonpositive(best - m) / zc;
      least = std::min(least, std::min(share, 1.f));
    }
    p.coverage[u] = least;
  }
  float* acc = s.acc.data();
  std::fill(acc, acc + p.groups * p.d, 0.f);
  const auto values_of = [&](int64_t i) {
    return cache + (static_cast<int64_t>(table[block_of(i, p)]) * p.kv + h) * 2 * area + area;
  };
  const int64_t cap = kept_capacity(p);
  if (p.value_form == 0) {
    // rows form: the kept rows are first copied into one buffer (float32), then summed. The
    // copies are independent, so the core keeps many of the scattered rows in flight; summing
    // straight from the cache chained each row's loads behind the last row's accumulation and
    // left the core waiting on them (no prefetch distance or cache level changed that).
    float* rows = s.kept_values.data();
    for (int64_t k = 0; k < count; ++k) {
      const T* v = values_of(kept[k]) + slot_of(kept[k], p) * p.d;
      float* r = rows + k * p.d;
#pragma omp simd
      for (int64_t j = 0; j < p.d; ++j) r[j] = load(v + j);
    }
    for (int64_t k = 0; k < count; ++k)
      for (int64_t g = 0; g < p.groups; ++g) {
        const float w = s.weights[g * cap + k];
        const float* r = rows + k * p.d;
        float* a = acc + g * p.d;
#pragma omp simd
        for (int64_t j = 0; j < p.d; ++j) a[j] += w * r[j];
      }
  } else {  // AMX tiles: a value is spread over its block; read in place
    for (int64_t k = 0; k < count; ++k) {
      const int64_t i = kept[k], slot = slot_of(i, p);
      const T* values = values_of(i);
      for (int64_t g = 0; g < p.groups; ++g) {
        const float w = s.weights[g * cap + k];
        float* a = acc + g * p.d;
        for (int64_t j = 0; j < p.d; ++j) a[j] += w * value_at(values, slot, j, p.bs, p.d, 1);
      }
    }
  }
  float* o = p.out + u * p.groups * p.d;
  for (int64_t g = 0; g < p.groups; ++g)
    for (int64_t j = 0; j < p.d; ++j) o[g * p.d + j] = acc[g * p.d + j] / z[g];
}

template <typename T>
void refine_unit(const Refine& p, const T* cache, int64_t u, Scratch& s) {
  const int64_t h = u % p.kv, n = p.lens[u], area = p.bs * p.d, stride = p.width * p.bs;
  const int32_t* table = p.tables + u * p.width;
  const float* qh = p.q + u * p.groups * p.d;
  const auto keys_of = [&](int64_t blk) { return cache + (static_cast<int64_t>(table[blk]) * p.kv + h) * 2 * area; };
  const int64_t blocks = (n + p.bs - 1) / p.bs;
  for (int64_t blk = 0; blk < blocks && blk < kBlocksAhead; ++blk) request_block(keys_of(blk), p.bs, p.d);
  for (int64_t blk = 0; blk < blocks; ++blk)  // the blocks are scattered: each one requested kBlocksAhead early
    one_block(keys_of(blk), qh, s.logits.data() + blk * p.bs, p.groups, p.bs, p.d, stride, p.key_form,
              blk + kBlocksAhead < blocks ? keys_of(blk + kBlocksAhead) : nullptr);
  rank_candidates(p, u, n, s);
  attend_kept(p, cache, u, h, keep_best(p, n, s), s);
}

template <typename T>
int run(const T* cache, const Refine& p, int64_t units) {
  if (p.bs > kMaxBlock || p.bs <= 0 || p.d <= 0 || p.groups <= 0 || p.width <= 0 || p.budget <= 0 ||
      (p.key_form == 1 && (p.bs % 16 != 0 || p.d % 2 != 0)) || (p.value_form == 1 && (p.bs % 2 != 0 || p.d % 16 != 0)))
    return 1;
  for (int64_t u = 0; u < units; ++u)
    if (p.lens[u] <= 0 || p.lens[u] > p.width * p.bs) return 1;  // every unit attends to its own token
#pragma omp parallel
  {
    Scratch scratch(p);
#pragma omp for schedule(dynamic, 1)
    for (int64_t u = 0; u < units; ++u) refine_unit(p, cache, u, scratch);
  }
  return 0;
}

}  // namespace

#define SPECONTEXT_REFINE_ENTRY(name, T, forms_ok)                                                                 \
  extern "C" int name(const T* cache, const int32_t* tables, const int64_t* logical, const int32_t* lens,          \
                      const int64_t* row_len, const float* q, float* out, float* coverage, int64_t rows,              \
                      int64_t kv, int64_t groups,                                                                   \
                      int64_t width, int64_t bs, int64_t d, int key_form, int value_form, int64_t budget,           \
                      int64_t sinks, int64_t recent) {                                                              \
    if (!(forms_ok)) return 1;                                                                                      \
    const int shift = bs > 0 && (bs & (bs - 1)) == 0 ? __builtin_ctzll(bs) : -1;                                    \
    const Refine p{tables, logical, lens, row_len, q, out, coverage, kv, groups, width, bs, d, key_form, value_form, \
                   budget, sinks, recent, shift};                                                                   \
    return run(cache, p, rows * kv);                                                                                \
  }

SPECONTEXT_REFINE_ENTRY(specontext_paged_refine_attention_f32, float, key_form == 0 && value_form == 0)
SPECONTEXT_REFINE_ENTRY(specontext_paged_refine_attention_bf16, uint16_t,
                        (key_form == 0 || key_form == 1) && (value_form == 0 || value_form == 1))
