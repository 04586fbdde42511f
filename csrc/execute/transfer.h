// execute: the boundary between host memory and the device (DESIGN.md §3, "Two memories"). A kernel
// reads and writes device memory only; a value whose home is the host (assembled there because it
// did not fit, kept there across passes, a random stream) reaches a kernel through an explicit copy
// into a device temporary — counted in the device's peak — and goes back the same way. Every copy is
// counted (bytes and time, each way: torch_lazymem.stats()). On the simulated device the copies take
// the time of a modeled link (torch_lazymem.testing.simulated_device(capacity, link=...)), and a
// kernel handed host memory is an internal error while the boundary is checked.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Event.h>

#include <chrono>
#include <optional>
#include <string>

namespace lazymem {

struct Node;

// A device copy of `host` (host memory; a view of any geometry): dense, of `dtype` (`host`'s when
// Undefined). Charged to the device; counted host-to-device.
at::Tensor copy_to_device(const at::Tensor& host, c10::ScalarType dtype = c10::ScalarType::Undefined);
// Copies `device` into `host` (host memory, same shape); counted device-to-host.
void copy_to_host(const at::Tensor& host, const at::Tensor& device);
// Copies `device` into `host` (host memory, same shape) without the executor waiting for it
// (DESIGN.md §3): a chunk's result goes out while the next chunk computes. Where copies out are
// asynchronous (copies_out_async), on the simulated device the link carries the bytes on its own
// timeline, and with LAZYMEM_CHECK_BOUNDARY=1 (the test suite, the fuzzer) they reach `host` only
// when awaited, as on a real link, so a reader that does not wait reads stale bytes; on a stream (CUDA),
// into pinned memory, the copy stream carries them after the compute stream's work so far, and the
// device temporary's memory is not reused before they are out (record_stream). Elsewhere (pageable
// memory, off) it is copy_to_host. Every host-side reader or writer of `host` waits first
// (await_copies_out): the synchronous copies, a gather of host-held rows, an upload into it, the
// loop's undo log, the growth of its storage, a copy in started ahead (on the simulated device, or of
// a view that is not dense), and the executor at the end of every run, before anything outside it
// sees the value. Not Binder::home itself: a chunk's readers of rows it just wrote read them on the
// device (KeptRows) and must not wait for their copy out.
void copy_out(const at::Tensor& host, const at::Tensor& device);
// Waits until the copies out into `dst` (nullptr: every one) have ended and their bytes are in host
// memory. Cheap when none is in flight.
void await_copies_out(const c10::StorageImpl* dst = nullptr);
// Whether copy_out is asynchronous on `dev`: LAZYMEM_ASYNC_COPY_OUT=0/1, else (the default) on the
// simulated device (a CPU backing) and not yet on an accelerator (unchecked on a GPU so far).
bool copies_out_async(const c10::Device& dev);
// Counts a copy of `bytes` made elsewhere (a random stream moved to the host) and takes the link's time.
void count_transfer(int64_t bytes, bool to_device);

// A copy of host memory into a device temporary started ahead of its reader (the next chunk's rows of a
// value held in host memory, issued while this chunk computes). On the simulated device (a CPU backing)
// its bytes are in place at once and the copy ends when the modeled link has carried them (a copy
// engine on the link's timeline: the executor computes meanwhile and waits, in get(), only for what
// is left); on another backing (CUDA) a copy stream carries it,
// after an event on the compute stream (the temporary's memory is free there) and before its reader
// (the compute stream waits for the copy's event: the host does not). The temporary is allocated, and
// charged to the device, when the copy starts.
class PendingCopy {
 public:
  explicit PendingCopy(const at::Tensor& host);
  PendingCopy(const PendingCopy&) = delete;
  PendingCopy& operator=(const PendingCopy&) = delete;
  // On a stream, a copy dropped unread orders the compute stream after it before its memory is freed.
  ~PendingCopy();
  // The device copy, once the copy has ended (the simulated device: the link has carried it; a
  // stream: the compute stream is ordered after it).
  const at::Tensor& get();
  int64_t bytes() const {
    return bytes_;
  }

 private:
  at::Tensor host_, device_;
  int64_t bytes_ = 0;
  std::chrono::steady_clock::time_point ready_{}; // the simulated device's: when the link has carried it
  std::optional<c10::Event> ended_;               // a copy stream's: the copy's end on it...
  bool ordered_ = false;                          // ...and whether the compute stream waits for it
};
// The modeled link of the simulated device, in bytes per second each way (0: not modeled — copies
// take what the memcpy takes). torch_lazymem.testing.simulated_device(link=...).
void set_link_bandwidth(double bytes_per_second);
double link_bandwidth();

// Whether kernels' operands are checked to be in device memory (the simulated device's boundary):
// LAZYMEM_CHECK_BOUNDARY=1 (the test suite and the fuzzer), or while a simulated device is set.
bool boundary_checked();
// With the boundary checked: an internal error when `t` (operand `what` of `n`) is in host memory.
void check_on_device(const at::Tensor& t, const Node& n, const char* what, size_t index);

} // namespace lazymem
