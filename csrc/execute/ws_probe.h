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

// Time probes. A plan that recomputes values crossing passes without the measured node times to
// price holding them in host memory instead (Plan::unpriced: a program's first step) would, on the
// CPU backing device, run every recomputing node again for every chunk of every pass that reads
// them: the BatchNorm CNN's first step at 3,264 rows took 7.1 s where later ones, priced, take about
// 2 s. Each recomputed node of unknown time runs instead on zeros of its first chunk's geometry
// (twice, the faster counted: the first may build a kernel's primitives), and its time per row is
// learned. True if every one was (the caller plans again, priced, and marks the plan probe_priced).
// Not on CUDA, where a kernel's time needs a synchronization and recomputing is the cheaper default.
bool probe_node_times(const Plan& plan);

} // namespace lazymem
