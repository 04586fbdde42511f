// plan: plans reused across steps. A training loop records the same program every step: the same
// ops on the same shapes, the same dataflow between buffers, the same placements. The planner's
// output depends only on that structure and on a few facts about each buffer (its size, whether it
// holds data and where, whether it is a data leaf, whether it must survive, whether the sync point
// reads it), the budget, the memory already held and what the workspace model has learned. A
// fingerprint of all of it keys a small cache of plans stored with their buffers and nodes as
// indices (buffers numbered by first appearance, versions relative to each buffer's first
// reference); a program with the same fingerprint gets the stored plan with its own buffers and
// nodes put back in, nodes the planner synthesized rebuilt, no planning and no meta probes. The
// fingerprint is compared whole, never just hashed: a collision cannot hand out a wrong plan.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "plan/planner.h"

namespace lazymem {

struct Fingerprint {
  std::vector<uint64_t> key;          // everything the planner reads, in a canonical order: the
  size_t words = 0;                   // first `words` (the rest is room kept for the next one)
  uint64_t hash = 0;
  std::vector<LazyBuffer*> buffers;   // canonical numbering: first appearance, defs before uses
  std::vector<uint32_t> base;         // per buffer: the version of its first reference
  int64_t budget = -1;                // the planner's budget (compared apart from the key)
  int64_t whole_budget = -1;          // what an unsplit plan may hold (PlanInput::whole_budget)
  // Device bytes held before the program (compared apart from the key): an unsplit plan is the same
  // plan under other resident bytes while it still fits (results kept across steps grow them, and
  // CUDA graphs key on the plan), a split one only under the same.
  int64_t resident = 0;
  bool cacheable = false;             // false: an argument the fingerprint cannot describe, a poison
};

// The fingerprint of a planner input: per node the id of the meta result it was recorded from
// (Node::sig) with its buffers and versions, or every word of it when it has none — read from the
// nodes' tape (PlanInput::tape, written as they were recorded) when there is one, else from a tape
// built now — then per buffer the facts the plan depends on. Written into `fp`, whose vectors keep
// their room from one call to the next (no allocation per step).
void fingerprint(const PlanInput& in, Fingerprint& fp);

// The cached plan for a program with this fingerprint, instantiated on `in`'s nodes and buffers.
std::optional<Plan> reuse_plan(const PlanInput& in, const Fingerprint& fp);
// Stores `plan` (just made for `in`) under `fp`. The plan's `template_id` names the entry.
void remember_plan(const PlanInput& in, Fingerprint&& fp, Plan& plan);
// A loop of the plan behind `template_id` ran out of memory and finished with smaller chunks: the
// next instantiation uses `chunk` rows for `stage`.
void plan_learned_chunk(uint64_t template_id, size_t stage, int64_t chunk);
// Drops the cached plan behind `template_id` (one made without what its run measured).
void forget_plan(uint64_t template_id);
// Hands back a plan that has run (its synthesized nodes that the program did not take are no longer
// referenced): the next instantiation of its entry patches it and them in place instead of copying
// the stored plan and rebuilding the nodes.
void recycle_plan(Plan&& plan);
// Drops every cached plan (the backing device or the capacity changed; tests).
void clear_plan_cache();
size_t plan_cache_size();

} // namespace lazymem
