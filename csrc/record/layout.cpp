// record: output layouts the backing device's kernels choose where the meta kernel cannot know.
// Meta convolution returns contiguous outputs (meta tensors carry no device, so it cannot tell which
// backend would run), while a CPU or CUDA convolution returns channels-last when its backend does
// (oneDNN or the slow 2-d kernel for a channels-last input, cuDNN for channels-last operands). A
// recorded layout that differs from the kernel's makes replay copy the result into the recorded
// strides, and later ops then see other strides than eager (different kernels, different rounding).
// So for these ops the backend is selected here exactly as ATen selects it — on device tensors that
// hold metadata only — and the meta outputs are given that backend's memory format.
// The same place corrects an output dtype a meta kernel gets wrong: torch 2.11's meta
// _scaled_dot_product_flash_attention_for_cpu gives its logsumexp float32 for double inputs where
// the CPU kernel (and 2.13's meta) gives the inputs' opmath type; recorded as float32, the backward
// kernel refused it ("expected scalar type Double but found Float").
#include "record/layout.h"

#include <ATen/native/ConvUtils.h>
#include <ATen/ops/empty_strided.h>
#include <c10/core/MemoryFormat.h>
#include <c10/core/TensorOptions.h>
#include <c10/util/strides.h>
#include <c10/core/impl/LocalDispatchKeySet.h>

#include "core/runtime.h"
#include "ops/meta_probe.h"

namespace lazymem {
namespace {

// A tensor on the backing device with `t`'s geometry and dtype and no data: what backend selection
// reads (device, dtype, sizes, strides) without allocating.
at::Tensor device_shell(const at::Tensor& t, c10::Device device) {
  c10::Storage storage(c10::Storage::use_byte_size_t(), t.storage().nbytes(), c10::DataPtr(nullptr, device), nullptr,
                       false);
  auto impl = c10::make_intrusive<c10::TensorImpl>(std::move(storage), c10::computeDispatchKey(
                                                                         std::nullopt, c10::kStrided, device),
                                                   t.dtype());
  impl->set_sizes_and_strides(t.sizes(), t.strides(), t.storage_offset());
  return at::Tensor(std::move(impl));
}

at::MemoryFormat conv_format(const torch::jit::Stack& args, bool backward) {
  // convolution(input, weight, bias?, stride, padding, dilation, transposed, output_padding, groups)
  // convolution_backward(grad_output, input, weight, bias_sizes?, stride, padding, dilation,
  //                      transposed, output_padding, groups, output_mask)
  const size_t o = backward ? 1 : 0;
  const at::Tensor& input_meta = args[o].toTensor();
  const at::Tensor& weight_meta = args[o + 1].toTensor();
  const c10::Device device = backing_device();
  // A 1-d convolution runs as a 2-d one on a contiguous, unsqueezed input (as ATen's does; its
  // backend selection makes the input contiguous first, which must not copy a shell).
  const bool one_d = weight_meta.dim() == 3;
  at::Tensor input = device_shell(one_d ? input_meta.contiguous() : input_meta, device);
  at::Tensor weight = device_shell(weight_meta, device);
  std::optional<at::Tensor> bias;
  std::optional<std::vector<c10::SymInt>> bias_sizes;
  const c10::IValue& b = args[o + 2]; // bias (forward) or bias_sizes (backward)
  if (!backward && b.isTensor() && b.toTensor().defined()) bias = device_shell(b.toTensor(), device);
  if (backward && !b.isNone()) bias_sizes = b.toSymIntVector();
  auto sym = [&](size_t i) { return args[o + i].toSymIntVector(); };
  const auto stride = sym(3), padding = sym(4), dilation = sym(5), output_padding = sym(7);
  const bool transposed = args[o + 6].toBool();
  const c10::SymInt groups = args[o + 8].toSymInt();
  at::OptionalSymIntArrayRef bias_sizes_ref = std::nullopt;
  if (bias_sizes) bias_sizes_ref = *bias_sizes;
  at::native::ConvBackend backend = at::native::select_conv_backend(
      input, weight, bias, stride, padding, dilation, transposed, output_padding, groups, bias_sizes_ref);
  if (one_d) {
    input = device_shell(input_meta.contiguous().unsqueeze(2), device);
    weight = device_shell(weight_meta.unsqueeze(2), device);
  }
  return at::native::_determine_backend_memory_format(input, weight, backend);
}

// `t` (a meta output, dense) restrided as a kernel allocates an output of this memory format.
at::Tensor in_format(const at::Tensor& t, at::MemoryFormat fmt) {
  if (!t.defined() || !t.is_non_overlapping_and_dense()) return t;
  c10::SmallVector<int64_t, 5> strides;
  if (fmt == at::MemoryFormat::ChannelsLast && (t.dim() == 4 || t.dim() == 3)) {
    if (t.dim() == 3) { // a 1-d convolution's output from the unsqueezed 2-d run, squeezed back
      auto s = c10::get_channels_last_strides_2d(std::vector<int64_t>{t.size(0), t.size(1), 1, t.size(2)});
      strides = {s[0], s[1], s[3]};
    } else {
      auto s = c10::get_channels_last_strides_2d(t.sizes());
      strides.assign(s.begin(), s.end());
    }
  } else if (fmt == at::MemoryFormat::ChannelsLast3d && t.dim() == 5) {
    auto s = c10::get_channels_last_strides_3d(t.sizes());
    strides.assign(s.begin(), s.end());
  } else {
    auto s = c10::contiguous_strides(t.sizes());
    strides.assign(s.begin(), s.end());
  }
  if (t.strides().equals(strides)) return t;
  return at::empty_strided(t.sizes(), strides, t.options());
}

} // namespace

bool backing_layout_applies(const c10::OperatorHandle& op) {
  static const c10::OperatorName conv("aten::convolution", "");
  static const c10::OperatorName conv_bw("aten::convolution_backward", "");
  static const c10::OperatorName flash_cpu("aten::_scaled_dot_product_flash_attention_for_cpu", "");
  const auto& name = op.operator_name();
  return name == conv || name == conv_bw || name == flash_cpu;
}

void apply_backing_layout(const c10::OperatorHandle& op, const torch::jit::Stack& args, torch::jit::Stack& results) {
  const c10::Device device = backing_device();
  if (!device.is_cpu() && !device.is_cuda()) return;
  static const c10::OperatorName flash_cpu("aten::_scaled_dot_product_flash_attention_for_cpu", "");
  if (op.operator_name() == flash_cpu) {
    // (output, logsumexp): the logsumexp as the CPU kernel allocates it (ops/meta_probe.h).
    if (results.size() < 2 || !results[1].isTensor() || !args[0].isTensor()) return;
    const at::Tensor lse = results[1].toTensor();
    const auto want = backing_result_dtype(op, 1, args[0].toTensor().scalar_type());
    if (lse.defined() && want && lse.scalar_type() != *want) {
      c10::impl::ExcludeDispatchKeyGuard guard(kAboveBackendKeys);
      results[1] = at::empty_strided(lse.sizes(), lse.strides(), lse.options().dtype(*want));
    }
    return;
  }
  static const c10::OperatorName conv_bw("aten::convolution_backward", "");
  const bool backward = op.operator_name() == conv_bw;
  c10::impl::ExcludeDispatchKeyGuard guard(kAboveBackendKeys);
  const at::MemoryFormat fmt = conv_format(args, backward);
  // The forward's output; the backward's grad_input and grad_weight (grad_bias is 1-d).
  const size_t n = backward ? 2 : 1;
  for (size_t j = 0; j < n && j < results.size(); ++j) {
    if (results[j].isTensor()) results[j] = in_format(results[j].toTensor(), fmt);
  }
}

} // namespace lazymem
