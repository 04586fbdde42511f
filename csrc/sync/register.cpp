// sync: the dispatcher registrations that record ops or reach a sync point: the boxed fallback
// (record, or run eagerly when the recorder cannot), the composites captured whole, the convolution
// entry points, host<->lazymem copies (upload = a recorded copy_, download = a sync point) and
// scalar reads.
#include <ATen/core/Tensor.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/library.h>

#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "core/runtime.h"
#include "device/phantom.h"
#include "execute/real.h"
#include "record/recorder.h"
#include "sync/sync.h"

namespace lazymem {

void record_or_run(const c10::OperatorHandle& op, torch::jit::Stack* stack, bool allow_constants) {
  if (record_call(op, stack, allow_constants) == Recorded::kNeedsEager) run_eager(op, stack);
  maybe_auto_flush();
}

void sync_fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  record_or_run(op, stack, /*allow_constants=*/false);
}

namespace {

// The captures that depend on the backing device's type (see g_captured below).
struct Captures {
  std::vector<std::string> cpu_only, cuda_only; // qualified names
  std::unique_ptr<torch::Library> lib;          // those of the current backing device type
  c10::DeviceType active = c10::DeviceType::COMPILE_TIME_MAX_DEVICE_TYPES;
  std::mutex mu;
};
Captures& captures() {
  static Captures* c = new Captures();
  return *c;
}

} // namespace

void capture_for_backing(c10::DeviceType t) {
  Captures& c = captures();
  std::lock_guard<std::mutex> lock(c.mu);
  if (c.active == t) return;
  c.lib.reset(); // deregisters the other device type's
  const auto& names = t == c10::DeviceType::CUDA ? c.cuda_only : c.cpu_only;
  if (!names.empty()) {
    c.lib = std::make_unique<torch::Library>(torch::Library::IMPL, "aten", c10::DispatchKey::PrivateUse1, __FILE__,
                                             __LINE__);
    for (const std::string& q : names) c.lib->impl(q.c_str(), torch::CppFunction::makeFromBoxedFunction<&sync_fallback>());
  }
  c.active = t;
}

namespace {

void record_copy(const at::Tensor& dst, const at::Tensor& src, bool non_blocking) {
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("aten::copy_", "");
  torch::jit::Stack stack{dst, src, non_blocking};
  record_or_run(op, &stack, /*allow_constants=*/true);
}

// Reads a lazymem tensor into a tensor on another device (the download of every sync point). Into
// host memory the copy has ended when this returns, non_blocking or not: the value is read at a sync
// point, which has waited for the program anyway, and the caller has no stream of the backing device
// to wait on (`x.to("cpu", non_blocking=True)` gets pinned memory, which a CUDA copy would otherwise
// still be filling when the caller reads it).
void read_into(const at::Tensor& lazy, const at::Tensor& dst, bool non_blocking) {
  materialize({buffer_of(lazy)});
  auto lock = lock_flush();
  c10::impl::ExcludeDispatchKeyGuard guard(kAboveBackendKeys);
  dst.copy_(real_view_of(lazy), non_blocking && !dst.is_cpu());
}

at::Tensor lazy_copy_from(const at::Tensor& self, const at::Tensor& dst, bool non_blocking) {
  if (is_lazy(dst)) {
    // lazymem <- lazymem is an ordinary recorded copy_; lazymem <- host snapshots the source.
    record_copy(dst, self, non_blocking);
  } else {
    read_into(self, dst, non_blocking);
  }
  return dst;
}

at::Tensor lazy_copy_from_and_resize(const at::Tensor& self, const at::Tensor& dst) {
  {
    // lazymem's resize_ is geometry only; a host destination is resized by its own kernel.
    c10::impl::ExcludeDispatchKeyGuard guard(kAboveBackendKeys);
    dst.resize_(self.sizes());
  }
  return lazy_copy_from(self, dst, false);
}

c10::Scalar lazy_local_scalar_dense(const at::Tensor& self) {
  materialize({buffer_of(self)});
  auto lock = lock_flush();
  ReplayScope scope;
  return real_view_of(self).item();
}

// convolution_overrideable has convolution's schema: record the real op so replay runs the backing
// device's own convolution.
void conv_overrideable(const c10::OperatorHandle&, torch::jit::Stack* stack) {
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("aten::convolution", "");
  record_or_run(op, stack);
}

// convolution_backward_overrideable lacks convolution_backward's bias_sizes argument: insert it.
void conv_backward_overrideable(const c10::OperatorHandle&, torch::jit::Stack* stack) {
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("aten::convolution_backward", "");
  const size_t n = 10; // grad_output, input, weight, stride, padding, dilation, transposed, output_padding, groups, mask
  const size_t first = stack->size() - n;
  const at::Tensor& weight = (*stack)[first + 2].toTensor();
  bool transposed = (*stack)[first + 6].toBool();
  int64_t groups = (*stack)[first + 8].toInt();
  int64_t out_channels = transposed ? weight.size(1) * groups : weight.size(0);
  stack->insert(stack->begin() + static_cast<std::ptrdiff_t>(first + 3), c10::IValue(std::vector<int64_t>{out_channels}));
  record_or_run(op, stack);
}

// A _foreach_ op with a backend kernel (a CUDA build's multi-tensor kernels): recorded whole where the
// backing device has that kernel, so replay runs eager's fused kernel (one node per call). On a CPU
// backing, where the op has no CPU kernel, eager runs its per-tensor slow path: so does lazymem,
// recording one node per tensor, as a CPU-only build of torch does — what the planner splits along
// the tensor list (plan/lanes.h) and what CPU eager computes, the same kernels.
// (Registered for the _foreach_ ops that have no CPU kernel and a CompositeExplicitAutograd one.)
void foreach_fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  if (backing_device().is_cpu()) {
    op.callBoxedForDispatchKey(c10::DispatchKey::CompositeExplicitAutograd, *stack);
    return;
  }
  sync_fallback(op, stack);
}

// Composite kernels of two kinds would otherwise pre-empt the boxed fallback on PrivateUse1:
//  - CompositeExplicitAutogradNonFunctional kernels (generated for structured ops: add.Tensor, mm,
//    index.Tensor, ...) run the structured meta function on lazymem tensors and call the out= op,
//    and some (index.Tensor with masks) reach device-specific code that cannot run on lazymem;
//  - the _foreach_* slow paths loop over per-tensor ops (one node per tensor).
//  - CompositeExplicitAutograd kernels of ops that also have CPU/CUDA kernels (see below).
// Capturing them whole records one node per call with the backing device's own kernel at replay.
// In-place view ops stay composite (pure metadata), and new_empty_strided stays a factory.
//
// A CompositeImplicitAutograd op with an autograd formula and a kernel of one device type only (a
// CUDA build's _fused_rms_norm: CUDA kernels for it and its backward, a decomposition everywhere
// else) is captured only while that device backs lazymem: captured on the CPU backing, autograd took
// its formula and the backward op had no CPU kernel to replay (torch 2.11's CUDA wheel on a machine
// without a GPU: every RMSNorm training step failed). Uncaptured, it decomposes above autograd, as
// eager on that device does.
const bool g_captured = [] {
  static auto* lib = new torch::Library(torch::Library::IMPL, "aten", c10::DispatchKey::PrivateUse1, __FILE__, __LINE__);
  register_unboxed_kernels(*lib); // first: the loop below skips ops with a PrivateUse1 kernel
  auto& dispatcher = c10::Dispatcher::singleton();
  Captures& by_device = captures();
  for (const c10::OperatorName& name : dispatcher.getAllOpNames()) {
    if (name.name.rfind("aten::", 0) != 0 || name.name == "aten::new_empty_strided") continue;
    auto op = dispatcher.findOp(name);
    if (!op || op->hasKernelForDispatchKey(c10::DispatchKey::PrivateUse1) || op->hasTag(at::Tag::inplace_view)) continue;
    const bool cpu = op->hasKernelForDispatchKey(c10::DispatchKey::CPU);
    const bool cuda = op->hasKernelForDispatchKey(c10::DispatchKey::CUDA);
    bool ceanf = op->hasKernelForDispatchKey(c10::DispatchKey::CompositeExplicitAutogradNonFunctional);
    bool backend = cpu || cuda;
    bool foreach = name.name.rfind("aten::_foreach_", 0) == 0 && backend;
    // CompositeExplicitAutograd kernels beside real CPU/CUDA kernels (native_layer_norm, addr, ...)
    // exist for other backends only: CPU and CUDA never decompose them, so neither does lazymem.
    // (Replayed on a device without its own kernel, the explicit composite runs below autograd.)
    bool hybrid = backend && op->hasKernelForDispatchKey(c10::DispatchKey::CompositeExplicitAutograd);
    // Likewise CompositeImplicitAutograd kernels beside CPU/CUDA kernels and an autograd formula
    // (mish_backward, silu_backward): the formula keeps autograd intact when captured.
    const bool implicit = backend && op->hasKernelForDispatchKey(c10::DispatchKey::CompositeImplicitAutograd) &&
        op->hasKernelForDispatchKey(c10::DispatchKey::Autograd);
    std::string qualified = name.name.substr(6);
    if (!name.overload_name.empty()) qualified += "." + name.overload_name;
    if (implicit && !(ceanf || foreach || hybrid) && cpu != cuda) {
      (cpu ? by_device.cpu_only : by_device.cuda_only).push_back(qualified);
      continue;
    }
    if (!(ceanf || foreach || hybrid || implicit)) continue;
    if (foreach && !op->hasKernelForDispatchKey(c10::DispatchKey::CPU) &&
        op->hasKernelForDispatchKey(c10::DispatchKey::CompositeExplicitAutograd)) {
      lib->impl(qualified.c_str(), torch::CppFunction::makeFromBoxedFunction<&foreach_fallback>());
    } else {
      lib->impl(qualified.c_str(), torch::CppFunction::makeFromBoxedFunction<&sync_fallback>());
    }
  }
  flush_hooks().backing_chosen = &capture_for_backing;
  return true;
}();

} // namespace
} // namespace lazymem

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  using namespace lazymem;
  m.impl("_copy_from", TORCH_FN(lazy_copy_from));
  m.impl("_copy_from_and_resize", TORCH_FN(lazy_copy_from_and_resize));
  m.impl("_local_scalar_dense", TORCH_FN(lazy_local_scalar_dense));
  // Captured whole (CompositeExplicitAutograd, so autograd is unaffected): one node each.
  m.impl("convolution", torch::CppFunction::makeFromBoxedFunction<&sync_fallback>());
  m.impl("convolution_backward", torch::CppFunction::makeFromBoxedFunction<&sync_fallback>());
  // logsumexp's composite calls its out= form, which no split rule can shard (a written output):
  // captured functional, it replays through the same composite on the backing device and splits
  // over the batch as a log-sum-exp pass.
  m.impl("logsumexp", torch::CppFunction::makeFromBoxedFunction<&sync_fallback>());
  m.impl("convolution_overrideable", torch::CppFunction::makeFromBoxedFunction<&conv_overrideable>());
  m.impl("convolution_backward_overrideable",
         torch::CppFunction::makeFromBoxedFunction<&conv_backward_overrideable>());
}

TORCH_LIBRARY_IMPL(_, PrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&lazymem::sync_fallback>());
}
