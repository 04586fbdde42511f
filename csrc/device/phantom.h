// device: phantom storage. Every lazymem tensor is a plain TensorImpl on a StorageImpl whose
// DataPtr context owns a reference to a LazyBuffer and whose data pointer is a unique address in a
// PROT_NONE reservation: never dereferenced (a stray host access faults instead of corrupting
// memory), unique so libraries that dedupe storages by data_ptr keep working.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Allocator.h>
#include <c10/core/StorageImpl.h>

#include "ir/node.h"

namespace lazymem {

c10::Allocator* phantom_allocator();

// The buffer behind a lazymem storage, or nullptr if `s` is not a phantom storage.
LazyBuffer* buffer_of(const c10::StorageImpl& s);
inline LazyBuffer* buffer_of(const at::TensorBase& t) {
  return t.has_storage() ? buffer_of(*t.storage().unsafeGetStorageImpl()) : nullptr;
}
inline BufferPtr buffer_ptr(LazyBuffer* b) {
  return c10::intrusive_ptr<LazyBuffer>::unsafe_reclaim_from_nonowning(b);
}

inline bool is_lazy(const at::TensorBase& t) {
  return t.defined() && t.device().type() == c10::DeviceType::PrivateUse1;
}

// A fresh phantom storage (and LazyBuffer) of `nbytes`.
c10::intrusive_ptr<c10::StorageImpl> make_phantom_storage(size_t nbytes);
// A lazymem tensor on `storage` with `meta`'s geometry and dtype.
at::Tensor make_lazy_tensor(c10::Storage storage, const TensorMeta& meta);
// A lazymem tensor on a fresh phantom storage of `nbytes` bytes.
at::Tensor make_lazy_tensor(size_t nbytes, const TensorMeta& meta);
// Grows a phantom storage (resize_, set_ past the end); contents are preserved by the executor.
void grow_phantom(c10::StorageImpl& s, size_t nbytes);

} // namespace lazymem
