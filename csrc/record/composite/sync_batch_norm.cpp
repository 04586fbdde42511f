// record: the five kernels nn.SyncBatchNorm calls (batch_norm_stats, batch_norm_gather_stats_with_counts,
// batch_norm_elemt, batch_norm_backward_reduce, batch_norm_backward_elemt), which ATen implements for
// CUDA only. On lazymem they are recorded as their math in ordinary ATen ops — per-channel moments
// over every dim but the channel's (var_mean, which a split merges over chunks exactly), sums over
// the batch (partials), pointwise normalization — so SyncBatchNorm runs on any backing device and
// splits along the batch: statistics over all chunks of all ranks (its all-gather and all-reduce
// between them). The formulas are the CUDA kernels' (Welford merge of the ranks' statistics, the
// unbiased running variance, the backward's projection).
#include <ATen/TensorOperators.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/rsqrt.h>
#include <ATen/ops/sum.h>
#include <ATen/ops/var_mean.h>
#include <torch/library.h>

#include <tuple>
#include <vector>

#include "core/check.h"

namespace lazymem {
namespace {

using at::Tensor;

// Every dim but the channel's (dim 1).
std::vector<int64_t> reduced_dims(const Tensor& input) {
  LAZYMEM_CHECK(input.dim() >= 2, "SyncBatchNorm expects an input of at least 2 dims (N, C, ...), got ",
                input.sizes());
  std::vector<int64_t> dims{0};
  for (int64_t d = 2; d < input.dim(); ++d) dims.push_back(d);
  return dims;
}

// A per-channel vector shaped to broadcast against the input: (1, C, 1, ...).
Tensor per_channel(const Tensor& v, const Tensor& input) {
  std::vector<int64_t> shape(input.dim(), 1);
  shape[1] = v.numel();
  return v.reshape(shape);
}

std::tuple<Tensor, Tensor> batch_norm_stats(const Tensor& input, double eps) {
  auto [var, mean] = at::var_mean(input, reduced_dims(input), /*correction=*/0, /*keepdim=*/false);
  return {mean, at::rsqrt(var + eps)};
}

std::tuple<Tensor, Tensor> batch_norm_gather_stats_with_counts(const Tensor& input, const Tensor& mean,
                                                               const Tensor& invstd,
                                                               const std::optional<Tensor>& running_mean,
                                                               const std::optional<Tensor>& running_var,
                                                               double momentum, double eps, const Tensor& counts) {
  // mean, invstd: (world, C); counts: (world,). The ranks' statistics merged (Chan / Welford).
  Tensor c = counts.to(mean.scalar_type()).reshape({-1, 1});
  Tensor n = c.sum();
  Tensor avg = (c * mean).sum(0) / n;
  Tensor var_j = invstd.pow(-2) - eps;
  Tensor var_n = (c * (var_j + (mean - avg).pow(2))).sum(0);
  Tensor save_invstd = at::rsqrt(var_n / n + eps);
  if (running_mean.has_value() && running_mean->defined()) {
    running_mean->mul_(1 - momentum).add_(avg.to(running_mean->scalar_type()), momentum);
  }
  if (running_var.has_value() && running_var->defined()) {
    running_var->mul_(1 - momentum).add_((var_n / (n - 1)).to(running_var->scalar_type()), momentum);
  }
  return {avg, save_invstd};
}

Tensor batch_norm_elemt(const Tensor& input, const std::optional<Tensor>& weight, const std::optional<Tensor>& bias,
                        const Tensor& mean, const Tensor& invstd, double /*eps*/) {
  Tensor out = (input - per_channel(mean, input)) * per_channel(invstd, input);
  if (weight.has_value() && weight->defined()) out = out * per_channel(*weight, input);
  if (bias.has_value() && bias->defined()) out = out + per_channel(*bias, input);
  return out;
}

std::tuple<Tensor, Tensor, Tensor, Tensor> batch_norm_backward_reduce(const Tensor& grad_out, const Tensor& input,
                                                                      const Tensor& mean, const Tensor& invstd,
                                                                      const std::optional<Tensor>& /*weight*/,
                                                                      bool input_g, bool weight_g, bool bias_g) {
  const std::vector<int64_t> dims = reduced_dims(input);
  Tensor sum_dy = grad_out.sum(dims);
  Tensor sum_dy_xmu = (grad_out * (input - per_channel(mean, input))).sum(dims);
  return {input_g ? sum_dy : Tensor(), input_g ? sum_dy_xmu : Tensor(), weight_g ? sum_dy_xmu * invstd : Tensor(),
          bias_g ? sum_dy : Tensor()};
}

Tensor batch_norm_backward_elemt(const Tensor& grad_out, const Tensor& input, const Tensor& mean, const Tensor& invstd,
                                 const std::optional<Tensor>& weight, const Tensor& sum_dy, const Tensor& sum_dy_xmu,
                                 const Tensor& count) {
  Tensor n = count.sum().to(sum_dy.scalar_type());
  Tensor grad_mean = sum_dy / n;
  Tensor proj_scale = invstd * invstd * sum_dy_xmu / n;
  Tensor grad_scale = (weight.has_value() && weight->defined()) ? invstd * *weight : invstd;
  return (grad_out - per_channel(grad_mean, input) - (input - per_channel(mean, input)) * per_channel(proj_scale, input)) *
      per_channel(grad_scale, input);
}

} // namespace
} // namespace lazymem

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("batch_norm_stats", TORCH_FN(lazymem::batch_norm_stats));
  m.impl("batch_norm_gather_stats_with_counts", TORCH_FN(lazymem::batch_norm_gather_stats_with_counts));
  m.impl("batch_norm_elemt", TORCH_FN(lazymem::batch_norm_elemt));
  m.impl("batch_norm_backward_reduce", TORCH_FN(lazymem::batch_norm_backward_reduce));
  m.impl("batch_norm_backward_elemt", TORCH_FN(lazymem::batch_norm_backward_elemt));
}
