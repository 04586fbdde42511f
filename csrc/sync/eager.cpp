// sync: the eager path, for ops whose outputs depend on data (nonzero, unique, boolean masks,
// item) or that have no meta kernel. It flushes what the op reads (everything pending when the op
// writes, since pending readers must see the old values), runs the op on the backing device now,
// and wraps its results as lazymem tensors whose buffers already hold real data.
#include <ATen/core/Tensor.h>
#include <ATen/ops/nonzero.h>
#include <c10/core/GradMode.h>

#include "core/check.h"
#include "core/config.h"
#include "core/runtime.h"
#include "device/generator.h"
#include "device/phantom.h"
#include "execute/ragged.h"
#include "execute/replay.h"
#include "execute/real.h"
#include "ir/program.h"
#include "ops/op_rules.h"
#include "record/recorder.h"
#include "sync/sync.h"

namespace lazymem {
namespace {

struct LazyArgRef {
  int32_t arg;
  int32_t elem;
  at::Tensor lazy;
  at::Tensor real;
  bool write;
};

template <typename F>
void for_each_tensor(torch::jit::Stack& stack, size_t first, size_t n, F&& f) {
  for (size_t i = 0; i < n; ++i) {
    c10::IValue& v = stack[first + i];
    if (v.isTensor()) {
      f(static_cast<int32_t>(i), -1, v.toTensor());
    } else if (v.isList()) {
      auto l = v.toList();
      for (size_t e = 0; e < l.size(); ++e) {
        c10::IValue x = l.get(e);
        if (x.isTensor()) f(static_cast<int32_t>(i), static_cast<int32_t>(e), x.toTensor());
      }
    }
  }
}

at::Tensor wrap_result(const at::Tensor& r, const std::vector<LazyArgRef>& args) {
  if (!r.defined()) return r;
  const c10::StorageImpl* rs = r.has_storage() ? r.storage().unsafeGetStorageImpl() : nullptr;
  for (const auto& a : args) {
    if (r.unsafeGetTensorImpl() == a.real.unsafeGetTensorImpl()) return a.lazy; // in-place return
    if (rs && a.real.storage().unsafeGetStorageImpl() == rs) {
      // A view of an input: the same view on the lazymem side.
      auto impl = c10::make_intrusive<c10::TensorImpl>(c10::TensorImpl::VIEW, c10::Storage(a.lazy.storage()),
                                                       a.lazy.key_set(), r.dtype());
      TensorMeta::of(*r.unsafeGetTensorImpl()).apply_to(*impl);
      return at::Tensor(std::move(impl));
    }
  }
  if (r.device() != backing_device()) return r; // e.g. a CPU-side result of a CUDA-backed op
  TensorMeta meta = TensorMeta::of(*r.unsafeGetTensorImpl());
  at::Tensor t = make_lazy_tensor(r.storage().nbytes(), meta);
  LazyBuffer* b = buffer_of(t);
  b->version = 1; // a fresh buffer no other thread can name yet
  b->real_version = 1;
  b->set_real(r.storage());
  return t;
}

// nonzero(a), masked_select(a, mask) and a[mask] (one boolean mask over a's leading dims) of a value
// still pending: recorded as one lazymem::ragged_sink node and materialized with it, so the value is
// consumed where it is computed — chunk by chunk when the plan splits, never stored whole — and the
// pieces joined in row order (execute/ragged.h). Returns false when the call is not such an op.
bool run_ragged(const c10::OperatorHandle& op, torch::jit::Stack& stack, size_t first) {
  static const c10::OperatorName nonzero("aten::nonzero", ""), masked_select("aten::masked_select", ""),
      index("aten::index", "Tensor");
  const auto& name = op.operator_name();
  RaggedKind kind;
  at::Tensor a = stack[first].isTensor() ? stack[first].toTensor() : at::Tensor();
  at::Tensor b;
  if (!a.defined() || !is_lazy(a) || a.dim() == 0) return false;
  if (name == nonzero) {
    kind = RaggedKind::kNonzero;
  } else if (name == masked_select) {
    kind = RaggedKind::kMaskedSelect;
    b = stack[first + 1].toTensor();
    if (b.scalar_type() != at::kBool || !b.sizes().equals(a.sizes())) return false;
  } else if (name == index) {
    kind = RaggedKind::kMaskIndex;
    auto l = stack[first + 1].toList();
    if (l.size() != 1) return false;
    c10::IValue m = l.get(0);
    if (!m.isTensor()) return false;
    b = m.toTensor();
    if (b.scalar_type() != at::kBool || b.dim() == 0 || b.dim() > a.dim() ||
        !b.sizes().equals(a.sizes().slice(0, b.dim()))) {
      return false;
    }
  } else {
    return false;
  }
  if (b.defined() && !is_lazy(b)) return false;
  LazyBuffer* ab = buffer_of(a);
  LazyBuffer* bb = b.defined() ? buffer_of(b) : nullptr;
  if (!ab || (b.defined() && !bb)) return false; // the eager path reports it
  // Only a pending value gains from running inside its plan; real data runs as before.
  bool pending = Program::get().pending_writer(*ab) != 0;
  if (bb) pending = pending || Program::get().pending_writer(*bb) != 0;
  if (!pending) return false;

  stats().ops_eager.fetch_add(1, std::memory_order_relaxed); // it runs now, inside its value's plan
  static const auto sink = c10::Dispatcher::singleton().findSchemaOrThrow("lazymem::ragged_sink", "");
  RaggedCollector collector;
  torch::jit::Stack call{c10::IValue(a), b.defined() ? c10::IValue(b) : c10::IValue(), c10::IValue(static_cast<int64_t>(kind)),
                         c10::IValue(collector.token()), c10::IValue(int64_t{0}), c10::IValue(int64_t{-1})};
  LAZYMEM_INTERNAL_ASSERT(record_call(sink, &call) == Recorded::kDone, "lazymem::ragged_sink was not recorded");
  const at::Tensor count = call.at(0).toTensor();
  materialize({buffer_of(count)});
  std::optional<at::Tensor> result;
  {
    auto lock = lock_flush();
    ReplayScope scope;
    result = collector.assemble(a.size(0));
  }
  LAZYMEM_INTERNAL_ASSERT(result.has_value(), op.schema().name(), ": the chunks' results do not cover the batch");
  torch::jit::drop(stack, op.schema().arguments().size());
  stack.push_back(wrap_result(*result, {}));
  return true;
}

// Boolean masks among the indices of index_put_ and friends: replaced by the long indices eager's
// own kernels derive from them (ATen's expandTensors: nonzero(mask), one column per masked dim),
// computed now — only the mask is read, chunk by chunk when it is pending and batch-sharded — and
// the write recorded with them, so it leaves the written value and the rest of the step pending
// instead of running everything recorded before it. (Index reads stay eager: their output shape is
// data-dependent by tag, and one flush for mask and value beats two.) Returns false when the call
// has no such mask, or one eager would reject (its own checks and messages then apply).
bool run_mask_expanded(const c10::OperatorHandle& op, torch::jit::Stack& stack, size_t first) {
  if (op.operator_name().name == "aten::index") return false; // (the caller checked eager_if_mask_index)
  if (!stack[first].isTensor() || !is_lazy(stack[first].toTensor())) return false;
  const at::Tensor self = stack[first].toTensor();
  auto indices = stack[first + 1].toList();
  c10::List<std::optional<at::Tensor>> expanded;
  int64_t dim = 0;
  bool any_mask = false;
  for (size_t i = 0; i < indices.size(); ++i) {
    c10::IValue e = indices.get(i);
    if (!e.isTensor() || !e.toTensor().defined()) {
      expanded.push_back(std::nullopt);
      ++dim;
      continue;
    }
    at::Tensor t = e.toTensor();
    if (t.scalar_type() == at::kByte) return false; // deprecated: eager warns
    if (t.scalar_type() != at::kBool) {
      expanded.push_back(t);
      ++dim;
      continue;
    }
    if (!is_lazy(t) || t.dim() == 0 || dim + t.dim() > self.dim()) return false;
    for (int64_t k = 0; k < t.dim(); ++k) {
      if (t.size(k) != self.size(dim + k)) return false;
    }
    const at::Tensor nz = at::nonzero(t); // this op's eager path: the mask alone is read
    for (int64_t k = 0; k < t.dim(); ++k) expanded.push_back(nz.select(1, k));
    dim += t.dim();
    any_mask = true;
  }
  if (!any_mask) return false;
  stack[first + 1] = c10::IValue(expanded);
  return record_call(op, &stack) == Recorded::kDone;
}

} // namespace

void run_eager(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const auto& schema = op.schema();
  const OpRules& rules = op_rules(op);
  const size_t n = schema.arguments().size();
  const size_t first = stack->size() - n;
  if (!rules.any_write && !rules.random && run_ragged(op, *stack, first)) return;
  if (rules.eager_if_mask_index && run_mask_expanded(op, *stack, first)) return;
  stats().ops_eager.fetch_add(1, std::memory_order_relaxed);

  std::vector<LazyArgRef> args;
  std::vector<LazyBuffer*> bufs;
  bool writes = false;
  for_each_tensor(*stack, first, n, [&](int32_t i, int32_t e, const at::Tensor& t) {
    if (!is_lazy(t)) {
      // CPU scalars and index lists may hold host tensors, as on CUDA; anything else is a device mix.
      TORCH_CHECK(!t.defined() || e >= 0 || (t.device().is_cpu() && t.dim() == 0),
                  "Expected all tensors to be on the same device, but found at least two devices, lazymem:0 and ",
                  t.device(), "! (", schema.name(), "; move the ", t.device(), " tensor with .to('lazymem') first)");
      return;
    }
    LazyBuffer* b = buffer_of(t);
    LAZYMEM_CHECK(b != nullptr, schema.name(), ": a lazymem tensor without lazymem storage was passed");
    bool w = rules.writes[i] != 0;
    writes = writes || w;
    args.push_back({i, e, t, at::Tensor(), w});
    bufs.push_back(b);
  });
  if (writes || rules.random) {
    // Pending readers of the written buffers must run before the write, and pending draws from the
    // generator before this one.
    synchronize_program(); // nothing may stay pending that reads a buffer this op writes
  }
  materialize(bufs);

  auto lock = lock_flush();
  for (auto& a : args) {
    bring_to_device(*buffer_of(a.lazy)); // a kernel reads device memory only
    a.real = real_view_of(a.lazy);
    c10::IValue& slot = (*stack)[first + a.arg];
    if (a.elem < 0) {
      slot = a.real;
    } else {
      auto l = slot.toList().copy();
      l.set(a.elem, c10::IValue(a.real));
      slot = c10::IValue(l);
    }
  }
  LazyGenerator* gen = nullptr;
  if (rules.random) {
    bool given = rules.generator_arg >= 0 && !(*stack)[first + rules.generator_arg].isNone();
    gen = lazy_generator_of(given ? (*stack)[first + rules.generator_arg].toGenerator() : default_lazy_generator(),
                            schema.name().c_str());
  }
  {
    ReplayScope scope;
    redispatch_on_backing(op, *stack, first, rules.device_args, rules.generator_arg, gen,
                          c10::GradMode::is_enabled());
  }
  // Written arguments: new versions, already applied to real data; geometry changes (out= resize).
  for (auto& a : args) {
    if (!a.write) continue;
    LazyBuffer* b = buffer_of(a.lazy);
    if (a.real.storage().nbytes() > b->nbytes.load()) grow_phantom(*a.lazy.storage().unsafeGetStorageImpl(), a.real.storage().nbytes());
    if (!a.real.sizes().equals(a.lazy.sizes()) || !a.real.strides().equals(a.lazy.strides())) {
      a.lazy.unsafeGetTensorImpl()->set_sizes_and_strides(a.real.sizes(), a.real.strides(), a.real.storage_offset());
    }
    b->real_version = Program::get().note_external_write(*b);
    b->poison = nullptr;
  }
  const size_t nret = schema.returns().size();
  for (size_t j = stack->size() - nret; j < stack->size(); ++j) {
    c10::IValue& v = (*stack)[j];
    if (v.isTensor()) {
      v = wrap_result(v.toTensor(), args);
    } else if (v.isTensorList()) {
      c10::List<at::Tensor> out;
      for (const at::Tensor& t : v.toTensorList()) out.push_back(wrap_result(t, args));
      v = c10::IValue(out);
    }
  }
}

} // namespace lazymem
