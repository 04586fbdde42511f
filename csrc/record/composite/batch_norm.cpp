// record: batch norm takes the kernel eager takes on the backing device.
//
// batch_norm (and instance_norm through it) is a composite whose _batch_norm_impl_index picks cuDNN's
// kernel by the input's device type (at::native::_select_batch_norm_backend): a lazymem input is
// not a CUDA tensor, so the composite would record ATen's native kernel, whose results differ from
// eager CUDA's (cuDNN's) in the last bits of the output and of every gradient. On a CUDA backing
// device this kernel, above autograd (AutogradPrivateUse1, and PrivateUse1 for inference mode),
// asks the same selection function about metadata twins of the inputs and, where it answers cuDNN,
// records cudnn_batch_norm exactly as the composite calls it, so autograd records
// cudnn_batch_norm_backward: eager's kernels, bitwise. Every other case is the composite itself.
// The planner splits cudnn_batch_norm like native_batch_norm (plan/synth.cpp expands a training one
// into passes); its reserve space is empty for the plain batch norm the composite requests.
#include <ATen/core/Tensor.h>
#include <ATen/native/Normalization.h>
#include <ATen/ops/_batch_norm_impl_index_native.h>
#include <ATen/ops/cudnn_batch_norm.h>
#include <torch/library.h>

#include "core/runtime.h"
#include "record/meta.h"

namespace lazymem {
namespace {

using at::Tensor;

void check_features(const char* name, int64_t expected, const Tensor& t) {
  TORCH_CHECK(!t.defined() || t.numel() == expected, name, " should contain ", expected, " elements not ", t.numel());
}

bool cudnn_chosen(const Tensor& input, const Tensor& weight, const Tensor& bias, const Tensor& running_mean,
                  const Tensor& running_var, bool training, double eps) {
  if (!backing_device().is_cuda() || input.dim() < 2 || input.numel() == 0) return false;
  const int64_t c = input.size(1);
  check_features("running_mean", c, running_mean);
  check_features("running_var", c, running_var);
  check_features("weight", c, weight);
  check_features("bias", c, bias);
  return at::native::_select_batch_norm_backend(metadata_twin(input), metadata_twin(weight), metadata_twin(bias),
                                                metadata_twin(running_mean), metadata_twin(running_var), training,
                                                eps) == at::native::BatchNormBackend::Cudnn;
}

std::tuple<Tensor, Tensor, Tensor, Tensor, int64_t> lazy_batch_norm_impl_index(
    const Tensor& input, const std::optional<Tensor>& weight_opt, const std::optional<Tensor>& bias_opt,
    const std::optional<Tensor>& running_mean_opt, const std::optional<Tensor>& running_var_opt, bool training,
    double momentum, double eps, bool cudnn_enabled) {
  const Tensor weight = weight_opt.value_or(Tensor());
  const Tensor bias = bias_opt.value_or(Tensor());
  const Tensor running_mean = running_mean_opt.value_or(Tensor());
  const Tensor running_var = running_var_opt.value_or(Tensor());
  if (cudnn_chosen(input, weight, bias, running_mean, running_var, training, eps)) {
    // As the composite calls it (Normalization.cpp, BatchNormBackend::Cudnn).
    auto [out, save_mean, save_var, reserve] = at::cudnn_batch_norm(
        input.contiguous(input.suggest_memory_format()), weight.contiguous(), bias.contiguous(),
        running_mean.defined() ? running_mean.contiguous() : running_mean,
        running_var.defined() ? running_var.contiguous() : running_var, training, momentum, eps);
    return {out, save_mean, save_var, reserve, 1};
  }
  return at::native::_batch_norm_impl_index(input, weight_opt, bias_opt, running_mean_opt, running_var_opt, training,
                                            momentum, eps, cudnn_enabled);
}

} // namespace
} // namespace lazymem

TORCH_LIBRARY_IMPL(aten, AutogradPrivateUse1, m) {
  m.impl("_batch_norm_impl_index", TORCH_FN(lazymem::lazy_batch_norm_impl_index));
}
TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("_batch_norm_impl_index", TORCH_FN(lazymem::lazy_batch_norm_impl_index));
}
