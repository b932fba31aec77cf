// The read-bandwidth probe (tandem/plan/measure.py's memory_bandwidth_gbs): every byte
// of a tensor read once, across threads, the way the integer-dot kernels stream their
// tiles (each thread one contiguous range, asking for the line kPrefetchBytes ahead),
// so that a decode step's bytes per second are set beside what this machine's threads
// can read at best, not beside what a plain reduction happens to reach (on a 2-vCPU
// Intel Xeon VM torch's sum of 1 GiB read 22.9-23.1 GB/s, this 27.2-27.9).

#include <atomic>

// The xor of data's 64-bit words (returned so that no read can be dropped).
int64_t read_stream(torch::Tensor data) {
  TORCH_CHECK(data.is_contiguous() && data.nbytes() % 64 == 0, "data: contiguous, whole lines");
  const uint64_t* words = static_cast<const uint64_t*>(data.data_ptr());
  const int64_t lines = static_cast<int64_t>(data.nbytes() / 64);
  std::atomic<uint64_t> total{0};
  pybind11::gil_scoped_release released;
  at::parallel_for(0, lines, 1 << 14, [&](int64_t begin, int64_t end) {
    uint64_t acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int64_t line = begin; line < end; ++line) {
      __builtin_prefetch(words + line * 8 + quant::kPrefetchBytes / 8, 0, 2);
      for (int i = 0; i < 8; ++i) acc[i] ^= words[line * 8 + i];
    }
    uint64_t x = 0;
    for (int i = 0; i < 8; ++i) x ^= acc[i];
    total.fetch_xor(x);
  });
  return static_cast<int64_t>(total.load());
}
