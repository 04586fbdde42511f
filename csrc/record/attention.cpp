// record: scaled-dot-product attention takes the kernel eager takes on the backing device.
//
// SDPA is a composite that picks its kernel by the query's device type (_fused_sdp_choice_stub)
// and then calls that kernel's op: lazymem answers the choice as the backing device would for the
// same inputs, so the recorded program holds eager's kernel (and its backward), not SDPA's math
// decomposition — bitwise equal to eager, without every head's L x S attention matrix.
// - CPU backing: the CPU choice (flash attention for CPU or math).
// - CUDA backing: the CUDA choice (flash, memory-efficient or cuDNN attention, by torch's own
//   selection rules and flags), except with dropout (math; see lazy_sdp_choice). The composite's memory-efficient and cuDNN branches call
//   device-generic ops; its flash branch calls the CPU flash op for any device but CUDA, so lazymem
//   registers SDPA above the backend (AutogradPrivateUse1 and PrivateUse1) and runs the composite's
//   CUDA flash branch itself: head dim padded to a multiple of 8, the scale of the unpadded head
//   dim, the output sliced back.
#include <cmath>

#include <ATen/Functions.h>
#include <ATen/SDPBackend.h>
#include <ATen/native/transformers/attention.h>
#include <ATen/ops/scaled_dot_product_attention_native.h>
#include <torch/library.h>

#include "core/runtime.h"
#include "record/meta.h"

namespace lazymem {
namespace {

using SdpChoiceFn = int64_t(const at::Tensor&, const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                            double, bool, std::optional<double>, bool);

int64_t lazy_sdp_choice(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                        const std::optional<at::Tensor>& mask, double dropout, bool is_causal,
                        std::optional<double> scale, bool enable_gqa) {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("aten::_fused_sdp_choice", "").typed<SdpChoiceFn>();
  if (backing_device().is_cpu()) {
    // The CPU kernel reads metadata only: lazymem tensors answer as CPU tensors would.
    return op.redispatch(c10::DispatchKeySet(c10::DispatchKey::CPU), q, k, v, mask, dropout, is_causal, scale,
                         enable_gqa);
  }
  // With dropout the fused CUDA kernels return their dropout seed and offset as CPU scalars that
  // their backward reads on the host, while lazymem keeps every output on the device: the math
  // path instead (its dropout is an ordinary recorded op).
  if (dropout > 0.0) return static_cast<int64_t>(at::SDPBackend::math);
  std::optional<at::Tensor> m;
  if (mask && mask->defined()) m = metadata_twin(*mask);
  return op.redispatch(c10::DispatchKeySet(backing_key()), metadata_twin(q), metadata_twin(k), metadata_twin(v), m,
                       dropout, is_causal, scale, enable_gqa);
}

at::Tensor pad_head_dim_to_8(const at::Tensor& t) {
  const int64_t d = t.size(-1);
  return d % 8 == 0 ? t : at::pad(t, {0, 8 - d % 8});
}

at::Tensor lazy_sdpa(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                     const std::optional<at::Tensor>& mask, double dropout, bool is_causal, std::optional<double> scale,
                     bool enable_gqa) {
  if (backing_device().is_cuda() && q.dim() >= 2 &&
      lazy_sdp_choice(q, k, v, mask, dropout, is_causal, scale, enable_gqa) ==
          static_cast<int64_t>(at::SDPBackend::flash_attention)) {
    const int64_t head_dim = q.size(-1);
    const double s = scale ? *scale : 1.0 / std::sqrt(static_cast<double>(head_dim));
    at::Tensor out = std::get<0>(at::_scaled_dot_product_flash_attention(
        pad_head_dim_to_8(q), pad_head_dim_to_8(k), pad_head_dim_to_8(v), dropout, is_causal,
        /*return_debug_mask=*/false, s));
    return out.size(-1) == head_dim ? out : out.slice(-1, 0, head_dim);
  }
  return at::native::scaled_dot_product_attention(q, k, v, mask, dropout, is_causal, scale, enable_gqa);
}

} // namespace
} // namespace lazymem

namespace at::native {
REGISTER_PRIVATEUSE1_DISPATCH(_fused_sdp_choice_stub, &lazymem::lazy_sdp_choice)
} // namespace at::native

// Above the backend so the flash branch records CUDA's flash op with its own derivative; at
// PrivateUse1 too, for calls below autograd (inference mode).
TORCH_LIBRARY_IMPL(aten, AutogradPrivateUse1, m) {
  m.impl("scaled_dot_product_attention", TORCH_FN(lazymem::lazy_sdpa));
}
TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("scaled_dot_product_attention", TORCH_FN(lazymem::lazy_sdpa));
}
