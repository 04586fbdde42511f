// record: meta mirrors and the inference cache.
#include "record/meta.h"

#include <atomic>
#include <mutex>
#include <unordered_map>

#include <ATen/MemoryOverlap.h>
#include <ATen/ops/empty_strided.h>
#include <c10/core/impl/LocalDispatchKeySet.h>

#include "core/boxed.h"
#include "core/check.h"
#include "core/config.h"
#include "core/runtime.h"
#include "device/phantom.h"
#include "ops/meta_probe.h"
#include "record/cpp_meta.h"
#include "record/native_meta.h"
#include "record/layout.h"

namespace lazymem {
namespace {

using Cache = std::unordered_map<CallKey, std::shared_ptr<const MetaResult>, CallKeyHash>;

std::mutex g_cache_mu;
std::atomic<uint64_t> g_cache_generation{0}; // bumped by clears, so per-thread fronts drop their copies
Cache& cache() {
  static Cache* c = new Cache();
  return *c;
}

// Per-thread front of the shared cache: hits on the recording hot path take no lock.
struct LocalCache {
  Cache entries;
  uint64_t generation = 0;
  Cache& current() {
    uint64_t g = g_cache_generation.load(std::memory_order_acquire);
    if (g != generation) {
      entries.clear();
      generation = g;
    }
    return entries;
  }
};
thread_local LocalCache t_cache;

void remember_locally(const CallKey& key, const std::shared_ptr<const MetaResult>& r) {
  Cache& local = t_cache.current();
  if (local.size() >= config().meta_cache_capacity.load(std::memory_order_relaxed)) local.clear();
  local.emplace(key, r);
}

at::Tensor mirror(const at::Tensor& t, const c10::intrusive_ptr<c10::StorageImpl>& storage) {
  auto impl = c10::make_intrusive<c10::TensorImpl>(c10::Storage(storage), c10::DispatchKeySet(c10::DispatchKey::Meta),
                                                   t.dtype());
  impl->set_sizes_and_strides(t.sizes(), t.strides(), t.storage_offset());
  if (t.is_conj()) impl->_set_conj(true);
  if (t.is_neg()) impl->_set_neg(true);
  return at::Tensor(std::move(impl));
}

c10::intrusive_ptr<c10::StorageImpl> meta_storage(size_t nbytes) {
  return c10::make_intrusive<c10::StorageImpl>(c10::StorageImpl::use_byte_size_t(), nbytes,
                                               c10::DataPtr(nullptr, c10::Device(c10::DeviceType::Meta)),
                                               c10::GetAllocator(c10::DeviceType::Meta), /*resizable=*/true);
}

at::Tensor constant_mirror(const at::Tensor& t) {
  c10::impl::ExcludeDispatchKeyGuard guard(kAboveBackendKeys);
  return at::empty_strided(t.sizes(), t.strides(), t.options().device(c10::kMeta));
}

void set_arg(torch::jit::Stack& stack, const TensorArg& ta, at::Tensor value) {
  c10::IValue& slot = stack[ta.arg];
  if (ta.elem < 0) {
    slot = std::move(value);
  } else {
    slot.toList().set(ta.elem, c10::IValue(std::move(value)));
  }
}

OutSpec describe(const at::Tensor& r, const Call& call, const std::vector<at::Tensor>& mirrors,
                 const std::vector<c10::intrusive_ptr<c10::StorageImpl>>& storages) {
  OutSpec o;
  if (!r.defined()) return o;
  for (size_t i = 0; i < mirrors.size(); ++i) {
    if (mirrors[i].defined() && r.unsafeGetTensorImpl() == mirrors[i].unsafeGetTensorImpl()) {
      o.kind = OutSpec::kSelf;
      o.src = static_cast<int32_t>(i);
      return o;
    }
  }
  o.meta = TensorMeta::of(*r.unsafeGetTensorImpl());
  const c10::StorageImpl* rs = r.has_storage() ? r.storage().unsafeGetStorageImpl() : nullptr;
  for (size_t i = 0; i < call.tensors.size(); ++i) {
    const TensorArg& ta = call.tensors[i];
    if (ta.kind == TensorArg::kLazy && storages[ta.alias].get() == rs) {
      o.kind = OutSpec::kView;
      o.src = static_cast<int32_t>(i);
      return o;
    }
  }
  o.kind = OutSpec::kNew;
  o.nbytes = rs ? rs->nbytes() : o.meta.extent_bytes();
  o.nbytes = std::max(o.nbytes, o.meta.extent_bytes());
  return o;
}

// What meta inference runs before the Meta key, also for the planner's meta probes (ops/meta_probe.h).
bool meta_first(const c10::OperatorHandle& op, torch::jit::Stack& stack) {
  if (const c10::KernelFunction* cpp = shadowed_cpp_meta_kernel(op)) {
    call_boxed(*cpp, op, c10::DispatchKeySet(c10::DispatchKey::Meta), &stack);
    return true;
  }
  return native_meta(op, stack);
}
const bool g_meta_first_installed = [] {
  set_meta_first(&meta_first);
  return true;
}();

// Runs the op on the meta mirrors. For structured ops the composite kernel is reached through an
// otherwise unused backend key (PrivateUse2 has no kernels, so its dispatch entry is the
// CompositeExplicitAutogradNonFunctional kernel): it runs the op's C++ meta function — exactly
// eager's shape, dtype and overlap checks, with eager's messages — then the out= op on Meta.
// Python meta kernels registered on the Meta key are looser (no casting or overlap checks). Where
// the op's generated C++ Meta kernel is only shadowed by a Python one, it is called directly: the
// same meta function, and no out= call to reach Python (record/cpp_meta.h).
bool dispatch_meta(Call& call, torch::jit::Stack& stack) {
  c10::impl::ExcludeDispatchKeyGuard guard(kAboveBackendKeys);
  // The op's own generated C++ Meta kernel, where a Python one shadows it: for a structured op the
  // same meta function without the composite's out= call, which would reach the Python kernel; for
  // the others (zero_, fill_, out= forms) eager's meta kernel (cpp_meta.h). Else a C++ meta function
  // of lazymem's for an op whose meta kernel is Python only (native_meta.h).
  if (meta_first(call.op, stack)) return true;
  if (call.rules.structured) {
    torch::jit::Stack copy = stack;
    try {
      redispatch_boxed(call.op, c10::DispatchKeySet(c10::DispatchKey::PrivateUse2), &copy);
      stack = std::move(copy);
      return true;
    } catch (const c10::NotImplementedError&) {
      // the composite reached something without a meta kernel: fall back to the Meta key
    }
  }
  try {
    redispatch_boxed(call.op, c10::DispatchKeySet(c10::DispatchKey::Meta), &stack);
  } catch (const c10::NotImplementedError&) {
    return false;
  }
  return true;
}

// TensorIterator's memory-overlap checks, run on the lazymem tensors themselves (their unique phantom
// addresses make them exact) with eager's messages, for in-place ops whose meta kernel may be a
// Python one that skips them. Overlap is a function of the cache key (alias classes, geometry), so
// a cache hit has already passed them.
void check_overlaps(const Call& call) {
  for (const TensorArg& out : call.tensors) {
    if (out.kind != TensorArg::kLazy || !out.write) continue;
    at::assert_no_internal_overlap(out.t());
    for (const TensorArg& in : call.tensors) {
      if (in.kind == TensorArg::kLazy && !in.write && in.alias == out.alias) at::assert_no_partial_overlap(out.t(), in.t());
    }
  }
}

std::shared_ptr<const MetaResult> run_meta(Call& call) {
  if (call.rules.iterator_overlap_checks) check_overlaps(call);
  const auto& schema = call.op.schema();
  torch::jit::Stack stack;
  stack.reserve(call.num_args);
  for (size_t i = 0; i < call.num_args; ++i) {
    const c10::IValue& v = call.arg(i);
    stack.push_back(v.isList() ? c10::IValue(v.toList().copy()) : v);
  }
  // One meta storage per lazymem storage (alias class, indexed by lazy-argument ordinal), sized like it.
  std::vector<c10::intrusive_ptr<c10::StorageImpl>> storages;
  std::vector<at::Tensor> mirrors(call.tensors.size());
  for (size_t i = 0; i < call.tensors.size(); ++i) {
    const TensorArg& ta = call.tensors[i];
    if (ta.kind == TensorArg::kLazy) {
      int32_t ordinal = static_cast<int32_t>(storages.size());
      storages.emplace_back();
      if (ta.alias == ordinal) storages[ordinal] = meta_storage(ta.t().storage().nbytes());
      mirrors[i] = mirror(ta.t(), storages[ta.alias]);
      set_arg(stack, ta, mirrors[i]);
    } else if (ta.kind == TensorArg::kConstant) {
      set_arg(stack, ta, constant_mirror(ta.t()));
    }
  }
  if (call.rules.generator_arg >= 0) stack[call.rules.generator_arg] = c10::IValue();
  for (int32_t d : call.rules.device_args) {
    if (!stack[d].isNone()) stack[d] = c10::IValue(c10::Device(c10::DeviceType::Meta));
  }
  // Metadata of written arguments before the call, to detect out= resizes.
  std::vector<std::pair<TensorMeta, size_t>> before(call.tensors.size());
  for (size_t i = 0; i < call.tensors.size(); ++i) {
    if (call.tensors[i].write && mirrors[i].defined()) {
      before[i] = {TensorMeta::of(*mirrors[i].unsafeGetTensorImpl()), mirrors[i].storage().nbytes()};
    }
  }
  const bool layout = backing_layout_applies(call.op);
  torch::jit::Stack args;
  if (layout) args = stack;
  if (!dispatch_meta(call, stack)) return nullptr;
  if (layout) apply_backing_layout(call.op, args, stack);
  auto result = std::make_shared<MetaResult>();
  static std::atomic<uint64_t> ids{0};
  result->id = ids.fetch_add(1, std::memory_order_relaxed) + 1;
  const auto& returns = schema.returns();
  LAZYMEM_INTERNAL_ASSERT(stack.size() == returns.size(), "meta run of ", schema.name(), " returned ",
                          stack.size(), " values for ", returns.size(), " returns");
  result->rets.resize(returns.size());
  for (size_t j = 0; j < returns.size(); ++j) {
    RetSpec& rs = result->rets[j];
    const c10::IValue& v = stack[j];
    auto kind = returns[j].type()->kind();
    rs.optional = kind == c10::TypeKind::OptionalType;
    if (v.isTensor()) {
      rs.items.push_back(describe(v.toTensor(), call, mirrors, storages));
    } else if (v.isTensorList() || (kind == c10::TypeKind::ListType && v.isList())) {
      rs.is_list = true;
      auto l = v.toList();
      for (size_t e = 0; e < l.size(); ++e) {
        c10::IValue x = l.get(e);
        rs.items.push_back(x.isTensor() ? describe(x.toTensor(), call, mirrors, storages) : OutSpec{});
      }
    } else if (v.isNone() && (kind == c10::TypeKind::TensorType || rs.optional)) {
      rs.items.emplace_back();
    } else {
      OutSpec o;
      o.kind = OutSpec::kValue;
      o.value = v;
      rs.items.push_back(std::move(o));
    }
    for (const OutSpec& o : rs.items) result->new_outs += o.kind == OutSpec::kNew;
  }
  for (size_t i = 0; i < call.tensors.size(); ++i) {
    if (!call.tensors[i].write || !mirrors[i].defined()) continue;
    TensorMeta after = TensorMeta::of(*mirrors[i].unsafeGetTensorImpl());
    size_t nbytes = mirrors[i].storage().nbytes();
    const TensorMeta& b = before[i].first;
    if (after.sizes != b.sizes || after.strides != b.strides || after.offset != b.offset || nbytes != before[i].second) {
      result->mutations.push_back({static_cast<int32_t>(i), std::move(after), nbytes});
    }
  }
  return result;
}

} // namespace

std::shared_ptr<const MetaResult> infer_meta(Call& call) {
  if (call.cacheable) {
    Cache& local = t_cache.current();
    auto hit = local.find(call.key);
    if (hit != local.end()) {
      stats().meta_cache_hits.fetch_add(1, std::memory_order_relaxed);
      return hit->second;
    }
    std::shared_ptr<const MetaResult> shared;
    {
      std::lock_guard<std::mutex> lock(g_cache_mu);
      auto it = cache().find(call.key);
      if (it != cache().end()) shared = it->second;
    }
    if (shared) {
      remember_locally(call.key, shared);
      stats().meta_cache_hits.fetch_add(1, std::memory_order_relaxed);
      return shared;
    }
  }
  stats().meta_cache_misses.fetch_add(1, std::memory_order_relaxed);
  // No lock is held here: meta kernels written in Python take the GIL.
  std::shared_ptr<const MetaResult> r = run_meta(call);
  if (r && call.cacheable) {
    {
      std::lock_guard<std::mutex> lock(g_cache_mu);
      if (cache().size() >= config().meta_cache_capacity.load()) {
        cache().clear();
        g_cache_generation.fetch_add(1, std::memory_order_release);
      }
      cache().emplace(call.key, r);
    }
    remember_locally(call.key, r);
  }
  return r;
}

void clear_meta_cache() {
  std::lock_guard<std::mutex> lock(g_cache_mu);
  cache().clear();
  g_cache_generation.fetch_add(1, std::memory_order_release);
}

size_t meta_cache_size() {
  std::lock_guard<std::mutex> lock(g_cache_mu);
  return cache().size();
}

at::Tensor metadata_twin(const at::Tensor& t) {
  if (!t.defined()) return {};
  const c10::Device dev = backing_device();
  c10::Storage st(c10::Storage::use_byte_size_t(), 0, c10::DataPtr(nullptr, dev), nullptr, /*resizable=*/false);
  auto impl = c10::make_intrusive<c10::TensorImpl>(std::move(st), c10::DispatchKeySet(backing_key()), t.dtype());
  impl->set_sizes_and_strides(t.sizes(), t.strides(), t.storage_offset());
  at::Tensor twin(std::move(impl));
  if (t.requires_grad()) twin.set_requires_grad(true);
  return twin;
}

} // namespace lazymem
