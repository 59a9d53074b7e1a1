// Reading vLLM's paged CPU KV blocks in their own packing (specontext_vllm/layout.py): one
// block's key logits for a KV head's query heads. Shared by the plugin's kernels
// (paged_key_logits.cpp, paged_refine_attention.cpp).
//
// A block's key area: [bs * d] elements in one of two forms: 0 = transposed (key j of token t at
// j * bs + t: vLLM's vector path), 1 = AMX bf16 tiles (16-token tiles of [d / 2][16][2] pairs).
// Its value area follows it: 0 = rows (value j of token t at t * d + j), 1 = AMX bf16 tiles
// (16-dimension tiles of [bs / 2][16][2] token pairs).
#pragma once

#include <cstdint>
#include <cstring>

namespace specontext_paged {

constexpr int64_t kMaxBlock = 128;

inline float widen(uint16_t x) {
  uint32_t bits = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

template <typename T>
inline float load(const T* p) { return static_cast<float>(*p); }
template <>
inline float load<uint16_t>(const uint16_t* p) { return widen(*p); }

template <typename T>
void transposed_block(const T* keys, const float* q, float* out, int64_t groups, int64_t bs, int64_t d,
                      int64_t out_stride) {
  for (int64_t g = 0; g < groups; ++g) {
    float acc[kMaxBlock] = {0.f};
    const float* qg = q + g * d;
    for (int64_t j = 0; j < d; ++j) {
      const float qj = qg[j];
      const T* row = keys + j * bs;
#pragma omp simd
      for (int64_t t = 0; t < bs; ++t) acc[t] += qj * load(row + t);
    }
    std::memcpy(out + g * out_stride, acc, bs * sizeof(float));
  }
}

inline void tiled_block(const uint16_t* keys, const float* q, float* out, int64_t groups, int64_t bs, int64_t d,
                 int64_t out_stride) {
  for (int64_t g = 0; g < groups; ++g) {
    float acc[kMaxBlock] = {0.f};
    const float* qg = q + g * d;
    for (int64_t s = 0; s < bs / 16; ++s) {
      const uint16_t* tile = keys + s * 16 * d;
      for (int64_t p = 0; p < d / 2; ++p) {
        const float q0 = qg[2 * p], q1 = qg[2 * p + 1];
        const uint16_t* pairs = tile + p * 32;
#pragma omp simd
        for (int64_t i = 0; i < 16; ++i)
          acc[s * 16 + i] += q0 * widen(pairs[2 * i]) + q1 * widen(pairs[2 * i + 1]);
      }
    }
    std::memcpy(out + g * out_stride, acc, bs * sizeof(float));
  }
}

// The same two forms with the block size and the query heads per pass (up to kGroupTile)
// compile-time constants: every key row (or pair of rows) is loaded and widened once for all
// of them. In the plugin's bf16 step this took the selection's logits from 25.4 to 18.4 ms a
// step (8 rows x 7680 tokens x 8 layers, scratch timing); fp32 did not move (~27 ms for the
// 377 MB of fp32 keys those layers hold: 14 GB/s, bound by the bytes, not this arithmetic).
constexpr int64_t kGroupTile = 4;

template <typename T, int64_t BS, int64_t NG>
void transposed_tile(const T* keys, const float* q, float* out, int64_t d, int64_t out_stride) {
  float acc[NG][BS] = {};
  for (int64_t j = 0; j < d; ++j) {
    float k[BS];
    const T* row = keys + j * BS;
#pragma omp simd
    for (int64_t t = 0; t < BS; ++t) k[t] = load(row + t);
    for (int64_t g = 0; g < NG; ++g) {
      const float qj = q[g * d + j];
#pragma omp simd
      for (int64_t t = 0; t < BS; ++t) acc[g][t] += qj * k[t];
    }
  }
  for (int64_t g = 0; g < NG; ++g) std::memcpy(out + g * out_stride, acc[g], BS * sizeof(float));
}

template <int64_t BS, int64_t NG>
void pairs_tile(const uint16_t* keys, const float* q, float* out, int64_t d, int64_t out_stride) {
  float acc[NG][BS] = {};
  for (int64_t s = 0; s < BS / 16; ++s) {
    const uint16_t* tile = keys + s * 16 * d;
    for (int64_t p = 0; p < d / 2; ++p) {
      const uint16_t* pairs = tile + p * 32;
      float k0[16], k1[16];
#pragma omp simd
      for (int64_t i = 0; i < 16; ++i) {
        k0[i] = widen(pairs[2 * i]);
        k1[i] = widen(pairs[2 * i + 1]);
      }
      for (int64_t g = 0; g < NG; ++g) {
        const float q0 = q[g * d + 2 * p], q1 = q[g * d + 2 * p + 1];
#pragma omp simd
        for (int64_t i = 0; i < 16; ++i) acc[g][s * 16 + i] += q0 * k0[i] + q1 * k1[i];
      }
    }
  }
  for (int64_t g = 0; g < NG; ++g) std::memcpy(out + g * out_stride, acc[g], BS * sizeof(float));
}

// Up to kGroupTile query heads at a time, each count a compile-time constant.
template <typename T, int64_t BS>
void fixed_block(const T* keys, const float* q, float* out, int64_t groups, int64_t d, int64_t out_stride,
                 int form) {
  for (int64_t g0 = 0; g0 < groups; g0 += kGroupTile) {
    const int64_t ng = groups - g0 < kGroupTile ? groups - g0 : kGroupTile;
    const float* qg = q + g0 * d;
    float* o = out + g0 * out_stride;
    if (form == 0) {
      switch (ng) {
        case 1: transposed_tile<T, BS, 1>(keys, qg, o, d, out_stride); break;
        case 2: transposed_tile<T, BS, 2>(keys, qg, o, d, out_stride); break;
        case 3: transposed_tile<T, BS, 3>(keys, qg, o, d, out_stride); break;
        default: transposed_tile<T, BS, 4>(keys, qg, o, d, out_stride); break;
      }
    } else {
      const uint16_t* tiles = reinterpret_cast<const uint16_t*>(keys);
      switch (ng) {
        case 1: pairs_tile<BS, 1>(tiles, qg, o, d, out_stride); break;
        case 2: pairs_tile<BS, 2>(tiles, qg, o, d, out_stride); break;
        case 3: pairs_tile<BS, 3>(tiles, qg, o, d, out_stride); break;
        default: pairs_tile<BS, 4>(tiles, qg, o, d, out_stride); break;
      }
    }
  }
}

template <typename T>
void one_block(const T* keys, const float* q, float* out, int64_t groups, int64_t bs, int64_t d,
               int64_t out_stride, int form) {
  if (bs == 32) return fixed_block<T, 32>(keys, q, out, groups, d, out_stride, form);
  if (bs == 16) return fixed_block<T, 16>(keys, q, out, groups, d, out_stride, form);
  if (form == 0) return transposed_block(keys, q, out, groups, bs, d, out_stride);
  tiled_block(reinterpret_cast<const uint16_t*>(keys), q, out, groups, bs, d, out_stride);
}

// Element j of token t's value in a block's value area of form `form` (see above).
template <typename T>
inline float value_at(const T* area, int64_t t, int64_t j, int64_t bs, int64_t d, int form) {
  if (form == 0) return load(area + t * d + j);
  return load(area + (j / 16) * bs * 16 + (t / 2) * 32 + (j % 16) * 2 + t % 2);
}

}  // namespace specontext_paged
