// execute: replay of one planned node on the backing device. The node's boxed arguments are copied,
// host constants narrowed and batch-carrying ints rewritten for the current chunk, every lazymem
// operand replaced by the binder's real view; the op is redispatched below autograd, autocast and
// Python keys on the backing key, with the node's generator; results go back through the binder.
#pragma once

#include <exception>
#include <string>

#include <ATen/core/stack.h>

#include "device/generator.h"
#include "execute/bind.h"

namespace lazymem {

// Runs `pn` with the binder's views. `stack` is the caller's, reused from node to node.
void replay(const PlannedNode& pn, Binder& binder, torch::jit::Stack& stack);
// Whether this thread's last replay() reached its kernel: one that raised before (binding its
// operands ran out of memory) changed nothing the node writes.
bool replay_reached_kernel();

// Runs `op` on the backing device with its arguments at stack[first...]: Device arguments become the
// backing device; a random op (gen != nullptr) draws from gen's backing generator, through its
// Generator argument or by lending that state to the backing default generator; kernels that read
// GradMode see `grad_mode`. Used by replay and by the eager path. The caller holds a ReplayScope.
void redispatch_on_backing(const c10::OperatorHandle& op, torch::jit::Stack& stack, size_t first,
                           c10::ArrayRef<int32_t> device_args, int32_t generator_arg, LazyGenerator* gen,
                           bool grad_mode);

// Runs `op` on the backing device (arguments from stack[0]) drawing from `g`.
void redispatch_with(const c10::OperatorHandle& op, torch::jit::Stack& stack, c10::ArrayRef<int32_t> device_args,
                     int32_t generator_arg, const at::Generator& g, bool grad_mode);

// Annotates an exception thrown by a node's kernel with the op and its recording site, keeping the
// exception's type (IndexError stays IndexError, OutOfMemoryError stays OutOfMemoryError).
std::exception_ptr annotate_node_error(const std::exception& e, const std::string& prefix);

} // namespace lazymem
