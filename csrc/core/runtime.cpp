// core: backing-device state and flush hooks.
#include "core/runtime.h"

#include <atomic>
#include <mutex>

#include <ATen/Context.h>

#include "core/cuda_backend.h"

namespace lazymem {
namespace {

std::once_flag g_backing_once;
std::atomic<int> g_backing_type{static_cast<int>(c10::DeviceType::CPU)};
std::atomic<int> g_backing_index{-1}; // CPU tensors carry index -1; CUDA gets a real index
// Set once the default is chosen: backing_device() is asked ~16 times per replayed op, and
// std::call_once sets two thread-locals on every call (__tls_get_addr in a shared library).
std::atomic<bool> g_backing_chosen{false};

void choose_default_backing() {
  if (g_backing_chosen.load(std::memory_order_acquire)) return;
  std::call_once(g_backing_once, [] {
    // CUDA only through the device-generic context query: no CUDA headers, same build everywhere.
    bool cuda = false;
    try {
      cuda = at::globalContext().hasCUDA() &&
          at::globalContext().getAcceleratorHooksInterface(c10::DeviceType::CUDA).deviceCount() > 0;
    } catch (...) {
      cuda = false;
    }
    if (cuda) {
      g_backing_type = static_cast<int>(c10::DeviceType::CUDA);
      g_backing_index = 0;
    }
    if (flush_hooks().backing_chosen) flush_hooks().backing_chosen(static_cast<c10::DeviceType>(g_backing_type.load()));
    g_backing_chosen.store(true, std::memory_order_release);
  });
}

} // namespace

c10::Device backing_device() {
  choose_default_backing();
  return c10::Device(static_cast<c10::DeviceType>(g_backing_type.load()),
                     static_cast<c10::DeviceIndex>(g_backing_index.load()));
}

c10::DispatchKey backing_key() {
  return backing_device().is_cuda() ? c10::DispatchKey::CUDA : c10::DispatchKey::CPU;
}

void set_backing_device_unchecked(c10::Device d) {
  choose_default_backing();
  g_backing_type = static_cast<int>(d.type());
  g_backing_index = d.is_cpu() ? -1 : (d.has_index() ? d.index() : 0);
  if (flush_hooks().backing_chosen) flush_hooks().backing_chosen(d.type());
}

void init_backing_device() {
  static std::atomic<bool> done{false};
  static std::atomic<bool> hook_claimed{false};
  static std::once_flag runtime_once;
  if (done.load(std::memory_order_acquire)) return;
  c10::Device d = backing_device();
  if (d.is_cpu()) return;
  std::call_once(runtime_once, [&] {
    at::globalContext().lazyInitDevice(d.type());
    if (d.is_cuda()) load_cuda_backend();
  });
  // The hook takes the GIL: it runs outside any lock of ours, once, on the first thread here (a
  // thread that holds the GIL and finds it claimed goes on rather than wait for it).
  if (!hook_claimed.exchange(true)) {
    if (flush_hooks().backing_initialized) flush_hooks().backing_initialized(d);
    done.store(true, std::memory_order_release);
  }
}

FlushHooks& flush_hooks() {
  static FlushHooks* h = new FlushHooks();
  return *h;
}

} // namespace lazymem
