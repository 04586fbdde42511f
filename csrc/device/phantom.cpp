// device: the phantom allocator.
#include "device/phantom.h"

#include <sys/mman.h>

#include <atomic>

#include "core/check.h"
#include "core/runtime.h"

namespace lazymem {
namespace {

// The DataPtr context is the LazyBuffer itself, holding one reference. No locks here: the deleter
// runs wherever the last storage reference drops (Python dealloc with the GIL held, or inside a
// flush); it only marks the buffer dead and drops its reference.
void delete_handle(void* ctx) {
  auto* b = static_cast<LazyBuffer*>(ctx);
  b->storage_alive.store(false, std::memory_order_release);
  // Data nobody can name any more, kept by pending nodes that may be dead too: worth a sweep.
  if (b->holds_data.load(std::memory_order_relaxed) && c10::raw::intrusive_ptr::use_count(b) > 1) note_dead_pinned();
  c10::intrusive_ptr<LazyBuffer>::reclaim(b); // drops the DataPtr's reference
}

class AddressSpace {
 public:
  AddressSpace() {
    for (size_t size : {size_t(1) << 44, size_t(1) << 40, size_t(1) << 36}) {
      void* p = mmap(nullptr, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
      if (p != MAP_FAILED) {
        base_ = reinterpret_cast<uintptr_t>(p);
        size_ = size;
        return;
      }
    }
    // No reservation possible (ulimit -v): fall back to a high range that is never mapped by us.
    base_ = uintptr_t(1) << 46;
    size_ = size_t(1) << 40;
  }
  void* next(size_t nbytes) {
    // 256-byte granules; wraps around after the reservation (addresses stay unique among live
    // buffers unless more than the reservation's size is alive at once).
    size_t span = ((nbytes + 255) / 256 + 1) * 256;
    size_t off = cursor_.fetch_add(span, std::memory_order_relaxed) % (size_ - span);
    return reinterpret_cast<void*>(base_ + off);
  }

 private:
  uintptr_t base_ = 0;
  size_t size_ = 0;
  std::atomic<size_t> cursor_{0};
};

AddressSpace& address_space() {
  static AddressSpace* a = new AddressSpace();
  return *a;
}

class PhantomAllocator final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t nbytes) override {
    // The backing device is chosen before the first lazymem buffer exists (not at import, which must
    // not query CUDA): its captures are registered by then (core/runtime.h backing_chosen). Once per
    // process; a later change registers its own through set_backing_device.
    static const bool chosen = (static_cast<void>(backing_device()), true);
    static_cast<void>(chosen);
    LazyBuffer* b = c10::make_intrusive<LazyBuffer>(nbytes).release();
    return {address_space().next(nbytes), b, &delete_handle, c10::Device(c10::DeviceType::PrivateUse1, 0)};
  }
  c10::DeleterFnPtr raw_deleter() const override {
    return nullptr; // context != data: raw allocation is not supported
  }
  void copy_data(void*, const void*, std::size_t) const override {
    TORCH_CHECK(false, "lazymem: tried to copy the bytes of a lazymem storage directly; lazymem ",
                "storages hold no host-visible memory. Copy the tensor with .cpu() or .to(...) instead.");
  }
};

PhantomAllocator g_phantom;

} // namespace

// at::GetAllocator(PrivateUse1): torch.UntypedStorage(n, device="lazymem"), storage.resize_, empty_generic.
REGISTER_ALLOCATOR(c10::DeviceType::PrivateUse1, &g_phantom);

c10::Allocator* phantom_allocator() {
  return &g_phantom;
}

LazyBuffer* buffer_of(const c10::StorageImpl& s) {
  const c10::DataPtr& dp = s.data_ptr();
  if (dp.get_deleter() != &delete_handle) return nullptr;
  return static_cast<LazyBuffer*>(dp.get_context());
}

c10::intrusive_ptr<c10::StorageImpl> make_phantom_storage(size_t nbytes) {
  return c10::make_intrusive<c10::StorageImpl>(c10::StorageImpl::use_byte_size_t(), nbytes,
                                               g_phantom.allocate(nbytes), &g_phantom,
                                               /*resizable=*/true);
}

at::Tensor make_lazy_tensor(c10::Storage storage, const TensorMeta& meta) {
  auto impl = c10::make_intrusive<c10::TensorImpl>(
      std::move(storage), c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
      caffe2::TypeMeta::fromScalarType(meta.dtype));
  meta.apply_to(*impl);
  return at::Tensor(std::move(impl));
}

at::Tensor make_lazy_tensor(size_t nbytes, const TensorMeta& meta) {
  return make_lazy_tensor(c10::Storage(make_phantom_storage(nbytes)), meta);
}

void grow_phantom(c10::StorageImpl& s, size_t nbytes) {
  LazyBuffer* b = buffer_of(s);
  LAZYMEM_CHECK(b != nullptr, "expected a lazymem storage");
  if (nbytes <= s.nbytes()) return;
  s.set_nbytes(nbytes);
  size_t cur = b->nbytes.load();
  while (cur < nbytes && !b->nbytes.compare_exchange_weak(cur, nbytes)) {}
}

} // namespace lazymem
