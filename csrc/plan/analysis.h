// plan: the split planner's working state over one detached program, and its passes:
//   place_batch   seeds (data leaves, marks) and propagation of placements through the op rules,
//                 then sinking: replicated values only ever used row by row become batch-sharded;
//   assign_stages whole stages and chunk loops (passes over the batch) by dependence;
// (plan/split.cpp turns the result into a Plan.) Nodes synthesized by the planner (NLL's total
// weight over the targets) join the node list after the program's own.
#pragma once

#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "ir/node.h"
#include "ops/placement.h"
#include "plan/plan.h"

namespace lazymem {

// One batch of the plan: values whose rows pair by index (the rules pair them), split by one loop
// per pass. Sources put into one batch start it; batches that an op pairs with equal rows merge.
struct BatchClass {
  int64_t rows = 0;
  int32_t parent = -1; // union-find: -1 for a batch that has not merged into another
  uint64_t id = 0;     // the global batch id its stored values carry (LazyBuffer::fact_batch), 0: none yet
};

// A value entering the plan from outside it that may carry a batch (DESIGN.md §7): an upload (still
// pending or run by an earlier materialization), a value an earlier plan stored with a batch fact,
// a buffer marked with torch_lazymem.mark_batch, or a factory whose sizes may carry a batch (arange
// made on the device). The solver gives it one of its options — a row layout, i.e. which dim is the
// batch — or none.
struct Source {
  enum Kind : uint8_t { kUpload, kStored, kMarked, kFactory };
  int32_t buf = -1;
  Kind kind = kUpload;
  std::vector<int8_t> dims;       // per option: the view dim it makes the batch (-1: a stored layout)
  std::vector<RowLayout> layouts; // per option
  uint64_t id = 0;                // a stored value's batch id (0: none)
  int32_t hint = -1;              // the option tried first (dim 0 of an upload, the stored or marked one)
  int32_t choice = -1;            // the solution (-1: not a batch)
  std::string why;                // for explain()
};

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
  int32_t batch = -1;         // a loop node: the batch it runs over (canonical, see Analysis::find)
  RowMap map;                 // a loop node: which of its batch's rows it computes
};

struct Analysis {
  std::vector<NodeInfo> nodes;        // the program's nodes, then synthesized ones
  std::vector<NodePtr> owned;         // synthesized nodes
  std::vector<int32_t> order;         // nodes that run, in execution order
  std::vector<BufInfo> bufs;
  std::unordered_map<const LazyBuffer*, int32_t> index;
  size_t program_bufs = 0;            // buffers of the program (synthesized nodes' fresh ones follow)
  std::vector<BatchClass> batches;    // the batches of the current assignment
  std::vector<Source> sources;
  std::vector<std::string> source_notes; // per source, the dim chosen and why (explain())
  std::vector<int32_t> loop_batches;  // assign_stages: the batches loops run over, one stage kind each
  // The batch a class has merged into (path-compressing), and the rows of a place's batch.
  int32_t find(int32_t c) const {
    while (batches[c].parent >= 0) c = batches[c].parent;
    return c;
  }
  int64_t rows_of(const Place& p) const {
    return batches[find(p.batch)].rows;
  }
  // Merges two batches of equal rows; false (nothing done) when their rows differ.
  bool unite(int32_t x, int32_t y);
  int64_t batch = 0;                  // the rows of the largest batch (notes)
  std::vector<std::string> notes;
  size_t barriers = 0;
  std::vector<Expansion> expansions;  // program nodes replaced by synthesized ones (expand_node)
  // Nodes that must run whole (a meta probe on the chunk's shapes disagreed with their rule).
  std::unordered_map<const Node*, std::string> forced_barriers;
  // Nodes that read every partial operand finished (after its loop) even where their rule could take
  // it as a partial: a linear op on a partial whose other operand needs that partial finished
  // (clip_grad_norm_'s `g.mul_(coef)`, coef computed from the norms of the finished gradients).
  std::unordered_set<const Node*> finished_reads;
  // Set by assign_stages when it fails: the nodes that read a partial in a later stage than its loop.
  std::vector<const Node*> crossing;

  int32_t buffer(LazyBuffer* b);
  int32_t add_node(Node* n);
  // The placement node->uses[u] sees: S (dim, unit) when its buffer is batch-sharded and the view
  // localizes, R otherwise (a view that does not localize is a gathered whole), P for partials.
  Place use_place(const NodeInfo& ni, size_t u) const;
  // Whether node->uses[u] reads a version a loop accumulates (finished only when the loop ends).
  bool reads_partial(const NodeInfo& ni, size_t u) const;
};

// Builds the analysis over `nodes` (the detached program) with `runs` (schedule order) and live
// values; solves for the batch (each source's dim, or none: the assignment the rules accept that
// holds the fewest bytes whatever the chunk size, then has the fewest barriers and loops) and
// propagates placements. Returns false (with a note) when nothing can be split: no source, or every
// op that reads a batch is a barrier.
bool place_batch(Analysis& a, const std::vector<Node*>& nodes, const std::vector<int32_t>& runs,
                 const std::vector<LazyBuffer*>& live, const std::vector<LazyBuffer*>& needed);

// Seeds the sources' chosen batches, propagates placements through every node in order, then sinks
// (plan/batch.cpp). The solver calls it once per assignment it tries.
void propagate(Analysis& a);

// Evaluates node `i`'s rule against the current placements (with `want` for its defs) and records
// the outcome in a.nodes[i] (a barrier when the rule fails or is missing with batched operands).
// Operands of different batches with equal rows merge them first: the op pairs their rows.
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

// An unsplit plan's batch facts (plan/facts.cpp): the batch solved for as if it were to split, and
// a fact for each surviving value it writes that the solution makes batch-sharded.
struct Schedule;
void note_unsplit_facts(const std::vector<Node*>& nodes, const Schedule& s, const std::vector<LazyBuffer*>& needed,
                        Plan& plan);

// The split plan's notes: batch and passes, barriers and why, what stays pending, what is stored in
// host memory; and its batch and barrier count (plan/notes.cpp).
void note_split(Plan& plan, const Analysis& a);

// Assigns each running node a stage. Stages cycle through kinds: a whole stage (nodes run once),
// then a loop over each batch in turn (Analysis::loop_batches), so stage s is whole when
// s % stage_kinds(a) == 0 and a loop over stage_batch(a, s) otherwise. Returns the number of stages,
// or -1 (with a note, and Analysis::crossing) if a partial value would have to cross a loop.
int32_t assign_stages(Analysis& a);
int32_t stage_kinds(const Analysis& a);
// The batch a loop stage runs over (-1 for a whole stage).
int32_t stage_batch(const Analysis& a, int32_t stage);

} // namespace lazymem
