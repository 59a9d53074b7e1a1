// One-row bfloat16 linear layer on the CPU: y = W x, the weights read once at close to the
// copy rate (issue 51: inductor's fused reduction and aten::mm read SmolLM2's bf16 weights at
// about 11 GB/s on a 2-core Xeon where a copy runs at 26).
//
// What it computes (passes/gemv.py, one_row_linear, for a bfloat16 input row):
//   y[o] = bf16( sum_i float(W[o, i]) * float(x[i]) ), float32 accumulation, the sum rounded
//   to bfloat16 once (to nearest, ties to even), as inductor's reduction rounds it; only the
//   order of the float32 additions differs.
// With AVX512_BF16 (vdpbf16ps: 32 products of bfloat16 pairs summed into 16 float32 lanes per
// instruction; bfloat16 denormals read as zero) four output rows share each load of x;
// without it the rows are widened to float32 and summed with FMAs (AVX-512F) or scalar code.
// The output rows of one or several weights (one input row) are split between the threads
// (OpenMP), four at a time. Written for
// specontext; built and loaded by runtime/cpu_gemv.py.
#include <cstdint>
#include <cstring>

#include "cpu_common.h"

using namespace specontext_cpu;

namespace {

constexpr int ROWS = 4;  // output rows per block: they share each load of x
constexpr int AHEAD = 2 * ROWS;  // rows ahead whose same columns are prefetched: 20 -> 23 GB/s in a scratch
                                 // timing against 1 KiB ahead in the same row (2-core Xeon)

inline uint16_t round_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  if ((bits & 0x7f800000u) == 0x7f800000u && (bits & 0x007fffffu)) return static_cast<uint16_t>((bits >> 16) | 0x40u);  // NaN stays NaN
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

#if defined(__AVX512BF16__)
template <int R>
void rows_bf16(const uint16_t* w, const uint16_t* x, uint16_t* y, int64_t in) {
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 32 <= in; i += 32) {
    const __m512bh xv = reinterpret_cast<__m512bh>(_mm512_loadu_si512(x + i));
    for (int r = 0; r < R; ++r) {
      _mm_prefetch(reinterpret_cast<const char*>(w + (r + AHEAD) * in + i), _MM_HINT_T0);  // two blocks on (never faults)
      acc[r] = _mm512_dpbf16_ps(acc[r], reinterpret_cast<__m512bh>(_mm512_loadu_si512(w + r * in + i)), xv);
    }
  }
  if (i < in) {  // the last in % 32 elements: masked loads (zeros add nothing)
    const __mmask32 mask = (in - i) >= 32 ? ~0u : ((1u << (in - i)) - 1u);
    const __m512bh xv = reinterpret_cast<__m512bh>(_mm512_maskz_loadu_epi16(mask, x + i));
    for (int r = 0; r < R; ++r)
      acc[r] = _mm512_dpbf16_ps(acc[r], reinterpret_cast<__m512bh>(_mm512_maskz_loadu_epi16(mask, w + r * in + i)), xv);
  }
  for (int r = 0; r < R; ++r) y[r] = round_bf16(_mm512_reduce_add_ps(acc[r]));
}
#else
template <int R>
void rows_bf16(const uint16_t* w, const uint16_t* x, uint16_t* y, int64_t in) {
  for (int r = 0; r < R; ++r) {
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < in; ++i) sum += widen(w[r * in + i]) * widen(x[i]);
    y[r] = round_bf16(sum);
  }
}
#endif

}  // namespace

// 1 when the library was built with AVX512_BF16 (the fast path), else 0.
extern "C" int specontext_gemv_bf16_native() {
#if defined(__AVX512BF16__)
  return 1;
#else
  return 0;
#endif
}

// y[k] [out[k]] = w[k] [out[k], in] x [in] for the `count` weights of one input row (a layer's
// query, key and value projections; its gate and up projections), all bfloat16 (raw 16-bit
// patterns), each weight row-major and contiguous: one parallel region over every weight's
// four-row blocks. Returns 0, or 1 for sizes it does not take (count < 1, in < 1, out[k] < 1).
extern "C" int specontext_gemv_bf16(const uint16_t* const* w, const uint16_t* x, uint16_t* const* y,
                                    const int64_t* out, int64_t count, int64_t in) {
  constexpr int64_t MAX_WEIGHTS = 16;
  if (count < 1 || count > MAX_WEIGHTS || in < 1) return 1;
  int64_t first[MAX_WEIGHTS + 1] = {0};  // first[k]: weight k's first block among all of them
  for (int64_t k = 0; k < count; ++k) {
    if (out[k] < 1) return 1;
    first[k + 1] = first[k] + out[k] / ROWS;
  }
#pragma omp parallel for schedule(static)
  for (int64_t b = 0; b < first[count]; ++b) {
    int64_t k = 0;
    while (b >= first[k + 1]) ++k;
    const int64_t row = (b - first[k]) * ROWS;
    rows_bf16<ROWS>(w[k] + row * in, x, y[k] + row, in);
  }
  for (int64_t k = 0; k < count; ++k)
    for (int64_t o = (out[k] / ROWS) * ROWS; o < out[k]; ++o) rows_bf16<1>(w[k] + o * in, x, y[k] + o, in);
  return 0;
}

#ifdef SPECONTEXT_TORCH_OPS
#include <atomic>
#include <vector>

#include "torch_op.h"

namespace {

std::atomic<int64_t> op_calls{0};

using specontext_op::ScalarType;
using specontext_op::Tensor;

// specontext::cpu_gemv_bf16's CPU kernel (schema and Python kernel: runtime/cpu_gemv.py): the
// same checks, no Python per call (the Python kernel's dispatch and ctypes cost ~13 us a call,
// 121 calls a step of SmolLM2).
std::vector<Tensor> gemv_op(Tensor input, std::vector<Tensor> weights) {
  constexpr int64_t MAX_WEIGHTS = 16;
  const int64_t count = static_cast<int64_t>(weights.size());
  STD_TORCH_CHECK(input.is_cpu() && input.scalar_type() == ScalarType::BFloat16 && input.dim() == 1 &&
                      input.size(0) > 0 && count >= 1 && count <= MAX_WEIGHTS,
                  "cpu_gemv_bf16 takes a bfloat16 CPU input [in_features >= 1] and 1 to 16 weights; got input ",
                  specontext_op::shape(input), ", ", count, " weights");
  const Tensor x = specontext_op::dense(input);
  const int64_t in = x.size(0);
  const uint16_t* w[MAX_WEIGHTS];
  uint16_t* y[MAX_WEIGHTS];
  int64_t out[MAX_WEIGHTS];
  std::vector<Tensor> outs;
  outs.reserve(count);
  for (int64_t k = 0; k < count; ++k) {
    const Tensor& weight = weights[k];
    STD_TORCH_CHECK(weight.is_cpu() && weight.scalar_type() == ScalarType::BFloat16 && weight.dim() == 2 &&
                        weight.size(1) == in && weight.is_contiguous() && weight.size(0) > 0,
                    "cpu_gemv_bf16 takes contiguous bfloat16 CPU weights [out_features >= 1, in_features=", in,
                    "]; got weight ", specontext_op::shape(weight));
    outs.push_back(torch::stable::new_empty(x, {weight.size(0)}, ScalarType::BFloat16));
    w[k] = static_cast<const uint16_t*>(weight.data_ptr());
    y[k] = static_cast<uint16_t*>(outs.back().data_ptr());
    out[k] = weight.size(0);
  }
  op_calls.fetch_add(1, std::memory_order_relaxed);  // a call the kernel serves
  const int status = specontext_gemv_bf16(w, static_cast<const uint16_t*>(x.data_ptr()), y, out, count, in);
  STD_TORCH_CHECK(status == 0, "cpu_gemv_bf16 rejected its inputs");
  return outs;
}

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(specontext, CPU, m) { m.impl("cpu_gemv_bf16", TORCH_BOX(&gemv_op)); }

// Calls of the operator's C++ kernel in this process (runtime/cpu_kernels.py kernel_calls).
extern "C" int64_t specontext_gemv_bf16_op_calls() { return op_calls.load(std::memory_order_relaxed); }
#endif
