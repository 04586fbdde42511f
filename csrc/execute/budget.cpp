// execute: the memory budget and the device allocator's view of it — the budget lazymem plans to
// (the user's cap, the host's or the device's memory), the slack a CUDA caching allocator needs, the
// allocator fraction that holds the process to the budget while a plan runs, the bytes the kernels'
// libraries keep, and the device's peak over a run. The counting allocator and its counters are
// memory.cpp's.
#include "execute/memory.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <string>

#include <unistd.h>

#include "core/check.h"
#include "core/config.h"
#include "core/cuda_backend.h"
#include "core/runtime.h"
#include "core/version.h"
#include "execute/graphs.h"
#include "ir/buffer.h"
#if LAZYMEM_TORCH_AT_LEAST(2, 9)
#include <c10/core/CachingDeviceAllocator.h>
#endif

namespace lazymem {

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

} // namespace lazymem
