// execute: real memory on the backing device. Real storages are allocated (and charged to the
// lazymem device counter) only here and in kernels run under replay_scope(); real views are
// TensorImpls over a buffer's real storage with a TensorRef's geometry.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/impl/LocalDispatchKeySet.h>

#include "execute/memory.h"
#include "ir/node.h"

namespace lazymem {

// Everything a kernel run on behalf of lazymem needs: autograd, autocast, Python modes and
// functorch excluded (the recorded ops are already below autograd), and CPU allocations charged to
// the lazymem device counter.
class ReplayScope {
 public:
  ReplayScope();

 private:
  c10::impl::ExcludeDispatchKeyGuard exclude_;
  CountingScope counting_;
};

// Allocates `nbytes` of real storage on the backing device.
c10::Storage allocate_real(size_t nbytes);
// Allocates `nbytes` of host memory for the device (a value whose home is the host): counted as
// host memory (execute/memory.h, storage_domain); pinned when the backing device has a pinned
// allocator, so copies to and from it can run asynchronously.
c10::Storage allocate_host(size_t nbytes);
// A value held in host memory comes home to the device (an op that runs eagerly on it): copied over
// (counted) into device storage. Nothing if it is on the device.
void bring_to_device(LazyBuffer& b);
// Makes sure `b` has real storage covering `need` bytes: allocates (uninitialized, as eager empty
// does) if it has none, grows it keeping the old bytes if it is too small. `allocating`: the bytes it
// allocates are added there first (an allocation refused is counted too).
void ensure_real(LazyBuffer& b, size_t need, int64_t* allocating = nullptr);
// A backing-device tensor viewing `b`'s real storage with `meta`'s geometry (b must have real data).
at::Tensor real_view(LazyBuffer& b, const TensorMeta& meta);
inline at::Tensor real_view(const TensorRef& r) {
  return real_view(*r.buf, r.meta);
}
// The backing-device view of a lazymem tensor's current value (its buffer must already be
// materialized, or at version 0). The caller holds the flush lock while it uses the view.
at::Tensor real_view_of(const at::Tensor& lazy);

} // namespace lazymem
