// Work shared among the threads from one counter, for the kernels whose pieces differ
// in cost or whose threads differ in speed: quant_ops.cpp's tiles and decode
// attention's (sequence, span, heads) items in cpu_ops.cpp.
//
// at::parallel_for gives each thread an equal share fixed in advance. On a 2-vCPU VM
// the two threads do not run at one speed: in a batch-1 decode step of a 1B model
// (Llama-3.2-1B's shape, Q4_K_M) the second thread waited on the first 16% of its time,
// more than half of it while the first was still in its share of a matrix's tiles. A
// thread that is ahead here takes the next run of the work; runs start long (half of
// what is left divided among the threads) so that each thread's stream of tiles stays
// long for its prefetches, and shrink to ``min_run`` at the end. Which thread computes
// a piece never changes its result: every piece is computed by the same code.
//
// First in the module's one translation unit (tandem/kernels/cpu.py), so that both
// files can use it; a benchmark that builds one of them alone puts it in front too.

#include <ATen/Parallel.h>
#include <algorithm>
#include <atomic>
#include <cstdint>

namespace work {

class SharedRuns {
 public:
  SharedRuns(int64_t count, int64_t min_run, int64_t threads)
      : count_(count), min_run_(std::max<int64_t>(1, min_run)), threads_(threads) {}

  // The next run [begin, end) of [0, count); false when none is left.
  bool next(int64_t& begin, int64_t& end) {
    int64_t first = next_.load(std::memory_order_relaxed), run;
    do {
      if (first >= count_) return false;
      run = std::max(min_run_, (count_ - first) / (2 * threads_));
    } while (!next_.compare_exchange_weak(first, first + run, std::memory_order_relaxed));
    begin = first;
    end = std::min(count_, first + run);
    return true;
  }

 private:
  const int64_t count_, min_run_, threads_;
  std::atomic<int64_t> next_{0};
};

// Calls body(runs) once on each of up to at::get_num_threads() threads (one, inline,
// inside another parallel region); body takes runs from ``runs`` until it is empty.
// Per-thread state (buffers, a tile configuration) goes in body, before its loop.
template <typename Body>
void share(int64_t count, int64_t min_run, const Body& body) {
  if (count <= 0) return;
  const int64_t threads = std::min<int64_t>(count, at::get_num_threads());
  SharedRuns runs(count, min_run, threads);
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) { body(runs); });
}

}  // namespace work
