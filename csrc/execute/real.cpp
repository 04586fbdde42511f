// execute: real storage and views.
#include "execute/real.h"

#include <ATen/Context.h>
#include <ATen/ops/empty.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/DeviceGuard.h>

#include "core/check.h"
#include "core/runtime.h"
#include "device/phantom.h"
#include "execute/transfer.h"

namespace lazymem {
namespace {

MemoryCounter* counter_for_backing() {
  return backing_device().is_cpu() ? &device_counter() : nullptr;
}

} // namespace

ReplayScope::ReplayScope() : exclude_(kAboveBackendKeys), counting_(counter_for_backing(), /*workers=*/true) {}

c10::Storage allocate_real(size_t nbytes) {
  c10::Device dev = backing_device();
  if (dev.is_cpu()) {
    CountingScope scope(&device_counter());
    return c10::Storage(c10::Storage::use_byte_size_t(), nbytes, c10::GetCPUAllocator(), /*resizable=*/true);
  }
  init_backing_device();
  c10::DeviceGuard guard(dev);
  return c10::Storage(c10::Storage::use_byte_size_t(), nbytes, c10::GetAllocator(dev.type()), /*resizable=*/true);
}

c10::Storage allocate_host(size_t nbytes) {
  CountingScope host(&host_counter());
  c10::Device dev = backing_device();
  c10::Allocator* alloc = c10::GetCPUAllocator();
  if (!dev.is_cpu()) {
    init_backing_device();
    try {
      alloc = at::globalContext().getPinnedMemoryAllocator(dev.type());
    } catch (const c10::Error&) {
      // No pinned allocator for this device type: pageable memory (copies are synchronous).
    }
  }
  return c10::Storage(c10::Storage::use_byte_size_t(), nbytes, alloc, /*resizable=*/false);
}

void bring_to_device(LazyBuffer& b) {
  if (!b.has_real() || !b.real_on_host) return;
  ReplayScope scope; // (the copy is the device's)
  const TensorMeta bytes = TensorMeta::contiguous({static_cast<int64_t>(b.real.nbytes())}, c10::kByte);
  b.set_real(copy_to_device(real_view(b, bytes)).storage(), false);
}

void ensure_real(LazyBuffer& b, size_t need, int64_t* allocating) {
  if (b.has_real() && b.real.nbytes() >= need) return;
  const size_t want = std::max(b.nbytes.load(), need);
  if (allocating) *allocating += static_cast<int64_t>(want);
  if (!b.has_real()) {
    b.set_real(allocate_real(want));
    return;
  }
  // Grown by resize_/set_ after it was materialized: copy the old bytes into the larger storage.
  c10::Storage grown = allocate_real(want);
  TensorMeta bytes;
  bytes.dtype = c10::ScalarType::Byte;
  bytes.sizes = {static_cast<int64_t>(b.real.nbytes())};
  bytes.strides = {1};
  at::Tensor old_view = real_view(b, bytes);
  if (b.real_on_host) await_copies_out(b.real.unsafeGetStorageImpl()); // (read on the host)
  c10::Storage old = b.real;
  b.set_real(grown);
  {
    ReplayScope scope;
    real_view(b, bytes).copy_(old_view);
  }
}

at::Tensor real_view(LazyBuffer& b, const TensorMeta& meta) {
  LAZYMEM_INTERNAL_ASSERT(b.has_real(), "real_view of buffer b", b.id, " that has no real data");
  // A view past the storage's end reads another block's bytes: a wrong answer, never a result.
  LAZYMEM_INTERNAL_ASSERT(meta.numel() == 0 || meta.extent_bytes() <= b.real.nbytes(), "a view ", meta.to_string(),
                          " of b", b.id, " reaches past the end of its storage of ", b.real.nbytes(), " bytes");
  auto impl = c10::make_intrusive<c10::TensorImpl>(
      c10::Storage(b.real), c10::DispatchKeySet(b.real_on_host ? c10::DispatchKey::CPU : backing_key()),
      caffe2::TypeMeta::fromScalarType(meta.dtype));
  meta.apply_to(*impl);
  return at::Tensor(std::move(impl));
}

} // namespace lazymem

namespace lazymem {

at::Tensor real_view_of(const at::Tensor& lazy) {
  LazyBuffer* b = buffer_of(lazy);
  LAZYMEM_CHECK(b != nullptr, "expected a lazymem tensor, got a tensor on ", lazy.device());
  TensorMeta meta = TensorMeta::of(*lazy.unsafeGetTensorImpl());
  ensure_real(*b, meta.extent_bytes());
  return real_view(*b, meta);
}

} // namespace lazymem
