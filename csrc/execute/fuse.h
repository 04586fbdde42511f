// execute: chains of pointwise arithmetic on small tensors run as one loop on the CPU backing.
//
// Replaying a tiny op costs what eager's costs below Python: the dispatcher, a TensorIterator and an
// allocation (~1.6 us for 16 floats on the CI machine), where its arithmetic takes nanoseconds. A
// loop of such ops (`a = a * 1.0001 + 0.001`, thousands of times) therefore replayed as slowly as
// eager ran it, after recording it: 1.3x eager's time. In a whole stage, a run of consecutive nodes
// (one or more) each of which is one correctly rounded or exact IEEE operation — add and sub with
// alpha 1, mul, div, neg, reciprocal, abs, maximum, minimum, relu, clamp by numbers, pow by 2, 3, -2
// or -1, threshold_backward; functional, out= or in place — on dense float or double tensors of one
// size (an operand may be a 0-dim host constant: a Python number), with at most kMaxFusedElements
// elements (below ATen's grain size: its kernels run on one thread there too), runs as one loop over
// blocks of elements. Each op computes the value eager's kernel computes, in the same dtype (ATen's
// vectorized add is fmadd(b, alpha, a), which with alpha 1 rounds a + b once; its clamp_min is
// max_ps(min, x), which is (x < min) ? min : x), so results are bitwise eager's. Not sqrt: eager's
// float sqrt is not IEEE's on every CPU.
//
// Memory: a value that dies inside the chain gets no storage; the chain's other results are
// allocated before it runs, so a chain is fused only as far as those bytes stay within what running
// its nodes one by one holds at its peak (what the plan predicted). In place: a tensor the chain
// updates is read and written through one view only (blocks of one view are not another's), else the
// chain is cut there. Nodes whose operands are not on the device, poisoned, or of another version than
// recorded run plainly (the plain path reports them). stats(): fused_chains, fused_nodes,
// fusion_fallbacks. torch_lazymem.set_fusion(False) (LAZYMEM_FUSION=0) turns it off.
#pragma once

#include <cstdint>
#include <memory>

#include "execute/executor.h"

namespace lazymem {

constexpr int64_t kMaxFusedElements = 32768; // at::internal::GRAIN_SIZE

// The fusing runner for one execution of `plan`, or nullptr: fusion off, or a backing device other
// than the CPU. The caller holds the flush lock until the runner is gone.
std::unique_ptr<StageRunner> fusion_runner(const Plan& plan);

} // namespace lazymem
