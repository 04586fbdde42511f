// execute: node replay.
#include "execute/replay.h"

#include <ATen/Context.h>
#include <c10/core/GradMode.h>

#include "core/check.h"
#include "core/runtime.h"
#include "execute/real.h"

namespace lazymem {
namespace {

c10::IValue copy_if_list(const c10::IValue& v) {
  return v.isList() ? c10::IValue(v.toList().copy()) : v;
}

void place(torch::jit::Stack& stack, int32_t arg, int32_t elem, c10::IValue v) {
  c10::IValue& slot = stack[arg];
  if (elem < 0) {
    slot = std::move(v);
  } else {
    slot.toList().set(elem, std::move(v));
  }
}

const c10::IValue& ret_value(const torch::jit::Stack& stack, const Def& d, c10::IValue& scratch) {
  const c10::IValue& r = stack[d.ret];
  if (d.elem < 0) return r;
  scratch = r.toList().get(d.elem);
  return scratch;
}

int64_t rewritten(const ArgRewrite& rw, const Binder& binder) {
  switch (rw.kind) {
    case ArgRewrite::kRows:
      return rw.base + rw.scale * binder.chunk_rows();
    case ArgRewrite::kStart:
      return rw.base + rw.scale * binder.chunk_start();
    case ArgRewrite::kConst:
      break;
  }
  return rw.base;
}

// Ops without a Generator argument draw from the backing device's default generator: lend it this
// node's generator state for the duration of the kernel.
class DefaultGeneratorLoan {
 public:
  explicit DefaultGeneratorLoan(at::Generator ours)
      : ours_(std::move(ours)), def_(at::globalContext().defaultGenerator(backing_device())) {
    std::scoped_lock lock(def_.mutex(), ours_.mutex());
    saved_ = def_.clone();
    def_.set_state(ours_.get_state());
  }
  ~DefaultGeneratorLoan() {
    try {
      std::scoped_lock lock(def_.mutex(), ours_.mutex());
      ours_.set_state(def_.get_state());
      def_.set_state(saved_.get_state());
    } catch (...) {
      // A failure to restore generator state cannot be reported from a destructor; the stream
      // continues from wherever the kernel left the default generator.
    }
  }

 private:
  at::Generator ours_;
  at::Generator def_;
  at::Generator saved_;
};

} // namespace

void redispatch_on_backing(const c10::OperatorHandle& op, torch::jit::Stack& stack, size_t first,
                           c10::ArrayRef<int32_t> device_args, int32_t generator_arg, LazyGenerator* gen,
                           bool grad_mode) {
  for (int32_t d : device_args) {
    if (!stack[first + d].isNone()) stack[first + d] = c10::IValue(backing_device());
  }
  c10::AutoGradMode grad(grad_mode);
  const c10::DispatchKeySet ks(backing_key());
  if (!gen) {
    op.redispatchBoxed(ks, &stack);
    return;
  }
  at::Generator ours = gen->backing();
  if (generator_arg >= 0) {
    stack[first + generator_arg] = c10::IValue(ours);
    op.redispatchBoxed(ks, &stack);
  } else {
    DefaultGeneratorLoan loan(ours);
    op.redispatchBoxed(ks, &stack);
  }
}

void replay(const PlannedNode& pn, Binder& binder, torch::jit::Stack& stack) {
  Node& n = *pn.node;
  stack.clear();
  for (const auto& a : n.args) stack.push_back(copy_if_list(a));
  for (const ConstNarrow& c : pn.consts) place(stack, c.arg, c.elem, binder.constant(pn, c));
  for (const ArgRewrite& rw : pn.rewrites) place(stack, rw.arg, rw.elem, c10::IValue(rewritten(rw, binder)));
  c10::SmallVector<const c10::StorageImpl*, 8> taken;
  for (size_t i = 0; i < n.uses.size(); ++i) {
    const Use& u = n.uses[i];
    at::Tensor v = binder.use(pn, i);
    taken.push_back(v.storage().unsafeGetStorageImpl());
    place(stack, u.arg, u.elem, c10::IValue(std::move(v)));
  }
  redispatch_on_backing(pn.op, stack, 0, n.device_args, n.generator_arg,
                        static_cast<LazyGenerator*>(n.generator.get()), n.grad_mode);
  c10::IValue scratch;
  for (size_t i = 0; i < n.defs.size(); ++i) {
    const Def& d = n.defs[i];
    const c10::IValue& r = ret_value(stack, d, scratch);
    try {
      binder.def(pn, i, r.toTensor(), taken);
    } catch (const c10::OutOfMemoryError&) {
      throw; // retryable: the node goes back to the program
    } catch (const std::exception& e) {
      d.ref.buf->poison = annotate_node_error(e, "lazymem: " + n.describe() + ": ");
    }
    if (i < pn.post_div.size() && pn.post_div[i] != 0) binder.bound_def(pn, i).div_(pn.post_div[i]);
  }
  binder.done(pn);
  stack.clear(); // drop the real views and results now: buffers are released right after their last use
}

std::exception_ptr annotate_node_error(const std::exception& e, const std::string& prefix) {
  const c10::SourceLocation loc{__func__, __FILE__, static_cast<uint32_t>(__LINE__)};
#define LAZYMEM_REWRAP(T)                                            \
  if (auto* x = dynamic_cast<const T*>(&e)) {                        \
    return std::make_exception_ptr(T(loc, prefix + x->msg()));       \
  }
  LAZYMEM_REWRAP(c10::OutOfMemoryError)
  LAZYMEM_REWRAP(c10::IndexError)
  LAZYMEM_REWRAP(c10::ValueError)
  LAZYMEM_REWRAP(c10::TypeError)
  LAZYMEM_REWRAP(c10::NotImplementedError)
  LAZYMEM_REWRAP(c10::LinAlgError)
  LAZYMEM_REWRAP(c10::Error)
#undef LAZYMEM_REWRAP
  return std::make_exception_ptr(std::runtime_error(prefix + e.what()));
}

} // namespace lazymem
