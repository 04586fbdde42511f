// record: meta functions for ops whose only meta kernel is a Python reference, written after the
// backing device's own kernels (their output shapes, dtypes and layouts, and eager's checks and
// messages). torch's reference for native_layer_norm runs torch._refs in Python (hundreds of µs a
// call) and its first call imports torch._dynamo (through torch._refs.mean's dynamo-disable
// wrapper: 1.9 s on this machine), which a model's first step paid; eager never runs it.
#pragma once

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>

namespace lazymem {

// Runs `op`'s C++ meta function on `stack` (meta tensors) when lazymem has one: native_layer_norm,
// native_layer_norm_backward, relu and relu_ (through clamp_min's C++ meta kernel, as eager's relu
// runs clamp_min; torch's Python reference for relu imported torch._dynamo in an inference's first
// step), _transformer_encoder_layer_fwd on a dense source, native_batch_norm (and
// _native_batch_norm_legit) and its backward on the CPU backing (well-formed calls), the CPU flash
// attention and its backward on dense 4-D inputs. False (the stack untouched) otherwise. Off with
// LAZYMEM_CPP_META=0, as record/cpp_meta.h.
bool native_meta(const c10::OperatorHandle& op, torch::jit::Stack& stack);

} // namespace lazymem
