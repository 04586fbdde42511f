// device: autocast for lazymem. torch.autocast("lazymem") casts like torch.autocast("cuda"): the same
// public op lists (ATen's AT_FORALL_* policy lists) registered on the AutocastPrivateUse1 key; the
// recorded ops are the post-cast ones, so replay (which excludes autocast keys) runs them as recorded.
#include <ATen/autocast_mode.h>
#include <torch/headeronly/version.h>
#include <torch/library.h>

namespace {
#if TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR < 13
using at::DimnameList; // (named tensors' list, named unqualified by ATen 2.11's policy lists; gone in 2.13)
#endif
using at::Tensor;
using c10::IntArrayRef;
using c10::Scalar;
using c10::ScalarType;
} // namespace

TORCH_LIBRARY_IMPL(_, AutocastPrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFallthrough());
}

TORCH_LIBRARY_IMPL(aten, AutocastPrivateUse1, m) {
#define LAZYMEM_LOWER_PRECISION_FP(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, lower_precision_fp)
#define LAZYMEM_FP32(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, fp32)
#define LAZYMEM_FP32_SET_OPT_DTYPE(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, fp32_set_opt_dtype)
#define LAZYMEM_DIFFERENT_SIGNATURE(...) KERNEL_DIFFERENT_REDISPATCH_SIGNATURE_PRIVATEUSEONE(__VA_ARGS__)
#define LAZYMEM_PROMOTE(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, promote)
  AT_FORALL_LOWER_PRECISION_FP(LAZYMEM_LOWER_PRECISION_FP)
  AT_FORALL_FP32(LAZYMEM_FP32)
  AT_FORALL_FP32_SET_OPT_DTYPE(LAZYMEM_FP32_SET_OPT_DTYPE)
  AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE(LAZYMEM_DIFFERENT_SIGNATURE)
  AT_FORALL_PROMOTE(LAZYMEM_PROMOTE)
#undef LAZYMEM_LOWER_PRECISION_FP
#undef LAZYMEM_FP32
#undef LAZYMEM_FP32_SET_OPT_DTYPE
#undef LAZYMEM_DIFFERENT_SIGNATURE
#undef LAZYMEM_PROMOTE
}
