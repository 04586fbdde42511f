// ops: helpers shared by the placement-rule families (ops/rules_*.cpp): dim arithmetic, numpy
// broadcasting of operands against an output, and the common outcomes (everything replicated, a
// failure with its reason). Rules are written against these so each family reads as its algebra.
#pragma once

#include <optional>
#include <vector>

#include "ops/placement.h"

namespace lazymem::rules {

inline int64_t wrap_dim(int64_t d, int64_t ndim) {
  return d < 0 ? d + std::max<int64_t>(ndim, 1) : d;
}

inline bool fail(RuleResult& r, const char* why) {
  r.why = why;
  return false;
}

// Every operand whole, every output replicated: the rule of an op none of whose operands carry the
// batch (partial operands are then used finished).
inline bool replicated(const RuleCall& c, RuleResult& r) {
  for (auto& m : r.ins) m = OperandMode::whole();
  for (auto& o : r.outs) o = Place::R();
  return true;
}

// True when no operand carries the batch (S) and no output is demanded batch-sharded.
bool nothing_batched(const RuleCall& c);
// True when some operand is partial.
bool any_partial(const RuleCall& c);

// Numpy broadcasting of the operands with indices in `which` (all when empty) against an output of
// sizes `out`: finds the output dim carrying the batch (from batch-sharded operands, or `want`),
// sets each operand's mode (its rows when its aligned dim has the output's size, whole when that dim
// is broadcast or absent) and returns the output's placement. nullopt (with r.why) on a conflict:
// operands sharded along different output dims, or an operand whose rows cannot follow.
std::optional<Place> broadcast(const RuleCall& c, RuleResult& r, c10::IntArrayRef out, const Place* want,
                               c10::ArrayRef<int64_t> which = {});

// Binds operand `i`, aligned with the output's batch dim `out_dim` (of an output with `out_ndim`
// dims, numpy-aligned from the right, sharded as `p`), to its rows, or whole if broadcast there.
// False on conflict.
bool align(const RuleCall& c, RuleResult& r, size_t i, int64_t out_ndim, int64_t out_dim, int64_t out_size,
           const Place& p);

// Binds the operands at arguments `args` (inputs, targets, saved statistics of a per-sample op) to
// the batch found among them: all must carry it along the same dim, before dim `limit`, with the
// same rows; every other operand (weights, class weights) must not carry it. With `demand`, an
// output wanted batch-sharded (before `limit`) seeds it when no operand carries it. Returns its
// placement (R when nothing carries it), or nullopt with r.why on a conflict.
std::optional<Place> bind_batch(const RuleCall& c, RuleResult& r, std::initializer_list<int> args, int64_t limit,
                                bool demand);

// An int-list argument as a vector (an int, an empty list or None gives an empty vector).
std::vector<int64_t> int_list(const c10::IValue& v);

// The output's shape for pointwise-like ops: the def's, or the written operand's (in-place / out=).
std::optional<c10::IntArrayRef> output_sizes(const RuleCall& c);
// Index of the written operand (in-place self / out=), or -1.
int64_t written(const RuleCall& c);

} // namespace lazymem::rules
