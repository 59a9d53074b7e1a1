// One-row linear layer on the CPU: out[o] = sum_i weight[o, i] * x[i], float32 accumulation.
//
// A batch-1 decode step multiplies one activation row by every weight matrix: its cost is
// reading the weights once. Each work item takes ROWS output rows and streams them side by
// side, so each load of x serves ROWS weight rows, and it prefetches the next item's rows as it
// goes (without it the short rows of a small matrix end before the hardware prefetcher ramps
// up: 17.9 against 22.8 GB/s over SmolLM2's weights on a 2-core Xeon). Several matrices that
// multiply the same row (query/key/value, gate/up) are one call: their items are split between
// the threads (OpenMP, torch's pool) in one parallel region.
// bfloat16 weights and x: with AVX512-BF16, VDPBF16PS multiplies pairs of bfloat16 values
// exactly in float32 and adds them to float32 sums (denormal inputs read as zero, as the
// instruction does); without it each element is widened to float32 exactly (the high half of
// a float32) and multiplied-added. float32 weights and x: fused multiply-add. Output float32:
// the caller rounds it to the layer's dtype and adds the bias. Written for specontext (issue
// 51: the bfloat16 step's weights read at the copy rate); built and loaded by
// runtime/cpu_kernels.py.
#include <cstdint>
#include <vector>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace {

constexpr int64_t ROWS = 4;  // output rows streamed side by side per work item

inline float widen(uint16_t x) {
  const uint32_t bits = static_cast<uint32_t>(x) << 16;
  float f;
  __builtin_memcpy(&f, &bits, sizeof(f));
  return f;
}

// Scalar (vectorisable) dot products of `rows` rows of w with x, from element `from` on.
template <typename T>
inline void dot_tail(const T* w, const T* x, float* acc, int64_t rows, int64_t from, int64_t n_in) {
  for (int64_t r = 0; r < rows; ++r) {
    float sum = 0.f;
    const T* row = w + r * n_in;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = from; i < n_in; ++i) {
      if constexpr (sizeof(T) == 2) {
        sum += widen(row[i]) * widen(x[i]);
      } else {
        sum += row[i] * x[i];
      }
    }
    acc[r] += sum;
  }
}

// Prefetch the ROWS rows of the next item (up to `end`) at element i of each row.
template <typename T>
inline void prefetch_next(const T* w, const T* end, int64_t i, int64_t n_in) {
#ifdef __AVX512F__
  for (int64_t r = ROWS; r < 2 * ROWS; ++r) {
    const T* p = w + r * n_in + i;
    if (p < end) _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T0);
  }
#endif
}

// out[0 .. rows-1] for the `rows` (<= ROWS) weight rows starting at w (the matrix ends at end).
inline void block_f32(const float* w, const float* end, const float* x, float* out, int64_t rows, int64_t n_in) {
  float acc[ROWS] = {0.f, 0.f, 0.f, 0.f};
  int64_t i = 0;
#ifdef __AVX512F__
  if (rows == ROWS) {
    __m512 s0 = _mm512_setzero_ps(), s1 = _mm512_setzero_ps(), s2 = _mm512_setzero_ps(), s3 = _mm512_setzero_ps();
    for (; i + 16 <= n_in; i += 16) {
      prefetch_next(w, end, i, n_in);
      const __m512 xv = _mm512_loadu_ps(x + i);
      s0 = _mm512_fmadd_ps(_mm512_loadu_ps(w + i), xv, s0);
      s1 = _mm512_fmadd_ps(_mm512_loadu_ps(w + n_in + i), xv, s1);
      s2 = _mm512_fmadd_ps(_mm512_loadu_ps(w + 2 * n_in + i), xv, s2);
      s3 = _mm512_fmadd_ps(_mm512_loadu_ps(w + 3 * n_in + i), xv, s3);
    }
    acc[0] = _mm512_reduce_add_ps(s0);
    acc[1] = _mm512_reduce_add_ps(s1);
    acc[2] = _mm512_reduce_add_ps(s2);
    acc[3] = _mm512_reduce_add_ps(s3);
  }
#endif
  dot_tail(w, x, acc, rows, i, n_in);
  for (int64_t r = 0; r < rows; ++r) out[r] = acc[r];
}

inline void block_bf16(const uint16_t* w, const uint16_t* end, const uint16_t* x, float* out, int64_t rows,
                       int64_t n_in) {
  float acc[ROWS] = {0.f, 0.f, 0.f, 0.f};
  int64_t i = 0;
#if defined(__AVX512BF16__)
  if (rows == ROWS) {
    __m512 s0 = _mm512_setzero_ps(), s1 = _mm512_setzero_ps(), s2 = _mm512_setzero_ps(), s3 = _mm512_setzero_ps();
    for (; i + 32 <= n_in; i += 32) {
      prefetch_next(w, end, i, n_in);
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + i);
      s0 = _mm512_dpbf16_ps(s0, (__m512bh)_mm512_loadu_si512(w + i), xv);
      s1 = _mm512_dpbf16_ps(s1, (__m512bh)_mm512_loadu_si512(w + n_in + i), xv);
      s2 = _mm512_dpbf16_ps(s2, (__m512bh)_mm512_loadu_si512(w + 2 * n_in + i), xv);
      s3 = _mm512_dpbf16_ps(s3, (__m512bh)_mm512_loadu_si512(w + 3 * n_in + i), xv);
    }
    acc[0] = _mm512_reduce_add_ps(s0);
    acc[1] = _mm512_reduce_add_ps(s1);
    acc[2] = _mm512_reduce_add_ps(s2);
    acc[3] = _mm512_reduce_add_ps(s3);
  }
#elif defined(__AVX512F__)
  if (rows == ROWS) {
    __m512 s0 = _mm512_setzero_ps(), s1 = _mm512_setzero_ps(), s2 = _mm512_setzero_ps(), s3 = _mm512_setzero_ps();
    auto load = [](const uint16_t* p) {
      return _mm512_castsi512_ps(_mm512_slli_epi32(
          _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
    };
    for (; i + 16 <= n_in; i += 16) {
      prefetch_next(w, end, i, n_in);
      const __m512 xv = load(x + i);
      s0 = _mm512_fmadd_ps(load(w + i), xv, s0);
      s1 = _mm512_fmadd_ps(load(w + n_in + i), xv, s1);
      s2 = _mm512_fmadd_ps(load(w + 2 * n_in + i), xv, s2);
      s3 = _mm512_fmadd_ps(load(w + 3 * n_in + i), xv, s3);
    }
    acc[0] = _mm512_reduce_add_ps(s0);
    acc[1] = _mm512_reduce_add_ps(s1);
    acc[2] = _mm512_reduce_add_ps(s2);
    acc[3] = _mm512_reduce_add_ps(s3);
  }
#endif
  dot_tail(w, x, acc, rows, i, n_in);
  for (int64_t r = 0; r < rows; ++r) out[r] = acc[r];
}

// out = [w_0 x, w_1 x, ...] for `count` matrices w_k [n_outs[k], n_in] (each contiguous).
template <typename T, typename Block>
int one_row_linear(const T* x, const T* const* weights, const int64_t* n_outs, int64_t count, float* out,
                   int64_t n_in, Block block) {
  if (count < 1 || n_in < 0) return 1;
  std::vector<int64_t> first_item(count + 1, 0), first_row(count + 1, 0);  // prefix sums
  for (int64_t k = 0; k < count; ++k) {
    if (n_outs[k] < 0) return 1;
    first_item[k + 1] = first_item[k] + (n_outs[k] + ROWS - 1) / ROWS;
    first_row[k + 1] = first_row[k] + n_outs[k];
  }
  const int64_t items = first_item[count];
#pragma omp parallel for schedule(static)
  for (int64_t item = 0; item < items; ++item) {
    int64_t k = 0;
    while (item >= first_item[k + 1]) ++k;
    const int64_t o = (item - first_item[k]) * ROWS;
    const int64_t rows = n_outs[k] - o < ROWS ? n_outs[k] - o : ROWS;
    const T* w = weights[k];
    block(w + o * n_in, w + n_outs[k] * n_in, x, out + first_row[k] + o, rows, n_in);
  }
  return 0;
}

}  // namespace

// x float32 [n_in]; weights: `count` float32 matrices [n_outs[k], n_in] (row-major, contiguous);
// out float32 [sum(n_outs)]: the products side by side.
extern "C" int specontext_one_row_linear_f32(const float* x, const float* const* weights, const int64_t* n_outs,
                                             int64_t count, float* out, int64_t n_in) {
  return one_row_linear(x, weights, n_outs, count, out, n_in, block_f32);
}

// x and weights bfloat16 (their raw 16-bit patterns), out float32.
extern "C" int specontext_one_row_linear_bf16(const uint16_t* x, const uint16_t* const* weights,
                                              const int64_t* n_outs, int64_t count, float* out, int64_t n_in) {
  return one_row_linear(x, weights, n_outs, count, out, n_in, block_bf16);
}
