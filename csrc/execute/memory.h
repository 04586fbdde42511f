// execute: byte-exact memory accounting. A MemoryCounter is one "device": bytes allocated, peak
// and an optional capacity past which allocation raises torch.OutOfMemoryError, as CUDA does.
// On the CPU backing device every allocation made on a thread inside a CountingScope is charged
// to that scope's counter by a wrapper around the CPU allocator (installed on first use). The
// lazymem device counter is what torch.lazymem.memory_allocated() reports; the eager counter backs
// torch_lazymem.testing.memory_cap() so eager PyTorch can be run under the same capacity.
#pragma once

#include <c10/core/Device.h>

#include <atomic>
#include <cstdint>
#include <string>
#include <thread>

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
  // A plan's budget while it runs (-1 = none): charges past it raise as past the capacity, so a model
  // that underestimated is caught by the run (and learns) where no allocator enforces the budget.
  void set_budget_limit(int64_t bytes) { budget_limit_.store(bytes, std::memory_order_relaxed); }
  void reset_peak() { peak_.store(allocated()); }
  void reset_window_peak() { window_peak_.store(allocated()); }
  // The peak since the last reset_node_peak(): the executor measures each node's transient bytes.
  // A refused allocation counts (allocated + its size): what the node tried to hold. Frees made by
  // other threads meanwhile (a tensor the recording thread drops while the pipeline's worker runs a
  // node) do not count: the node's view of the device is allocated() plus what they freed
  // (node_allocated()), so they neither lower its peak nor pass for its workspace.
  int64_t node_peak() const { return node_peak_.load(std::memory_order_relaxed); }
  int64_t node_allocated() const { return allocated() + foreign_freed_.load(std::memory_order_relaxed); }
  void reset_node_peak() {
    node_owner_.store(std::this_thread::get_id(), std::memory_order_relaxed);
    foreign_freed_.store(0, std::memory_order_relaxed);
    node_peak_.store(allocated(), std::memory_order_relaxed);
  }
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
  std::atomic<int64_t> foreign_freed_{0};     // since reset_node_peak(), by other threads
  std::atomic<std::thread::id> node_owner_{}; // the thread that called reset_node_peak()
  std::atomic<int64_t> capacity_{-1};
  std::atomic<int64_t> budget_limit_{-1};
  std::atomic<int64_t> armed_{0};
  std::atomic<int64_t> countdown_{0};
  std::atomic<int64_t> injected_{0}; // failures injected so far
};

MemoryCounter& device_counter(); // lazymem's backing device (the simulated GPU)

// The device counter held to a plan's budget for a scope (-1: no limit), then released.
struct ScopedBudgetLimit {
  explicit ScopedBudgetLimit(int64_t bytes) { device_counter().set_budget_limit(bytes); }
  ~ScopedBudgetLimit() { device_counter().set_budget_limit(-1); }
  ScopedBudgetLimit(const ScopedBudgetLimit&) = delete;
  ScopedBudgetLimit& operator=(const ScopedBudgetLimit&) = delete;
};
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
// capacity; by default the capacity, or what the device can still give lazymem plus what lazymem
// already holds, minus a margin: max(256 MiB, 10%) on the CPU, max(64 MiB, 2%) on CUDA, whose
// allocator is capped at the budget while a plan near it runs. On CUDA "can still give" is the caching
// allocator's: the device's free memory plus this process's cached free blocks, capped by the
// per-process memory fraction (fraction x total, less what the process has allocated); on the CPU,
// the host's available memory.
int64_t memory_budget();
// The user capped lazymem's memory: a budget (set_memory_budget), or a per-process memory fraction
// on the backing device.
bool memory_capped();
// Whether an allocator raises out of memory past the budget: the simulated device, when the budget
// is its capacity. Elsewhere (a budget set below the device, a plain CPU backing, CUDA) nothing
// would stop a plan from running over it, so a plan predicted over the budget is refused instead.
bool budget_enforced();
// What a plan may allocate at its peak under `budget` (-1: no budget). On a CUDA-like backing device,
// the budget less max(1/7, 22 MiB): the caching allocator reserves more than it hands out — a block
// of 1 to 10 MiB takes a 20 MiB segment, a smaller one a 2 MiB segment, blocks cached for other sizes
// (tools/gpu_check.py's capped runs reserved up to 1.14x their allocated peak) — and
// torch.cuda.max_memory_reserved() is what must stay within the budget (ScopedAllocatorCap holds it
// there). The CPU's counting allocator has no such overhead. That slack is for split plans, whose
// chunk-sized blocks fragment the cache.
int64_t plan_target(int64_t budget);
// What an unsplit plan may allocate at its peak under `budget`: on a CUDA-like device the budget
// less one 20 MiB and one 2 MiB segment. An unsplit plan allocates as eager would, in eager's order
// (eager's own reserved peak was 2% above its allocated one under a 3 GiB cap), and the capped
// allocator returns cached segments before it would run out (ScopedAllocatorCap); if it does run
// out, the run is planned again split. So a program that fits is never split (issue 30 item 4).
int64_t whole_plan_target(int64_t budget);
// Before a new plan runs on a CUDA-like device: when the caching allocator holds more cached free
// bytes than the plan leaves of its budget (`headroom`), they go back to the device (emptyCache).
// Blocks cached for other shapes (an earlier batch size, another program) would otherwise add to
// what the process reserves while the plan allocates anew. Reused plans find their own blocks cached
// and skip this. Returns the bytes released.
int64_t release_cached_blocks(int64_t headroom);
// The simulated device's pool of freed blocks (memory.cpp, DevicePool): the bytes it holds, reserved
// but not allocated, and giving them all back to the host's malloc (returns the bytes given back).
int64_t device_pool_bytes();
int64_t empty_device_pool();
void trim_device_pool(); // to the device's capacity, after it changed
bool device_pool_enabled(); // off with LAZYMEM_DEVICE_POOL=0 and under LAZYMEM_GUARD_FREED
// The CUDA caching allocator's per-process memory fraction of a device (1.0 = no limit), as the
// Python bindings read it at first use and whenever torch.cuda.set_per_process_memory_fraction
// changes it (the CUDA allocator's own interface is outside the CPU build).
void set_device_memory_fraction(int64_t index, double fraction);
// While a plan runs on a CUDA-like backing device, the caching allocator itself holds the process to
// the budget: its per-process memory fraction is lowered to what the process's other tensors hold
// (allocated, not lazymem's) plus `budget`, and the user's fraction is put back after (it also
// measures library_bytes() around the run). The plan allocates at most plan_target(budget); what the
// allocator reserves beyond that (segments rounded up, blocks split and cached for other sizes) is
// its own fragmentation, and at the cap it first
// returns its cached free segments and only then raises out of memory, which the run meets like any
// other (smaller chunks, a new plan). So torch.cuda.max_memory_reserved() stays within the budget
// on every step, the first one included. Nothing changes on the CPU, without a budget, or when the
// user's own fraction is already the tighter cap. Other threads' CUDA allocations during the run are
// held to the same cap.
class ScopedAllocatorCap {
 public:
  // `enforce` false: only measures (a plan predicted within half the budget leaves the allocator
  // room for its own overhead; setting the fraction is a call into Python, which the pipeline's
  // worker would have to wait for the GIL to make: the pipeline holds the cap for its batches from
  // the recording thread instead, with cap_allocator).
  ScopedAllocatorCap(int64_t budget, bool enforce);
  ~ScopedAllocatorCap();
  ScopedAllocatorCap(const ScopedAllocatorCap&) = delete;
  ScopedAllocatorCap& operator=(const ScopedAllocatorCap&) = delete;

 private:
  c10::Device device_{c10::kCPU};
  int64_t unheld_before_ = 0;
  double fraction_ = 0.0; // the fraction set for the scope (0: none)
  double restore_ = 1.0;
};
// The cap of ScopedAllocatorCap, set and put back by hand (the pipeline holds it across its worker's
// batches): lowers the allocator's fraction to what the process holds beyond lazymem's values and
// workspaces plus `budget`, where that is tighter than the user's. Returns the fraction to restore
// with restore_allocator (0: none was set). A call into Python: the caller may hold no lock that a
// thread holding the GIL could wait for.
double cap_allocator(int64_t budget);
void restore_allocator(double fraction);
// Device bytes lazymem's runs left allocated beyond its values: workspaces its kernels made and their
// libraries keep (cuBLAS's, 32 MiB per handle and stream on an H200: the recording thread's and the
// pipeline worker's on each stream they ran on, the graph capture stream's). Measured around each run
// on a CUDA-like device, and never more than the device holds beyond lazymem's values when asked;
// lazymem's, like its values: in its budget, its cap and its peak. 0 on the CPU. lazymem never frees
// them itself: a CUDA graph (the user's, or lazymem's) keeps the address of the workspace it was
// captured with.
int64_t library_bytes();
// Device bytes the caching allocator has reserved on `dev` (0 on the CPU).
int64_t reserved_on(c10::Device dev);
// What lazymem holds on a CUDA-like backing device: its values (resident_bytes()) and library_bytes().
int64_t lazymem_device_bytes();
// lazymem's peak bytes on a CUDA-like backing device during one execution, resident values included,
// from the caching allocator (lazymem's own allocations and its kernels' go through it). Exact with the
// CUDA backend (core/cuda_backend.h): the allocator's trace of every allocation and free since the
// window opened. Without it, from the allocator's statistics: exact when the execution sets the
// process's peak, else the largest value sampled — at node boundaries where the plan comes over half
// its budget, at its start and end otherwise (an earlier, larger step of the process hid the peak of
// a smaller one: gpu_check's float64 split took such a peak for its budget). Other threads'
// allocations meanwhile count as lazymem's. The allocator's peak is never reset (the user's
// max_memory_allocated() stays theirs).
class DevicePeakWindow {
 public:
  explicit DevicePeakWindow(c10::Device device);
  void sample(); // after a node
  int64_t peak() const;
  bool traced() const {
    return traced_;
  }

 private:
  int64_t allocated() const;
  int64_t process_peak() const;
  c10::Device device_;
  int64_t others_ = 0;     // bytes allocated by the rest of the process when the window opened
  int64_t peak_before_ = 0; // the process's peak then
  int64_t seen_ = 0;        // the largest sample, as lazymem's bytes
  int64_t base_ = 0;        // lazymem's bytes when the window opened
  bool traced_ = false;     // the CUDA backend traces allocations
};

// Installs the counting CPU allocator; idempotent. Returns false (and leaves counting off) if
// another allocator with a higher priority owns the CPU slot.
bool install_counting_cpu_allocator();
bool counting_cpu_allocator_active();

} // namespace lazymem
