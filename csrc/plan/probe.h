// plan: meta probes of chunk shapes. A loop node runs on a chunk's rows with operands bound as the
// plan says (chunk-local storages, narrowed or gathered rows, host constants narrowed, int
// arguments rewritten); its meta kernel is run on exactly those shapes, so a node whose meta kernel
// refuses them, or gives outputs other than its placement rule said, is found before anything runs
// (plan/split.cpp then makes it run whole).
#pragma once

#include <functional>
#include <string>
#include <unordered_map>

#include "ops/meta_probe.h"
#include "plan/plan.h"

namespace lazymem {

// The call `pn` makes on the chunk of batch rows [c0, c1) of loop `st`: its boxed arguments (ints
// rewritten for the chunk) and the geometry of every tensor operand (lazymem operands as bound, host
// constants narrowed); `rows`: the node's rows there (0: it does not run in this chunk).
struct ChunkCall {
  std::vector<c10::IValue> args;
  std::vector<ProbeTensor> tensors;
  int64_t rows = 0;
  int64_t first = 0; // the node's first row there
};
ChunkCall chunk_call(const Stage& st, const PlannedNode& pn, int64_t c0, int64_t c1,
                     const std::function<int32_t(const LazyBuffer*)>& storage_of);

// The call of a node that runs whole, with every lazymem operand whose dim 0 is `extent` narrowed to
// its first `rows` rows (the rest as recorded): a small copy of the call for measuring its kernel.
ChunkCall whole_call_narrowed(const PlannedNode& pn, int64_t extent, int64_t rows,
                              const std::function<int32_t(const LazyBuffer*)>& storage_of);

// Whether `pn`'s meta kernel accepts `call` (a kernel is never run on a geometry it refuses).
bool meta_accepts(const PlannedNode& pn, const ChunkCall& call);

// Why node `pn` of loop `st` cannot run on the chunk of batch rows [c0, c1) ("" when it can, or
// when it holds none of its rows there). `storage_of` numbers the buffers (operands sharing a
// storage in the program share it in the probe).
std::string probe_chunk(const Stage& st, const PlannedNode& pn, int64_t c0, int64_t c1,
                        const std::function<int32_t(const LazyBuffer*)>& storage_of);

// Every loop node of `plan` probed on its first full chunk and on the ragged last one (a node over a
// slice of the batch also on the chunks where its rows begin and end): the nodes that cannot run
// split, and why.
std::unordered_map<const Node*, std::string> probe_plan(const Plan& plan,
                                                       const std::function<int32_t(const LazyBuffer*)>& storage_of);

} // namespace lazymem
