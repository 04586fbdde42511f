// sync: the eager path, for ops whose outputs depend on data (nonzero, unique, boolean masks,
// item) or that have no meta kernel. It flushes what the op reads (everything pending when the op
// writes, since pending readers must see the old values), runs the op on the backing device now,
// and wraps its results as lazymem tensors whose buffers already hold real data.
#include <ATen/core/Tensor.h>
#include <c10/core/GradMode.h>

#include "core/check.h"
#include "core/config.h"
#include "core/runtime.h"
#include "device/generator.h"
#include "device/phantom.h"
#include "execute/replay.h"
#include "execute/real.h"
#include "ir/program.h"
#include "ops/op_rules.h"
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

} // namespace

void run_eager(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const auto& schema = op.schema();
  const OpRules& rules = op_rules(op);
  const size_t n = schema.arguments().size();
  const size_t first = stack->size() - n;
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
