// device: PrivateUse1 hooks. Every method that throws by default is overridden: once lazymem is
// registered it is "the accelerator" (at::getAccelerator prefers PrivateUse1), so autograd stream
// stashing, pin_memory and torch.accelerator all come here.
//
// Compile gates: the hooks interface grew over torch 2.x. Built and tested against 2.13; the gates
// below follow the header history (isBuilt/isAvailable/getNewGenerator became overridable hooks with
// throwing defaults in 2.6, the device-management methods moved into AcceleratorHooksInterface in 2.5).
#include <ATen/Context.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <c10/core/CPUAllocator.h>

#include <algorithm>
#include <map>
#include <mutex>

#include "core/check.h"
#include "core/runtime.h"
#include "core/version.h"
#include "device/generator.h"
#include "device/phantom.h"

namespace lazymem {
namespace {

// Pinned host memory for a CPU backing device: host memory is what the device reads already, so
// "pinned" is the CPU allocator's memory, remembered so is_pinned() says yes (DDP's reducer asserts
// it of its staging buffer with find_unused_parameters / static_graph; DataLoader(pin_memory=True)
// pins batches). Ranges, so a view into a pinned block is pinned too.
class HostPinnedAllocator final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t n) override {
    c10::DataPtr inner = c10::GetCPUAllocator()->allocate(n);
    void* data = inner.get();
    {
      std::lock_guard<std::mutex> lock(mu_);
      live_[static_cast<const char*>(data)] = n;
    }
    return {data, new Block{std::move(inner), this}, &release, c10::Device(c10::DeviceType::CPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override {
    return nullptr;
  }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
  bool contains(const void* p) const {
    const char* c = static_cast<const char*>(p);
    std::lock_guard<std::mutex> lock(mu_);
    auto it = live_.upper_bound(c);
    if (it == live_.begin()) return false;
    --it;
    return c < it->first + std::max<size_t>(it->second, 1);
  }

 private:
  struct Block {
    c10::DataPtr inner;
    HostPinnedAllocator* owner;
  };
  static void release(void* ctx) {
    auto* b = static_cast<Block*>(ctx);
    {
      std::lock_guard<std::mutex> lock(b->owner->mu_);
      b->owner->live_.erase(static_cast<const char*>(b->inner.get()));
    }
    delete b;
  }
  mutable std::mutex mu_;
  std::map<const char*, size_t> live_;
};

HostPinnedAllocator& host_pinned() {
  static auto* a = new HostPinnedAllocator(); // never destroyed: blocks may outlive static destruction
  return *a;
}

struct LazyHooks final : public at::PrivateUse1HooksInterface {
#if LAZYMEM_TORCH_AT_LEAST(2, 6)
  bool isBuilt() const override {
    return true;
  }
  bool isAvailable() const override {
    return true;
  }
  at::Generator getNewGenerator(c10::DeviceIndex index) const override {
    return new_lazy_generator(index);
  }
#endif
  const at::Generator& getDefaultGenerator(c10::DeviceIndex index) const override {
    return default_lazy_generator(index);
  }
  at::Device getDeviceFromPtr(void*) const override {
    return at::Device(c10::DeviceType::PrivateUse1, 0);
  }
  bool isPinnedPtr(const void* data) const override {
    if (backing_device().is_cuda()) return at::detail::getCUDAHooks().isPinnedPtr(data);
    return host_pinned().contains(data);
  }
  c10::Allocator* getPinnedMemoryAllocator() const override {
    if (backing_device().is_cuda()) {
      init_backing_device();
      return at::detail::getCUDAHooks().getPinnedMemoryAllocator();
    }
    return &host_pinned();
  }
  bool hasPrimaryContext(c10::DeviceIndex) const override {
    return true; // autograd's stash_current_streams dereferences the stream when true
  }
#if LAZYMEM_TORCH_AT_LEAST(2, 5)
  void init() const override {}
#endif
  void resizePrivateUse1Bytes(const c10::Storage& storage, size_t newsize) const override {
    auto* impl = storage.unsafeGetStorageImpl();
    LAZYMEM_CHECK(buffer_of(*impl) != nullptr, "resize of a storage that is not a lazymem storage");
    if (newsize > impl->nbytes()) {
      grow_phantom(*impl, newsize);
    } else {
      impl->set_nbytes(newsize);
    }
  }
#if LAZYMEM_TORCH_AT_LEAST(2, 5)
  c10::DeviceIndex deviceCount() const override {
    return 1;
  }
  void setCurrentDevice(c10::DeviceIndex index) const override {
    LAZYMEM_CHECK(index == 0, "device index ", static_cast<int>(index),
                  " is out of range; lazymem has a single device, lazymem:0");
  }
  c10::DeviceIndex getCurrentDevice() const override {
    return 0;
  }
  c10::DeviceIndex exchangeDevice(c10::DeviceIndex index) const override {
    setCurrentDevice(index);
    return 0;
  }
  c10::DeviceIndex maybeExchangeDevice(c10::DeviceIndex index) const override {
    return exchangeDevice(index);
  }
#endif
};

const bool g_registered = [] {
  at::RegisterPrivateUse1HooksInterface(new LazyHooks());
  return true;
}();

} // namespace
} // namespace lazymem
