// sync: unboxed PrivateUse1 kernels for the ops a training step records most (pointwise arithmetic,
// common unary ops, matrix products, their backward formulas' ops and the optimizers' in-place
// updates). They record exactly what the boxed fallback records, through the same record_call, but
// the call's tensors are borrowed onto the stack instead of copied there. The boxed fallback's
// wrapper copies every tensor argument into a std::vector of IValues; for a tensor held only by
// Python that copy is the 1 -> 2 reference transition, which increfs its PyObject under the GIL
// (c10/util/intrusive_ptr.h, PyObject preservation), and dropping it decrefs it under the GIL
// again: about 1,100 instructions per such argument, a vector allocation and the wrapper's own
// boxing on top. Every other behaviour (errors, the eager path, auto-flush) is the fallback's.
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/MaybeOwned.h>
#include <torch/library.h>

#include <memory>

#include "core/check.h"
#include "record/recorder.h"
#include "sync/sync.h"

namespace lazymem {
namespace {

// The arguments of one call on a stack whose tensors borrow the caller's (no reference counted).
// Whatever happens, the borrowed entries are released, never decref'd. One stack per thread is
// reused (a call recorded while another is being recorded on the same thread gets its own).
class BorrowedArgs {
 public:
  BorrowedArgs() {
    thread_local torch::jit::Stack t_stack;
    thread_local bool t_busy = false;
    if (!t_busy) {
      t_busy = true;
      busy_ = &t_busy;
      stack_ = &t_stack;
    } else {
      own_ = std::make_unique<torch::jit::Stack>();
      stack_ = own_.get();
    }
  }
  BorrowedArgs(const BorrowedArgs&) = delete;
  BorrowedArgs& operator=(const BorrowedArgs&) = delete;
  ~BorrowedArgs() {
    release();
    stack_->clear();
    if (busy_) *busy_ = false;
  }

  void push(const at::Tensor& t) {
    stack_->emplace_back(c10::MaybeOwnedTraits<at::Tensor>::createBorrow(t));
    ++n_;
  }
  void push(const c10::Scalar& s) {
    stack_->emplace_back(s);
    ++n_;
  }

  torch::jit::Stack* stack() {
    return stack_;
  }
  // The arguments as an owned stack (references counted), for the eager path.
  torch::jit::Stack owned() const {
    return torch::jit::Stack(stack_->begin(), stack_->begin() + static_cast<std::ptrdiff_t>(n_));
  }
  // After record_call: its one return, pushed after the arguments.
  c10::IValue& result() {
    LAZYMEM_INTERNAL_ASSERT(stack_->size() == n_ + 1, "an unboxed kernel's call left ", stack_->size(),
                            " values for ", n_, " arguments and one return");
    return stack_->back();
  }

  // Gives the borrowed tensors back without touching their reference counts.
  void release() {
    for (size_t i = 0; i < n_ && i < stack_->size(); ++i) {
      c10::IValue& v = (*stack_)[i];
      if (!v.isTensor()) continue;
      at::Tensor t = std::move(v).toTensor();
      c10::MaybeOwnedTraits<at::Tensor>::destroyBorrow(t);
    }
    n_ = 0;
  }

 private:
  torch::jit::Stack* stack_ = nullptr;
  std::unique_ptr<torch::jit::Stack> own_;
  bool* busy_ = nullptr;
  size_t n_ = 0;
};

// Records the call (or runs it eagerly where the recorder cannot) and returns its one result: None
// for an in-place op recorded (its caller returns `self`).
c10::IValue record_borrowed(const c10::OperatorHandle& op, BorrowedArgs& args) {
  if (record_call(op, args.stack(), /*allow_constants=*/false, /*borrowed=*/true) == Recorded::kNeedsEager) {
    torch::jit::Stack owned = args.owned();
    args.release();
    run_eager(op, &owned);
    maybe_auto_flush();
    LAZYMEM_INTERNAL_ASSERT(owned.size() == 1, op.schema().name(), " returned ", owned.size(), " values eagerly");
    return std::move(owned.back());
  }
  c10::IValue out = std::move(args.result());
  args.release();
  maybe_auto_flush();
  return out;
}

// An in-place op returns its `self`: recorded, record_call pushed None for it (borrowed); run
// eagerly, `self` itself.
void check_in_place(const c10::OperatorHandle& op, const at::Tensor& self, const c10::IValue& r) {
  const bool self_returned = r.isTensor() && r.toTensor().unsafeGetTensorImpl() == self.unsafeGetTensorImpl();
  LAZYMEM_INTERNAL_ASSERT(r.isNone() || self_returned, op.schema().name(), " did not return its self");
}

struct OpName {
  const char* name;
  const char* overload;
};

template <const OpName& N>
const c10::OperatorHandle& handle() {
  static const c10::OperatorHandle h = c10::Dispatcher::singleton().findSchemaOrThrow(N.name, N.overload);
  return h;
}

// A functional op: its one result.
template <const OpName& N, class... A>
at::Tensor functional(const A&... args) {
  BorrowedArgs a;
  (a.push(args), ...);
  return record_borrowed(handle<N>(), a).toTensor();
}

// An in-place op: its `self`.
template <const OpName& N, class... A>
at::Tensor& in_place(at::Tensor& self, const A&... rest) {
  BorrowedArgs a;
  a.push(self);
  (a.push(rest), ...);
  check_in_place(handle<N>(), self, record_borrowed(handle<N>(), a));
  return self;
}

using T = at::Tensor;
using S = c10::Scalar;

// Functional (Tensor, Tensor).
constexpr OpName kMul{"aten::mul", "Tensor"}, kDiv{"aten::div", "Tensor"}, kMm{"aten::mm", ""},
    kBmm{"aten::bmm", ""}, kSigmoidBackward{"aten::sigmoid_backward", ""}, kTanhBackward{"aten::tanh_backward", ""};
// Functional (Tensor, Tensor, Scalar).
constexpr OpName kAdd{"aten::add", "Tensor"}, kSub{"aten::sub", "Tensor"},
    kThresholdBackward{"aten::threshold_backward", ""};
// Functional (Tensor, Scalar) and (Tensor, Scalar, Scalar).
constexpr OpName kMulS{"aten::mul", "Scalar"}, kDivS{"aten::div", "Scalar"}, kPowS{"aten::pow", "Tensor_Scalar"},
    kAddS{"aten::add", "Scalar"};
// Functional (Tensor, Tensor, Tensor) and (Tensor, Tensor, Tensor, Scalar[, Scalar]).
constexpr OpName kWhere{"aten::where", "self"}, kAddcmul{"aten::addcmul", ""}, kAddcdiv{"aten::addcdiv", ""},
    kAddmm{"aten::addmm", ""};
// Functional unary.
constexpr OpName kNeg{"aten::neg", ""}, kExp{"aten::exp", ""}, kLog{"aten::log", ""}, kSqrt{"aten::sqrt", ""},
    kRsqrt{"aten::rsqrt", ""}, kTanh{"aten::tanh", ""}, kSigmoid{"aten::sigmoid", ""}, kRelu{"aten::relu", ""},
    kAbs{"aten::abs", ""}, kReciprocal{"aten::reciprocal", ""};
// In place: (self, Tensor), (self, Tensor, Scalar), (self, Scalar), (self, Scalar, Scalar),
// (self, Tensor, Tensor, Scalar), (self).
constexpr OpName kMul_{"aten::mul_", "Tensor"}, kDiv_{"aten::div_", "Tensor"}, kAdd_{"aten::add_", "Tensor"},
    kSub_{"aten::sub_", "Tensor"}, kLerp_{"aten::lerp_", "Scalar"}, kMulS_{"aten::mul_", "Scalar"},
    kDivS_{"aten::div_", "Scalar"}, kAddS_{"aten::add_", "Scalar"}, kAddcmul_{"aten::addcmul_", ""},
    kAddcdiv_{"aten::addcdiv_", ""}, kRelu_{"aten::relu_", ""}, kSqrt_{"aten::sqrt_", ""}, kNeg_{"aten::neg_", ""};

int g_registered = 0;

} // namespace

void register_unboxed_kernels(torch::Library& lib) {
  auto& dispatcher = c10::Dispatcher::singleton();
  // Only ops with their own kernels and autograd formulas: a backend kernel beside a
  // CompositeImplicitAutograd one would take the op away from its decomposition (and autograd).
  auto add = [&](const OpName& n, auto f) {
    auto op = dispatcher.findOp(c10::OperatorName(n.name, n.overload));
    if (!op || op->hasKernelForDispatchKey(c10::DispatchKey::CompositeImplicitAutograd) ||
        op->hasKernelForDispatchKey(c10::DispatchKey::PrivateUse1)) {
      return;
    }
    std::string qualified = std::string(n.name).substr(6);
    if (*n.overload) qualified += std::string(".") + n.overload;
    lib.impl(qualified.c_str(), f);
    ++g_registered;
  };
  add(kMul, TORCH_FN((functional<kMul, T, T>)));
  add(kDiv, TORCH_FN((functional<kDiv, T, T>)));
  add(kMm, TORCH_FN((functional<kMm, T, T>)));
  add(kBmm, TORCH_FN((functional<kBmm, T, T>)));
  add(kSigmoidBackward, TORCH_FN((functional<kSigmoidBackward, T, T>)));
  add(kTanhBackward, TORCH_FN((functional<kTanhBackward, T, T>)));
  add(kAdd, TORCH_FN((functional<kAdd, T, T, S>)));
  add(kSub, TORCH_FN((functional<kSub, T, T, S>)));
  add(kThresholdBackward, TORCH_FN((functional<kThresholdBackward, T, T, S>)));
  add(kMulS, TORCH_FN((functional<kMulS, T, S>)));
  add(kDivS, TORCH_FN((functional<kDivS, T, S>)));
  add(kPowS, TORCH_FN((functional<kPowS, T, S>)));
  add(kAddS, TORCH_FN((functional<kAddS, T, S, S>)));
  add(kWhere, TORCH_FN((functional<kWhere, T, T, T>)));
  add(kAddcmul, TORCH_FN((functional<kAddcmul, T, T, T, S>)));
  add(kAddcdiv, TORCH_FN((functional<kAddcdiv, T, T, T, S>)));
  add(kAddmm, TORCH_FN((functional<kAddmm, T, T, T, S, S>)));
  add(kNeg, TORCH_FN((functional<kNeg, T>)));
  add(kExp, TORCH_FN((functional<kExp, T>)));
  add(kLog, TORCH_FN((functional<kLog, T>)));
  add(kSqrt, TORCH_FN((functional<kSqrt, T>)));
  add(kRsqrt, TORCH_FN((functional<kRsqrt, T>)));
  add(kTanh, TORCH_FN((functional<kTanh, T>)));
  add(kSigmoid, TORCH_FN((functional<kSigmoid, T>)));
  add(kRelu, TORCH_FN((functional<kRelu, T>)));
  add(kAbs, TORCH_FN((functional<kAbs, T>)));
  add(kReciprocal, TORCH_FN((functional<kReciprocal, T>)));
  add(kMul_, TORCH_FN((in_place<kMul_, T>)));
  add(kDiv_, TORCH_FN((in_place<kDiv_, T>)));
  add(kAdd_, TORCH_FN((in_place<kAdd_, T, S>)));
  add(kSub_, TORCH_FN((in_place<kSub_, T, S>)));
  add(kLerp_, TORCH_FN((in_place<kLerp_, T, S>)));
  add(kMulS_, TORCH_FN((in_place<kMulS_, S>)));
  add(kDivS_, TORCH_FN((in_place<kDivS_, S>)));
  add(kAddS_, TORCH_FN((in_place<kAddS_, S, S>)));
  add(kAddcmul_, TORCH_FN((in_place<kAddcmul_, T, T, S>)));
  add(kAddcdiv_, TORCH_FN((in_place<kAddcdiv_, T, T, S>)));
  add(kRelu_, TORCH_FN((in_place<kRelu_>)));
  add(kSqrt_, TORCH_FN((in_place<kSqrt_>)));
  add(kNeg_, TORCH_FN((in_place<kNeg_>)));
}

int unboxed_kernels_registered() {
  return g_registered;
}

} // namespace lazymem
