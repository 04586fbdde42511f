// record: aten::dropout on the CPU backing device. Its CompositeImplicitAutograd kernel takes the
// fused native_dropout for PrivateUse1 inputs but, on the CPU, multiplies by a bernoulli noise divided
// by 1 - p: the two round differently for some p and record different backward graphs. On
// AutogradPrivateUse1 (and PrivateUse1, for inference mode) this kernel makes the CPU's decision, so
// autograd records eager CPU's graph and replay draws the same numbers. Other backing devices keep
// the original composite. (feature/alpha dropout and dropout_ never take the fused branch.)
#include <ATen/TensorOperators.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/dropout_native.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/library.h>

#include "core/runtime.h"

namespace lazymem {
namespace {

at::Tensor dropout(const at::Tensor& input, double p, bool train) {
  if (!backing_device().is_cpu()) return at::native::dropout(input, p, train);
  TORCH_CHECK(p >= 0 && p <= 1, "dropout probability has to be between 0 and 1, but got ", p);
  if (p == 0 || !train || input.sym_numel() == 0) return input;
  if (p == 1) return input * at::zeros({}, input.options());
  at::Tensor noise = at::empty_like(input);
  noise.bernoulli_(1 - p);
  noise.div_(1 - p);
  return input * noise;
}

} // namespace
} // namespace lazymem

TORCH_LIBRARY_IMPL(aten, AutogradPrivateUse1, m) {
  m.impl("dropout", TORCH_FN(lazymem::dropout));
}

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("dropout", TORCH_FN(lazymem::dropout));
}
