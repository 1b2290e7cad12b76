// Dynamic scheduling for the attention kernels: uneven work items (contexts of different
// lengths, the causal triangle's rows) handed out longest first from an atomic counter,
// so no thread sits idle while another finishes a long item (a static split does that).
#pragma once
#include <ATen/Parallel.h>
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <numeric>
#include <vector>

namespace kvmesh_cpu {

// Runs work(i) for every i in [0, n), longest first by cost(i), over torch's threads.
// make_worker() is called once per thread and returns that thread's `work` (so per-thread
// scratch buffers live in its closure).
template <typename Cost, typename MakeWorker>
void parallel_longest_first(int64_t n, Cost&& cost, MakeWorker&& make_worker) {
  if (n <= 0) return;
  std::vector<int64_t> order(n);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return cost(a) > cost(b); });
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), n), 1, [&](int64_t, int64_t) {
    auto work = make_worker();
    for (int64_t i = next.fetch_add(1); i < n; i = next.fetch_add(1)) work(order[i]);
  });
}

}  // namespace kvmesh_cpu
