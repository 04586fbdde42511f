// core: backing-device state and flush hooks.
#include "core/runtime.h"

#include <atomic>
#include <mutex>

#include <ATen/Context.h>

namespace lazymem {
namespace {

std::once_flag g_backing_once;
std::atomic<int> g_backing_type{static_cast<int>(c10::DeviceType::CPU)};
std::atomic<int> g_backing_index{-1}; // CPU tensors carry index -1; CUDA gets a real index

void choose_default_backing() {
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
}

void init_backing_device() {
  static std::atomic<bool> done{false};
  static std::mutex mu;
  if (done.load(std::memory_order_acquire)) return;
  c10::Device d = backing_device();
  if (d.is_cpu()) return;
  std::lock_guard<std::mutex> lock(mu);
  if (done.load(std::memory_order_relaxed)) return;
  at::globalContext().lazyInitDevice(d.type());
  if (flush_hooks().backing_initialized) flush_hooks().backing_initialized(d);
  done.store(true, std::memory_order_release);
}

FlushHooks& flush_hooks() {
  static FlushHooks* h = new FlushHooks();
  return *h;
}

} // namespace lazymem
