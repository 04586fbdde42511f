// execute: runs a planned segment on the backing device. Each node is replayed through the
// dispatcher (redispatchBoxed on the backing key, autograd/autocast/Python keys excluded) on real
// views of its buffers; functional outputs adopt the kernel's result storage when its geometry
// matches, otherwise are copied in; buffers are released right after their last use.
//
// Failure semantics. Out of memory: every node that has not run goes back to the front of the
// program, so nothing is lost and the same sync succeeds once memory is available. Any other
// error: the failing node's outputs (and everything computed from them) are poisoned, the rest of
// the segment runs, and the first error is raised at the sync point; later reads of a poisoned
// value raise the same error.
#pragma once

#include <cstdint>
#include <string>

#include "device/generator.h"
#include "ir/program.h"

namespace lazymem {

// Plans and runs a detached segment. Caller holds the flush lock.
void execute_segment(Segment& seg);

// Runs `op` on the backing device with its arguments at stack[first...]: Device arguments become the
// backing device; a random op (gen != nullptr) draws from gen's backing generator, through its
// Generator argument or by lending that state to the backing default generator; kernels that read
// GradMode see `grad_mode`. Used by replay and by the eager path. The caller holds a ReplayScope.
void redispatch_on_backing(const c10::OperatorHandle& op, torch::jit::Stack& stack, size_t first,
                           c10::ArrayRef<int32_t> device_args, int32_t generator_arg, LazyGenerator* gen,
                           bool grad_mode);

// Annotates an exception thrown by `node`'s kernel with the op and its recording site, keeping the
// exception's type (IndexError stays IndexError, OutOfMemoryError stays OutOfMemoryError).
std::exception_ptr annotate_node_error(const std::exception& e, const std::string& prefix);

} // namespace lazymem
