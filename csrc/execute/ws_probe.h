// execute: workspace probes. Kernels that allocate inside (the fused encoder layer, attention,
// recurrent composites, convolutions, fused optimizers) need memory the memory model cannot see from
// their outputs; until one runs, a plan under-predicts its peak, and the first step runs out of
// memory and retries. Before a plan runs on the CPU backing device, each node of such an op whose
// workspace is unknown for its shapes runs on zeros of its geometry at 1 and at 2 rows, charged to
// a counter of its own (not the device's), and the workspace model learns the two measurements (a
// loop node: its key's line; a whole node: its line along dim 0 extrapolated to the whole, an
// estimate that its first real run replaces).
#pragma once

#include "plan/plan.h"

namespace lazymem {

// True if something was learned (the caller plans again).
bool probe_workspace(const Plan& plan);

} // namespace lazymem
