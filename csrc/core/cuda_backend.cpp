// core: the CUDA backend's registry and loader (cuda_backend.h).
#include "core/cuda_backend.h"

#include <dlfcn.h>

#include <atomic>
#include <cstdio>
#include <mutex>
#include <string>

#include "core/config.h"

namespace lazymem {
namespace {
std::atomic<CudaBackend*> g_backend{nullptr};
} // namespace

CudaBackend* cuda_backend() {
  return g_backend.load(std::memory_order_acquire);
}

void register_cuda_backend(CudaBackend* backend) {
  g_backend.store(backend, std::memory_order_release);
}

void load_cuda_backend() {
  static std::once_flag once;
  std::call_once(once, [] {
    Dl_info info{};
    if (dladdr(reinterpret_cast<void*>(&load_cuda_backend), &info) == 0 || !info.dli_fname) return;
    std::string dir = info.dli_fname;
    dir = dir.substr(0, dir.find_last_of('/') + 1);
    // RTLD_GLOBAL: its static initializer registers the backend with this library's registry.
    if (!dlopen((dir + "liblazymem_cuda.so").c_str(), RTLD_NOW | RTLD_GLOBAL) && config().debug) {
      std::fprintf(stderr, "[lazymem] no CUDA graphs: %s\n", dlerror());
    }
  });
}

} // namespace lazymem
