// cuda: liblazymem_cuda.so, the CUDA backend (core/cuda_backend.h). Built only against a torch with
// CUDA (setup.py), loaded by the core on the first use of a CUDA backing device; the one place
// where lazymem includes CUDA headers.
#include <atomic>
#include <memory>
#include <mutex>
#include <optional>
#include <vector>

#include <ATen/cuda/CUDAGraph.h>
#include <c10/core/Event.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAStream.h>

#include "core/cuda_backend.h"

namespace lazymem {
namespace {

struct Graph {
  at::cuda::CUDAGraph graph;
  c10::cuda::CUDAStream previous;
  explicit Graph(c10::cuda::CUDAStream prev) : previous(prev) {}
};

// The allocator's trace: one callback per allocation and free of the process, under the
// allocator's lock; it only adds.
std::atomic<int> g_device{-1};
std::atomic<int64_t> g_held{0};
std::atomic<int64_t> g_peak{0};

void on_trace(const c10::CachingDeviceAllocator::TraceEntry& te) {
  using Action = c10::CachingDeviceAllocator::TraceEntry::Action;
  if (te.device_ != g_device.load(std::memory_order_relaxed)) return;
  const auto size = static_cast<int64_t>(te.size_);
  if (te.action_ == Action::ALLOC) {
    const int64_t held = g_held.fetch_add(size, std::memory_order_relaxed) + size;
    int64_t peak = g_peak.load(std::memory_order_relaxed);
    while (held > peak && !g_peak.compare_exchange_weak(peak, held, std::memory_order_relaxed)) {
    }
  } else if (te.action_ == Action::FREE_REQUESTED) {
    g_held.fetch_sub(size, std::memory_order_relaxed);
  }
}

// One side stream per device for every capture: a library keeps a workspace per stream it ran on
// (cuBLAS: 32 MiB), so a new stream per capture would leave one workspace per capture allocated
// (gpu_check's third run held 489 MiB of them after a dozen captures). Captures run one at a time
// (under the flush lock).
c10::cuda::CUDAStream capture_stream(c10::DeviceIndex device) {
  static std::mutex mu;
  static std::vector<std::optional<c10::cuda::CUDAStream>> streams;
  std::lock_guard<std::mutex> lock(mu);
  if (static_cast<size_t>(device) >= streams.size()) streams.resize(device + 1);
  if (!streams[device]) streams[device] = c10::cuda::getStreamFromPool(/*isHighPriority=*/false, device);
  return *streams[device];
}

class Backend final : public CudaBackend {
 public:
  void* capture_begin(c10::DeviceIndex device) override {
    c10::cuda::CUDAStream prev = c10::cuda::getCurrentCUDAStream(device);
    auto g = std::make_unique<Graph>(prev);
    c10::cuda::CUDAStream side = capture_stream(device);
    c10::Event ready(c10::DeviceType::CUDA);
    ready.record(prev); // the side stream sees what the current one wrote
    side.unwrap().wait(ready);
    c10::cuda::setCurrentCUDAStream(side);
    try {
      g->graph.capture_begin({0, 0}, cudaStreamCaptureModeThreadLocal);
    } catch (...) {
      c10::cuda::setCurrentCUDAStream(prev);
      throw;
    }
    return g.release();
  }

  void capture_end(void* graph) override {
    std::unique_ptr<Graph> g(static_cast<Graph*>(graph));
    try {
      g->graph.capture_end();
    } catch (...) {
      c10::cuda::setCurrentCUDAStream(g->previous); // (c10's checks cleared the capture's error)
      throw;
    }
    c10::cuda::setCurrentCUDAStream(g->previous);
    g.release();
  }

  void replay(void* graph) override {
    static_cast<Graph*>(graph)->graph.replay();
  }

  void destroy(void* graph) noexcept override {
    try {
      delete static_cast<Graph*>(graph);
    } catch (...) {
    }
  }

  void peak_reset(c10::DeviceIndex device) override {
    static std::once_flag attached;
    std::call_once(attached, [] { c10::cuda::CUDACachingAllocator::attachAllocatorTraceTracker(on_trace); });
    g_device.store(device, std::memory_order_relaxed);
    g_held.store(0, std::memory_order_relaxed);
    g_peak.store(0, std::memory_order_relaxed);
  }

  int64_t peak_since_reset() const override {
    return g_peak.load(std::memory_order_relaxed);
  }
};

// Registered when the library loads (core/cuda_backend.cpp dlopens it).
const bool g_registered = [] {
  static Backend backend;
  register_cuda_backend(&backend);
  return true;
}();

} // namespace
} // namespace lazymem
