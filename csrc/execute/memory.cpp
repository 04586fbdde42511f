// execute: counting CPU allocator and memory counters.
#include "execute/memory.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
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
#include "core/cuda_backend.h"
#include "core/runtime.h"
#include "core/version.h"
#include "execute/device_pool.h"
#include "execute/graphs.h"
#include "ir/buffer.h"
#if LAZYMEM_TORCH_AT_LEAST(2, 9)
#include <c10/core/CachingDeviceAllocator.h>
#endif

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

namespace {

// The host's available memory (MemAvailable: free plus reclaimable caches), read at most every
// 100 ms (a sync point may run thousands of times a second).
int64_t host_available() {
  static std::mutex mu;
  static int64_t cached = -1;
  static std::chrono::steady_clock::time_point at;
  std::lock_guard<std::mutex> lock(mu);
  auto now = std::chrono::steady_clock::now();
  if (cached >= 0 && now - at < std::chrono::milliseconds(100)) return cached;
  int64_t kb = -1;
  if (FILE* f = std::fopen("/proc/meminfo", "r")) {
    char line[256];
    while (std::fgets(line, sizeof(line), f)) {
      long long v = 0;
      if (std::sscanf(line, "MemAvailable: %lld kB", &v) == 1) {
        kb = v;
        break;
      }
    }
    std::fclose(f);
  }
  cached = kb >= 0 ? kb * 1024 : static_cast<int64_t>(sysconf(_SC_AVPHYS_PAGES)) * sysconf(_SC_PAGE_SIZE);
  at = now;
  return cached;
}

#if LAZYMEM_TORCH_AT_LEAST(2, 9)
c10::CachingDeviceAllocator::DeviceStats device_stats(c10::Device d) {
  return c10::getDeviceAllocator(d.type())->getDeviceStats(d.index());
}
constexpr auto kAllPools = static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE);
#endif

constexpr int kMaxDevices = 64;
std::atomic<double> g_fraction[kMaxDevices];

double device_memory_fraction(int64_t index) {
  if (index < 0 || index >= kMaxDevices) return 1.0;
  const double f = g_fraction[index].load(std::memory_order_relaxed);
  return f > 0.0 ? f : 1.0; // 0: never set
}

int64_t with_margin(int64_t total) {
  // Room for allocator rounding and fragmentation, library workspaces and the rest of the process.
  int64_t margin = std::max<int64_t>(int64_t{256} << 20, total / 10);
  return std::max<int64_t>(0, total - margin);
}

} // namespace

bool memory_capped() {
  const c10::Device dev = backing_device();
  return config().memory_budget.load(std::memory_order_relaxed) >= 0 ||
      (!dev.is_cpu() && device_memory_fraction(dev.index()) < 1.0);
}

int64_t memory_budget() {
  const int64_t user = config().memory_budget.load(std::memory_order_relaxed);
  c10::Device dev = backing_device();
  if (dev.is_cpu()) {
    const int64_t cap = device_counter().capacity();
    if (cap >= 0) return user >= 0 ? std::min(user, cap) : cap;
    if (user >= 0) return user;
    return with_margin(host_available() + device_counter().allocated() + device_pool_bytes());
  }
  if (user >= 0) return user;
  init_backing_device();
#if LAZYMEM_TORCH_AT_LEAST(2, 9)
  try {
    auto [free, total] = c10::getDeviceAllocator(dev.type())->getMemoryInfo(dev.index());
    const auto st = device_stats(dev);
    const int64_t allocated = st.allocated_bytes[kAllPools].current;
    // Blocks cached in CUDA graphs' pools serve only their graphs (execute/graphs.h): not free.
    const int64_t cached_free = std::max<int64_t>(
        0, st.reserved_bytes[kAllPools].current - allocated - stats().cuda_graph_pool_bytes.load(std::memory_order_relaxed));
    int64_t can_give = static_cast<int64_t>(free) + cached_free;
    const double fraction = device_memory_fraction(dev.index());
    if (fraction < 1.0) {
      can_give = std::min(can_give, static_cast<int64_t>(fraction * static_cast<double>(total)) - allocated);
    }
    // The margin is for what may allocate on the device beside lazymem's measured values and
    // workspaces: a library's workspace a first kernel makes, another thread's tensors. The
    // allocator's own overhead is plan_target's, and the allocator is capped at the budget.
    const int64_t avail = std::max<int64_t>(0, can_give) + lazymem_device_bytes();
    return std::max<int64_t>(0, avail - std::max<int64_t>(int64_t{64} << 20, avail / 50));
  } catch (const c10::Error&) {
  }
#endif
  return -1; // unknown: plan without a budget (nothing splits unless asked to)
}

bool budget_enforced() {
  if (!backing_device().is_cpu()) return false;
  const int64_t cap = device_counter().capacity();
  const int64_t user = config().memory_budget.load(std::memory_order_relaxed);
  return cap >= 0 && (user < 0 || user >= cap);
}

namespace {
constexpr int64_t kSegmentSlack = int64_t{22} << 20; // one 20 MiB large-pool and one 2 MiB small-pool segment
} // namespace

int64_t plan_target(int64_t budget) {
  if (budget < 0 || backing_device().is_cpu()) return budget;
  return std::max<int64_t>(0, budget - std::max(budget / 7, kSegmentSlack));
}

int64_t whole_plan_target(int64_t budget) {
  if (budget < 0 || backing_device().is_cpu()) return budget;
  return std::max<int64_t>(0, budget - kSegmentSlack);
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

int64_t release_cached_blocks(int64_t headroom) {
  const c10::Device dev = backing_device();
  if (dev.is_cpu()) return 0;
#if LAZYMEM_TORCH_AT_LEAST(2, 9)
  const auto before = device_stats(dev);
  const int64_t cached = before.reserved_bytes[kAllPools].current - before.allocated_bytes[kAllPools].current;
  if (cached <= std::max<int64_t>(headroom, 0)) return 0;
  c10::getDeviceAllocator(dev.type())->emptyCache();
  return before.reserved_bytes[kAllPools].current - device_stats(dev).reserved_bytes[kAllPools].current;
#else
  (void)headroom;
  return 0;
#endif
}

void set_device_memory_fraction(int64_t index, double fraction) {
  LAZYMEM_CHECK_VALUE(index >= 0 && index < kMaxDevices && fraction > 0.0 && fraction <= 1.0,
                      "set_device_memory_fraction: device ", index, ", fraction ", fraction,
                      " (expected a device index below ", kMaxDevices, " and a fraction in (0, 1])");
  g_fraction[index].store(fraction, std::memory_order_relaxed);
}

namespace {
std::atomic<int64_t> g_library_bytes{0};

int64_t allocated_on(c10::Device dev) {
#if LAZYMEM_TORCH_AT_LEAST(2, 9)
  return device_stats(dev).allocated_bytes[kAllPools].current;
#else
  (void)dev;
  return resident_bytes();
#endif
}
} // namespace

int64_t reserved_on(c10::Device dev) {
#if LAZYMEM_TORCH_AT_LEAST(2, 9)
  return dev.is_cpu() ? 0 : device_stats(dev).reserved_bytes[kAllPools].current;
#else
  (void)dev;
  return 0;
#endif
}

int64_t library_bytes() {
  const int64_t lib = g_library_bytes.load(std::memory_order_relaxed);
  if (lib <= 0) return 0;
  // Never more than what the device holds beyond lazymem's values now: workspaces freed since (the
  // user's torch._C._cuda_clearCublasWorkspaces()) are no longer lazymem's. (Graphs' pools count in
  // that bound: their cache's lock may be held by the caller, an execution replaying them.)
  try {
    return std::clamp<int64_t>(lib, 0, std::max<int64_t>(0, allocated_on(backing_device()) - resident_bytes()));
  } catch (const c10::Error&) {
    return lib;
  }
}

int64_t lazymem_device_bytes() {
  return resident_bytes() + library_bytes();
}

namespace {
// The fraction that holds the process to `budget` with `others` bytes of its own (0: the user's cap
// is the tighter one, or none can be set).
double capped_fraction(c10::Device dev, int64_t budget, int64_t others) {
  if (budget < 0 || !flush_hooks().set_allocator_fraction) return 0.0;
#if LAZYMEM_TORCH_AT_LEAST(2, 9)
  const int64_t total = static_cast<int64_t>(c10::getDeviceAllocator(dev.type())->getMemoryInfo(dev.index()).second);
  if (total <= 0) return 0.0;
  const double fraction = static_cast<double>(std::max<int64_t>(0, others) + budget) / static_cast<double>(total);
  return fraction < device_memory_fraction(dev.index()) ? fraction : 0.0;
#else
  (void)dev;
  (void)others;
  return 0.0;
#endif
}
} // namespace

double cap_allocator(int64_t budget) {
  const c10::Device dev = backing_device();
  if (dev.is_cpu()) return 0.0;
  try {
    const double fraction =
        capped_fraction(dev, budget, allocated_on(dev) - resident_bytes() - library_bytes());
    if (fraction <= 0.0) return 0.0;
    flush_hooks().set_allocator_fraction(dev, fraction);
    stats().allocator_caps.fetch_add(1, std::memory_order_relaxed);
    return device_memory_fraction(dev.index());
  } catch (const c10::Error&) {
    return 0.0;
  }
}

void restore_allocator(double fraction) {
  const c10::Device dev = backing_device();
  if (fraction > 0.0 && !dev.is_cpu()) flush_hooks().set_allocator_fraction(dev, fraction);
}

ScopedAllocatorCap::ScopedAllocatorCap(int64_t budget, bool enforce) {
  const c10::Device dev = backing_device();
  if (dev.is_cpu()) return;
  device_ = dev;
  try {
    const int64_t allocated = allocated_on(dev);
    // Not lazymem's: what the process holds beyond lazymem's values and workspaces (and its graphs').
    unheld_before_ = allocated - resident_bytes() - cuda_graph_unheld_bytes();
    if (!enforce) return;
    const double fraction = capped_fraction(dev, budget, unheld_before_ - library_bytes());
    if (fraction <= 0.0) return;
    flush_hooks().set_allocator_fraction(dev, fraction);
    fraction_ = fraction;
    restore_ = device_memory_fraction(dev.index());
    stats().allocator_caps.fetch_add(1, std::memory_order_relaxed);
  } catch (const c10::Error&) {
  }
}

ScopedAllocatorCap::~ScopedAllocatorCap() {
  if (device_.is_cpu()) return;
  try {
    if (fraction_ > 0.0) flush_hooks().set_allocator_fraction(device_, restore_);
    // What the run left allocated beyond lazymem's values was made by its kernels and kept by their
    // libraries (cuBLAS's workspace per stream, first made by the first matmul): lazymem's from now
    // on. Never more than what lazymem's values leave of the allocated bytes (the user may free
    // theirs meanwhile, and torch may clear the workspaces).
    const int64_t unheld = allocated_on(device_) - resident_bytes() - cuda_graph_unheld_bytes();
    int64_t lib = library_bytes() + std::max<int64_t>(0, unheld - unheld_before_);
    g_library_bytes.store(std::clamp<int64_t>(lib, 0, std::max<int64_t>(0, unheld)), std::memory_order_relaxed);
  } catch (...) {
  }
}

DevicePeakWindow::DevicePeakWindow(c10::Device device) : device_(device) {
  const int64_t resident = lazymem_device_bytes();
  others_ = allocated() - resident;
  peak_before_ = process_peak();
  seen_ = resident;
  base_ = resident;
  traced_ = device.is_cuda() && cuda_backend() != nullptr;
  if (traced_) cuda_backend()->peak_reset(device.index());
}

int64_t DevicePeakWindow::allocated() const {
#if LAZYMEM_TORCH_AT_LEAST(2, 9)
  return device_stats(device_).allocated_bytes[kAllPools].current;
#else
  return resident_bytes();
#endif
}

int64_t DevicePeakWindow::process_peak() const {
#if LAZYMEM_TORCH_AT_LEAST(2, 9)
  return device_stats(device_).allocated_bytes[kAllPools].peak;
#else
  return 0;
#endif
}

void DevicePeakWindow::sample() {
  seen_ = std::max(seen_, allocated() - others_);
}

int64_t DevicePeakWindow::peak() const {
  if (traced_) return std::max(seen_, base_ + cuda_backend()->peak_since_reset());
  const int64_t p = process_peak();
  return p > peak_before_ ? std::max(seen_, p - others_) : seen_;
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
