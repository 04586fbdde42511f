// core: process-wide runtime state that every stage reads: the backing device, and the flush
// entry points that device plumbing (guard, generator) calls without depending on execute/.
#pragma once

#include <cstdint>
#include <functional>
#include <string>

#include <c10/core/Device.h>
#include <c10/core/DispatchKey.h>

namespace lazymem {

// The real device the program runs on: CUDA when present at first use, CPU otherwise.
c10::Device backing_device();
c10::DispatchKey backing_key();
// Sets the backing device without any checks; execute/ validates before calling this.
void set_backing_device_unchecked(c10::Device d);

// Flush entry points, installed by execute/ at static-init time.
struct FlushHooks {
  // Runs every pending node recorded at or before `seq` (0 = nothing, UINT64_MAX = everything).
  std::function<void(uint64_t seq)> flush_until;
  // Where the op being recorded was called from (installed by the Python bindings; debug mode only).
  std::function<std::string()> recording_site;
};
FlushHooks& flush_hooks();
inline void flush_until(uint64_t seq) {
  if (seq != 0 && flush_hooks().flush_until) flush_hooks().flush_until(seq);
}
inline void flush_all() {
  flush_until(UINT64_MAX);
}

} // namespace lazymem
