// execute: the binder.
#include "execute/bind.h"

#include <cstdio>

#include <cmath>
#include <cstdint>
#include <optional>

#include <ATen/TensorOperators.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/hypot.h>
#include <ATen/ops/logaddexp.h>
#include <ATen/ops/maximum.h>
#include <ATen/ops/minimum.h>
#include <ATen/ops/pow.h>

#include "core/check.h"
#include "core/config.h"
#include "core/runtime.h"
#include "execute/real.h"
#include "execute/transfer.h"
#include "plan/localize.h"

namespace lazymem {
namespace {

// acc = the p-norm of the rows behind `acc` and those behind `part` (both p-norms, nonnegative):
// (acc^p + part^p)^(1/p). New values are computed aside, then copied, so an allocation failure
// leaves the accumulator as it was.
void merge_norms(at::Tensor& acc, const at::Tensor& part, double p) {
  if (std::isinf(p)) {
    acc.copy_(p > 0 ? at::maximum(acc, part) : at::minimum(acc, part));
  } else if (p == 0 || p == 1) {
    acc.copy_(acc + part);
  } else if (p == 2) {
    acc.copy_(at::hypot(acc, part));
  } else {
    acc.copy_(at::pow(at::pow(acc, p) + at::pow(part, p), 1.0 / p));
  }
}

using Taken = c10::SmallVector<const c10::StorageImpl*, 8>;

// Copies a kernel's result into `b`'s view `dst`: across the boundary when `b` is held in host memory.
void store(const LazyBuffer& b, const at::Tensor& dst, const at::Tensor& r) {
  if (b.real_on_host) {
    copy_out(dst, r);
  } else {
    dst.copy_(r);
  }
}

// A kernel result can become a buffer's (or slot's) storage when it is plain dense data on the
// backing device with exactly the expected geometry and enough bytes, and no other output of the
// same node already took its storage. A ZeroTensor has a sized storage with no memory behind it,
// and other functionality keys (conj/neg bits, Python) change what the bytes mean.
bool adoptable(const at::Tensor& r, const TensorMeta& m, size_t min_bytes, const Taken& taken) {
  const c10::StorageImpl* rs = r.has_storage() ? r.storage().unsafeGetStorageImpl() : nullptr;
  bool plain = rs && (rs->data_ptr().get() != nullptr || rs->nbytes() == 0) &&
      !r.key_set().has_any(c10::DispatchKeySet({c10::DispatchKey::ZeroTensor, c10::DispatchKey::Python}));
  return plain && r.device() == backing_device() && r.scalar_type() == m.dtype && r.sizes().equals(m.sizes) &&
      r.strides().equals(m.strides) && r.storage_offset() == m.offset && r.is_conj() == m.conj &&
      r.is_neg() == m.neg && rs->nbytes() >= min_bytes && std::find(taken.begin(), taken.end(), rs) == taken.end();
}

bool same_layout(const c10::TensorImpl& t, const TensorMeta& m) {
  return t.dtype() == caffe2::TypeMeta::fromScalarType(m.dtype) && t.storage_offset() == m.offset &&
      t.sizes().equals(m.sizes) && t.strides().equals(m.strides) && t.is_conj() == m.conj && t.is_neg() == m.neg;
}

void note_copied(const Def& d, const TensorMeta& m, const at::Tensor& r) {
  stats().outputs_copied.fetch_add(1, std::memory_order_relaxed);
  if (config().debug) {
    std::fprintf(stderr, "[lazymem] output %d copied: recorded %s, kernel returned strides %s offset %lld\n", d.ret,
                 m.to_string().c_str(), c10::str(r.strides()).c_str(), static_cast<long long>(r.storage_offset()));
  }
}

// The kernel disagrees with meta inference on an output's shape. Known placeholders (native_batch_norm's
// saved statistics in eval mode: empty on the CPU, sized in meta) keep the meta shape with uninitialized
// values, as placeholders are never read; anything else fails for this output alone.
void check_shape(const Def& d, const TensorMeta& m, const at::Tensor& r, bool placeholder) {
  LAZYMEM_CHECK(placeholder && (r.numel() == 0 || m.numel() == 0), "meta inference and the ", backing_device(),
                " kernel disagree on the shape of output ", d.ret, ": ", m.to_string(), " vs ", r.sizes(),
                "; this output cannot be used on lazymem (please report the op)");
}

} // namespace

at::Tensor storage_view(const c10::Storage& storage, const TensorMeta& meta, bool host) {
  // A view past the storage's end reads another block's bytes: a wrong answer, never a result.
  LAZYMEM_INTERNAL_ASSERT(meta.numel() == 0 || meta.extent_bytes() <= storage.nbytes(), "a view ", meta.to_string(),
                          " reaches past the end of its storage of ", storage.nbytes(), " bytes");
  auto impl = c10::make_intrusive<c10::TensorImpl>(
      c10::Storage(storage), c10::DispatchKeySet(host ? c10::DispatchKey::CPU : backing_key()),
      caffe2::TypeMeta::fromScalarType(meta.dtype));
  meta.apply_to(*impl);
  return at::Tensor(std::move(impl));
}

Binder::Binder(const Stage& stage)
    : stage_(stage), local_(stage.slots.size()), acc_started_(stage.accs.size(), 0) {
  if (!stage.loop) return;
  for (const PlannedNode& pn : stage.nodes) {
    for (size_t i = 0; i < pn.uses.size(); ++i) {
      const LazyBuffer& b = *pn.node->uses[i].ref.buf;
      if (b.has_real() && b.real_on_host && copied_ahead(stage, pn, i)) aheadable_.emplace_back(&pn, i);
    }
  }
}

void Binder::copy_ahead(const PlannedNode* pn, int64_t start, int64_t rows) {
  if (aheadable_.empty() || rows <= 0) return;
  for (const auto& [p, i] : aheadable_) {
    if (pn && p != pn) continue;
    for (auto it = ahead_.begin(); it != ahead_.end(); ++it) {
      if (it->pn == p && it->use == i) {
        ahead_.erase(it); // (rows of a chunk that did not come: its copy ends first)
        break;
      }
    }
    const int64_t c0 = c0_, c1 = c1_;
    c0_ = start;
    c1_ = start + rows;
    const auto [first, count] = rows_of(p->uses[i].map);
    at::Tensor v = count > 0 ? home(*p, i) : at::Tensor();
    c0_ = c0;
    c1_ = c1;
    if (!v.defined()) continue;
    try {
      ahead_.push_back(Ahead{p, i, first, count, std::make_unique<PendingCopy>(v)});
    } catch (const c10::OutOfMemoryError&) { // NOLINT(bugprone-empty-catch): copied when the node runs
    }
  }
}

at::Tensor Binder::take_ahead(const PlannedNode& pn, size_t i, const at::Tensor& v) {
  const int64_t key = static_cast<int64_t>(i);
  for (const Copy& c : copies_) {
    if (c.key == key) return c.device;
  }
  for (auto it = ahead_.begin(); it != ahead_.end(); ++it) {
    if (it->pn != &pn || it->use != i) continue;
    const auto [first, count] = rows_of(pn.uses[i].map);
    std::unique_ptr<PendingCopy> copy = std::move(it->copy);
    const bool match = it->first == first && it->count == count;
    ahead_.erase(it);
    if (!match) return at::Tensor(); // other rows: dropped (once its copy has ended)
    at::Tensor d = copy->get();
    copied_bytes_ += copy->bytes();
    copies_.push_back(Copy{key, v, d, false});
    return d;
  }
  return at::Tensor();
}

size_t Binder::node_index(const PlannedNode& pn) const {
  const PlannedNode* first = stage_.nodes.data();
  return &pn >= first && &pn < first + stage_.nodes.size() ? static_cast<size_t>(&pn - first) : SIZE_MAX;
}

void Binder::keep(const PlannedNode& pn, size_t i, const at::Tensor& home, const at::Tensor& r, const Taken& taken) {
  const size_t j = node_index(pn);
  for (Kept& k : kept_) {
    if (k.rows.read || k.rows.writer != j || k.rows.def != i) continue;
    // Readers view it as dense rows in the order of `home`'s elements, holding `home`'s values: the
    // kernel's result as it is when it is that and nothing else holds its memory (an operand it
    // aliases may be updated before a reader), else a dense copy (made inside the node's measured
    // window: the executor learns it as the node's workspace).
    const c10::StorageImpl* rs = r.has_storage() ? r.storage().unsafeGetStorageImpl() : nullptr;
    const bool as_is = rs && r.is_contiguous() && r.sizes().equals(home.sizes()) &&
        r.scalar_type() == home.scalar_type() && !r.is_conj() && !r.is_neg() &&
        !r.key_set().has_any(c10::DispatchKeySet({c10::DispatchKey::ZeroTensor, c10::DispatchKey::Python})) &&
        std::find(taken.begin(), taken.end(), rs) == taken.end();
    k.device = as_is ? r : at::empty(home.sizes(), home.options().device(backing_device())).copy_(r);
    k.home = home;
  }
}

at::Tensor Binder::kept_view(const PlannedNode& pn, size_t i, const at::Tensor& home) const {
  const size_t j = node_index(pn);
  for (const Kept& k : kept_) {
    if (!k.device.defined() ||
        std::find(k.rows.readers.begin(), k.rows.readers.end(), std::make_pair(j, i)) == k.rows.readers.end()) {
      continue;
    }
    // The reader's view of the value's storage, as a view of the kept rows (dense, in the order of
    // `k.home`'s elements: keep()).
    const int64_t delta = home.storage_offset() - k.home.storage_offset();
    int64_t span = 0;
    for (int64_t d = 0; d < home.dim(); ++d) span += (home.size(d) - 1) * home.stride(d);
    if (!k.home.is_contiguous() || delta < 0 || (home.numel() > 0 && delta + span >= k.home.numel())) {
      return at::Tensor(); // (not expected: kept_rows checked the views)
    }
    return k.device.as_strided(home.sizes(), home.strides(), k.device.storage_offset() + delta);
  }
  return at::Tensor();
}

void Binder::begin_chunk(int64_t start, int64_t rows) {
  if (!kept_known_) { // (the values the loop assembles in host memory have their storage by now)
    kept_known_ = true;
    for (KeptRows& k : kept_rows(stage_, [](const LazyBuffer* b) { return b->has_real() && b->real_on_host; })) {
      kept_.push_back(Kept{std::move(k), at::Tensor(), at::Tensor()});
    }
  }
  for (Kept& k : kept_) {
    k.device.reset();
    k.home.reset();
  }
  copies_.clear();
  c0_ = start;
  c1_ = start + rows;
  node_start_ = start;
  node_rows_ = rows;
  node_total_ = stage_.batch;
  for (auto& s : local_) s = c10::Storage();
}

bool Binder::begin_node(const PlannedNode& pn) {
  copies_.clear();
  const auto [first, count] = rows_of(pn.rows);
  node_start_ = first;
  node_rows_ = count;
  node_total_ = pn.rows.identity() ? stage_.batch : pn.rows.n;
  return count > 0 || !pn.row_node;
}

void Binder::after_node(const PlannedNode& pn) {
  if (kept_.empty()) return;
  const size_t j = node_index(pn);
  for (Kept& k : kept_) {
    if (k.rows.last != j) continue;
    k.device.reset();
    k.home.reset();
  }
}

void Binder::end_chunk() {
  for (auto& s : local_) s = c10::Storage();
  for (Kept& k : kept_) {
    k.device.reset();
    k.home.reset();
  }
}

int64_t Binder::slot_bytes(int32_t slot) const {
  const Slot& sl = stage_.slots[slot];
  if (sl.store != Store::kLocal) return sl.bytes;
  const auto [first, last] = local_rows(sl.layout, c0_, c1_);
  return sl.layout.bytes(last - first);
}

c10::Storage& Binder::slot_storage(int32_t slot) {
  c10::Storage& s = local_[slot];
  if (!s) s = allocate_real(static_cast<size_t>(slot_bytes(slot)));
  return s;
}

at::Tensor Binder::slot_view(int32_t slot, const TensorMeta& meta, bool partial) {
  const Slot& sl = stage_.slots[slot];
  if (partial && !local_[slot]) {
    // A partial read before anything wrote it in this chunk (its writers hold no rows here, as when
    // two backward calls over halves of the batch accumulate into one gradient): a sum's zero.
    storage_view(slot_storage(slot), TensorMeta::contiguous({sl.bytes}, c10::kByte)).zero_();
  }
  TensorMeta m = partial ? meta : localize(meta, sl.layout, c0_, c1_);
  return storage_view(slot_storage(slot), m);
}

at::Tensor Binder::device_copy(int64_t key, const at::Tensor& home, bool back, bool fill) {
  for (const Copy& c : copies_) {
    if (c.key == key) return c.device;
  }
  // A value the node only overwrites needs no bytes brought over.
  copied_bytes_ += static_cast<int64_t>(home.numel() * home.element_size());
  at::Tensor d = fill ? copy_to_device(home) : at::empty(home.sizes(), home.options().device(backing_device()));
  copies_.push_back(Copy{key, home, d, back});
  return d;
}

at::Tensor Binder::use(const PlannedNode& pn, size_t i) {
  at::Tensor v = home(pn, i);
  const Use& u = pn.node->uses[i];
  const Bound* bd = pn.uses.empty() ? nullptr : &pn.uses[i];
  // Only the buffer's own storage can be in host memory (slots are chunk-local device storage).
  const bool own = !bd || bd->bind == Bind::kWhole || bd->bind == Bind::kNarrow;
  if (!own || !u.ref.buf->real_on_host || !v.defined()) return v;
  if (bd && bd->bind == Bind::kNarrow && bd->outer != 1) { // a gathered copy
    copied_bytes_ += static_cast<int64_t>(v.numel() * v.element_size());
    return copy_to_device(v);
  }
  if (!kept_.empty() && bd && bd->bind == Bind::kNarrow && !u.write) {
    if (at::Tensor d = kept_view(pn, i, v); d.defined()) {
      stats().kept_reads.fetch_add(1, std::memory_order_relaxed);
      return d;
    }
  }
  at::Tensor d;
  if (!ahead_.empty() && bd && bd->bind == Bind::kNarrow) d = take_ahead(pn, i, v);
  if (!d.defined()) d = device_copy(static_cast<int64_t>(i), v, u.write, !u.write_only);
  if (!kept_.empty() && bd && bd->bind == Bind::kNarrow && !u.write) keep_read(pn, i, v, d);
  return d;
}

void Binder::keep_read(const PlannedNode& pn, size_t i, const at::Tensor& home, const at::Tensor& d) {
  const size_t j = node_index(pn);
  for (Kept& k : kept_) {
    if (!k.rows.read || k.rows.writer != j || k.rows.def != i) continue;
    // The copy is dense in the order of `home`'s elements (copy_to_device, PendingCopy), which are
    // one dense range (kept_rows): what kept_view expects.
    if (!home.is_contiguous() || !d.is_contiguous() || !d.sizes().equals(home.sizes())) return;
    k.device = d;
    k.home = home;
  }
}

at::Tensor Binder::home(const PlannedNode& pn, size_t i) {
  const Use& u = pn.node->uses[i];
  LazyBuffer& b = *u.ref.buf;
  const Bound* bd = pn.uses.empty() ? nullptr : &pn.uses[i];
  if (!bd || bd->bind == Bind::kWhole) {
    if (!u.full_overwrite() && !stage_.loop) {
      LAZYMEM_INTERNAL_ASSERT(b.has_real() ? b.real_version == u.ref.version : u.ref.version == 0,
                              pn.node->describe(), " reads b", b.id, " version ", u.ref.version,
                              " but the executor holds version ", b.real_version, b.has_real() ? "" : " (no data)");
    }
    ensure_real(b, u.ref.meta.extent_bytes(), &operand_storage_bytes_);
    // A read in the layout its kernel returned: that tensor (a TensorImpl per read cost ~800
    // instructions of a tiny op's ~11,000 replayed; eager passes its tensor on too).
    if (!u.write && b.real_impl && !b.real_on_host && same_layout(*b.real_impl, u.ref.meta)) {
      return at::Tensor(b.real_impl);
    }
    return real_view(b, u.ref.meta);
  }
  switch (bd->bind) {
    case Bind::kLocal: {
      // A chunk-local value is written in the chunk before anything reads it (by the node defining it,
      // or by a node run again for it): reading a fresh slot would read garbage.
      const Slot& sl = stage_.slots[bd->slot];
      const auto [first, last] = local_rows(sl.layout, c0_, c1_);
      LAZYMEM_INTERNAL_ASSERT(local_[bd->slot] || u.full_overwrite() || u.write_only || first == last,
                              pn.node->describe(), " reads rows of b", b.id, " that nothing wrote in this chunk");
      if (!local_[bd->slot]) operand_storage_bytes_ += slot_bytes(bd->slot);
      return slot_view(bd->slot, u.ref.meta, false);
    }
    case Bind::kPartial:
      return slot_view(bd->slot, u.ref.meta, true);
    case Bind::kNarrow: {
      LAZYMEM_INTERNAL_ASSERT(b.has_real(), pn.node->describe(), " reads rows of b", b.id, " which has no storage");
      // The buffer's own rows in this chunk (a slice of the batch, x[:h], holds fewer than the chunk).
      const auto [first, count] = rows_of(bd->map);
      if (bd->outer != 1) {
        // Rows of every block of a time-major flatten: gathered into a copy of the chunk's shape.
        LAZYMEM_INTERNAL_ASSERT(!u.write, pn.node->describe(), " writes rows of a time-major flatten in place");
        const TensorMeta g = gathered_rows(u.ref.meta, bd->dim, bd->unit, bd->outer, count);
        // (Held in host memory: gathered there, then copied over whole by use().)
        std::optional<CountingScope> host;
        if (b.real_on_host) {
          await_copies_out(b.real.unsafeGetStorageImpl()); // (read on the host)
          host.emplace(&host_counter());
        }
        return real_view(b, narrow_rows_blocks(u.ref.meta, bd->dim, bd->unit, bd->outer, first, count))
            .reshape(g.sizes);
      }
      return real_view(b, narrow_rows(u.ref.meta, bd->dim, bd->unit, first, count));
    }
    default:
      break;
  }
  LAZYMEM_INTERNAL_ASSERT(false, "bad binding for a use of ", pn.node->describe());
  return at::Tensor();
}

c10::IValue Binder::constant(const PlannedNode& pn, const ConstNarrow& c) const {
  const c10::IValue& v = c.elem < 0 ? pn.node->args[c.arg] : pn.node->args[c.arg].toList().get(c.elem);
  const at::Tensor& t = v.toTensor();
  if (c.outer > 1) { // the chunk's rows of each block, gathered block-major (plan.h ConstNarrow)
    const at::Tensor blocks = t.unflatten(c.dim, {c.outer, t.size(c.dim) / c.outer});
    return c10::IValue(blocks.narrow(c.dim + 1, node_start_ * c.unit, node_rows_ * c.unit).flatten(c.dim, c.dim + 1));
  }
  return c10::IValue(t.narrow(c.dim, node_start_ * c.unit, node_rows_ * c.unit));
}

TensorMeta Binder::def_meta(const PlannedNode& pn, size_t i) const {
  const Def& d = pn.node->defs[i];
  const Bound* bd = pn.defs.empty() ? nullptr : &pn.defs[i];
  if (!bd) return d.ref.meta;
  switch (bd->bind) {
    case Bind::kLocal:
      return localize(d.ref.meta, stage_.slots[bd->slot].layout, c0_, c1_);
    case Bind::kNarrow: {
      const auto [first, count] = rows_of(bd->map);
      if (bd->outer != 1) return gathered_rows(d.ref.meta, bd->dim, bd->unit, bd->outer, count);
      return narrow_rows(d.ref.meta, bd->dim, bd->unit, first, count);
    }
    default:
      return d.ref.meta;
  }
}

void Binder::def(const PlannedNode& pn, size_t i, const at::Tensor& r, Taken& taken) {
  const Def& d = pn.node->defs[i];
  LazyBuffer& b = *d.ref.buf;
  const Bound* bd = pn.defs.empty() ? nullptr : &pn.defs[i];
  const Bind bind = bd ? bd->bind : Bind::kWhole;
  if (bind == Bind::kDiscard) return;
  const TensorMeta m = def_meta(pn, i);
  if (!r.defined()) {
    // Some kernels return an undefined tensor where the meta kernel gives an empty one
    // (_native_multi_head_attention's weights without need_weights): the empty tensor it promised.
    LAZYMEM_INTERNAL_ASSERT(m.numel() == 0, "kernel returned an undefined tensor where meta inference promised ",
                            m.to_string());
    def(pn, i, at::empty(m.sizes, at::TensorOptions().dtype(m.dtype).device(backing_device())), taken);
    return;
  }
  if (bind == Bind::kWhole) {
    if (!b.has_real() && adoptable(r, m, b.nbytes.load(), taken)) {
      b.set_real(r.storage());
      b.real_impl = r.getIntrusivePtr();
      taken.push_back(r.storage().unsafeGetStorageImpl());
      return;
    }
    if (!r.sizes().equals(m.sizes)) {
      check_shape(d, m, r, pn.placeholder_outputs);
      ensure_real(b, m.extent_bytes());
      return;
    }
    // Meta and real strides can differ for ops without structured kernels: the recorded metadata is
    // authoritative, so the values are copied into the layout every lazymem view expects.
    note_copied(d, m, r);
    ensure_real(b, m.extent_bytes());
    store(b, real_view(b, m), r);
    return;
  }
  if (bind == Bind::kNarrow) {
    LAZYMEM_INTERNAL_ASSERT(b.has_real(), pn.node->describe(), " writes rows of b", b.id, " which has no storage");
    if (!r.sizes().equals(m.sizes)) {
      check_shape(d, m, r, pn.placeholder_outputs);
      return;
    }
    if (bd->outer != 1) { // scattered into every block of a time-major flatten
      const auto [first, count] = rows_of(bd->map);
      const TensorMeta e = narrow_rows_blocks(d.ref.meta, bd->dim, bd->unit, bd->outer, first, count);
      store(b, real_view(b, e), r.reshape(e.sizes));
      return;
    }
    const at::Tensor dst = real_view(b, m);
    store(b, dst, r);
    if (!kept_.empty() && b.real_on_host) keep(pn, i, dst, r, taken);
    return;
  }
  // kLocal / kPartial: the slot's storage.
  const Slot& sl = stage_.slots[bd->slot];
  int64_t local = sl.bytes;
  if (sl.store == Store::kLocal) {
    const auto [first, last] = local_rows(sl.layout, c0_, c1_);
    local = sl.layout.bytes(last - first);
  }
  const size_t need = static_cast<size_t>(local);
  c10::Storage& s = local_[bd->slot];
  if (!s && adoptable(r, m, need, taken)) {
    s = r.storage();
    taken.push_back(r.storage().unsafeGetStorageImpl());
    return;
  }
  if (!r.sizes().equals(m.sizes)) {
    check_shape(d, m, r, pn.placeholder_outputs);
    slot_storage(bd->slot);
    return;
  }
  storage_view(slot_storage(bd->slot), m).copy_(r);
}

at::Tensor Binder::bound_def(const PlannedNode& pn, size_t i) {
  const Def& d = pn.node->defs[i];
  const Bound* bd = pn.defs.empty() ? nullptr : &pn.defs[i];
  const TensorMeta m = def_meta(pn, i);
  if (bd && bd->bind == Bind::kDiscard) return at::Tensor();
  LAZYMEM_INTERNAL_ASSERT(!bd || bd->bind != Bind::kNarrow || bd->outer == 1, pn.node->describe(),
                          ": rows of a time-major flatten are no view");
  if (!bd || bd->bind == Bind::kWhole) ensure_real(*d.ref.buf, m.extent_bytes());
  if (!bd || bd->bind == Bind::kWhole || bd->bind == Bind::kNarrow) {
    at::Tensor v = real_view(*d.ref.buf, m);
    // Written by the node on the device, then copied into its home in host memory. With its contents:
    // a def already stored there (then divided by replay's post_div) is read back too.
    return d.ref.buf->real_on_host ? device_copy(~static_cast<int64_t>(i), v, true, true) : v;
  }
  return storage_view(slot_storage(bd->slot), m);
}

at::Tensor Binder::rows_along(const Bound* bd, const at::Tensor& full) const {
  if (!stage_.loop || !bd || (bd->bind != Bind::kLocal && bd->bind != Bind::kNarrow) || bd->dim < 0) return full;
  LAZYMEM_INTERNAL_ASSERT(bd->outer == 1, "rows of a time-major flatten along a random node's stream");
  const auto [first, count] = rows_of(bd->map);
  return full.narrow(bd->dim, first * bd->unit, count * bd->unit);
}

void Binder::done(const PlannedNode& pn) {
  for (const Copy& c : copies_) {
    if (c.back) copy_out(c.home, c.device);
  }
  copies_.clear();
  if (stage_.loop) return; // loops publish versions when they end
  const Node& n = *pn.node;
  for (const Def& d : n.defs) d.ref.buf->real_version = d.ref.version;
  for (const Use& u : n.uses) {
    if (!u.write) continue;
    u.ref.buf->real_version = u.write_version;
    if (u.full_overwrite()) u.ref.buf->poison = nullptr;
  }
}

void Binder::accumulate(int32_t slot) {
  const Slot& sl = stage_.slots[slot];
  const Accumulator& a = stage_.accs[sl.acc];
  LazyBuffer& b = *a.buf;
  c10::Storage& part = local_[slot];
  LAZYMEM_INTERNAL_ASSERT(static_cast<bool>(part), "partial of b", b.id, " was never written in this chunk");
  if (!acc_started_[sl.acc]) {
    // The first chunk's partial becomes the accumulator — whatever the buffer held before this loop
    // (an earlier execution of the same loop that finished before the plan stopped, replanned from
    // there, must not be added to).
    acc_started_[sl.acc] = 1;
    if (part.nbytes() >= b.nbytes.load()) {
      b.set_real(part);
    } else {
      if (b.has_real() && b.real.nbytes() < b.nbytes.load()) b.drop_real();
      ensure_real(b, b.nbytes.load());
      real_view(b, a.meta).copy_(storage_view(part, a.meta));
    }
    return;
  }
  at::Tensor acc = real_view(b, a.meta);
  at::Tensor p = storage_view(part, a.meta);
  switch (a.reduce) {
    case Reduce::kSum:
      acc.add_(p);
      break;
    case Reduce::kMax:
      at::maximum_out(acc, acc, p);
      break;
    case Reduce::kMin:
      at::minimum_out(acc, acc, p);
      break;
    case Reduce::kMoments: {
      // (biased variance, mean) of the rows before this chunk merged with this chunk's (Chan et al.):
      // mean += d * nb / n, var = var * na / n + var_b * nb / n + d^2 * na * nb / n^2, d = mean_b - mean.
      // (Chunks run in order: the rows before this chunk's are the node's rows [0, start).)
      const double na = static_cast<double>(node_start_) * static_cast<double>(a.per_row);
      const double nb = static_cast<double>(node_rows_) * static_cast<double>(a.per_row);
      const double n = na + nb;
      at::Tensor var = acc.select(0, 0), mean = acc.select(0, 1);
      // Computed aside, then copied (copies allocate nothing): an allocation failure leaves the
      // accumulator as it was, so the chunk can be retried.
      at::Tensor d = p.select(0, 1).sub(mean);
      at::Tensor v = var.mul(na / n).add_(p.select(0, 0), nb / n).add_(d.mul(d), na * nb / (n * n));
      at::Tensor m = mean.add(d, nb / n);
      var.copy_(v);
      mean.copy_(m);
      break;
    }
    case Reduce::kLogSumExp:
      acc.copy_(at::logaddexp(acc, p));
      break;
    case Reduce::kNorm:
      merge_norms(acc, p, a.ord);
      break;
    case Reduce::kNone:
      acc.copy_(p); // idempotent partials (every chunk computes the same value)
      break;
  }
}

} // namespace lazymem
