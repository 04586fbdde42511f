// execute: byte-exact memory accounting. A MemoryCounter is one "device": bytes allocated, peak
// and an optional capacity past which allocation raises torch.OutOfMemoryError, as CUDA does.
// On the CPU backing device every allocation made on a thread inside a CountingScope is charged
// to that scope's counter by a wrapper around the CPU allocator (installed on first use). The
// lazymem device counter is what torch.lazymem.memory_allocated() reports; the eager counter backs
// torch_lazymem.testing.memory_cap() so eager PyTorch can be run under the same capacity.
#pragma once

#include <atomic>
#include <cstdint>
#include <string>

#include <c10/core/Storage.h>

namespace lazymem {

class MemoryCounter {
 public:
  explicit MemoryCounter(const char* name) : name_(name) {}
  // Charges n bytes; throws c10::OutOfMemoryError (torch.OutOfMemoryError) past the capacity.
  void charge(size_t n);
  void release(size_t n);
  int64_t allocated() const { return allocated_.load(std::memory_order_relaxed); }
  int64_t peak() const { return peak_.load(std::memory_order_relaxed); }
  int64_t window_peak() const { return window_peak_.load(std::memory_order_relaxed); }
  int64_t capacity() const { return capacity_.load(std::memory_order_relaxed); }
  void set_capacity(int64_t bytes) { capacity_.store(bytes); } // -1 = unlimited
  void reset_peak() { peak_.store(allocated()); }
  void reset_window_peak() { window_peak_.store(allocated()); }
  // The peak since the last reset_node_peak(): the executor measures each node's transient bytes.
  // A refused allocation counts (allocated + its size): what the node tried to hold.
  int64_t node_peak() const { return node_peak_.load(std::memory_order_relaxed); }
  void reset_node_peak() { node_peak_.store(allocated(), std::memory_order_relaxed); }
  const char* name() const { return name_; }
  // Fault injection (torch_lazymem.testing.fail_allocation): the n-th allocation charged after
  // start_injection() raises torch.OutOfMemoryError as if past the capacity; n = 0 disarms.
  void arm_failure(int64_t n) { armed_.store(n, std::memory_order_relaxed); }
  void start_injection() { countdown_.store(armed_.exchange(0, std::memory_order_relaxed), std::memory_order_relaxed); }
  void stop_injection() { countdown_.store(0, std::memory_order_relaxed); }
  int64_t injected() const { return injected_.load(std::memory_order_relaxed); }

 private:
  const char* name_;
  std::atomic<int64_t> allocated_{0};
  std::atomic<int64_t> peak_{0};
  std::atomic<int64_t> window_peak_{0};
  std::atomic<int64_t> node_peak_{0};
  std::atomic<int64_t> capacity_{-1};
  std::atomic<int64_t> armed_{0};
  std::atomic<int64_t> countdown_{0};
  std::atomic<int64_t> injected_{0}; // failures injected so far
};

MemoryCounter& device_counter(); // lazymem's backing device (the simulated GPU)
MemoryCounter& eager_counter();  // memory_cap() for plain eager code
// Host memory lazymem holds for the device (values assembled or kept there, random streams, the
// undo log): uncapped, counted so the two memories are told apart (storage_domain).
MemoryCounter& host_counter();

// Which memory a storage is in, on the CPU backing (the simulated device): the device's (allocated
// by the counting allocator charged to the device counter), the host's (anything else: lazymem's
// host memory, the user's tensors), or unknown (counting is off: the two cannot be told apart).
enum class Domain : uint8_t { kDevice, kHost, kUnknown };
Domain storage_domain(const c10::Storage& s);

// While alive, CPU allocations on this thread are charged to `counter` (nullptr: none), and so are
// allocations made by intra-op worker threads (at::parallel_for) on its behalf: workers inside a
// parallel region with no scope of their own charge the innermost live scope that asked for them
// (`workers`). Kernels such as slow_conv2d's backward allocate per-thread buffers there.
class CountingScope {
 public:
  explicit CountingScope(MemoryCounter* counter, bool workers = false);
  ~CountingScope();
  CountingScope(const CountingScope&) = delete;
  CountingScope& operator=(const CountingScope&) = delete;

 private:
  MemoryCounter* prev_;
  MemoryCounter* prev_workers_;
  bool workers_;
};

MemoryCounter* current_counting_scope();
// Non-RAII form for Python context managers: push charges this thread's allocations to `counter`
// until the matching pop.
void push_counting_scope(MemoryCounter* counter);
void pop_counting_scope();
// Allocations charged from worker threads of a parallel region since the process started.
int64_t worker_allocations();
// Bytes lazymem may hold on the backing device, resident values included: the user's budget
// (torch_lazymem.set_memory_budget / LAZYMEM_MEMORY_BUDGET), capped by the simulated device's
// capacity; by default the capacity, or the device's free memory plus what lazymem already holds,
// minus a margin (CUDA: the caching allocator's memory info; CPU: the host's available memory).
int64_t memory_budget();
// Installs the counting CPU allocator; idempotent. Returns false (and leaves counting off) if
// another allocator with a higher priority owns the CPU slot.
bool install_counting_cpu_allocator();
bool counting_cpu_allocator_active();

} // namespace lazymem
