// plan: the third split axis (DESIGN.md §7), a tensor's own rows. An optimizer step's per-tensor
// chain for one parameter (plan/lanes.h: AdamW's lerp_, mul_, addcmul_, sqrt, div_, add_, addcdiv_)
// is element-wise over tensors of the parameter's shape, so it is exact along any partition of their
// elements. When even one tensor at a time does not fit — the parameter, its gradient and its state
// are held, and its temporaries (the sqrt of its second moment) come on top — a whole stage's run of
// such nodes becomes a loop over blocks of dim-0 rows: the values held before the run and after it
// bound to the block's rows of their storage (read, and updated in place under the loop's undo log),
// its temporaries chunk-local, values it makes that outlive it assembled whole. The peak becomes what
// is held plus one block's temporaries. Pure: reads node metadata and the memory model only.
#pragma once

#include <cstdint>

#include "plan/memory.h"

namespace lazymem {

// Turns each run of a whole stage of `plan` that holds a point of `model` above `budget` into a loop
// over blocks of its tensors' rows, where every node of the run is element-wise (ops tagged
// pointwise, or their in-place and out= forms) over tensors of one shape of at least 2 rows, each
// viewed as its whole storage, row-major (scalars are read whole; nothing random, effectful or
// uploaded). Returns whether any run was turned; the loops' chunk sizes are choose_chunks' to set.
bool block_rows(Plan& plan, const MemoryModel& model, int64_t budget);

} // namespace lazymem
