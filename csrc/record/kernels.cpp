// record: kernels registered directly on PrivateUse1 that never run anything — factories,
// metadata-only views, resize_/set_, the shallow-copy check — and the
// dispatcher plumbing that is not recording (autograd fallback, conjugate/negative fallthroughs,
// sparse errors). The kernels that record or reach a sync point are registered by sync/register.cpp.
#include <ATen/EmptyTensor.h>
#include <ATen/ops/_reshape_alias_native.h>
#include <ATen/ops/as_strided_native.h>
#include <ATen/ops/unfold_native.h>
#include <ATen/ops/view_as_complex_native.h>
#include <ATen/ops/view_as_real_native.h>
#include <ATen/ops/view_native.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/autograd/autograd_not_implemented_fallback.h>
#include <torch/library.h>

#include "core/check.h"
#include "core/runtime.h"
#include "core/version.h"
#include "device/phantom.h"

namespace lazymem {
namespace {

void check_device(std::optional<c10::Device> d, const char* op) {
  if (d && d->has_index()) {
    LAZYMEM_CHECK(d->index() == 0, op, ": device index ", static_cast<int>(d->index()),
                  " is out of range; lazymem has a single device, lazymem:0");
  }
}

void check_layout(std::optional<c10::Layout> layout, const char* op) {
  LAZYMEM_CHECK_NOT_IMPLEMENTED(!layout || *layout == c10::kStrided, op, ": only strided tensors are supported on ",
                                "lazymem, got layout ", *layout);
}

at::Tensor lazy_empty(c10::IntArrayRef size, std::optional<c10::ScalarType> dtype, std::optional<c10::Layout> layout,
                      std::optional<c10::Device> device, std::optional<bool>, std::optional<c10::MemoryFormat> mf) {
  check_device(device, "empty");
  check_layout(layout, "empty");
  const c10::DispatchKeySet ks(c10::DispatchKey::PrivateUse1);
  return at::detail::empty_generic(size, phantom_allocator(), ks, c10::dtype_or_default(dtype), mf);
}

at::Tensor lazy_empty_strided(c10::IntArrayRef size, c10::IntArrayRef stride, std::optional<c10::ScalarType> dtype,
                              std::optional<c10::Layout> layout, std::optional<c10::Device> device, std::optional<bool>) {
  check_device(device, "empty_strided");
  check_layout(layout, "empty_strided");
  const c10::DispatchKeySet ks(c10::DispatchKey::PrivateUse1);
  return at::detail::empty_strided_generic(size, stride, phantom_allocator(), ks, c10::dtype_or_default(dtype));
}

size_t needed_bytes(const at::Tensor& t) {
  return at::detail::computeStorageNbytes(t.sizes(), t.strides(), t.dtype().itemsize(), t.storage_offset());
}

// resize_ on phantom storage: geometry only; growth extends the buffer (the executor keeps the old
// bytes when it next touches real data). ATen's resize_ would swap in a new DataPtr and lose the buffer.
const at::Tensor& lazy_resize_(const at::Tensor& self, c10::IntArrayRef size, std::optional<c10::MemoryFormat> mf) {
  for (int64_t s : size) LAZYMEM_CHECK(s >= 0, "resize_: negative size ", s, " in ", size);
  auto* impl = self.unsafeGetTensorImpl();
  impl->set_sizes_contiguous(size);
  if (mf) {
    LAZYMEM_CHECK(*mf != c10::MemoryFormat::Preserve, "resize_: unsupported memory format Preserve");
    impl->empty_tensor_restride(*mf);
  }
  grow_phantom(*self.storage().unsafeGetStorageImpl(), needed_bytes(self));
  return self;
}

c10::StorageImpl* lazy_storage(const c10::Storage& s, const char* op) {
  auto* impl = s.unsafeGetStorageImpl();
  LAZYMEM_CHECK(impl && buffer_of(*impl) != nullptr, op, ": the source storage is on ",
                impl ? impl->device() : c10::Device(c10::kCPU),
                ", not lazymem; copy the data with .to('lazymem') instead of aliasing it");
  return impl;
}

at::Tensor& set_geometry(at::Tensor& self, c10::Storage source, int64_t offset, c10::IntArrayRef size,
                         c10::IntArrayRef stride) {
  lazy_storage(source, "set_");
  LAZYMEM_CHECK(offset >= 0, "set_: storage offset must be non-negative, got ", offset);
  LAZYMEM_CHECK(stride.empty() || stride.size() == size.size(), "set_: got ", size.size(), " sizes and ",
                stride.size(), " strides");
  auto* impl = self.unsafeGetTensorImpl();
  if (!impl->storage().is_alias_of(source)) impl->set_storage_keep_dtype(source);
  if (stride.empty()) {
    impl->set_sizes_contiguous(size);
    impl->set_storage_offset(offset);
  } else {
    impl->set_sizes_and_strides(size, stride, offset);
  }
  grow_phantom(*source.unsafeGetStorageImpl(), needed_bytes(self));
  return self;
}

at::Tensor& lazy_set_storage_offset(at::Tensor& self, c10::Storage source, int64_t offset, c10::IntArrayRef size,
                                    c10::IntArrayRef stride) {
  return set_geometry(self, std::move(source), offset, size, stride);
}

at::Tensor& lazy_set_storage(at::Tensor& self, c10::Storage source) {
  lazy_storage(source, "set_");
  int64_t n = static_cast<int64_t>(source.nbytes() / self.dtype().itemsize());
  return set_geometry(self, std::move(source), 0, {n}, {});
}

at::Tensor& lazy_set_tensor(at::Tensor& self, const at::Tensor& src) {
  LAZYMEM_CHECK(is_lazy(src), "set_: the source tensor is on ", src.device(), ", not lazymem");
  LAZYMEM_CHECK(self.dtype() == src.dtype(), "set_: could not set tensor of type ", self.dtype(),
                " to a tensor of type ", src.dtype());
  return set_geometry(self, src.storage(), src.storage_offset(), src.sizes(), src.strides());
}

at::Tensor& lazy_set_empty(at::Tensor& self) {
  auto* impl = self.unsafeGetTensorImpl();
  impl->set_storage_keep_dtype(c10::Storage(make_phantom_storage(0)));
  impl->set_sizes_contiguous({0});
  return self;
}

// param.data = other and Module.to() keep Parameter objects only between "compatible" tensor
// types; core lists CPU/CUDA/... dense but not PrivateUse1. A lazymem TensorImpl is a plain
// storage-backed TensorImpl, so a shallow copy between it and any dense strided tensor is safe: this
// keeps parameter identity (and tied weights) through model.to("lazymem") and back, as for CUDA.
bool lazy_has_compatible_shallow_copy_type(const at::Tensor& self, const at::Tensor& from) {
  auto dense = [](const at::Tensor& t) {
    return t.layout() == c10::kStrided && !t.is_sparse() && !t.is_quantized() && !t.is_nested() &&
        !t.is_mkldnn() && t.has_storage() && !t.key_set().has_any(c10::python_ks);
  };
  return dense(self) && dense(from) &&
      (is_lazy(self) || self.is_cpu() || self.is_cuda()) && (is_lazy(from) || from.is_cpu() || from.is_cuda());
}

} // namespace
} // namespace lazymem

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  using namespace lazymem;
  m.impl("empty.memory_format", TORCH_FN(lazy_empty));
  m.impl("empty_strided", TORCH_FN(lazy_empty_strided));
  m.impl("as_strided", TORCH_FN(at::native::as_strided_tensorimpl));
  m.impl("view", TORCH_FN(at::native::view));
  m.impl("_reshape_alias", TORCH_FN(at::native::_reshape_alias));
  m.impl("unfold", TORCH_FN(at::native::unfold));
  m.impl("view_as_real", TORCH_FN(at::native::view_as_real));
  m.impl("view_as_complex", TORCH_FN(at::native::view_as_complex));
  m.impl("resize_", TORCH_FN(lazy_resize_));
  m.impl("set_.source_Storage", TORCH_FN(lazy_set_storage));
  m.impl("set_.source_Storage_storage_offset", TORCH_FN(lazy_set_storage_offset));
  m.impl("set_.source_Tensor", TORCH_FN(lazy_set_tensor));
  m.impl("set_", TORCH_FN(lazy_set_empty));
  m.impl("_has_compatible_shallow_copy_type", TORCH_FN(lazy_has_compatible_shallow_copy_type));
}

// Core registers autograd fallbacks for the built-in backends only; without one, custom ops without
// derivative formulas would fail to dispatch (or silently lose grad_fn with a fallthrough).
TORCH_LIBRARY_IMPL(_, AutogradPrivateUse1, m) {
  m.fallback(torch::autograd::autogradNotImplementedFallback());
}

// The conjugate/negative-bit fallbacks resolve their bit by cloning, and a clone of a lazymem tensor
// copies through _copy_from again: endless recursion. _copy_from handles both bits itself (the
// recorded copy_ and the download both see the bit), so let it fall through.
TORCH_LIBRARY_IMPL(aten, Conjugate, m) {
  m.impl("_copy_from", torch::CppFunction::makeFallthrough());
  m.impl("_copy_from_and_resize", torch::CppFunction::makeFallthrough());
}

TORCH_LIBRARY_IMPL(aten, Negative, m) {
  m.impl("_copy_from", torch::CppFunction::makeFallthrough());
  m.impl("_copy_from_and_resize", torch::CppFunction::makeFallthrough());
}

namespace {
// Sparse layouts are not supported: fail at the first sparse op with a message that says what to do.
void sparse_unsupported(const c10::OperatorHandle& op, torch::jit::Stack*) {
  TORCH_CHECK_NOT_IMPLEMENTED(false, "lazymem: ", op.schema().name(), ": sparse tensors are not supported on ",
                              "lazymem; convert them with .to_dense() before moving them to lazymem");
}
} // namespace

TORCH_LIBRARY_IMPL(_, SparsePrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&sparse_unsupported>());
}

TORCH_LIBRARY_IMPL(_, SparseCsrPrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&sparse_unsupported>());
}
