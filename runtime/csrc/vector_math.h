// What our CPU kernels share (runtime/csrc/*.cpp, built together by runtime/cpu_kernels.py).
#pragma once
#include <cstdint>

namespace specontext {

constexpr int BLOCK = 32;       // slots scored before their values are added
constexpr int MAX_GROUP = 16;   // query heads per KV head
constexpr int MAX_DIM = 256;    // head_dim

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

}  // namespace specontext
