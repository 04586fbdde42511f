// record: the boxed fallback and node construction.
#include "record/recorder.h"

#include <array>
#include <cstring>

#include <ATen/core/Tensor.h>
#include <ATen/ops/_lazy_clone.h>
#include <ATen/ops/clone.h>
#include <c10/core/GradMode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>

#include "core/check.h"
#include "core/config.h"
#include "core/runtime.h"
#include "device/generator.h"
#include "device/phantom.h"
#include "ir/program.h"
#include "record/call.h"
#include "record/meta.h"

namespace lazymem {

thread_local int t_module_state = 0;

ModuleStateScope::ModuleStateScope() {
  ++t_module_state;
}
ModuleStateScope::~ModuleStateScope() {
  --t_module_state;
}

namespace {

// A host (or other-device) tensor copied into lazymem: snapshot it now, so later writes by the user
// cannot change what the recorded copy reads. Copy-on-write when the storage allows it.
at::Tensor snapshot(const at::Tensor& t) {
  c10::impl::ExcludeDispatchKeyGuard guard(kAboveBackendKeys);
  if (t.device().is_cpu()) {
    try {
      return at::_lazy_clone(t);
    } catch (const c10::Error&) {
      // Storage that cannot be shared copy-on-write (e.g. from_blob): take a real copy.
    }
  }
  return at::clone(t);
}

void set_slot(std::vector<c10::IValue>& args, const TensorArg& ta, c10::IValue v) {
  if (ta.elem < 0) {
    args[ta.arg] = std::move(v);
  } else {
    args[ta.arg].toList().set(ta.elem, std::move(v));
  }
}

// A wrapped Python number converted to `dtype` as TensorIterator would convert it on the CPU at every
// call of the op (compute_types: Tensor.to, an allocation and a copy; 6,000 instructions per
// `y * 1.0001`, nearly a third of such an op's replay): converted once here, cached per thread by
// value. Still a wrapped number, so type promotion and every kernel see what they saw. Only float32
// and float64: a reduced-precision kernel reads the number's original value (original_scalar_value),
// which the conversion would round first.
at::Tensor converted_number(const at::Tensor& number, at::ScalarType dtype) {
  const at::ScalarType from = number.scalar_type();
  if (from == dtype || (from != at::kDouble && from != at::kLong) || (dtype != at::kFloat && dtype != at::kDouble) ||
      !backing_device().is_cpu()) {
    return number;
  }
  int64_t bits = 0;
  std::memcpy(&bits, number.const_data_ptr(), sizeof(bits));
  struct Entry {
    int64_t bits = 0;
    at::ScalarType from = at::kDouble, to = at::kDouble;
    at::Tensor t;
  };
  thread_local std::array<Entry, 64> cache;
  Entry& e = cache[(static_cast<uint64_t>(bits) * 0x9E3779B97F4A7C15ULL >> 58) ^ (dtype == at::kFloat)];
  if (!e.t.defined() || e.bits != bits || e.from != from || e.to != dtype) {
    c10::impl::ExcludeDispatchKeyGuard guard(kAboveBackendKeys);
    at::Tensor t = number.to(dtype);
    t.unsafeGetTensorImpl()->set_wrapped_number(true);
    e = Entry{bits, from, dtype, std::move(t)};
  }
  return e.t;
}

at::Tensor view_of(const at::Tensor& base, const TensorMeta& meta) {
  auto impl = c10::make_intrusive<c10::TensorImpl>(c10::TensorImpl::VIEW, c10::Storage(base.storage()),
                                                   base.key_set(), caffe2::TypeMeta::fromScalarType(meta.dtype));
  meta.apply_to(*impl);
  return at::Tensor(std::move(impl));
}

class Emitter {
 public:
  Emitter(Call& call, const MetaResult& meta) : call_(call), meta_(meta), node_(new_node(call.op)) {}

  void run() {
    apply_mutations();
    // One allocation each for the node's defs and uses (most ops have one result, one or two
    // operands), and the results on the stack until the arguments are dropped.
    node_->defs.reserve(meta_.new_outs);
    c10::SmallVector<c10::IValue, 2> outs;
    for (size_t j = 0; j < meta_.rets.size(); ++j) {
      const RetSpec& rs = meta_.rets[j];
      if (rs.is_list) {
        c10::List<at::Tensor> l;
        for (size_t e = 0; e < rs.items.size(); ++e) {
          l.push_back(make_out(rs.items[e], rs, static_cast<int32_t>(j), static_cast<int32_t>(e)).toTensor());
        }
        outs.emplace_back(std::move(l));
      } else {
        outs.push_back(make_out(rs.items.at(0), rs, static_cast<int32_t>(j), -1));
      }
    }
    bool writes = false;
    for (const TensorArg& ta : call_.tensors) writes = writes || (ta.kind == TensorArg::kLazy && ta.write);
    const OpRules& rules = call_.rules;
    if (!node_->defs.empty() || writes || rules.random || rules.effect_only) {
      build_node();
      stats().ops_recorded.fetch_add(1, std::memory_order_relaxed);
    } else {
      stats().views.fetch_add(1, std::memory_order_relaxed);
    }
    if (!call_.borrowed) torch::jit::drop(*call_.stack, call_.num_args);
    for (auto& o : outs) call_.stack->push_back(std::move(o));
  }

 private:
  void apply_mutations() {
    for (const Mutation& m : meta_.mutations) {
      const at::Tensor& t = call_.tensors[m.tensor].t();
      c10::StorageImpl* s = t.storage().unsafeGetStorageImpl();
      if (m.storage_nbytes > s->nbytes()) grow_phantom(*s, m.storage_nbytes);
      t.unsafeGetTensorImpl()->set_sizes_and_strides(m.meta.sizes, m.meta.strides, m.meta.offset);
    }
  }

  c10::IValue make_out(const OutSpec& o, const RetSpec& rs, int32_t ret, int32_t elem) {
    switch (o.kind) {
      case OutSpec::kNone:
        return rs.optional && !rs.is_list ? c10::IValue() : c10::IValue(at::Tensor());
      case OutSpec::kNew: {
        at::Tensor t = make_lazy_tensor(o.nbytes, o.meta);
        Def& d = node_->defs.emplace_back();
        d.ret = ret;
        d.elem = elem;
        d.ref.buf = buffer_ptr(buffer_of(t));
        d.ref.meta = o.meta;
        return t;
      }
      case OutSpec::kView:
        return view_of(call_.tensors[o.src].t(), o.meta);
      case OutSpec::kSelf:
        // Borrowed: the caller returns its own `self` (a copy here would count a reference, for a
        // tensor Python holds a GIL round trip each way).
        if (call_.borrowed) return c10::IValue();
        return call_.tensors[o.src].t();
      case OutSpec::kValue:
        return o.value;
    }
    return c10::IValue();
  }

  void build_node() {
    Node& n = *node_;
    const OpRules& rules = call_.rules;
    // A lazymem tensor argument is replaced by an undefined tensor below: not copied first (a
    // counted reference taken and dropped; for a tensor Python alone holds, GIL round trips).
    uint64_t lazy_args = 0;
    for (const TensorArg& ta : call_.tensors) {
      if (ta.kind == TensorArg::kLazy && ta.elem < 0 && ta.arg < 64) lazy_args |= uint64_t{1} << ta.arg;
    }
    n.args.reserve(call_.num_args);
    for (size_t i = 0; i < call_.num_args; ++i) {
      const c10::IValue& v = call_.arg(i);
      if (i < 64 && (lazy_args >> i & 1)) {
        n.args.emplace_back(at::Tensor());
      } else {
        n.args.push_back(v.isList() ? c10::IValue(v.toList().copy()) : v);
      }
    }
    size_t lazy = 0;
    for (const TensorArg& ta : call_.tensors) lazy += ta.kind == TensorArg::kLazy;
    n.uses.reserve(lazy);
    for (const TensorArg& ta : call_.tensors) {
      switch (ta.kind) {
        case TensorArg::kLazy: {
          // The node holds the buffer, never the tensor: dropping the tensor must make it dead.
          set_slot(n.args, ta, c10::IValue(at::Tensor()));
          Use& u = n.uses.emplace_back();
          u.arg = ta.arg;
          u.elem = ta.elem;
          u.ref.buf = buffer_ptr(buffer_of(ta.t()));
          u.ref.meta = TensorMeta::of(*ta.t().unsafeGetTensorImpl());
          u.write = ta.write != 0;
          u.write_only = ta.write == 2 || (ta.write && rules.overwrites_self && ta.arg == 0);
          break;
        }
        case TensorArg::kCpuScalar:
          if (!ta.t().unsafeGetTensorImpl()->is_wrapped_number()) {
            set_slot(n.args, ta, snapshot(ta.t()));
          } else if (rules.casts_wrapped_number && ta.elem < 0 && ta.arg < 2) {
            for (const TensorArg& o : call_.tensors) {
              if (o.kind == TensorArg::kLazy && o.arg == 1 - ta.arg && o.elem < 0) {
                set_slot(n.args, ta, converted_number(ta.t(), o.t().scalar_type()));
              }
            }
          }
          break;
        case TensorArg::kConstant:
          set_slot(n.args, ta, snapshot(ta.t()));
          break;
      }
    }
    // An upload: copy_ of a host tensor. Its destination is a data leaf unless it holds module state
    // (uploaded under Module.to) or comes from a tensor that requires grad (a parameter).
    if (call_.op.schema().name() == "aten::copy_" && call_.tensors.size() == 2 &&
        call_.tensors[0].kind == TensorArg::kLazy && call_.tensors[1].kind == TensorArg::kConstant) {
      n.upload = true;
      if (t_module_state > 0 || call_.tensors[1].t().requires_grad()) {
        Program::get().set_batch_hint(*buffer_of(call_.tensors[0].t()), LazyBuffer::BatchHint::kNever, 0, 0,
                                      /*only_if_auto=*/true);
      }
    }
    n.device_args.assign(rules.device_args.begin(), rules.device_args.end());
    if (call_.cacheable) n.sig = meta_.id;
    n.grad_mode = c10::GradMode::is_enabled();
    n.effectful = rules.effect_only || rules.collective;
    n.floats_shape_free = rules.float_values_shape_free;
    n.state_arg = rules.state_arg;
    LazyGenerator* gen = nullptr;
    if (rules.random) {
      n.random = true;
      n.rng_form = random_form(call_.op, n.args);
      n.generator_arg = rules.generator_arg;
      at::Generator g;
      if (rules.generator_arg >= 0 && !n.args[rules.generator_arg].isNone()) {
        g = n.args[rules.generator_arg].toGenerator();
      } else {
        g = default_lazy_generator();
      }
      gen = lazy_generator_of(g, call_.op.schema().name().c_str());
      n.generator = g.getIntrusivePtr();
      if (rules.generator_arg >= 0) n.args[rules.generator_arg] = c10::IValue();
    }
    if (config().debug && flush_hooks().recording_site) n.site = flush_hooks().recording_site();
    uint64_t seq = Program::get().append(std::move(node_));
    if (gen) gen->note_draw(seq);
  }

  Call& call_;
  const MetaResult& meta_;
  NodePtr node_;
};

} // namespace

Recorded record_call(const c10::OperatorHandle& op, torch::jit::Stack* stack, bool allow_constants, bool borrowed) {
  const OpRules& rules = op_rules(op);
  if (rules.noop) {
    if (borrowed) return Recorded::kNeedsEager; // no unboxed kernel is a no-op; never guessed at
    torch::jit::drop(*stack, op.schema().arguments().size());
    return Recorded::kDone;
  }
  if (rules.eager) return Recorded::kNeedsEager;
  Call call(op, rules, stack, borrowed);
  analyze_call(call, allow_constants);
  if (rules.eager_if_mask_index && call.has_mask_index) return Recorded::kNeedsEager;
  std::shared_ptr<const MetaResult> meta = infer_meta(call);
  if (!meta) return Recorded::kNeedsEager;
  Emitter(call, *meta).run();
  return Recorded::kDone;
}

} // namespace lazymem
