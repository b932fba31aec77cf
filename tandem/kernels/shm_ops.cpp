// Synchronisation of tensor-parallel ranks on one host through shared memory
// (tandem/runner/shm_group.py): each rank publishes a counter in a shared segment; a
// rank writes its data, then posts its counter (a full fence, then a release store);
// a waiter reads the counters with acquire loads until every one has reached the
// value, then fences again before it reads the data. shm_all_reduce does a float32
// all-reduce's copy, post, wait and sum in one call; other dtypes are copied and summed
// by torch on the segment's tensors.

#include <atomic>
#include <chrono>
#include <thread>

// counters[index * stride] = value, after every store before it is visible.
void shm_post(torch::Tensor counters, int64_t index, int64_t value) {
  TORCH_CHECK(counters.scalar_type() == torch::kLong && counters.is_contiguous());
  std::atomic_thread_fence(std::memory_order_seq_cst);
  __atomic_store_n(counters.data_ptr<int64_t>() + index, value, __ATOMIC_RELEASE);
}

namespace shm {

// Whether counters[i * stride] >= value for every i < count, spinning at most spin_us
// microseconds (the caller checks that its peers are alive between calls; 0: looking
// once). Called without the GIL.
bool wait(const torch::Tensor& counters, int64_t stride, int64_t count, int64_t value,
          int64_t spin_us) {
  TORCH_CHECK(counters.scalar_type() == torch::kLong && counters.is_contiguous());
  TORCH_CHECK(count * stride <= counters.numel());
  const int64_t* base = counters.data_ptr<int64_t>();
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::microseconds(spin_us);
  for (int64_t round = 0;; ++round) {
    bool all = true;
    for (int64_t i = 0; i < count && all; ++i)
      all = __atomic_load_n(base + i * stride, __ATOMIC_ACQUIRE) >= value;
    if (all) {
      std::atomic_thread_fence(std::memory_order_seq_cst);
      return true;
    }
    if (spin_us <= 0) return false;
    if ((round & 63) == 63) {
      if (std::chrono::steady_clock::now() > deadline) return false;
      if (round > (1 << 16)) std::this_thread::yield();  // a long wait: let others run
    }
#if defined(__x86_64__) || defined(__i386__)
    _mm_pause();
#endif
  }
}

// One piece of a float32 all-reduce: ``data`` (n values) into this rank's slot of
// ``slots`` ([ranks, n], rows apart by their stride: the segment's current buffer),
// posted as collective ``value``; once every rank's counter has reached it (within
// spin_us), the slots are summed in rank order into ``data`` (every rank the same
// bits) and true is returned. false: the wait ran out; the caller checks that its
// peers are alive and calls again with post=false (no copy, no post: wait, then sum).
// Called without the GIL (shm_all_reduce below, decode_stack.cpp's ranked stack).
bool all_reduce(const torch::Tensor& data, const torch::Tensor& slots,
                const torch::Tensor& counters, int64_t stride, int64_t rank, int64_t value,
                int64_t spin_us, bool post) {
  TORCH_CHECK(data.scalar_type() == torch::kFloat && data.is_contiguous());
  TORCH_CHECK(slots.scalar_type() == torch::kFloat && slots.dim() == 2 && slots.stride(1) == 1);
  const int64_t ranks = slots.size(0), n = data.numel(), row = slots.stride(0);
  TORCH_CHECK(slots.size(1) == n && 0 <= rank && rank < ranks);
  float* out = data.data_ptr<float>();
  float* base = slots.data_ptr<float>();
  if (post) {
    std::memcpy(base + rank * row, out, n * sizeof(float));
    shm_post(counters, rank * stride, value);
  }
  if (!wait(counters, stride, ranks, value, spin_us)) return false;
  for (int64_t i = 0; i < n; ++i) {
    float sum = base[i];
    for (int64_t r = 1; r < ranks; ++r) sum += base[r * row + i];
    out[i] = sum;
  }
  return true;
}

}  // namespace shm

// shm::wait for Python, the GIL released while it spins: the engine process has other
// threads.
bool shm_wait(torch::Tensor counters, int64_t stride, int64_t count, int64_t value,
              int64_t spin_us) {
  pybind11::gil_scoped_release released;
  return shm::wait(counters, stride, count, value, spin_us);
}

// shm::all_reduce for Python (ShmGroup.all_reduce): a token's all-reduce in one call,
// no Python between its copy and its sum.
bool shm_all_reduce(torch::Tensor data, torch::Tensor slots, torch::Tensor counters,
                    int64_t stride, int64_t rank, int64_t value, int64_t spin_us, bool post) {
  pybind11::gil_scoped_release released;
  return shm::all_reduce(data, slots, counters, stride, rank, value, spin_us, post);
}
