// ops: the ops a split plan synthesizes where one recorded op becomes several nodes over passes of
// the batch (batch_split_theory.md §3.1, §5): batch norm in training mode. They are plain ATen
// compositions registered under `lazymem::` (CompositeExplicitAutograd: the same kernel runs on the
// CPU, on CUDA and on meta tensors for the planner's probes), so chunks still run through the
// dispatcher on whatever the backing device is. Channels are dim 1; every other dim is reduced.
//
//   bn_moments(x, dtype) -> [2, C]: (biased variance, mean) of this chunk, in `dtype`; chunks merge
//       with Chan's update (execute/bind.cpp, Reduce::kMoments), exact and numerically stable. On
//       the CPU, eager's own statistics kernel (batch_norm_update_stats: the one native_batch_norm
//       runs, vectorized, about 3x var_mean's Welford reduction over dims (0, 2, ...))
//   bn_finish(stats, eps) -> (mean, invstd)                  native_batch_norm's saved statistics
//   bn_update_running(rm!, rv!, stats, momentum, count)      running statistics, unbiased variance
//   bn_apply(x, mean, invstd, weight?, bias?) -> y           (x - mean) * invstd * weight + bias
//   bn_backward_reduce(g, x, mean, invstd, dtype) -> [2, C]: (sum g, invstd * sum g * (x - mean)),
//       summed over chunks: grad_bias and grad_weight. On the CPU, eager's own backward kernel with
//       only those two outputs asked for (no temporaries; about 10x the composition's speed)
//   bn_backward_params(red) -> (grad_weight, grad_bias)
//   bn_backward_elemt(g, x, mean, invstd, weight?, red, count) -> grad_input, in two passes
#include <ATen/TensorOperators.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/addcmul.h>
#include <ATen/ops/batch_norm_update_stats.h>
#include <ATen/ops/native_batch_norm_backward.h>
#include <ATen/ops/stack.h>
#include <ATen/ops/var_mean.h>
#include <torch/library.h>

namespace lazymem {
namespace {

std::vector<int64_t> reduced_dims(const at::Tensor& x) {
  std::vector<int64_t> dims{0};
  for (int64_t d = 2; d < x.dim(); ++d) dims.push_back(d);
  return dims;
}

// A per-channel vector shaped to broadcast against x: [1, C, 1, ...].
at::Tensor per_channel(const at::Tensor& v, const at::Tensor& x) {
  std::vector<int64_t> shape(x.dim(), 1);
  shape[1] = v.numel();
  return v.reshape(shape);
}

at::Tensor as(const at::Tensor& t, at::ScalarType dtype) {
  return t.scalar_type() == dtype ? t : t.to(dtype);
}

// Eager's CPU kernels for a chunk's statistics apply where they take the operands as they are:
// a floating point input in the statistics' dtype (float or double), not empty.
bool cpu_stats_kernel(const at::Tensor& x, at::ScalarType dtype) {
  return x.is_cpu() && x.scalar_type() == dtype && (dtype == at::kFloat || dtype == at::kDouble) && x.numel() > 0;
}

at::Tensor bn_moments(const at::Tensor& x, at::ScalarType dtype) {
  TORCH_CHECK(x.dim() >= 2, "lazymem::bn_moments: input of ", x.dim(), " dims, expected at least 2");
  at::Tensor xd = as(x, dtype);
  if (cpu_stats_kernel(xd, dtype)) {
    // Without running statistics and with momentum 0, only (mean, biased variance) come back.
    auto [mean, var] = at::batch_norm_update_stats(xd, std::nullopt, std::nullopt, /*momentum=*/0.0);
    return at::stack({var, mean});
  }
  auto [var, mean] = at::var_mean(xd, reduced_dims(x), /*correction=*/0, /*keepdim=*/false);
  return at::stack({var, mean});
}

std::tuple<at::Tensor, at::Tensor> bn_finish(const at::Tensor& stats, double eps) {
  return {stats.select(0, 1).clone(), stats.select(0, 0).add(eps).rsqrt_()};
}

void bn_update_running(const at::Tensor& running_mean, const at::Tensor& running_var, const at::Tensor& stats,
                       double momentum, int64_t count) {
  // As the CPU and CUDA kernels do: r = momentum * batch + (1 - momentum) * r, with the unbiased variance.
  const double unbias = count > 1 ? static_cast<double>(count) / static_cast<double>(count - 1)
                                  : std::numeric_limits<double>::infinity();
  // New values computed aside, then copied (copies allocate nothing): an allocation failure leaves
  // the running statistics untouched, so the update can be retried.
  at::Tensor mean = (running_mean * (1 - momentum)).add_(as(stats.select(0, 1), running_mean.scalar_type()), momentum);
  at::Tensor var = (running_var * (1 - momentum)).add_(as(stats.select(0, 0) * unbias, running_var.scalar_type()), momentum);
  running_mean.copy_(mean);
  running_var.copy_(var);
}

at::Tensor bn_apply(const at::Tensor& x, const at::Tensor& mean, const at::Tensor& invstd,
                    const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias) {
  // y = x * alpha + beta with alpha = invstd * w, beta = b - mean * alpha, as the CPU kernel transforms.
  at::Tensor alpha = weight && weight->defined() ? invstd * as(*weight, invstd.scalar_type()) : invstd;
  at::Tensor beta = -mean * alpha;
  if (bias && bias->defined()) beta.add_(as(*bias, beta.scalar_type()));
  const at::ScalarType dt = x.scalar_type();
  if (dt == invstd.scalar_type()) return at::addcmul(per_channel(beta, x), x, per_channel(alpha, x));
  return at::addcmul(per_channel(beta, x), as(x, invstd.scalar_type()), per_channel(alpha, x)).to(dt);
}

at::Tensor bn_backward_reduce(const at::Tensor& g, const at::Tensor& x, const at::Tensor& mean,
                              const at::Tensor& invstd, at::ScalarType dtype) {
  if (cpu_stats_kernel(x, dtype) && g.scalar_type() == dtype && mean.scalar_type() == dtype &&
      invstd.scalar_type() == dtype && g.is_cpu()) {
    // grad_weight = invstd * sum g * (x - mean) and grad_bias = sum g, as eager computes them.
    auto [gi, gw, gb] = at::native_batch_norm_backward(g, x, std::nullopt, std::nullopt, std::nullopt, mean, invstd,
                                                       /*train=*/true, /*eps=*/0.0, {false, true, true});
    return at::stack({gb, gw});
  }
  const std::vector<int64_t> dims = reduced_dims(x);
  at::Tensor gd = as(g, dtype);
  at::Tensor centered = as(x, dtype) - per_channel(mean, x);
  return at::stack({gd.sum(dims), (gd * centered).sum(dims).mul_(invstd)});
}

std::tuple<at::Tensor, at::Tensor> bn_backward_params(const at::Tensor& red) {
  return {red.select(0, 1).clone(), red.select(0, 0).clone()};
}

at::Tensor bn_backward_elemt(const at::Tensor& g, const at::Tensor& x, const at::Tensor& mean,
                             const at::Tensor& invstd, const std::optional<at::Tensor>& weight,
                             const at::Tensor& red, int64_t count) {
  // The CPU kernel's formula with the whole batch's sums: with k = dot * invstd^2 / N (red holds
  // dot * invstd) and scale = invstd * w, dx = (g - sum_g / N - (x - mean) * k) * scale, computed as
  // g * scale + x * alpha + beta with per-channel alpha = -k * scale, beta = (mean * k - sum_g / N) *
  // scale (as the CPU kernel's forward applies its statistics): two passes over the chunk and one
  // temporary where the formula as written took five passes and two (1.3-1.4x faster on an idle
  // 2-core CPU, 2.4x with the other core busy: memory traffic).
  const double n = static_cast<double>(count);
  const at::ScalarType st = mean.scalar_type();
  at::Tensor k = red.select(0, 1) * invstd / n;
  at::Tensor grad_mean = red.select(0, 0) / n;
  at::Tensor scale = weight && weight->defined() ? invstd * as(*weight, st) : invstd;
  at::Tensor ks = k * scale;
  at::Tensor beta = mean * ks - grad_mean * scale;
  at::Tensor dx = at::addcmul(per_channel(beta, x), as(x, st), per_channel(-ks, x));
  dx.addcmul_(as(g, st), per_channel(scale, x));
  return as(dx, x.scalar_type());
}

} // namespace
} // namespace lazymem

TORCH_LIBRARY_FRAGMENT(lazymem, m) {
  m.def("bn_moments(Tensor x, ScalarType dtype) -> Tensor");
  m.def("bn_finish(Tensor stats, float eps) -> (Tensor, Tensor)");
  m.def("bn_update_running(Tensor(a!) running_mean, Tensor(b!) running_var, Tensor stats, float momentum, "
        "int count) -> ()");
  m.def("bn_apply(Tensor x, Tensor mean, Tensor invstd, Tensor? weight, Tensor? bias) -> Tensor");
  m.def("bn_backward_reduce(Tensor grad_out, Tensor x, Tensor mean, Tensor invstd, ScalarType dtype) -> Tensor");
  m.def("bn_backward_params(Tensor red) -> (Tensor, Tensor)");
  m.def("bn_backward_elemt(Tensor grad_out, Tensor x, Tensor mean, Tensor invstd, Tensor? weight, Tensor red, "
        "int count) -> Tensor");
}

TORCH_LIBRARY_IMPL(lazymem, CompositeExplicitAutograd, m) {
  m.impl("bn_moments", TORCH_FN(lazymem::bn_moments));
  m.impl("bn_finish", TORCH_FN(lazymem::bn_finish));
  m.impl("bn_update_running", TORCH_FN(lazymem::bn_update_running));
  m.impl("bn_apply", TORCH_FN(lazymem::bn_apply));
  m.impl("bn_backward_reduce", TORCH_FN(lazymem::bn_backward_reduce));
  m.impl("bn_backward_params", TORCH_FN(lazymem::bn_backward_params));
  m.impl("bn_backward_elemt", TORCH_FN(lazymem::bn_backward_elemt));
}
