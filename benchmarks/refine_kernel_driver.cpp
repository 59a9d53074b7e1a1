// A standalone driver of our refine kernel (runtime/csrc/refine_attention.cpp) for perf: the
// kernel called for 30 layers a "step" with the default options' shapes at 8K (SmolLM2: 3 KV
// heads, 3 query heads each, head_dim 64; 1024 selected candidates and 128 rescued pages of 16
// tokens per KV head, budget 1024, 4 sinks, 64 recent), bfloat16 stores; prints the median
// milliseconds of a step. Where issue 51 found the kernel's barriers (docs/benchmarks.md,
// "How the step got here"):
//
//   g++ -O3 -march=native -fopenmp -fno-math-errno -fno-trapping-math -g -Iruntime/csrc \
//       benchmarks/refine_kernel_driver.cpp -o /tmp/refine_driver
//   OMP_NUM_THREADS=2 /tmp/refine_driver 50            # median (fastest) ms of 50 steps, stores from memory
//   SAME=1 OMP_NUM_THREADS=2 /tmp/refine_driver 50     # one layer's stores 30 times: in cache
//   F32=1 OMP_NUM_THREADS=2 /tmp/refine_driver 50      # float32 stores (the same values widened)
//   VIS=1 ...                                          # with the visibility mask the compiled step passes
//   HUGE=1 ...                                         # the stores on 2 MiB pages (madvise, as torch's THP_MEM_ALLOC_ENABLE=1)
//   JSON=1 ...                                         # a JSON line of the figures too
//   OMP_NUM_THREADS=2 perf record -o /tmp/refine.data /tmp/refine_driver 200 && perf report -i /tmp/refine.data
//
// The kernel's source is included (its symbols are then this program's, which perf names).
#include "../runtime/csrc/refine_attention.cpp"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include <sys/mman.h>

namespace driver {

// HUGE=1: buffers of 2 MiB or more aligned to 2 MiB and madvise(MADV_HUGEPAGE) before the first
// touch (transparent huge pages in "madvise" mode back only memory that asks for them)
template <typename T>
struct HugeAlloc {
  using value_type = T;
  HugeAlloc() = default;
  template <typename U>
  HugeAlloc(const HugeAlloc<U>&) {}
  T* allocate(size_t n) {
    constexpr size_t HUGE_PAGE = size_t(2) << 20;
    const size_t bytes = n * sizeof(T);
    if (std::getenv("HUGE") && bytes >= HUGE_PAGE) {
      const size_t size = (bytes + HUGE_PAGE - 1) & ~(HUGE_PAGE - 1);
      void* ptr = std::aligned_alloc(HUGE_PAGE, size);
      madvise(ptr, size, MADV_HUGEPAGE);
      return static_cast<T*>(ptr);
    }
    return static_cast<T*>(std::malloc(bytes));
  }
  void deallocate(T* ptr, size_t) { std::free(ptr); }
  template <typename U>
  bool operator==(const HugeAlloc<U>&) const { return true; }
  template <typename U>
  bool operator!=(const HugeAlloc<U>&) const { return false; }
};
template <typename T>
using Vec = std::vector<T, HugeAlloc<T>>;

uint16_t to_bf16(float x) {  // truncation: the driver needs bfloat16 values, not torch's rounding
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  return static_cast<uint16_t>(bits >> 16);
}

struct Layer {
  Vec<uint16_t> keys, values, page_min, page_max;  // [KV, C, D], [KV, C, D], [KV, PG, D] x 2
  std::vector<int64_t> candidates;                          // [KV, S]
};

constexpr int LAYERS = 30, KV = 3, G = 3, D = 64, CONTEXT = 8192, C = 8320, S = 1024, BUDGET = 1024, PAGE = 16,
              RESCUE = 128, SINKS = 4, RECENT = 64, PG = C / PAGE;

Layer make_layer(std::mt19937& rng) {
  std::normal_distribution<float> normal;
  Layer l;
  l.keys.resize(size_t(KV) * C * D);
  l.values.resize(size_t(KV) * C * D);
  for (auto& x : l.keys) x = to_bf16(normal(rng));
  for (auto& x : l.values) x = to_bf16(normal(rng));
  l.page_min.resize(size_t(KV) * PG * D);
  l.page_max.resize(size_t(KV) * PG * D);
  for (int h = 0; h < KV; ++h)
    for (int page = 0; page < PG; ++page)
      for (int d = 0; d < D; ++d) {
        float lo = widen(l.keys[(size_t(h) * C + page * PAGE) * D + d]), hi = lo;
        for (int t = 1; t < PAGE; ++t) {
          const float v = widen(l.keys[(size_t(h) * C + page * PAGE + t) * D + d]);
          lo = std::min(lo, v);
          hi = std::max(hi, v);
        }
        l.page_min[(size_t(h) * PG + page) * D + d] = to_bf16(lo);
        l.page_max[(size_t(h) * PG + page) * D + d] = to_bf16(hi);
      }
  for (int h = 0; h < KV; ++h) {  // the sinks, the recent window, sorted random positions between
    std::vector<int64_t> middle(CONTEXT - SINKS - RECENT);
    for (size_t i = 0; i < middle.size(); ++i) middle[i] = SINKS + int64_t(i);
    std::shuffle(middle.begin(), middle.end(), rng);
    std::vector<int64_t> row(middle.begin(), middle.begin() + (S - SINKS - RECENT));
    for (int i = 0; i < SINKS; ++i) row.push_back(i);
    for (int i = CONTEXT - RECENT; i < CONTEXT; ++i) row.push_back(i);
    std::sort(row.begin(), row.end());
    l.candidates.insert(l.candidates.end(), row.begin(), row.end());
  }
  return l;
}

struct Wide {  // a layer's stores as float32
  Vec<float> keys, values, page_min, page_max;
};

Wide widen_layer(const Layer& l) {
  const auto f = [](const Vec<uint16_t>& v) {
    Vec<float> out(v.size());
    for (size_t i = 0; i < v.size(); ++i) out[i] = widen(v[i]);
    return out;
  };
  return Wide{f(l.keys), f(l.values), f(l.page_min), f(l.page_max)};
}

}  // namespace driver

int main(int argc, char** argv) {
  using namespace driver;
  const int steps = argc > 1 ? std::atoi(argv[1]) : 50;
  const bool same = std::getenv("SAME") != nullptr;
  std::mt19937 rng(0);
  std::vector<Layer> layers;
  for (int i = 0; i < (same ? 1 : LAYERS); ++i) layers.push_back(make_layer(rng));
  std::normal_distribution<float> normal;
  std::vector<float> query(KV * G * D), out(KV * G * D);
  for (auto& x : query) x = normal(rng) * 0.125f;
  const int64_t length = CONTEXT;
  // VIS=1: the mask the compiled step passes (Hugging Face's: every written slot visible, the
  // rest of the capacity hidden), where the driver otherwise passes none
  std::vector<uint8_t> mask(C, 0);
  std::fill(mask.begin(), mask.begin() + CONTEXT, uint8_t{1});
  const uint8_t* visible = std::getenv("VIS") ? mask.data() : nullptr;
  const bool f32 = std::getenv("F32") != nullptr;
  std::vector<Wide> wide;
  if (f32)
    for (const Layer& l : layers) wide.push_back(widen_layer(l));
  std::vector<double> ms;
  double checksum = 0;
  for (int step = 0; step < steps; ++step) {
    const auto start = std::chrono::steady_clock::now();
    for (int i = 0; i < LAYERS; ++i) {
      const Layer& l = layers[same ? 0 : i];
      if (f32) {
        const Wide& w = wide[same ? 0 : i];
        specontext_refine_attention(query.data(), w.keys.data(), w.values.data(), l.candidates.data(), &length, 0,
                                    visible, 0, w.page_min.data(), w.page_max.data(), nullptr, nullptr, nullptr,
                                    nullptr, out.data(), 1, KV, G, C, D, S, PG, driver::RESCUE, PAGE, BUDGET, SINKS,
                                    RECENT);
      } else {
        specontext_refine_attention_bf16(query.data(), l.keys.data(), l.values.data(), l.candidates.data(), &length,
                                         0, visible, 0, l.page_min.data(), l.page_max.data(), nullptr, nullptr,
                                         nullptr, nullptr, out.data(), 1, KV, G, C, D, S, PG, driver::RESCUE, PAGE,
                                         BUDGET, SINKS, RECENT);
      }
      checksum += out[0];
    }
    ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count());
  }
  std::sort(ms.begin(), ms.end());
  std::printf("median %.3f ms a step of %d layers, fastest %.3f (checksum %g)\n", ms[ms.size() / 2], LAYERS, ms[0],
              checksum);
  if (std::getenv("JSON"))  // one JSON line more, for the results files
    std::printf("{\"dtype\": \"%s\", \"in_cache\": %s, \"mask\": %s, \"huge_pages\": %s, \"steps\": %d, \"median_ms\": %.4f, "
                "\"fastest_ms\": %.4f}\n",
                f32 ? "float32" : "bfloat16", same ? "true" : "false", visible ? "true" : "false", std::getenv("HUGE") ? "true" : "false", steps,
                ms[ms.size() / 2], ms[0]);
  return 0;
}
