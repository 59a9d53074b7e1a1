// Helpers shared by specontext's CPU kernels (decode_attention.cpp, refine_attention.cpp):
// a branch-free exponential for x <= 0, store elements widened to float32, and the AVX-512
// loads, prefetches and lane sums. runtime/cpu_kernels.py hashes this header with each
// source, so a change here rebuilds both.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif

namespace specontext_cpu {

// exp(x) for x <= 0 (logits minus their running maximum), branch-free so that the compiler
// vectorises the loops that call it: 2^n * p(r), r = x - n ln2 in [-ln2/2, ln2/2], p the
// degree-6 Taylor polynomial (relative error under 3e-7); x below -87 (and -inf) gives 0.
inline float exp_nonpositive(float x) {
  const float clamped = x < -87.0f ? -87.0f : x;
  // round to nearest by the 1.5 * 2^23 trick (vectorises; |clamped * log2(e)| < 2^22)
  const float n = (clamped * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  const float r = clamped - n * 0.693145751953125f - n * 1.428606765330187e-06f;
  float p = 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  __builtin_memcpy(&scale, &bits, sizeof(scale));
  return x < -87.0f ? 0.0f : p * scale;
}

// The visibility mask a kernel needs, or nullptr when it hides no written slot of any row
// (visible[b][p] != 0 for every p < min(length[b], capacity)): then every kernel's mask-free
// path gives the same result (a slot past the written length is never attended either way).
// The compiled step passes Hugging Face's mask, which at decode hides only the unwritten
// capacity; with it the refine kernel took its per-slot tests (a 30-layer bfloat16 step 8.7 ms
// against 8.1 with the mask dropped: benchmarks/refine_kernel_ab.sh with VIS=1, issue 51,
// docs/benchmarks.md "Runs ah and ai"). One memchr per row.
inline const uint8_t* needed_mask(const uint8_t* visible, int64_t visible_stride, const int64_t* lengths,
                                  int64_t length_stride, int64_t batch, int64_t capacity) {
  if (!visible) return nullptr;
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t written = std::min(std::max<int64_t>(lengths[b * length_stride], 0), capacity);
    if (std::memchr(visible + b * visible_stride, 0, static_cast<size_t>(written))) return visible;
  }
  return nullptr;
}

// The maximum of row[lo, hi) (-inf when empty), vectorised (std::max in the loop was not).
inline float row_max(const float* row, int64_t lo, int64_t hi) {
  float m = -__builtin_inff();
#pragma omp simd reduction(max : m)
  for (int64_t i = lo; i < hi; ++i) m = m > row[i] ? m : row[i];
  return m;
}

// The softmax statistics of row[lo, hi): st[0] = its maximum (-inf when every entry is -inf),
// st[1] = the sum of exp(row[i] - max) (0 then). Splits of a row merge as
// M = max_s m_s, Z = sum_s z_s exp(m_s - M).
inline void split_stats(const float* row, int64_t lo, int64_t hi, float* st) {
  const float m = row_max(row, lo, hi);
  float z = 0.f;
  if (m != -__builtin_inff()) {
#pragma omp simd reduction(+ : z)
    for (int64_t i = lo; i < hi; ++i) z += exp_nonpositive(row[i] - m);
  }
  st[0] = m;
  st[1] = z;
}

// fn(std::integral_constant<int, G>, std::integral_constant<int, D>) with compile-time group
// and head sizes for the common shapes (unrolled, vectorised loops), 0 and 0 (run-time sizes)
// for the others. The shapes, as (query heads per KV head, head_dim): 3 x 64 (SmolLM2-135M and
// 360M), 4 x 64 (Llama-3.2-1B), 4 x 128 (Llama-3-8B, Mistral-7B, Qwen3-8B), 8 x 128, 7 x 64
// (Qwen2.5-0.5B), 7 x 128 (Qwen2.5-7B), 6 x 128 (Qwen2.5-1.5B), 8 x 64 (TinyLlama-1.1B).
template <typename Fn>
inline void with_shape(int64_t G, int64_t D, Fn&& fn) {
  using std::integral_constant;
  if (G == 3 && D == 64) fn(integral_constant<int, 3>{}, integral_constant<int, 64>{});
  else if (G == 4 && D == 64) fn(integral_constant<int, 4>{}, integral_constant<int, 64>{});
  else if (G == 4 && D == 128) fn(integral_constant<int, 4>{}, integral_constant<int, 128>{});
  else if (G == 8 && D == 128) fn(integral_constant<int, 8>{}, integral_constant<int, 128>{});
  else if (G == 7 && D == 64) fn(integral_constant<int, 7>{}, integral_constant<int, 64>{});
  else if (G == 7 && D == 128) fn(integral_constant<int, 7>{}, integral_constant<int, 128>{});
  else if (G == 6 && D == 128) fn(integral_constant<int, 6>{}, integral_constant<int, 128>{});
  else if (G == 8 && D == 64) fn(integral_constant<int, 8>{}, integral_constant<int, 64>{});
  else fn(integral_constant<int, 0>{}, integral_constant<int, 0>{});
}

// A hint to the core that this thread spins waiting for another (x86 PAUSE, Arm YIELD).
inline void pause_cpu() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// A float16 store element (IEEE binary16): its bits, a type of its own so that the kernels'
// templates tell it from bfloat16 (uint16_t); the same size and layout as torch.float16.
struct half_t {
  uint16_t bits;
};

// A store element as float32: bfloat16 is the high half of a float32 (stored as uint16_t);
// float16 converts exactly (the CPU's F16C conversion where it has one).
inline float widen(float x) { return x; }
inline float widen(int8_t x) { return static_cast<float>(x); }  // an int8 store's level (its row's scale apart)
inline float widen(uint16_t x) {
  const uint32_t bits = static_cast<uint32_t>(x) << 16;
  float f;
  __builtin_memcpy(&f, &bits, sizeof(f));
  return f;
}
inline float widen(half_t x) {
  // branch-free (selects), so that the kernels' generic loops vectorise it (F16C's scalar
  // conversion kept them scalar: a review found float16 3.5-10x slower than bfloat16 there);
  // the kernels' fast shapes load 16 at a time with VCVTPH2PS (load16)
  const uint32_t h = x.bits, sign = (h & 0x8000u) << 16, exponent = (h >> 10) & 0x1fu, mantissa = h & 0x3ffu;
  const uint32_t normal = sign | ((exponent + 112u) << 23) | (mantissa << 13);  // rebias 15 -> 127
  const uint32_t special = sign | 0x7f800000u | (mantissa << 13);                // inf, NaN
  float f;
  const uint32_t bits = exponent == 0x1fu ? special : normal;
  __builtin_memcpy(&f, &bits, sizeof(f));
  const float small = static_cast<float>(mantissa) * 5.9604644775390625e-08f;  // zero, subnormal: m * 2^-24
  return exponent == 0 ? (sign ? -small : small) : f;
}

// float16's rounding of a float32 (to nearest, ties to even) as a float32, via the CPU's F16C
// conversion, or in software: the logits' query of a float16 store, as the torch bodies round it.
inline float round_half(float x) {
#ifdef __F16C__
  return _cvtsh_ss(_cvtss_sh(x, _MM_FROUND_TO_NEAREST_INT));
#else
  // float16 keeps 11 significant bits down to 2^-14, then a fixed step of 2^-24 (subnormals);
  // finite values at or above 65520 round to inf. Adding and subtracting 1.5 * 2^(e + 13)
  // (e: x's binary exponent, at least -14) rounds x to that many bits, ties to even, in float32.
  if (!(std::fabs(x) < 65520.0f)) return x != x ? x : (x > 0 ? __builtin_inff() : -__builtin_inff());
  int e;
  std::frexp(x, &e);  // |x| in [2^(e-1), 2^e)
  const float step = std::ldexp(1.0f, std::max(e - 1, -14) - 10);
  const volatile float big = step * 12582912.0f;  // 1.5 * 2^23 steps: the float32 sum rounds to whole steps
  return std::copysign((x + big) - big, x);  // a negative value that rounds to zero is -0, as F16C gives
#endif
}

// bfloat16's rounding of a float32 (to nearest, ties to even), as a float32: the logits' query
// of a bfloat16 store, as the torch bodies round it (sparse_attention.query_key_logits); the
// bfloat16 dot products (group_logits16_bf16) take it exactly.
inline float round_like(float x, uint16_t) {
  uint32_t bits;
  __builtin_memcpy(&bits, &x, sizeof(bits));
  bits = (bits + 0x7fffu + ((bits >> 16) & 1u)) & 0xffff0000u;
  __builtin_memcpy(&x, &bits, sizeof(x));
  return x;
}
inline float round_like(float x, half_t) { return round_half(x); }
inline float round_like(float x, float) { return x; }
inline float round_like(float x, int8_t) { return x; }  // an int8 store's query stays float32

// Whether q[0, n) holds values of the store's dtype only (for bfloat16: the low 16 bits zero).
inline bool holds_store_values(const float* q, int64_t n, uint16_t) {
  uint32_t low = 0;
  for (int64_t i = 0; i < n; ++i) {
    uint32_t bits;
    __builtin_memcpy(&bits, q + i, sizeof(bits));
    low |= bits & 0xffffu;
  }
  return low == 0;
}
inline bool holds_store_values(const float* q, int64_t n, half_t) {
  for (int64_t i = 0; i < n; ++i)
    if (round_half(q[i]) != q[i] && q[i] == q[i]) return false;
  return true;
}
inline bool holds_store_values(const float*, int64_t, float) { return true; }
inline bool holds_store_values(const float*, int64_t, int8_t) { return false; }  // no int8 dot products

// Whether group_logits16<T, G_, D_, true> takes the bfloat16 dot products (the kernels count
// the calls that did: tests assert the path that ran).
template <typename T, int G_, int D_>
constexpr bool uses_bf16_dot() {
#ifdef __AVX512BF16__
  return std::is_same_v<T, uint16_t> && G_ > 0 && D_ > 0 && D_ % 32 == 0;
#else
  return false;
#endif
}

#ifdef __AVX512F__
// 16 store elements as float32 (a bfloat16 element is the high half of a float32).
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline __m512 load16(const half_t* p) {  // VCVTPH2PS (AVX-512F): exact
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline __m512 load16(const int8_t* p) {  // an int8 store's levels, exact
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

// Prefetch one store row (D elements) into L1, one request per 64-byte line: a core streams a
// block's keys, then its values, from two places; the hardware prefetcher alone kept it at about
// 8 GB/s a core on a 2-core Xeon (issue 51).
template <typename T, int D_>
inline void prefetch_row(const T* row) {
  constexpr int LINES = (D_ * static_cast<int>(sizeof(T)) + 63) / 64;
  for (int line = 0; line < LINES; ++line)
    _mm_prefetch(reinterpret_cast<const char*>(row) + 64 * line, _MM_HINT_T0);
}

// Prefetch one store row into L2, for a row far ahead (each kernel's FAR rows): with the L1 requests
// alone (16 rows ahead) a core loaded a block, then computed on it, then loaded the next (the
// kernels ran at their in-cache compute time plus the store's read time); requests this far
// ahead keep the reads running under the compute. Measured alone on an AMD EPYC (Zen 4, 2 cores,
// issue 51, docs/benchmarks.md "How the step got here"): the dense kernel 1.22x,
// the refine kernel's scattered candidate and value rows 1.25x.
template <typename T, int D_>
inline void prefetch_row_l2(const T* row) {
  constexpr int LINES = (D_ * static_cast<int>(sizeof(T)) + 63) / 64;
  for (int line = 0; line < LINES; ++line)
    _mm_prefetch(reinterpret_cast<const char*>(row) + 64 * line, _MM_HINT_T1);
}

// out[j] = the sum of acc[j]'s 16 lanes, for 16 vectors at once: a transposing tree of 15
// adds and 31 shuffles, where 16 horizontal sums take 16 x 8 dependent operations.
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


#ifdef __AVX512BF16__
// group_logits16 for bfloat16 key rows with the CPU's bfloat16 dot products (VDPBF16PS: each
// lane adds the products of a pair of elements, exact in float32, to a float32 sum; inputs below
// 2^-126 count as 0): no widening of the rows, half the multiply-adds. q must hold bfloat16
// values (the callers round the logits' query to the store's dtype, as the torch bodies do), so
// its conversion here is exact; only the order of the float32 additions differs from the
// widening path.
template <int G_, int D_>
inline void group_logits16_bf16(const float* q, const uint16_t* const* rows, float* out, int64_t stride) {
  constexpr int CH = D_ / 32;  // 32 elements a vector
  constexpr int R = G_ <= 3 ? 8 : (G_ <= 6 ? 4 : (G_ <= 12 ? 2 : 1));
  __m512bh qv[G_][CH];
  for (int g = 0; g < G_; ++g)
    for (int c = 0; c < CH; ++c)
      qv[g][c] = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(q + g * D_ + 32 * c + 16), _mm512_loadu_ps(q + g * D_ + 32 * c));
  __m512 sums[G_][16];
  for (int r0 = 0; r0 < 16; r0 += R) {
    __m512 acc[G_][R];
    for (int g = 0; g < G_; ++g)
      for (int r = 0; r < R; ++r) acc[g][r] = _mm512_setzero_ps();
    for (int c = 0; c < CH; ++c)
      for (int r = 0; r < R; ++r) {
        const __m512bh kv = (__m512bh)_mm512_loadu_si512(rows[r0 + r] + 32 * c);
        for (int g = 0; g < G_; ++g) acc[g][r] = _mm512_dpbf16_ps(acc[g][r], qv[g][c], kv);
      }
    for (int g = 0; g < G_; ++g)
      for (int r = 0; r < R; ++r) sums[g][r0 + r] = acc[g][r];
  }
  for (int g = 0; g < G_; ++g) _mm512_storeu_ps(out + g * stride, sum_lanes16(sums[g]));
}
#endif

// out[g * stride + jj] = q[g] . rows[jj] for the G_ query heads of a KV group (q: [G_, D_]
// float32) and 16 key rows of D_ store elements: each row chunk is loaded (and, for bfloat16,
// widened) once for all G_ heads, R rows at a time so that the G_ x R accumulators stay in
// registers (looping over the heads outside reloaded each row G_ times: for bfloat16 stores
// that widening was most of the selection kernel's time, issue 51).
// DOT: q holds bfloat16 values (holds_store_values), so a bfloat16 store may take the bfloat16
// dot products.
template <typename T, int G_, int D_, bool DOT = false>
inline void group_logits16(const float* q, const T* const* rows, float* out, int64_t stride) {
#ifdef __AVX512BF16__
  if constexpr (DOT && uses_bf16_dot<T, G_, D_>()) {
    group_logits16_bf16<G_, D_>(q, rows, out, stride);
    return;
  }
#endif
  constexpr int R = G_ <= 3 ? 8 : (G_ <= 6 ? 4 : (G_ <= 12 ? 2 : 1));
  __m512 sums[G_][16];
  for (int r0 = 0; r0 < 16; r0 += R) {
    __m512 acc[G_][R];
    for (int g = 0; g < G_; ++g)
      for (int r = 0; r < R; ++r) acc[g][r] = _mm512_setzero_ps();
    for (int d = 0; d < D_; d += 16) {
      __m512 qv[G_];
      for (int g = 0; g < G_; ++g) qv[g] = _mm512_loadu_ps(q + g * D_ + d);
      for (int r = 0; r < R; ++r) {
        const __m512 kv = load16(rows[r0 + r] + d);
        for (int g = 0; g < G_; ++g) acc[g][r] = _mm512_fmadd_ps(qv[g], kv, acc[g][r]);
      }
    }
    for (int g = 0; g < G_; ++g)
      for (int r = 0; r < R; ++r) sums[g][r0 + r] = acc[g][r];
  }
  for (int g = 0; g < G_; ++g) _mm512_storeu_ps(out + g * stride, sum_lanes16(sums[g]));
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define SPECONTEXT_INT8_DOT 1
// out[g * stride + jj] = qscale[g] * (q8[g] . rows[jj]) for 16 int8 key rows of D_ levels and
// the G_ heads' int8 query rows: VPDPBUSD multiplies unsigned by signed bytes, so each key byte
// is flipped to level + 128 (unsigned) and 128 * (sum of the query's levels) taken off after.
// Integer products summed in int32 and then in float32, exactly (|sum| < 2^24 at D_ <= 256);
// one rounding, the query's scale (the key's scale is the caller's, per row).
template <int G_, int D_>
inline void group_logits16_int8(const int8_t* q8, const float* qscale, const int32_t* qsum,
                                const int8_t* const* rows, float* out, int64_t stride) {
  constexpr int C_ = D_ / 64;
  __m512i qv[G_][C_];
  for (int g = 0; g < G_; ++g)
    for (int c = 0; c < C_; ++c) qv[g][c] = _mm512_loadu_si512(q8 + g * D_ + 64 * c);
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  __m512 sums[G_][16];
  for (int r = 0; r < 16; ++r) {
    __m512i acc[G_];
    for (int g = 0; g < G_; ++g) acc[g] = _mm512_setzero_si512();
    for (int c = 0; c < C_; ++c) {
      const __m512i k = _mm512_xor_si512(_mm512_loadu_si512(rows[r] + 64 * c), flip);
      for (int g = 0; g < G_; ++g) acc[g] = _mm512_dpbusd_epi32(acc[g], k, qv[g][c]);
    }
    for (int g = 0; g < G_; ++g) sums[g][r] = _mm512_cvtepi32_ps(acc[g]);
  }
  for (int g = 0; g < G_; ++g) {
    const __m512 dots = _mm512_sub_ps(sum_lanes16(sums[g]), _mm512_set1_ps(128.f * static_cast<float>(qsum[g])));
    _mm512_storeu_ps(out + g * stride, _mm512_mul_ps(dots, _mm512_set1_ps(qscale[g])));
  }
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
// The first `count` (< 16) store elements at p as float32, the other lanes 0 (no read past them).
inline __m512 load16_first(const float* p, int64_t count) {
  return _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << count) - 1u), p);
}
inline __m512 load16_first(const uint16_t* p, int64_t count) {
  const __m256i raw = _mm256_maskz_loadu_epi16(static_cast<__mmask16>((1u << count) - 1u), p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline __m512 load16_first(const half_t* p, int64_t count) {
  return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(static_cast<__mmask16>((1u << count) - 1u), p));
}
inline __m512 load16_first(const int8_t* p, int64_t count) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(static_cast<__mmask16>((1u << count) - 1u), p)));
}
#define SPECONTEXT_ROW_VECTORS 1
#endif

// q[0, n) . row[0, n) in float32 (store elements widened as loaded), for the kernels' generic
// loops (the shapes with_shape does not unroll, and the rows left over): 16 elements a vector
// and one lane sum at the end. A loop over `widen` left float16 scalar (its scalar conversion;
// 3.5-10x slower than bfloat16, found by a review) and, for float32 and bfloat16, ended every
// row in a horizontal sum the compiler placed per iteration (this: 2-3x faster at 7 query heads
// a KV head, head_dim 64, scratch timing).
template <typename T>
inline float dot_row(const float* q, const T* row, int64_t n) {
#ifdef SPECONTEXT_ROW_VECTORS
  __m512 acc = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + i), load16(row + i), acc);
  if (i < n) acc = _mm512_fmadd_ps(load16_first(q + i, n - i), load16_first(row + i, n - i), acc);
  return _mm512_reduce_add_ps(acc);
#else
  float dot = 0.f;
#pragma omp simd reduction(+ : dot)
  for (int64_t d = 0; d < n; ++d) dot += q[d] * widen(row[d]);
  return dot;
#endif
}

// acc[0, n) += w * row[0, n) (store elements widened as loaded): dot_row's counterpart for the
// value sums of the generic loops.
template <typename T>
inline void add_row(float* acc, float w, const T* row, int64_t n) {
#ifdef SPECONTEXT_ROW_VECTORS
  const __m512 wv = _mm512_set1_ps(w);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(acc + i, _mm512_fmadd_ps(wv, load16(row + i), _mm512_loadu_ps(acc + i)));
  if (i < n) {
    const __mmask16 tail = static_cast<__mmask16>((1u << (n - i)) - 1u);
    _mm512_mask_storeu_ps(acc + i, tail, _mm512_fmadd_ps(wv, load16_first(row + i, n - i), load16_first(acc + i, n - i)));
  }
#else
#pragma omp simd
  for (int64_t d = 0; d < n; ++d) acc[d] += w * widen(row[d]);
#endif
}

}  // namespace specontext_cpu
