// record: C++ meta functions for ops whose meta kernel is Python only (native_meta.h).
#include "record/native_meta.h"

#include <array>
#include <optional>
#include <string_view>

#include <ATen/ATen.h>
#include <ATen/AccumulateType.h>
#include <ATen/EmptyTensor.h>
#include <ATen/native/cpu/mixed_data_type.h>
#include <ATen/native/layer_norm.h>

#include "core/config.h"
#include "core/runtime.h"
#include "record/cpp_meta.h"

namespace lazymem {
namespace {

std::vector<int64_t> int_list(const c10::IValue& v) {
  std::vector<int64_t> out;
  for (const c10::IValue& e : v.toListRef()) out.push_back(e.isSymInt() ? e.toSymInt().guard_int(__FILE__, __LINE__) : e.toInt());
  return out;
}

at::Tensor optional_tensor(const c10::IValue& v) {
  return v.isNone() ? at::Tensor() : v.toTensor();
}

// A contiguous meta tensor of `sizes` and `dtype` (eager's kernels allocate their outputs so:
// empty_like with LEGACY_CONTIGUOUS_MEMORY_FORMAT, at::empty).
at::Tensor empty(c10::IntArrayRef sizes, at::ScalarType dtype) {
  return at::empty(sizes, at::TensorOptions().dtype(dtype).device(c10::kMeta));
}

// The dtype of native_layer_norm's mean and rstd on the backing device: the CPU kernel's
// param_scalar_type (the input's, float where the parameters are float and the input reduced), the
// CUDA one's accumulate type.
at::ScalarType stat_dtype(const at::Tensor& input, const at::Tensor& weight, const at::Tensor& bias) {
  if (backing_device().is_cuda()) return at::toAccumulateType(input.scalar_type(), /*is_cuda=*/true);
  const bool mixed = at::native::is_mixed_type(input, weight, bias);
  if (mixed) at::native::check_mixed_data_type(input, weight, bias);
  return at::native::param_scalar_type(input, mixed);
}

void layer_norm(torch::jit::Stack& stack) {
  const at::Tensor input = stack[0].toTensor();
  const std::vector<int64_t> normalized = int_list(stack[1]);
  const at::Tensor weight = optional_tensor(stack[2]), bias = optional_tensor(stack[3]);
  const at::ScalarType dtype = stat_dtype(input, weight, bias);
  (void)at::native::_check_layer_norm_inputs(input, normalized, weight, bias);
  const size_t axis = static_cast<size_t>(input.dim()) - normalized.size();
  std::vector<int64_t> stat(input.sizes().begin(), input.sizes().begin() + static_cast<int64_t>(axis));
  stat.resize(static_cast<size_t>(input.dim()), 1);
  stack.clear();
  stack.emplace_back(empty(input.sizes(), input.scalar_type()));
  stack.emplace_back(empty(stat, dtype));
  stack.emplace_back(empty(stat, dtype));
}

void layer_norm_backward(torch::jit::Stack& stack) {
  const at::Tensor input = stack[1].toTensor();
  const at::Tensor weight = optional_tensor(stack[5]), bias = optional_tensor(stack[6]);
  const auto mask = stack[7].to<std::array<bool, 3>>();
  (void)at::native::_check_layer_norm_inputs(input, int_list(stack[2]), weight, bias);
  // eager: empty_like each (zeros_like for the parameters' gradients of an empty batch: the same meta)
  auto like = [](bool wanted, const at::Tensor& t) {
    return wanted && t.defined() ? empty(t.sizes(), t.scalar_type()) : at::Tensor();
  };
  stack.clear();
  stack.emplace_back(like(mask[0], input));
  stack.emplace_back(like(mask[1], weight));
  stack.emplace_back(like(mask[2], bias));
}

// relu and relu_: eager's kernels check the dtype, then run clamp_min(self, 0) (clamp_min_): a
// structured op, whose C++ meta kernel gives exactly eager's result layout.
void relu(torch::jit::Stack& stack, bool in_place) {
  const at::Tensor self = stack[0].toTensor();
  TORCH_CHECK(self.scalar_type() != at::kBool, "Boolean inputs not supported for relu");
  static const c10::OperatorHandle clamp_min = c10::Dispatcher::singleton().findSchemaOrThrow("aten::clamp_min", "");
  static const c10::OperatorHandle clamp_min_ = c10::Dispatcher::singleton().findSchemaOrThrow("aten::clamp_min_", "");
  const c10::OperatorHandle& target = in_place ? clamp_min_ : clamp_min;
  stack.clear();
  stack.emplace_back(self);
  stack.emplace_back(c10::Scalar(0));
  const c10::DispatchKeySet meta(c10::DispatchKey::Meta);
  if (const c10::KernelFunction* cpp = shadowed_cpp_meta_kernel(target)) {
    cpp->callBoxed(target, meta, &stack);
  } else {
    target.redispatchBoxed(meta, &stack);
  }
}

// _transformer_encoder_layer_fwd (nn.TransformerEncoderLayer's inference fast path): torch's Python
// meta kernel returns empty_like(src), whose Python reference imported sympy (0.95 s) in an
// inference's first step. The same here for a dense source; anything else takes the Python kernel.
bool transformer_encoder_layer(torch::jit::Stack& stack) {
  const at::Tensor src = stack[0].toTensor();
  if (!src.is_non_overlapping_and_dense()) return false;
  at::Tensor out = at::detail::empty_strided_meta(src.sizes(), src.strides(), src.scalar_type());
  stack.clear();
  stack.emplace_back(std::move(out));
  return true;
}

} // namespace

bool native_meta(const c10::OperatorHandle& op, torch::jit::Stack& stack) {
  static const bool on = env_flag("LAZYMEM_CPP_META").value_or(true);
  if (!on) return false;
  const c10::OperatorName& name = op.operator_name();
  if (!name.overload_name.empty()) return false;
  if (name.name == "aten::native_layer_norm") {
    layer_norm(stack);
    return true;
  }
  if (name.name == "aten::native_layer_norm_backward") {
    layer_norm_backward(stack);
    return true;
  }
  if (name.name == "aten::_transformer_encoder_layer_fwd") return transformer_encoder_layer(stack);
  if (name.name == "aten::relu" || name.name == "aten::relu_") {
    relu(stack, name.name == "aten::relu_");
    return true;
  }
  return false;
}

} // namespace lazymem
