// core: process-wide runtime state that every stage reads: the backing device, and the flush
// entry points that device plumbing (guard, generator) calls without depending on sync/.
#pragma once

#include <cstdint>
#include <functional>
#include <string>

#include <c10/core/Device.h>
#include <c10/core/DispatchKey.h>
#include <c10/core/DispatchKeySet.h>

namespace lazymem {

// The keys above a backend that lazymem excludes whenever it runs ops itself (meta inference,
// replay, snapshots, downloads): the recorded ops are already below autograd, autocast and Python
// modes, and functorch/functionalization must not wrap them again.
constexpr c10::DispatchKeySet kAboveBackendKeys = c10::autograd_dispatch_keyset_with_ADInplaceOrView |
    c10::autocast_dispatch_keyset | c10::python_ks |
    c10::DispatchKeySet({c10::DispatchKey::Functionalize, c10::DispatchKey::FuncTorchDynamicLayerFrontMode,
                         c10::DispatchKey::FuncTorchDynamicLayerBackMode, c10::DispatchKey::PreDispatch});

// The real device the program runs on: CUDA when present at first use, CPU otherwise.
c10::Device backing_device();
c10::DispatchKey backing_key();
// Sets the backing device without any checks; the caller validates first.
void set_backing_device_unchecked(c10::Device d);
// Initializes the backing device's runtime once (CUDA: its context and caching allocator), before
// lazymem's first allocation, copy or memory query there: lazymem may be the process's first CUDA
// user, and ATen's CUDA allocator refuses a device nobody initialized. Cheap after the first call.
void init_backing_device();

// Flush entry points, installed by sync/ at static-init time.
struct FlushHooks {
  // Runs every pending node recorded at or before `seq` (0 = nothing, UINT64_MAX = everything).
  std::function<void(uint64_t seq)> flush_until;
  // Runs everything pending and leaves nothing pending (device synchronization).
  std::function<void()> synchronize;
  // The last materialization's plan as text (torch_lazymem.explain).
  std::function<std::string()> explain;
  // Where the op being recorded was called from (installed by the Python bindings; debug mode only).
  std::function<std::string()> recording_site;
  // Progress of a materialization expected to run long: chunks done of the plan's total, then once
  // with `finished` (installed by the Python bindings: a tqdm bar on a terminal).
  std::function<void(int64_t done, int64_t total, bool finished)> progress;
  // Called once after the backing device's runtime is initialized (installed by the Python
  // bindings: reads the CUDA allocator's per-process memory fraction, which has no C++ interface
  // outside the CUDA build).
  std::function<void(c10::Device)> backing_initialized;
  // Called whenever the backing device is chosen or changed, before anything runs on it (installed
  // by sync/register.cpp: the kernels captured on PrivateUse1 for that device type only).
  std::function<void(c10::DeviceType)> backing_chosen;
  // Sets the CUDA caching allocator's per-process memory fraction of a device without changing what
  // the user set (installed by the Python bindings, for the same reason; execute/memory.h's
  // ScopedAllocatorCap).
  std::function<void(c10::Device, double fraction)> set_allocator_fraction;
  // Runs `wait` (a blocking wait for the flush lock) without the GIL when this thread holds it
  // (installed by the Python bindings; sync/sync.cpp acquire_flush).
  std::function<void(const std::function<void()>& wait)> without_gil;
};
FlushHooks& flush_hooks();
inline void flush_until(uint64_t seq) {
  if (seq != 0 && flush_hooks().flush_until) flush_hooks().flush_until(seq);
}
inline void flush_all() {
  flush_until(UINT64_MAX);
}
inline void synchronize_program() {
  if (flush_hooks().synchronize) flush_hooks().synchronize();
}

} // namespace lazymem
