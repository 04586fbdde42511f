// record: the recorder. Every op on lazymem tensors that has no direct kernel reaches the boxed
// fallback (registered by sync/); record_call analyses the call, infers outputs on meta mirrors
// (cached), creates the output tensors (fresh phantom buffers, or views/aliases of the inputs'
// storages) and appends one Node to the program. Nothing runs here: an op whose outputs depend on
// data, or that has no meta kernel, is reported back (kNeedsEager) and the sync layer runs it.
#pragma once

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>

namespace lazymem {

enum class Recorded : uint8_t {
  kDone,       // recorded (or a no-op): the stack holds the op's returns
  kNeedsEager, // not recorded, the stack is untouched: the op must run for real now (sync/eager)
};

// Records `op` with the arguments on `stack` and replaces them with its returns. With
// allow_constants, non-lazymem tensor arguments are snapshotted into the node (host-to-lazymem copy).
// With `borrowed` (the unboxed kernels of sync/unboxed.cpp), the stack's tensors borrow the caller's
// (no reference counted): they are left on the stack, the returns pushed after them, and the caller
// releases them; an in-place op's return (its `self`) is pushed as None, the caller returning `self`.
Recorded record_call(const c10::OperatorHandle& op, torch::jit::Stack* stack, bool allow_constants = false,
                     bool borrowed = false);

// While alive on a thread, host uploads recorded there hold module state (parameters, buffers), not
// data: their buffers are never batch seeds. torch_lazymem wraps nn.Module._apply in one.
struct ModuleStateScope {
  ModuleStateScope();
  ~ModuleStateScope();
};

} // namespace lazymem
