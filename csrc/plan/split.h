// plan: the split plan. From the placements and stages (plan/analysis.h) it decides what stays
// pending, where each batch-sharded value lives (chunk-local storage, or full storage on the device
// or in host memory when it must outlive a loop or is the result), binds every operand of every
// node, sets up partials and their accumulators, and picks each loop's chunk size from the memory
// model: the largest that fits the budget, balanced over the batch, aligned to 8 where that still
// fits (or what torch_lazymem.testing.force_chunks asks for).
#pragma once

#include "plan/planner.h"
#include "plan/schedule.h"

namespace lazymem {

// Fills `plan` with a split plan for the program; false (with notes in `plan`) when it cannot be
// split or no chunk size fits.
bool make_split_plan(const PlanInput& in, const Schedule& s, Plan& plan);

} // namespace lazymem
