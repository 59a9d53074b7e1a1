// Our CPU kernels as torch operator kernels (torch's stable C ABI, torch >= 2.10): compiled into a
// kernel's library only with -DSPECONTEXT_TORCH_OPS (runtime/cpu_kernels.py builds it so where
// this torch ships the stable headers), the library registers the CPU kernel of an operator
// whose schema runtime/ defines in Python. The compiled step's call then reaches the C++ kernel
// through the dispatcher in about 5 us instead of 40-70 us through a Python kernel (30 calls a
// step per kernel; issue 51). Where the library is built without it, the Python kernel
// (registered for CompositeExplicitAutograd) serves the operator: the same C++ arithmetic through
// ctypes.
//
// The checks here guard memory (a std::runtime_error naming the argument, never a read out of
// bounds); the Python entry points check the same with ValueErrors, and the step's traced bodies
// check the example values once, while the step is traced (runtime/aten_step.py
// _dense_store_attention, runtime/cpu_refine.py refine_attend).
#pragma once
#ifdef SPECONTEXT_TORCH_OPS
#include "cpu_common.h"
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>

#include <atomic>
#include <cstdint>
#include <optional>
#include <string>

namespace specontext_op {

using torch::stable::Tensor;
using torch::headeronly::ScalarType;

inline bool store_dtype(const Tensor& t) {
  return t.scalar_type() == ScalarType::Float || t.scalar_type() == ScalarType::BFloat16 ||
         t.scalar_type() == ScalarType::Half;
}

// fn(element) with the kernels' element type of a store dtype: float, uint16_t (bfloat16's bits)
// or specontext_cpu::half_t (float16's bits); callers checked store_dtype.
template <typename Fn>
inline int with_store_element(ScalarType dtype, Fn&& fn) {
  if (dtype == ScalarType::BFloat16) return fn(uint16_t{});
  if (dtype == ScalarType::Half) return fn(specontext_cpu::half_t{});
  return fn(float{});
}

inline Tensor dense(const Tensor& t) { return t.is_contiguous() ? t : torch::stable::contiguous(t); }

inline const void* pointer(const std::optional<Tensor>& t) { return t.has_value() ? t->data_ptr() : nullptr; }

// "[2, 3, 300, 64]" (for the errors: what was given)
inline std::string shape(const Tensor& t) {
  std::string out = "[";
  for (int64_t i = 0; i < t.dim(); ++i) out += (i ? ", " : "") + std::to_string(t.size(i));
  return out + "]";
}

// What runtime/cpu_kernels.py check_inputs checks: query float32 [B, H, 1, D]; key and value
// stores [B, KV, C, D] of one dtype (float32, bfloat16 or float16), H a multiple of KV with at most
// max_group heads per KV head, D <= max_dim; length int64 [1 or B]; visible bool [1 or B, C].
inline void check_store_inputs(const char* op, const Tensor& query, const Tensor& keys, const Tensor& values,
                               const Tensor& length, const std::optional<Tensor>& visible, int64_t max_group,
                               int64_t max_dim) {
  auto given = [&] {  // built only when a check fails (the message arguments are evaluated then)
    return std::string(" (got query ") + shape(query) + ", key_cache " + shape(keys) + ", value_cache " +
           shape(values) + ", length " + shape(length) +
           (visible.has_value() ? ", visible " + shape(*visible) : std::string()) + ")";
  };
  STD_TORCH_CHECK(query.is_cpu() && keys.is_cpu() && values.is_cpu() && length.is_cpu(), op,
                  ": query, key_cache, value_cache and length must be CPU tensors");
  STD_TORCH_CHECK(query.dim() == 4 && query.scalar_type() == ScalarType::Float, op,
                  ": query must be a 4-d float32 CPU tensor", given());
  STD_TORCH_CHECK(keys.dim() == 4 && values.dim() == 4 && store_dtype(keys) && keys.scalar_type() == values.scalar_type(),
                  op, ": key_cache and value_cache must be 4-d float32, bfloat16 or float16 CPU tensors of one dtype", given());
  const int64_t b = query.size(0), heads = query.size(1), d = query.size(3);
  const int64_t kv = keys.size(1), capacity = keys.size(2);
  for (int64_t i = 0; i < 4; ++i)
    STD_TORCH_CHECK(values.size(i) == keys.size(i), op, ": value_cache must have the key store's shape", given());
  STD_TORCH_CHECK(keys.size(0) == b && keys.size(3) == d && kv > 0 && heads % kv == 0, op,
                  ": keys must have the query's batch and head_dim, and a number of KV heads dividing its heads", given());
  STD_TORCH_CHECK(query.size(2) == 1 && heads / kv <= max_group && d <= max_dim, op, ": takes one query row, at most ",
                  max_group, " query heads per KV head and head_dim <= ", max_dim, given());
  STD_TORCH_CHECK(length.scalar_type() == ScalarType::Long && (length.numel() == 1 || length.numel() == b), op,
                  ": length must be int64 with 1 or batch entries", given());
  if (visible.has_value()) {
    const Tensor& v = *visible;
    STD_TORCH_CHECK(v.is_cpu() && v.scalar_type() == ScalarType::Bool && v.dim() >= 1 && v.size(v.dim() - 1) == capacity &&
                        (v.numel() == capacity || v.numel() == b * capacity),
                    op, ": visible must be a bool CPU tensor [1 or batch, capacity]", given());
  }
}

// The visible mask's row stride: capacity where it has a row per batch row, 0 where one row serves all.
inline int64_t visible_stride(const std::optional<Tensor>& visible, int64_t capacity) {
  return visible.has_value() && visible->numel() > capacity ? capacity : 0;
}

}  // namespace specontext_op
#endif
