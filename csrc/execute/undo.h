// execute: what running a node again would change twice, for the executor's retries and its undo
// log. A node runs again when its loop's chunk runs again in halves, or when the rest of a program is
// planned again after it ran out of memory; that is exact only where the node's second run finds
// what its first found.
#pragma once

#include <cstdint>
#include <vector>

#include "plan/plan.h"

namespace lazymem {

// Running the node takes numbers from its generator's stream (a random op run whole that has not
// drawn yet): run twice, it would not give the same. Stream and row-keyed draws read the same again.
bool draws_from_generator(const PlannedNode& pn);
// In-place ops whose second application changes nothing (f(f(x)) = f(x) with scalar arguments):
// running them again on rows they already updated is exact.
bool idempotent_in_place(const c10::FunctionSchema& s);
// Whether use k writes rows of the value from their old contents: an in-place update, or an out=
// argument the node also reads (mul.out(p, c, out=p), what a per-tensor _foreach_mul_ records).
bool reads_what_it_writes(const Node& n, size_t k);
// Whether running `pn` for a chunk's rows again gives the same state: it writes no rows of a stored
// value in place from their old contents and draws no random numbers from a generator's stream.
bool redoable_node(const PlannedNode& pn);
// The uses through which `pn` updates rows of a value stored before the loop in place (a
// read-modify-write of a narrowed view). Not the loop's own stores and accumulators: abandoning the
// loop drops them, and running it again makes them anew before updating them.
std::vector<size_t> stored_rows_updated(const Stage& st, const PlannedNode& pn);
// For a node of a whole stage: the uses through which it updates an earlier value in place when it
// may run out of memory inside its kernel after doing so (it allocates as it runs: outputs of its
// own, or a list's tensors one at a time), to be saved before it runs (Walker::save_updated). Not
// values held in host memory (updated on a device copy, copied back once the node has run). When
// they come to more than `max_bytes`, none: their buffers go to `unsaved` instead.
std::vector<size_t> node_updates_to_save(const PlannedNode& pn, int64_t max_bytes, std::vector<LazyBuffer*>& unsaved);

} // namespace lazymem
