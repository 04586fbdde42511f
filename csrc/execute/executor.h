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

#include "ir/program.h"

namespace lazymem {

// Plans and runs a detached segment. Caller holds the flush lock.
void execute_segment(Segment& seg);

// Annotates an exception thrown by `node`'s kernel with the op and its recording site, keeping the
// exception's type (IndexError stays IndexError, OutOfMemoryError stays OutOfMemoryError).
std::exception_ptr annotate_node_error(const std::exception& e, const std::string& prefix);

} // namespace lazymem
