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

#include "core/boxed.h"
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

// empty_like(t, t.suggest_memory_format()) without the Meta key's empty_like (a Python reference).
at::Tensor empty_in_format(const at::Tensor& t) {
  const auto options = at::TensorOptions().dtype(t.scalar_type()).device(c10::kMeta);
  return at::empty(t.sizes(), options.memory_format(t.suggest_memory_format()));
}

// native_batch_norm (and _native_batch_norm_legit: the same CPU kernel and arguments) and its
// backward on the CPU backing, as batch_norm_cpu allocates: the output (and grad_input) empty_like
// the input in its suggested memory format; the saved statistics (and the parameters' gradients) 1-D
// in the parameters' type: the input's, float for a reduced-precision input with float parameters;
// the saved statistics are empty in evaluation. Only for well-formed calls (1-D parameters of the
// channels' count, of one type the CPU kernel accepts, the statistics each mode reads): anything
// else takes torch's Python kernel and its checks. (Its Python decomposition cost the BatchNorm CNN's
// first step tens of milliseconds.)
struct BatchNormParams {
  at::ScalarType dtype; // of the statistics and the parameters' gradients
  int64_t channels;
};
std::optional<BatchNormParams> batch_norm_params(const at::Tensor& input, std::initializer_list<at::Tensor> params) {
  if (!backing_device().is_cpu() || input.dim() < 2) return std::nullopt;
  const int64_t channels = input.size(1);
  std::optional<at::ScalarType> type;
  for (const at::Tensor& p : params) {
    if (!p.defined()) continue;
    if (p.dim() != 1 || p.size(0) != channels || (type && *type != p.scalar_type())) return std::nullopt;
    type = p.scalar_type();
  }
  const at::ScalarType in = input.scalar_type();
  if (!at::isFloatingType(in)) return std::nullopt;
  const bool reduced = in == at::kBFloat16 || in == at::kHalf;
  if (type && *type != in && !(reduced && *type == at::kFloat)) return std::nullopt;
  return BatchNormParams{type.value_or(in), channels};
}

bool batch_norm(torch::jit::Stack& stack) {
  const at::Tensor input = stack[0].toTensor();
  const at::Tensor weight = optional_tensor(stack[1]), bias = optional_tensor(stack[2]);
  const at::Tensor running_mean = optional_tensor(stack[3]), running_var = optional_tensor(stack[4]);
  const bool train = stack[5].toBool();
  if (!train && (!running_mean.defined() || !running_var.defined())) return false;
  const std::optional<BatchNormParams> p = batch_norm_params(input, {weight, bias, running_mean, running_var});
  if (!p) return false;
  const int64_t stat = train ? p->channels : 0;
  at::Tensor out = empty_in_format(input);
  stack.clear();
  stack.emplace_back(std::move(out));
  stack.emplace_back(empty({stat}, p->dtype));
  stack.emplace_back(empty({stat}, p->dtype));
  return true;
}

bool batch_norm_backward(torch::jit::Stack& stack) {
  const at::Tensor grad_out = stack[0].toTensor(), input = stack[1].toTensor();
  const at::Tensor weight = optional_tensor(stack[2]);
  const at::Tensor running_mean = optional_tensor(stack[3]), running_var = optional_tensor(stack[4]);
  const at::Tensor save_mean = optional_tensor(stack[5]), save_invstd = optional_tensor(stack[6]);
  const bool train = stack[7].toBool();
  const auto mask = stack[9].to<std::array<bool, 3>>();
  if (grad_out.sizes() != input.sizes() || grad_out.scalar_type() != input.scalar_type()) return false;
  if (train ? !save_mean.defined() || !save_invstd.defined() : !running_mean.defined() || !running_var.defined()) {
    return false;
  }
  const std::optional<BatchNormParams> p =
      batch_norm_params(input, {weight, running_mean, running_var, save_mean, save_invstd});
  if (!p) return false;
  at::Tensor grad_input = mask[0] ? empty_in_format(input) : at::Tensor();
  stack.clear();
  stack.emplace_back(std::move(grad_input));
  stack.emplace_back(mask[1] ? empty({p->channels}, p->dtype) : at::Tensor());
  stack.emplace_back(mask[2] ? empty({p->channels}, p->dtype) : at::Tensor());
  return true;
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
    call_boxed(*cpp, target, meta, &stack);
  } else {
    redispatch_boxed(target, meta, &stack);
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

// The CPU flash attention (scaled_dot_product_attention's CPU kernel) and its backward: torch's
// Python meta kernels, whose empty_like reference imported sympy on the first call (0.8-1 s, in an
// attention model's first step). The same outputs for dense 4-D inputs: the attention empty_like
// the query, the log-sum-exp (batch, heads, query length) of its computation type laid out as
// (batch, length, heads); the gradients laid out (batch, length, heads, head size). Anything else
// takes the Python kernels.
bool flash_attention_cpu(torch::jit::Stack& stack) {
  const at::Tensor query = stack[0].toTensor();
  if (query.dim() != 4 || !query.is_non_overlapping_and_dense()) return false;
  const at::ScalarType q = query.scalar_type();
  const at::ScalarType lse_type = q == at::kHalf || q == at::kBFloat16 ? at::kFloat : q;
  at::Tensor attention = at::detail::empty_strided_meta(query.sizes(), query.strides(), q);
  at::Tensor lse = empty({query.size(0), query.size(2), query.size(1)}, lse_type).transpose(1, 2);
  stack.clear();
  stack.emplace_back(std::move(attention));
  stack.emplace_back(std::move(lse));
  return true;
}

bool flash_attention_cpu_backward(torch::jit::Stack& stack) {
  std::array<at::Tensor, 3> grads;
  for (size_t i = 0; i < grads.size(); ++i) {
    const at::Tensor t = stack[1 + i].toTensor(); // query, key, value
    if (t.dim() != 4) return false;
    grads[i] = empty({t.size(0), t.size(2), t.size(1), t.size(3)}, t.scalar_type()).permute({0, 2, 1, 3});
  }
  stack.clear();
  for (at::Tensor& g : grads) stack.emplace_back(std::move(g));
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
  if (name.name == "aten::native_batch_norm" || name.name == "aten::_native_batch_norm_legit") return batch_norm(stack);
  if (name.name == "aten::native_batch_norm_backward") return batch_norm_backward(stack);
  if (name.name == "aten::_scaled_dot_product_flash_attention_for_cpu") return flash_attention_cpu(stack);
  if (name.name == "aten::_scaled_dot_product_flash_attention_for_cpu_backward") {
    return flash_attention_cpu_backward(stack);
  }
  if (name.name == "aten::relu" || name.name == "aten::relu_") {
    relu(stack, name.name == "aten::relu_");
    return true;
  }
  return false;
}

} // namespace lazymem
