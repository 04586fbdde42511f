// plan: the second split axis, along a list of tensors (DESIGN.md §7, notes/batch_everywhere.md §6).
// An optimizer step records each _foreach_ op as one node per parameter (the per-tensor kernels it
// is made of), op after op: every parameter's temporaries (AdamW's sqrt of its second moment) are
// alive at once, a whole model's worth. Such a chain of runs — each run the same op on every tensor
// of the list, position k of each run touching only list element k's buffers (plus values every
// position only reads) — is exact in any order of its lanes. When the step does not fit, the chain
// runs group by group of lanes instead: the peak becomes what is held plus one group's temporaries.
// Pure: reads node metadata only.
#pragma once

#include <string>
#include <vector>

#include "plan/schedule.h"

namespace lazymem {

struct LaneChain {
  size_t first = 0;                       // position in Schedule::run of its first node
  size_t last = 0;                        // one past its last node
  size_t lanes = 0;                       // the list's length
  size_t runs = 0;                        // ops applied to it
  std::vector<std::vector<size_t>> nodes; // per lane, its nodes' positions in Schedule::run, in order
  std::vector<size_t> others;             // positions in [first, last) of nodes of no lane (they touch
                                          // no lane's buffers): run before the chain
};

// The chains among the schedule's run (disjoint, in order).
std::vector<LaneChain> find_lane_chains(const std::vector<const Node*>& nodes, const Schedule& s);

// Reorders `s.run` (and its releases, recomputed) so that each chain runs in `groups` groups of
// consecutive lanes (every op on the group's lanes, then the next group's), its other nodes first.
void run_lanes_in_groups(Schedule& s, const std::vector<const Node*>& nodes, const std::vector<LaneChain>& chains,
                         size_t groups);

// "the _foreach_ chain over N tensors (R ops) runs in G groups of tensors", for explain().
std::string describe_lane_groups(const std::vector<LaneChain>& chains, size_t groups);

} // namespace lazymem
