// Splitting a kernel over std::threads. Threads are started per call (no pool, so no shared
// mutable state between concurrent handlers) and only when the work pays for their start-up.
#pragma once

#include <algorithm>
#include <cfenv>
#include <cstdint>
#include <exception>
#include <initializer_list>
#include <limits>
#include <thread>
#include <vector>

namespace kbit::cpu {

// Below this many "element operations" per thread, starting a thread (~tens of us) costs more
// than it saves.
constexpr int64_t kMinWorkPerThread = int64_t(1) << 20;

// How many threads to use for `work` element operations split into at most `max_parts` parts.
// Work estimates are products of sizes that may not fit in int64: saturating_product caps them.
inline int64_t saturating_product(std::initializer_list<int64_t> factors) {
  constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
  int64_t product = 1;
  for (int64_t f : factors) {
    if (f <= 0) return 0;
    if (product > kMax / f) return kMax;
    product *= f;
  }
  return product;
}

inline int thread_count(int64_t work, int64_t max_parts) {
  const int64_t hardware = std::max<int64_t>(1, std::thread::hardware_concurrency());
  const int64_t by_work = std::max<int64_t>(1, work / kMinWorkPerThread);
  return int(std::max<int64_t>(1, std::min({hardware, by_work, max_parts})));
}

// Splits [0, count) into `parts` contiguous ranges whose bounds are multiples of `grain` (but
// the last) and runs body(begin, end) on each; the calling thread takes the last range. A
// thread that cannot be started has its range run inline, so failures only cost speed.
// Workers take the caller's floating-point environment (XLA's CPU threads flush denormals to
// zero), so a result never depends on which thread computed it. Every started thread is joined
// on every path (a std::thread destroyed while joinable terminates the process); an exception
// from a body, on any thread, is rethrown to the caller after all threads have finished.
template <class Body>
void parallel_ranges(int64_t count, int64_t grain, int parts, const Body& body) {
  const int64_t grains = (count + grain - 1) / grain;
  parts = int(std::max<int64_t>(1, std::min<int64_t>(parts, grains)));
  auto range_begin = [&](int part) { return std::min(count, grain * (grains * part / parts)); };
  std::fenv_t caller_env;
  const bool have_env = std::fegetenv(&caller_env) == 0;
  std::vector<std::exception_ptr> errors(static_cast<size_t>(parts));
  auto run = [&body, &errors](int part, int64_t begin, int64_t end) noexcept {
    try {
      body(begin, end);
    } catch (...) {
      errors[size_t(part)] = std::current_exception();
    }
  };
  struct Joiner {  // joins on scope exit, including when starting a thread or a body throws
    std::vector<std::thread> threads;
    ~Joiner() {
      for (std::thread& thread : threads)
        if (thread.joinable()) thread.join();
    }
  } joiner;
  try { joiner.threads.reserve(size_t(parts - 1)); } catch (...) {}
  for (int part = 0; part < parts - 1; ++part) {
    const int64_t begin = range_begin(part), end = range_begin(part + 1);
    try {
      joiner.threads.emplace_back([&run, &caller_env, have_env, part, begin, end] {
        if (have_env) std::fesetenv(&caller_env);
        run(part, begin, end);
      });
    } catch (...) {
      run(part, begin, end);
    }
  }
  run(parts - 1, range_begin(parts - 1), count);
  for (std::thread& thread : joiner.threads) thread.join();
  for (const std::exception_ptr& error : errors)
    if (error) std::rethrow_exception(error);
}

}  // namespace kbit::cpu
