// device: the DeviceGuardImplInterface for lazymem:0. A real guard (not NoOpDeviceGuardImpl): the
// autograd engine needs deviceCount() >= 1, streams with index 0 and working events to run
// backward on its device thread. Device synchronization flushes the pending program.
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include "core/check.h"
#include "core/runtime.h"

namespace lazymem {
namespace {

constexpr c10::DeviceType kType = c10::DeviceType::PrivateUse1;
int g_event_token = 0; // events are tokens: lazymem work is ordered by the program, not streams

c10::Device the_device() {
  return c10::Device(kType, 0);
}

struct LazyGuardImpl final : public c10::impl::DeviceGuardImplInterface {
  c10::DeviceType type() const override {
    return kType;
  }
  c10::Device exchangeDevice(c10::Device d) const override {
    setDevice(d);
    return the_device();
  }
  c10::Device getDevice() const override {
    return the_device();
  }
  void setDevice(c10::Device d) const override {
    LAZYMEM_CHECK(d.type() == kType, "cannot set a ", d.type(), " device on the lazymem guard");
    LAZYMEM_CHECK(!d.has_index() || d.index() == 0, "device index ", static_cast<int>(d.index()),
                  " is out of range; lazymem has a single device, lazymem:0");
  }
  void uncheckedSetDevice(c10::Device) const noexcept override {}
  c10::Stream getStream(c10::Device) const noexcept override {
    return c10::Stream(c10::Stream::DEFAULT, the_device());
  }
  c10::Stream getDefaultStream(c10::Device) const override {
    return c10::Stream(c10::Stream::DEFAULT, the_device());
  }
  c10::Stream getStreamFromGlobalPool(c10::Device, bool) const override {
    return c10::Stream(c10::Stream::DEFAULT, the_device());
  }
  c10::Stream getNewStream(c10::Device, int) const override {
    return c10::Stream(c10::Stream::DEFAULT, the_device());
  }
  c10::Stream exchangeStream(c10::Stream) const noexcept override {
    return c10::Stream(c10::Stream::DEFAULT, the_device());
  }
  void destroyEvent(void*, const c10::DeviceIndex) const noexcept override {}
  void record(void** event, const c10::Stream&, const c10::DeviceIndex, const c10::EventFlag) const override {
    *event = &g_event_token;
  }
  void block(void*, const c10::Stream&) const override {}
  bool queryEvent(void*) const override {
    return true;
  }
  c10::DeviceIndex deviceCount() const noexcept override {
    return 1;
  }
  bool queryStream(const c10::Stream&) const override {
    return true;
  }
  void synchronizeStream(const c10::Stream&) const override {
    synchronize_program();
  }
  void synchronizeEvent(void*) const override {}
  void synchronizeDevice(const c10::DeviceIndex) const override {
    synchronize_program();
  }
  double elapsedTime(void*, void*, const c10::DeviceIndex) const override {
    return 0.0;
  }
  void recordDataPtrOnStream(const c10::DataPtr&, const c10::Stream&) const override {}
};

C10_REGISTER_GUARD_IMPL(PrivateUse1, LazyGuardImpl);

} // namespace
} // namespace lazymem
