// execute: copies across the host/device boundary, and the boundary's check.
#include "execute/transfer.h"

#include <atomic>
#include <chrono>
#include <mutex>
#include <thread>

#include <ATen/ops/empty.h>

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

// The copy started at `start` (its memcpy done by now) ends when the link has carried its bytes.
void take_link_time(int64_t bytes, bool to_device, Clock::time_point start, bool measured = true) {
  const double bw = config().link_bandwidth.load(std::memory_order_relaxed);
  Clock::time_point end = Clock::now();
  if (bw > 0 && bytes > 0) {
    Link& l = g_links[to_device ? 0 : 1];
    const auto dur = std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(bytes / bw));
    Clock::time_point finish;
    {
      std::lock_guard<std::mutex> lock(l.mu);
      const Clock::time_point begin = std::max(start, l.busy_until);
      finish = begin + dur;
      l.busy_until = finish;
    }
    if (finish > end) {
      std::this_thread::sleep_until(finish);
      end = finish;
    }
  }
  if (measured) observe_copy(bytes, std::chrono::duration<double>(end - start).count());
  Stats& s = stats();
  (to_device ? s.h2d_bytes : s.d2h_bytes).fetch_add(static_cast<uint64_t>(bytes), std::memory_order_relaxed);
  (to_device ? s.h2d_copies : s.d2h_copies).fetch_add(1, std::memory_order_relaxed);
  (to_device ? s.h2d_ns : s.d2h_ns)
      .fetch_add(static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(end - start).count()),
                 std::memory_order_relaxed);
}

} // namespace

at::Tensor copy_to_device(const at::Tensor& host, c10::ScalarType dtype) {
  const auto start = Clock::now();
  at::Tensor t = at::empty(host.sizes(), at::TensorOptions()
                                             .dtype(dtype == c10::ScalarType::Undefined ? host.scalar_type() : dtype)
                                             .device(backing_device()));
  t.copy_(host);
  take_link_time(static_cast<int64_t>(host.numel() * host.element_size()), true, start);
  return t;
}

void copy_to_host(const at::Tensor& host, const at::Tensor& device) {
  const auto start = Clock::now();
  host.copy_(device);
  take_link_time(static_cast<int64_t>(device.numel() * device.element_size()), false, start);
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
