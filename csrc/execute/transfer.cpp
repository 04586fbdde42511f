// execute: copies across the host/device boundary, and the boundary's check.
#include "execute/transfer.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <exception>
#include <iterator>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

#include <ATen/ops/empty.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include "core/check.h"
#include "core/config.h"
#include "core/runtime.h"
#include "execute/memory.h"
#include "ir/node.h"
#include "plan/timing.h"

namespace lazymem {
namespace {

using Clock = std::chrono::steady_clock;

// One link each way, busy until the end of its last copy: a copy starts when the link is free (or
// now) and the caller waits for its end, so copies in one direction are serialized as on a bus.
struct Link {
  std::mutex mu;
  Clock::time_point busy_until{};
};
Link g_links[2];

// The end of a copy of `bytes` started at `start` over the modeled link (`start` itself when the link
// is not modeled): after the link's earlier copies, taking bytes / bandwidth. Reserves the link until then.
Clock::time_point link_finish(int64_t bytes, bool to_device, Clock::time_point start) {
  const double bw = config().link_bandwidth.load(std::memory_order_relaxed);
  if (bw <= 0 || bytes <= 0) return start;
  Link& l = g_links[to_device ? 0 : 1];
  const auto dur = std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(bytes / bw));
  std::lock_guard<std::mutex> lock(l.mu);
  const Clock::time_point finish = std::max(start, l.busy_until) + dur;
  l.busy_until = finish;
  return finish;
}

// Counts a copy that took from `start` to `end` (and teaches the planner its time when `measured`).
void count_copy(int64_t bytes, bool to_device, Clock::time_point start, Clock::time_point end, bool measured) {
  if (measured) observe_copy(bytes, std::chrono::duration<double>(end - start).count());
  Stats& s = stats();
  (to_device ? s.h2d_bytes : s.d2h_bytes).fetch_add(static_cast<uint64_t>(bytes), std::memory_order_relaxed);
  (to_device ? s.h2d_copies : s.d2h_copies).fetch_add(1, std::memory_order_relaxed);
  (to_device ? s.h2d_ns : s.d2h_ns)
      .fetch_add(static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(end - start).count()),
                 std::memory_order_relaxed);
}

// The copy started at `start` (its memcpy done by now) ends when the link has carried its bytes: the
// caller waits for that.
void take_link_time(int64_t bytes, bool to_device, Clock::time_point start, bool measured = true) {
  Clock::time_point end = Clock::now();
  const Clock::time_point finish = link_finish(bytes, to_device, start);
  if (finish > end) {
    std::this_thread::sleep_until(finish);
    end = finish;
  }
  count_copy(bytes, to_device, start, end, measured);
}

} // namespace

namespace {

// The copy stream of `dev` (one per device, from the backend's pool).
c10::Stream copy_stream(const c10::Device& dev) {
  static std::mutex mu;
  static std::vector<std::pair<c10::Device, c10::Stream>> streams;
  std::lock_guard<std::mutex> lock(mu);
  for (const auto& [d, s] : streams) {
    if (d == dev) return s;
  }
  c10::impl::VirtualGuardImpl impl(dev.type());
  streams.emplace_back(dev, impl.getStreamFromGlobalPool(dev, /*isHighPriority=*/false));
  return streams.back().second;
}

} // namespace

PendingCopy::PendingCopy(const at::Tensor& host)
    : host_(host), bytes_(static_cast<int64_t>(host.numel() * host.element_size())) {
  const c10::Device dev = backing_device();
  // The one copy stream orders a copy in after the copies out before it; not a source that is no dense
  // view, which ATen's copy_ first makes contiguous on the host, now.
  if (dev.is_cpu() || !host.is_contiguous()) await_copies_out(host.storage().unsafeGetStorageImpl());
  device_ = at::empty(host.sizes(), host.options().device(dev)); // charged now, on the compute stream
  stats().h2d_ahead.fetch_add(1, std::memory_order_relaxed);
  if (dev.is_cpu()) {
    // The simulated device's copy engine: the bytes are in place now (host and device are both this
    // machine's memory, and a memcpy on the thread that runs kernels keeps every allocation and every
    // kernel's threads where they would be without it); the copy is done when the modeled link has
    // carried it, after the link's earlier copies, while the executor goes on computing.
    const auto start = Clock::now();
    device_.copy_(host);
    ready_ = std::max(link_finish(bytes_, true, start), Clock::now());
    count_copy(bytes_, true, start, ready_, /*measured=*/true);
    return;
  }
  c10::impl::VirtualGuardImpl impl(dev.type());
  const c10::Stream compute = impl.getStream(dev);
  const c10::Stream copy = copy_stream(dev);
  // The temporary's memory may still be read by work queued on the compute stream before it was
  // freed there: the copy starts after that work.
  c10::Event free_on_compute(dev.type());
  free_on_compute.record(compute);
  free_on_compute.block(copy);
  {
    c10::StreamGuard on_copy(copy);
    device_.copy_(host, /*non_blocking=*/true);
  }
  ended_.emplace(dev.type());
  ended_->record(copy);
  Stats& st = stats();
  st.h2d_bytes.fetch_add(static_cast<uint64_t>(bytes_), std::memory_order_relaxed);
  st.h2d_copies.fetch_add(1, std::memory_order_relaxed);
}

const at::Tensor& PendingCopy::get() {
  if (ended_) {
    if (!ordered_) {
      c10::impl::VirtualGuardImpl impl(device_.device().type());
      ended_->block(impl.getStream(device_.device()));
      ordered_ = true;
    }
    return device_;
  }
  const auto now = Clock::now();
  if (ready_ > now) {
    std::this_thread::sleep_until(ready_);
    stats().copy_wait_ns.fetch_add(
        static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(ready_ - now).count()),
        std::memory_order_relaxed);
  }
  return device_;
}

PendingCopy::~PendingCopy() {
  if (ended_ && !ordered_) {
    // Dropped unread: nothing on the compute stream may reuse the temporary before the copy ends.
    try {
      c10::impl::VirtualGuardImpl impl(device_.device().type());
      ended_->block(impl.getStream(device_.device()));
    } catch (...) { // NOLINT(bugprone-empty-catch): a destructor; the device is failing anyway
    }
  }
}

namespace {
// Before a copy that waits for the device (a CUDA copy_ with pageable host memory waits for the
// stream's queued kernels): that wait first, so the copy's measured time is the link's, not the
// kernels' (the planner prices copies by it). The same wait the copy would have made.
Clock::time_point start_timed_copy(const c10::Device& dev) {
  if (!dev.is_cpu()) c10::impl::VirtualGuardImpl(dev.type()).getStream(dev).synchronize();
  return Clock::now();
}
} // namespace

at::Tensor copy_to_device(const at::Tensor& host, c10::ScalarType dtype) {
  await_copies_out(host.storage().unsafeGetStorageImpl());
  const auto start = start_timed_copy(backing_device());
  at::Tensor t = at::empty(host.sizes(), at::TensorOptions()
                                             .dtype(dtype == c10::ScalarType::Undefined ? host.scalar_type() : dtype)
                                             .device(backing_device()));
  t.copy_(host);
  take_link_time(static_cast<int64_t>(host.numel() * host.element_size()), true, start);
  return t;
}

void copy_to_host(const at::Tensor& host, const at::Tensor& device) {
  await_copies_out(host.storage().unsafeGetStorageImpl());
  const auto start = start_timed_copy(device.device());
  host.copy_(device);
  take_link_time(static_cast<int64_t>(device.numel() * device.element_size()), false, start);
}

namespace {

// A copy out not waited for yet, in the order issued.
struct CopyOut {
  at::Tensor host;  // its destination (held until it ends: its memory is not reused meanwhile)
  at::Tensor stash; // the simulated device's, with the boundary checked: the bytes, put into `host` when awaited
  int64_t bytes = 0;
  Clock::time_point finish{};             // the simulated device's: when the link has carried it
  std::optional<c10::Event> began, ended; // a copy stream's (timed: they teach the planner the link's rate)
};

std::mutex g_out_mu;
std::vector<CopyOut> g_out;
std::atomic<size_t> g_out_count{0}; // copies issued and not yet ended (in g_out, or being waited for)
std::mutex g_await_mu;              // one waiter at a time: no waiter returns while another holds its copies

bool destined_for(const CopyOut& c, const c10::StorageImpl* dst) {
  return !dst || c.host.storage().unsafeGetStorageImpl() == dst;
}

} // namespace

bool copies_out_async(const c10::Device& dev) {
  const int v = config().async_copy_out.load(std::memory_order_relaxed);
  return v >= 0 ? v == 1 : dev.is_cpu();
}

void copy_out(const at::Tensor& host, const at::Tensor& device) {
  const c10::Device dev = device.device();
  CopyOut c;
  c.bytes = static_cast<int64_t>(device.numel() * device.element_size());
  if (c.bytes == 0 || !copies_out_async(dev) || (!dev.is_cpu() && !host.is_pinned())) {
    copy_to_host(host, device); // (after the copies out into `host` before it)
    return;
  }
  c.host = host;
  if (dev.is_cpu()) {
    // The simulated device's copy engine: the link carries the bytes after its earlier copies while
    // the executor goes on. With the boundary checked they land in `host` only when awaited.
    const auto start = Clock::now();
    if (config().check_boundary.load(std::memory_order_relaxed) && boundary_checked()) {
      CountingScope held(&host_counter());
      c.stash = at::empty(device.sizes(), device.options());
      c.stash.copy_(device);
    } else {
      host.copy_(device);
    }
    c.finish = std::max(link_finish(c.bytes, false, start), Clock::now());
    count_copy(c.bytes, false, start, c.finish, /*measured=*/true);
  } else {
    c10::impl::VirtualGuardImpl impl(dev.type());
    const c10::Stream copy = copy_stream(dev);
    // After the compute stream's work so far (the kernel that wrote `device`).
    c10::Event written(dev.type());
    written.record(impl.getStream(dev));
    written.block(copy);
    c.began.emplace(dev.type(), c10::EventFlag::BACKEND_DEFAULT);
    c.began->record(copy);
    {
      c10::StreamGuard on_copy(copy);
      host.copy_(device, /*non_blocking=*/true);
    }
    device.record_stream(copy); // its memory is not reused before the copy has read it
    c.ended.emplace(dev.type(), c10::EventFlag::BACKEND_DEFAULT);
    c.ended->record(copy);
    Stats& st = stats();
    st.d2h_bytes.fetch_add(static_cast<uint64_t>(c.bytes), std::memory_order_relaxed);
    st.d2h_copies.fetch_add(1, std::memory_order_relaxed);
  }
  stats().d2h_behind.fetch_add(1, std::memory_order_relaxed);
  std::lock_guard<std::mutex> lock(g_out_mu);
  g_out.push_back(std::move(c));
  g_out_count.fetch_add(1, std::memory_order_acq_rel);
}

void await_copies_out(const c10::StorageImpl* dst) {
  if (g_out_count.load(std::memory_order_acquire) == 0) return;
  std::lock_guard<std::mutex> waiting(g_await_mu);
  std::vector<CopyOut> due;
  {
    std::lock_guard<std::mutex> lock(g_out_mu);
    auto keep = std::stable_partition(g_out.begin(), g_out.end(), [&](const CopyOut& c) { return !destined_for(c, dst); });
    std::move(keep, g_out.end(), std::back_inserter(due));
    g_out.erase(keep, g_out.end());
  }
  const auto t0 = Clock::now();
  std::exception_ptr failed; // (every copy is waited for, then the first failure raised)
  for (CopyOut& c : due) { // (in issue order: two copies into one place land as issued)
    try {
      if (c.ended) {
        c.ended->synchronize();
        try {
          const double ms = c.began->elapsedTime(*c.ended);
          observe_copy(c.bytes, ms / 1e3);
          stats().d2h_ns.fetch_add(static_cast<uint64_t>(ms * 1e6), std::memory_order_relaxed);
        } catch (const c10::Error&) { // NOLINT(bugprone-empty-catch): untimed events: nothing learned
        }
      } else {
        if (c.finish > Clock::now()) std::this_thread::sleep_until(c.finish);
        if (c.stash.defined()) c.host.copy_(c.stash);
      }
    } catch (...) {
      if (!failed) failed = std::current_exception();
    }
    g_out_count.fetch_sub(1, std::memory_order_acq_rel);
  }
  if (failed) std::rethrow_exception(failed);
  stats().copy_out_wait_ns.fetch_add(
      static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - t0).count()),
      std::memory_order_relaxed);
}

void count_transfer(int64_t bytes, bool to_device) {
  take_link_time(bytes, to_device, Clock::now(), /*measured=*/false); // (its memcpy was not timed here)
}

void set_link_bandwidth(double bytes_per_second) {
  config().link_bandwidth.store(bytes_per_second > 0 ? bytes_per_second : 0.0, std::memory_order_relaxed);
}

double link_bandwidth() {
  return config().link_bandwidth.load(std::memory_order_relaxed);
}

bool boundary_checked() {
  if (!backing_device().is_cpu()) return false;
  return (config().check_boundary.load(std::memory_order_relaxed) || device_counter().capacity() >= 0) &&
      counting_cpu_allocator_active();
}

void check_on_device(const at::Tensor& t, const Node& n, const char* what, size_t index) {
  if (!t.defined() || !t.has_storage() || t.numel() == 0) return;
  LAZYMEM_INTERNAL_ASSERT(storage_domain(t.storage()) != Domain::kHost, n.describe(), " was handed host memory as ",
                          what, " ", index, " (", t.sizes(), " ", t.scalar_type(),
                          "): a value held in host memory reaches a kernel only through a copy into device memory");
}

} // namespace lazymem
