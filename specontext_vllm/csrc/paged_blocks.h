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
// Blocks are scattered over the cache: a block's keys are requested while the block this many
// before it is read (one_block's `ahead`).
constexpr int64_t kBlocksAhead = 2;

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

// `ahead`: a block read later (or null); its key rows are requested (prefetch locality hint 1)
// one row per row read here, so that the requests are spread over the arithmetic instead of issued in a burst
// (a burst of a block's 64-128 requests fills the core's miss queue and stalls it).
template <typename T, int64_t BS, int64_t NG>
void transposed_tile(const T* keys, const float* q, float* out, int64_t d, int64_t out_stride, const T* ahead) {
  float acc[NG][BS] = {};
  for (int64_t j = 0; j < d; ++j) {
    if (ahead)
      for (int64_t b = 0; b < BS * static_cast<int64_t>(sizeof(T)); b += 64)
        __builtin_prefetch(reinterpret_cast<const char*>(ahead + j * BS) + b, 0, 1);
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
void pairs_tile(const uint16_t* keys, const float* q, float* out, int64_t d, int64_t out_stride,
                const uint16_t* ahead) {
  float acc[NG][BS] = {};
  for (int64_t s = 0; s < BS / 16; ++s) {
    const uint16_t* tile = keys + s * 16 * d;
    for (int64_t p = 0; p < d / 2; ++p) {
      if (ahead) __builtin_prefetch(ahead + s * 16 * d + p * 32, 0, 1);  // the same 64 bytes of the later block
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
                 int form, const T* ahead) {
  for (int64_t g0 = 0; g0 < groups; g0 += kGroupTile) {
    const int64_t ng = groups - g0 < kGroupTile ? groups - g0 : kGroupTile;
    const float* qg = q + g0 * d;
    float* o = out + g0 * out_stride;
    const T* later = g0 == 0 ? ahead : nullptr;  // requested once, by the first pass
    if (form == 0) {
      switch (ng) {
        case 1: transposed_tile<T, BS, 1>(keys, qg, o, d, out_stride, later); break;
        case 2: transposed_tile<T, BS, 2>(keys, qg, o, d, out_stride, later); break;
        case 3: transposed_tile<T, BS, 3>(keys, qg, o, d, out_stride, later); break;
        default: transposed_tile<T, BS, 4>(keys, qg, o, d, out_stride, later); break;
      }
    } else {
      const uint16_t* tiles = reinterpret_cast<const uint16_t*>(keys);
      const uint16_t* next = reinterpret_cast<const uint16_t*>(later);
      switch (ng) {
        case 1: pairs_tile<BS, 1>(tiles, qg, o, d, out_stride, next); break;
        case 2: pairs_tile<BS, 2>(tiles, qg, o, d, out_stride, next); break;
        case 3: pairs_tile<BS, 3>(tiles, qg, o, d, out_stride, next); break;
        default: pairs_tile<BS, 4>(tiles, qg, o, d, out_stride, next); break;
      }
    }
  }
}

// Requests a block's key area (bs * d elements) at once: for the block sizes read by the
// generic loops, which do not spread the requests.
template <typename T>
inline void request_block(const T* keys, int64_t bs, int64_t d) {
  const char* at = reinterpret_cast<const char*>(keys);
  for (int64_t b = 0; b < bs * d * static_cast<int64_t>(sizeof(T)); b += 64) __builtin_prefetch(at + b, 0, 1);
}

// One block's logits; `ahead` (or null): the block to be read some blocks later, requested
// while this one is read.
template <typename T>
void one_block(const T* keys, const float* q, float* out, int64_t groups, int64_t bs, int64_t d,
               int64_t out_stride, int form, const T* ahead = nullptr) {
  if (bs == 32) return fixed_block<T, 32>(keys, q, out, groups, d, out_stride, form, ahead);
  if (bs == 16) return fixed_block<T, 16>(keys, q, out, groups, d, out_stride, form, ahead);
  if (ahead) request_block(ahead, bs, d);
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
