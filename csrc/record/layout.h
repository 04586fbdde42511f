// record: output layouts the backing device's kernels choose where the meta kernel cannot know
// (convolutions' memory format, decided by the backend ATen selects on the device).
#pragma once

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>

namespace lazymem {

// True for ops whose meta outputs may need the backing device's layout.
bool backing_layout_applies(const c10::OperatorHandle& op);
// Restrides `results` (the meta run's outputs) to the layout the backing device's kernel returns for
// `args` (the meta run's arguments).
void apply_backing_layout(const c10::OperatorHandle& op, const torch::jit::Stack& args, torch::jit::Stack& results);

} // namespace lazymem
