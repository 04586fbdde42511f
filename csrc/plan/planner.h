// plan: the planner's entry point. Given the detached program, what the sync point needs and what
// must survive it, and the memory budget, it returns the Plan: unsplit (one whole stage, exactly
// eager's kernels in program order) when the program fits, split along the batch otherwise.
#pragma once

#include <functional>
#include <vector>

#include "ir/tape.h"
#include "plan/plan.h"

namespace lazymem {

struct PlanInput {
  std::vector<Node*> nodes;                           // the detached program, in program order
  std::function<bool(const LazyBuffer&)> live_out;    // values that must survive the plan
  std::vector<LazyBuffer*> needed;                    // values the sync point reads
  const Tape* tape = nullptr;                         // the nodes' tape, if kept as they were recorded
  // A split may leave batch-sharded values that survive but are not needed pending (recomputed
  // chunk by chunk when something needs them) instead of storing them at full size.
  bool keep_pending = true;
  int64_t budget = -1;                                // bytes lazymem may hold (-1: unlimited)
  // What an unsplit plan may hold at its peak (>= budget; -1: budget): the allocator's slack the
  // budget leaves for a split plan's chunk-sized blocks is not needed by eager's own order.
  int64_t whole_budget = -1;
  int64_t resident = 0;                               // device bytes held before the plan runs
  int64_t library = 0;                                // of them, libraries' workspaces (CUDA's cuBLAS)
  int64_t force_chunks = 0;                           // > 0: split every loop into this many chunks
  // The backing device is the CPU: random forms that follow the CPU's kernels are eager's there
  // (core/rng_form.h); elsewhere those run keyed by batch rows.
  bool cpu_backing = true;
  // Batch-sharded values crossing passes: stored (device, else host memory) or recomputed chunk by
  // chunk where they are read. kWhenTooBig recomputes those the device cannot hold, kAlways every
  // one that can be (testing); kPriced recomputes those the device cannot hold unless holding them
  // in host memory costs less: the recomputing nodes' measured time against the copies' modeled time
  // (plan/timing.h); until the nodes have run once, as kWhenTooBig (the plan says it is unpriced).
  enum class Recompute : uint8_t { kNever, kWhenTooBig, kAlways, kPriced } recompute = Recompute::kWhenTooBig;
  // What each node costs each chunk beyond its share of the work, in nanoseconds (0: nothing worth
  // trading). On a GPU a kernel launch is several microseconds whatever its size, so many small
  // chunks cost time that holding a large stored value in host memory instead can save
  // (prefer_host_store, plan/memory.h).
  int64_t chunk_node_ns = 0;
};

Plan make_plan(const PlanInput& in);

} // namespace lazymem
