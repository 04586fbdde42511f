// plan: the split planner's working state over one detached program, and its passes:
//   place_batch   seeds (data leaves, marks) and propagation of placements through the op rules,
//                 then sinking: replicated values only ever used row by row become batch-sharded;
//   assign_stages whole stages and chunk loops (passes over the batch) by dependence;
// (plan/split.cpp turns the result into a Plan.) Nodes synthesized by the planner (NLL's total
// weight over the targets) join the node list after the program's own.
#pragma once

#include <string>
#include <unordered_map>
#include <vector>

#include "ir/node.h"
#include "ops/placement.h"
#include "plan/plan.h"

namespace lazymem {

struct BufInfo {
  LazyBuffer* buf = nullptr;
  Place place;              // R, S (with layout) or P
  RowLayout layout;         // S
  bool resident = false;    // holds real data when the plan starts
  bool seed = false;        // batch-sharded because it is a data leaf or marked
  bool live = false;        // its value must survive the plan
  bool needed = false;      // the sync point reads it
  uint32_t p_first = 0;     // P: the versions that are partial (written in a loop)
  uint32_t p_last = 0;
  bool p_finish = false;    // P whose accumulator is finished by a division (a mean, NLL): its
                            // partials mean nothing to other ops, which read it finished
};

// Where a rule's operand comes from: a Use of the node, or a host tensor in its arguments.
struct OperandSrc {
  int32_t use = -1;
  int32_t arg = -1;
  int32_t elem = -1;
};

struct NodeInfo {
  Node* node = nullptr;
  bool runs = false;          // computed by this plan
  bool loop = false;          // runs chunk by chunk
  bool barrier = false;       // batch-sharded operands but no rule (or a failed one): runs whole
  const char* family = "";
  RuleResult rr;              // the rule's outcome: operand modes, output placements, rewrites
  std::vector<Operand> ops;   // operands as the rule saw them (uses first, then host constants)
  std::vector<OperandSrc> src;
  std::vector<int32_t> use_buf; // buffer index of each use
  std::vector<int32_t> def_buf; // buffer index of each def
  std::vector<bool> discard;    // per def: not produced by this node when split (NLL's total weight)
  int32_t serves = -1;        // a synthesized node: the node it was made for
  int32_t stage = -1;
};

struct Analysis {
  std::vector<NodeInfo> nodes;        // the program's nodes, then synthesized ones
  std::vector<NodePtr> owned;         // synthesized nodes
  std::vector<int32_t> order;         // nodes that run, in execution order
  std::vector<BufInfo> bufs;
  std::unordered_map<const LazyBuffer*, int32_t> index;
  int64_t batch = 0;
  std::vector<std::string> notes;
  size_t barriers = 0;
  std::vector<Expansion> expansions;  // program nodes replaced by synthesized ones (expand_node)
  // Nodes that must run whole (a meta probe on the chunk's shapes disagreed with their rule).
  std::unordered_map<const Node*, std::string> forced_barriers;

  int32_t buffer(LazyBuffer* b);
  int32_t add_node(Node* n);
  // The placement node->uses[u] sees: S (dim, unit) when its buffer is batch-sharded and the view
  // localizes, R otherwise (a view that does not localize is a gathered whole), P for partials.
  Place use_place(const NodeInfo& ni, size_t u) const;
  // Whether node->uses[u] reads a version a loop accumulates (finished only when the loop ends).
  bool reads_partial(const NodeInfo& ni, size_t u) const;
};

// Builds the analysis over `nodes` (the detached program) with `runs` (schedule order) and live
// values; finds the batch and propagates placements. Returns false (with a note) when nothing can
// be split: no data leaf, leaves that disagree on the batch size, or every batched op a barrier.
bool place_batch(Analysis& a, const std::vector<Node*>& nodes, const std::vector<int32_t>& runs,
                 const std::vector<LazyBuffer*>& live, const std::vector<LazyBuffer*>& needed);

// Evaluates node `i`'s rule against the current placements (with `want` for its defs) and records
// the outcome in a.nodes[i] (a barrier when the rule fails or is missing with batched operands).
void evaluate(Analysis& a, int32_t i, const std::vector<Place>& want = {});
// Records node i's outcome in the placements of the buffers it defines and writes. False on a
// conflict (a buffer with two row layouts, a loop node writing a whole value, S mixed with P).
bool apply_outcome(Analysis& a, int32_t i);

// NLL with a mean reduction, split: nodes computing its total weight from the targets alone, made
// to run before it (the tw pass). Returns false if they cannot be made (the NLL node then runs whole).
bool synthesize_total_weight(Analysis& a, int32_t nll);

// A node whose rule asks for expansion (RuleResult::expand: batch norm in training mode), replaced
// by synthesized nodes over passes of the batch that produce its defs and writes. False (nothing
// changed) when they cannot be made or placed.
bool expand_node(Analysis& a, int32_t i);

// The split plan's notes: batch and passes, barriers and why, what stays pending, what is stored in
// host memory; and its batch and barrier count (plan/plan.cpp).
void note_split(Plan& plan, const Analysis& a);

// Assigns each running node a stage: even = whole (run once), odd = chunk loop. Returns the number
// of stages, or -1 (with a note) if a partial value would have to cross a loop.
int32_t assign_stages(Analysis& a);

} // namespace lazymem
