// core: what a CUDA build of torch offers that has no device-generic interface (DESIGN.md §8): CUDA
// graph capture and replay, and the caching allocator's allocation trace. liblazymem_cuda.so
// (csrc/cuda/, built only against a torch with CUDA) implements it and registers itself when loaded;
// the core loads it on first use of a CUDA backing device and works without it (no graphs, peaks
// sampled).
#pragma once

#include <cstdint>

#include <c10/core/Device.h>

namespace lazymem {

class CudaBackend {
 public:
  virtual ~CudaBackend() = default;
  // Begins capturing the calling thread's work on `device` into a new graph with a private memory
  // pool: a side stream (ordered after the current one) becomes current, in thread-local capture
  // mode, so that other threads' CUDA calls go on. Returns the graph.
  virtual void* capture_begin(c10::DeviceIndex device) = 0;
  // Ends the capture and instantiates the graph; the stream current before capture_begin is current
  // again. Throws when the capture failed (a kernel that cannot be captured): the graph is destroyed.
  virtual void capture_end(void* graph) = 0;
  // Launches the graph on the current stream.
  virtual void replay(void* graph) = 0;
  // Destroys the graph; its pool's memory goes back to the allocator once nothing holds a block.
  virtual void destroy(void* graph) noexcept = 0;
  // Device bytes the caching allocator handed out on `device` at most since the last call of
  // peak_reset, relative to what it had handed out then (every thread's allocations count).
  virtual void peak_reset(c10::DeviceIndex device) = 0;
  virtual int64_t peak_since_reset() const = 0;
};

// The registered backend, or nullptr (a CPU build of torch, a CPU backing device, or a library that
// did not load: load_cuda_backend says why once, in debug mode).
CudaBackend* cuda_backend();
void register_cuda_backend(CudaBackend* backend);
// Loads liblazymem_cuda.so from the core library's folder once; idempotent, never throws.
void load_cuda_backend();

} // namespace lazymem
