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
  const char* name() const { return name_; }

 private:
  const char* name_;
  std::atomic<int64_t> allocated_{0};
  std::atomic<int64_t> peak_{0};
  std::atomic<int64_t> window_peak_{0};
  std::atomic<int64_t> capacity_{-1};
};

MemoryCounter& device_counter(); // lazymem's backing device (the simulated GPU)
MemoryCounter& eager_counter();  // memory_cap() for plain eager code

// While alive, CPU allocations on this thread are charged to `counter` (nullptr: none).
class CountingScope {
 public:
  explicit CountingScope(MemoryCounter* counter);
  ~CountingScope();
  CountingScope(const CountingScope&) = delete;
  CountingScope& operator=(const CountingScope&) = delete;

 private:
  MemoryCounter* prev_;
};

MemoryCounter* current_counting_scope();
// Non-RAII form for Python context managers: push charges this thread's allocations to `counter`
// until the matching pop.
void push_counting_scope(MemoryCounter* counter);
void pop_counting_scope();
// Installs the counting CPU allocator; idempotent. Returns false (and leaves counting off) if
// another allocator with a higher priority owns the CPU slot.
bool install_counting_cpu_allocator();
bool counting_cpu_allocator_active();

} // namespace lazymem
