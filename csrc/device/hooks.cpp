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

#include "core/check.h"
#include "core/runtime.h"
#include "core/version.h"
#include "device/generator.h"
#include "device/phantom.h"

namespace lazymem {
namespace {

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
    return backing_device().is_cuda() && at::detail::getCUDAHooks().isPinnedPtr(data);
  }
  c10::Allocator* getPinnedMemoryAllocator() const override {
    if (backing_device().is_cuda()) return at::detail::getCUDAHooks().getPinnedMemoryAllocator();
    return c10::GetCPUAllocator();
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
