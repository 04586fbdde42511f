// execute: the counting CPU allocator, the memory counters and their scopes (the budget: budget.cpp).
#include "execute/memory.h"

#include <algorithm>
#include <atomic>
#include <mutex>
#include <vector>

#include <sys/mman.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <string>
#include <deque>

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/alignment.h>
#include <c10/core/impl/alloc_cpu.h>
#include <ATen/Parallel.h>

#include "core/check.h"
#include "core/config.h"
#include "core/runtime.h"
#include "execute/device_pool.h"
#include "ir/buffer.h"

namespace lazymem {

void MemoryCounter::charge(size_t n) {
  int64_t bytes = static_cast<int64_t>(n);
  int64_t now = allocated_.fetch_add(bytes, std::memory_order_relaxed) + bytes;
  const int64_t node_now = now + foreign_freed_.load(std::memory_order_relaxed); // (see node_peak)
  int64_t cap = capacity_.load(std::memory_order_relaxed);
  if (countdown_.load(std::memory_order_relaxed) > 0 && countdown_.fetch_sub(1, std::memory_order_relaxed) == 1) {
    allocated_.fetch_sub(bytes, std::memory_order_relaxed);
    injected_.fetch_add(1, std::memory_order_relaxed);
    int64_t q = node_peak_.load(std::memory_order_relaxed);
    while (node_now > q && !node_peak_.compare_exchange_weak(q, node_now)) {}
    TORCH_CHECK_WITH(OutOfMemoryError, false, "lazymem: ", name_, " out of memory (injected by "
                     "torch_lazymem.testing.fail_allocation). Tried to allocate ", format_bytes(bytes), ".");
  }
  const int64_t budget = budget_limit_.load(std::memory_order_relaxed);
  const bool by_budget = budget >= 0 && (cap < 0 || budget < cap);
  if (by_budget) cap = budget;
  if (cap >= 0 && now > cap) {
    allocated_.fetch_sub(bytes, std::memory_order_relaxed);
    // The node peak includes the refused request: what the node tried to hold, for learning.
    int64_t q = node_peak_.load(std::memory_order_relaxed);
    while (node_now > q && !node_peak_.compare_exchange_weak(q, node_now)) {}
    TORCH_CHECK_WITH(OutOfMemoryError, false, "lazymem: ", name_, " out of memory. Tried to allocate ",
                     format_bytes(bytes), "; ", by_budget ? "the plan's memory budget " : "capacity ",
                     format_bytes(cap), ", of which ", format_bytes(now - bytes), " is already allocated.");
  }
  int64_t p = peak_.load(std::memory_order_relaxed);
  while (now > p && !peak_.compare_exchange_weak(p, now)) {}
  p = window_peak_.load(std::memory_order_relaxed);
  while (now > p && !window_peak_.compare_exchange_weak(p, now)) {}
  p = node_peak_.load(std::memory_order_relaxed);
  while (node_now > p && !node_peak_.compare_exchange_weak(p, node_now)) {}
}

void MemoryCounter::release(size_t n) {
  allocated_.fetch_sub(static_cast<int64_t>(n), std::memory_order_relaxed);
  if (node_owner_.load(std::memory_order_relaxed) != std::this_thread::get_id()) {
    foreign_freed_.fetch_add(static_cast<int64_t>(n), std::memory_order_relaxed);
  }
}

MemoryCounter& device_counter() {
  static MemoryCounter* c = new MemoryCounter("the lazymem device");
  return *c;
}

MemoryCounter& host_counter() {
  static MemoryCounter* c = new MemoryCounter("host memory");
  return *c;
}

MemoryCounter& eager_counter() {
  static MemoryCounter* c = new MemoryCounter("memory_cap (eager CPU)");
  return *c;
}

namespace {

thread_local MemoryCounter* t_counter = nullptr;
// The counter intra-op worker threads charge (the scope that runs kernels on their behalf).
std::atomic<MemoryCounter*> g_workers{nullptr};
std::atomic<int64_t> g_worker_allocations{0};

MemoryCounter* counter_for_this_thread() {
  if (MemoryCounter* c = t_counter) return c;
  MemoryCounter* w = g_workers.load(std::memory_order_acquire);
  if (w && (at::in_parallel_region() || c10::ParallelGuard::is_enabled())) {
    g_worker_allocations.fetch_add(1, std::memory_order_relaxed);
    return w;
  }
  return nullptr;
}

// Every block carries a header recording its size and the counter it was charged to, so frees
// are exact on any thread, after any scope has ended. The header keeps the data 64-byte aligned.
struct alignas(c10::gAlignment) Header {
  MemoryCounter* counter;
  size_t nbytes;
  size_t mapped; // guarded block: the bytes mapped for it (0: from the CPU allocator)
  size_t pooled; // a block of the device's pool: its size, header included (0: not pooled)
};
constexpr size_t kHeader = sizeof(Header);


// LAZYMEM_GUARD_FREED=1 (the sanitizer job sets it): every block of the lazymem device is mapped on
// its own pages, filled with 0xFA bytes, and, when freed, made inaccessible and kept out of reuse for
// a while, so a read of freed device memory faults at once wherever it happens — in ATen's kernels
// too, which the sanitizers do not instrument — and a read of memory nothing wrote fails loudly
// instead of reading another buffer's bytes.
bool guard_freed() {
  static const bool on = env_flag("LAZYMEM_GUARD_FREED").value_or(false);
  return on;
}

class Quarantine {
 public:
  void add(void* p, size_t n) {
    mprotect(p, n, PROT_NONE);
    madvise(p, n, MADV_DONTNEED); // the pages go back to the system; the addresses stay reserved
    std::lock_guard<std::mutex> lock(mu_);
    blocks_.emplace_back(p, n);
    if (blocks_.size() > kBlocks) {
      munmap(blocks_.front().first, blocks_.front().second);
      blocks_.pop_front();
    }
  }

 private:
  static constexpr size_t kBlocks = 16384; // well under vm.max_map_count
  std::mutex mu_;
  std::deque<std::pair<void*, size_t>> blocks_;
};

Quarantine& quarantine() {
  static Quarantine* q = new Quarantine();
  return *q;
}

void* guarded_alloc(size_t n, size_t* mapped) {
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  *mapped = (n + kHeader + page - 1) / page * page;
  void* p = mmap(nullptr, *mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  TORCH_CHECK(p != MAP_FAILED, "lazymem: mmap of ", *mapped, " bytes failed");
  // Fresh memory is not zeros: a kernel that reads a block nothing wrote (a value dropped and
  // allocated again before it was recomputed) sees 0xFA bytes — indices far out of range, floats
  // huge — and fails loudly instead of reading plausible zeros.
  std::memset(p, 0xFA, *mapped);
  return p;
}

void counted_free(void* p) {
  if (!p) return;
  auto* h = reinterpret_cast<Header*>(static_cast<char*>(p) - kHeader);
  if (h->counter) h->counter->release(h->nbytes);
  c10::profiledCPUMemoryReporter().Delete(p);
  if (h->mapped) {
    quarantine().add(h, h->mapped);
    return;
  }
  if (h->pooled && device_pool().put(h, h->pooled)) return;
  c10::free_cpu(h);
}

// A device block from the pool, or from malloc (the pool given back first when malloc has none).
void* device_block(size_t bytes) {
  if (void* h = device_pool().take(bytes)) return h;
  stats().device_pool_misses.fetch_add(1, std::memory_order_relaxed);
  try {
    return c10::alloc_cpu(bytes);
  } catch (const c10::Error&) {
    if (device_pool().empty() == 0) throw;
  }
  return c10::alloc_cpu(bytes);
}

class CountingCPUAllocator final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t n) override {
    MemoryCounter* c = counter_for_this_thread();
    if (c) c->charge(n);
    void* raw = nullptr;
    size_t mapped = 0;
    size_t pooled = 0;
    try {
      const bool device = c && c == &device_counter();
      if (device && guard_freed()) {
        raw = guarded_alloc(n, &mapped);
      } else if (device && n >= DevicePool::kMin && DevicePool::on()) {
        pooled = (n + 511) / 512 * 512 + kHeader; // sizes rounded as CUDA's caching allocator rounds
        raw = device_block(pooled);
      } else {
        raw = c10::alloc_cpu(n + kHeader);
      }
    } catch (const c10::Error&) {
      if (c) c->release(n);
      // The host itself has no room: an out-of-memory error like any other, not a bare RuntimeError.
      TORCH_CHECK_WITH(OutOfMemoryError, false, "lazymem: ", c ? c->name() : "the host", " out of memory. Tried to allocate ",
                       format_bytes(static_cast<int64_t>(n)), " and the host could not provide it",
                       c ? (", with " + format_bytes(c->allocated()) + " already allocated.") : std::string("."));
    }
    auto* h = static_cast<Header*>(raw);
    h->counter = c;
    h->nbytes = n;
    h->mapped = mapped;
    h->pooled = pooled;
    void* p = static_cast<char*>(raw) + kHeader;
    c10::profiledCPUMemoryReporter().New(p, n);
    return {p, p, &counted_free, c10::Device(c10::DeviceType::CPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override {
    return &counted_free;
  }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
};

CountingCPUAllocator g_counting;

} // namespace

Domain storage_domain(const c10::Storage& s) {
  if (!s) return Domain::kUnknown;
  const c10::DataPtr& dp = s.data_ptr();
  if (dp.get_deleter() != &counted_free || !dp.get()) return s.nbytes() == 0 ? Domain::kUnknown : Domain::kHost;
  // The storage's data is the block's start (counted blocks are never handed out at an offset).
  if (dp.get_context() != dp.get()) return Domain::kUnknown;
  const auto* h = reinterpret_cast<const Header*>(static_cast<const char*>(dp.get()) - kHeader);
  return h->counter == &device_counter() ? Domain::kDevice : Domain::kHost;
}

namespace {

std::once_flag g_install_once;
bool g_installed = false;

} // namespace

CountingScope::CountingScope(MemoryCounter* counter, bool workers)
    : prev_(t_counter), prev_workers_(nullptr), workers_(workers && counter) {
  if (counter) install_counting_cpu_allocator();
  t_counter = counter;
  if (workers_) prev_workers_ = g_workers.exchange(counter, std::memory_order_acq_rel);
}

CountingScope::~CountingScope() {
  t_counter = prev_;
  if (workers_) g_workers.store(prev_workers_, std::memory_order_release);
}

int64_t worker_allocations() {
  return g_worker_allocations.load(std::memory_order_relaxed);
}

MemoryCounter* current_counting_scope() {
  return t_counter;
}

namespace {
thread_local std::vector<std::pair<MemoryCounter*, MemoryCounter*>> t_scope_stack;
} // namespace

void push_counting_scope(MemoryCounter* counter) {
  if (counter) install_counting_cpu_allocator();
  t_scope_stack.emplace_back(t_counter, g_workers.load());
  t_counter = counter;
  if (counter) g_workers.store(counter, std::memory_order_release);
}

void pop_counting_scope() {
  if (t_scope_stack.empty()) return;
  t_counter = t_scope_stack.back().first;
  g_workers.store(t_scope_stack.back().second, std::memory_order_release);
  t_scope_stack.pop_back();
}

int64_t device_pool_bytes() {
  return device_pool().held();
}

int64_t empty_device_pool() {
  return device_pool().empty();
}

bool device_pool_enabled() {
  return DevicePool::on() && !guard_freed();
}

void trim_device_pool() {
  device_pool().trim();
}

bool install_counting_cpu_allocator() {
  std::call_once(g_install_once, [] {
    // Priority 1 beats ATen's default registration (0); a higher-priority custom allocator wins
    // and counting is reported as unavailable instead of silently wrong.
    c10::SetCPUAllocator(&g_counting, /*priority=*/1);
  });
  g_installed = c10::GetCPUAllocator() == &g_counting;
  return g_installed;
}

bool counting_cpu_allocator_active() {
  return c10::GetCPUAllocator() == &g_counting;
}

} // namespace lazymem
