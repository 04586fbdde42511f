// ops: the ops a split plan synthesizes for statistics over the batch other than batch norm's
// (batch_split_theory.md §3.2, §3.4): softmax / log-softmax and their backward, variance and
// standard deviation. Like ops/split_ops.cpp, plain ATen compositions under `lazymem::`
// (CompositeExplicitAutograd: any backing device, and meta for the planner's probes).
//
//   softmax_from_lse(x, lse, log) -> y            exp(x - lse), or x - lse (log-softmax), with
//       lse = logsumexp(x, dim, keepdim) merged over chunks by logaddexp (Reduce::kLogSumExp)
//   softmax_backward_reduce(g, y, dim, log) -> s  sum(g * y) (softmax) or sum(g) (log-softmax)
//       over `dim`, kept; summed over chunks
//   softmax_backward_apply(g, y, s, log) -> dx    y * (g - s), or g - exp(y) * s: the CPU
//       kernels' formulas with the whole batch's sum
//   moments(x, dims, dtype) -> [2, ...]           (biased variance, mean) over `dims`, kept;
//       merged over chunks by Chan's update (Reduce::kMoments)
//   moments_finish(m, correction, count, dims, keepdim, sqrt) -> (var or std, mean)
#include <ATen/TensorOperators.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/exp.h>
#include <ATen/ops/sqrt.h>
#include <ATen/ops/stack.h>
#include <ATen/ops/var_mean.h>
#include <torch/library.h>

namespace lazymem {
namespace {

at::Tensor softmax_from_lse(const at::Tensor& x, const at::Tensor& lse, bool log) {
  at::Tensor shifted = x - lse;
  return log ? shifted : shifted.exp_();
}

at::Tensor softmax_backward_reduce(const at::Tensor& g, const at::Tensor& y, int64_t dim, bool log) {
  return log ? g.sum(dim, /*keepdim=*/true) : (g * y).sum(dim, /*keepdim=*/true);
}

at::Tensor softmax_backward_apply(const at::Tensor& g, const at::Tensor& y, const at::Tensor& s, bool log) {
  return log ? g - at::exp(y).mul_(s) : y * (g - s);
}

at::Tensor moments(const at::Tensor& x, at::IntArrayRef dims, at::ScalarType dtype) {
  auto [var, mean] = at::var_mean(x.scalar_type() == dtype ? x : x.to(dtype), dims, /*correction=*/0,
                                  /*keepdim=*/true);
  return at::stack({var, mean});
}

std::tuple<at::Tensor, at::Tensor> moments_finish(const at::Tensor& m, double correction, int64_t count,
                                                  at::IntArrayRef dims, bool keepdim, bool sqrt) {
  // var = M2 / max(0, N - correction) = biased * N / max(0, N - correction), as eager divides.
  const double n = static_cast<double>(count);
  const double denom = std::max(0.0, n - correction);
  at::Tensor var = m.select(0, 0), mean = m.select(0, 1);
  if (!keepdim) {
    var = var.squeeze(dims);
    mean = mean.squeeze(dims);
  }
  var = var * (n / denom);
  if (sqrt) var.sqrt_();
  return {var, mean.clone()};
}

} // namespace
} // namespace lazymem

TORCH_LIBRARY_FRAGMENT(lazymem, m) {
  m.def("softmax_from_lse(Tensor x, Tensor lse, bool log) -> Tensor");
  m.def("softmax_backward_reduce(Tensor grad, Tensor out, int dim, bool log) -> Tensor");
  m.def("softmax_backward_apply(Tensor grad, Tensor out, Tensor sum, bool log) -> Tensor");
  m.def("moments(Tensor x, int[] dims, ScalarType dtype) -> Tensor");
  m.def("moments_finish(Tensor m, float correction, int count, int[] dims, bool keepdim, bool sqrt) -> (Tensor, "
        "Tensor)");
}

TORCH_LIBRARY_IMPL(lazymem, CompositeExplicitAutograd, m) {
  m.impl("softmax_from_lse", TORCH_FN(lazymem::softmax_from_lse));
  m.impl("softmax_backward_reduce", TORCH_FN(lazymem::softmax_backward_reduce));
  m.impl("softmax_backward_apply", TORCH_FN(lazymem::softmax_backward_apply));
  m.impl("moments", TORCH_FN(lazymem::moments));
  m.impl("moments_finish", TORCH_FN(lazymem::moments_finish));
}
