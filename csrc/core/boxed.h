// core: a boxed kernel call that keeps the out= tensors it returns alive.
//
// An unboxed kernel returning several references to its out= arguments (std::tuple<Tensor&, Tensor&>:
// nanmedian.dim_values, max.dim_max, sort.values, ...) is boxed by make_boxed_from_unboxed_functor,
// which takes the result, drops the arguments from the stack, then pushes the returns. Up to torch 2.12
// it decays only a lone reference, so a tuple's references point into the dropped IValues: where the
// stack held the only reference to an out= tensor (a real view lazymem made for the call, a meta
// mirror of a probe), pushing the returns reads a freed TensorImpl (torch 2.13's decay_if_tuple fixes
// it). Every boxed call lazymem makes with a stack of its own goes through redispatch_boxed.
#pragma once

#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/SmallVector.h>

namespace lazymem {

// The tensors among `op`'s arguments (the top of `stack`) that it writes and may return, when it
// returns more than one value (a lone returned reference is copied before the drop).
class KeepReturnedOuts {
 public:
  KeepReturnedOuts(const c10::OperatorHandle& op, const torch::jit::Stack& stack) {
    const c10::FunctionSchema& s = op.schema();
    if (s.returns().size() < 2) return;
    const auto& args = s.arguments();
    if (stack.size() < args.size()) return;
    const size_t first = stack.size() - args.size();
    for (size_t i = 0; i < args.size(); ++i) {
      const c10::AliasInfo* a = args[i].alias_info();
      if (a && a->isWrite() && stack[first + i].isTensor()) kept_.push_back(stack[first + i].toTensor());
    }
  }

 private:
  c10::SmallVector<at::Tensor, 2> kept_;
};

inline void redispatch_boxed(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
  KeepReturnedOuts keep(op, *stack);
  op.redispatchBoxed(ks, stack);
}

inline void call_boxed(const c10::KernelFunction& k, const c10::OperatorHandle& op, c10::DispatchKeySet ks,
                       torch::jit::Stack* stack) {
  KeepReturnedOuts keep(op, *stack);
  k.callBoxed(op, ks, stack);
}

} // namespace lazymem
