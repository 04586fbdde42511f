// record: the recorder. Every op on lazymem tensors that has no direct kernel reaches the boxed
// fallback; record_call analyses the call, infers outputs on meta mirrors (cached), creates the
// output tensors (fresh phantom buffers, or views/aliases of the inputs' storages) and appends one
// Node to the program. Nothing runs. Data-dependent ops and ops without meta kernels take the eager
// path instead: flush what they read, run them for real, wrap the results as materialized buffers.
#pragma once

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>

namespace lazymem {

// The PrivateUse1 boxed fallback.
void lazy_fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack);

// Records `op` with the arguments on `stack` and replaces them with its returns. With
// allow_constants, non-lazymem tensor arguments are snapshotted into the node (host-to-lazymem copy).
void record_call(const c10::OperatorHandle& op, torch::jit::Stack* stack, bool allow_constants = false);

// Runs `op` for real on the backing device now (after flushing what it reads).
void run_eager(const c10::OperatorHandle& op, torch::jit::Stack* stack);

} // namespace lazymem
