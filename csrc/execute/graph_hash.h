// execute: what a CUDA graph bakes in of a node (execute/graphs.h): a hash of its non-tensor
// arguments — scalars, sizes, flags, host scalars by value, device tensors by address — which a
// replay needs unchanged since capture.
#pragma once

#include <cstdint>

#include "plan/plan.h"

namespace lazymem {

// The hash of a node that never joins a graph: random ops (their draws keep the program's order),
// uploads from the host, effects, a host tensor of more than one element (copied from an address
// the graph would keep), an argument of a kind it cannot compare (a generator, an object).
constexpr uint64_t kGraphPlain = ~uint64_t{0};

uint64_t graph_node_hash(const PlannedNode& pn);

} // namespace lazymem
