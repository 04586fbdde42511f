// plan: the Plan — plain data that tells execute/ everything it does (the planner's entry point,
// make_plan, is plan/planner.h). A plan is a sequence of stages: whole stages run nodes once on
// whole buffers (every unsplit materialization is one whole stage); loop stages run their nodes
// chunk by chunk along the batch, binding each operand to the chunk's rows, a chunk-local storage or
// a partial, then finish partial results into accumulators. Every per-node decision (bindings, argument rewrites, which
// overload runs, what is accumulated, stored, released, retained) is made here, so execute/ never
// consults op rules. Pure: no device, no kernels; tested without a device.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <c10/util/ArrayRef.h>
#include <c10/util/FunctionRef.h>

#include "ir/node.h"
#include "ops/placement.h"

namespace lazymem {

// The storage of a batch-sharded buffer: `outer` blocks of `rows` rows of `row_bytes` each; its row
// r is the batch's row `map` gives (all of them in order when the map is the identity).
struct RowLayout {
  int64_t outer = 1;
  int64_t rows = 0;
  int64_t row_bytes = 0;
  RowMap map;
  int64_t bytes(int64_t local_rows) const {
    return outer * local_rows * row_bytes;
  }
  bool operator==(const RowLayout& o) const {
    return outer == o.outer && rows == o.rows && row_bytes == o.row_bytes && map == o.map;
  }
};

// Where a buffer's value lives while a loop runs.
enum class Store : uint8_t {
  kLocal,   // chunk-local storage [outer][chunk rows][row], allocated and freed within each chunk
  kPartial, // chunk-local partial of a P value, accumulated after its last write in the chunk
};

struct Slot {
  LazyBuffer* buf = nullptr;
  Store store = Store::kLocal;
  RowLayout layout;    // kLocal
  int64_t bytes = 0;   // kPartial: the partial's size (the whole value's)
  int32_t acc = -1;    // kPartial: index into Stage::accs
};

enum class Bind : uint8_t {
  kWhole,   // the buffer's real storage with the recorded view
  kLocal,   // the slot's chunk-local storage with the localized view
  kNarrow,  // the buffer's full storage (real, on the device or the host), view narrowed to the rows
  kPartial, // the slot's partial with the recorded view
  kDiscard, // (defs only) a result this plan does not need: dropped
};

struct Bound {
  Bind bind = Bind::kWhole;
  int8_t dim = -1;     // kLocal / kNarrow: the view dim carrying the batch
  int64_t unit = 1;
  int64_t outer = 1;   // kNarrow: blocks flattened into that dim (> 1: the rows are gathered, no view)
  int32_t slot = -1;   // kLocal / kPartial
  RowMap map;          // kLocal / kNarrow: which batch rows the view's rows are (a chunk binds those in it)
};

// A host tensor in the node's arguments (an upload's source) narrowed to the chunk's rows.
struct ConstNarrow {
  int32_t arg = -1;
  int32_t elem = -1;
  int8_t dim = -1;
  int64_t unit = 1;
  // > 1: `dim` flattens `outer` blocks of every batch row, as the chunk-local layout of the upload's
  // destination holds them (two halves of the batch, a time-major flatten): the chunk's rows of each
  // block are gathered, block-major, not narrowed as one block.
  int64_t outer = 1;
};

struct PlannedNode {
  Node* node = nullptr;              // (first: a reused plan patches it)
  // Whole stages: the buffers whose real data dies after this node, Stage::released[begin, end).
  uint32_t release_begin = 0;
  uint32_t release_end = 0;
  int32_t index = -1;               // position in the detached program
  c10::OperatorHandle op;           // usually node->op; a rule may replace the overload
  // Loop stages only (whole stages bind everything whole):
  std::vector<Bound> uses;          // parallel to node->uses
  std::vector<Bound> defs;          // parallel to node->defs
  std::vector<ConstNarrow> consts;
  std::vector<ArgRewrite> rewrites;
  std::vector<double> post_div;     // parallel to defs: divide each chunk's result by this (0: none)
  double post_div_written = 0;      // ...and the operand it writes (out= forms)
  std::vector<int32_t> accumulate;  // slots whose partial is complete after this node
  std::vector<int32_t> free_slots;  // slots whose chunk-local storage dies after this node
  bool placeholder_outputs = false; // outputs whose shapes the kernel may not match (BN placeholders)
  int64_t predicted = 0;            // the memory model's device bytes while it runs (LAZYMEM_DEBUG=3)
  mutable uint64_t time_key = 0;    // node_time_key (plan/timing.h), once computed
  RowMap rows;                      // Loop stages: the node's rows (of its batch-sharded outputs, else
                                    // operands); rewritten arguments, random draws and host constants
                                    // follow them, and a chunk holding none of them skips the node
  bool row_node = false;            // ...it has rows at all (not only partials or whole operands)
  // A random node in a loop draws eager's numbers from a stream generated whole once, in program
  // order (rng_stream: execute/streams.cpp), or, for a form that is not eager's on the backing
  // device, keyed by blocks of rng_block batch rows.
  bool rng_stream = false;
  uint32_t rng_block = 0;
  int64_t rng_row_bytes = 0;        // rng_stream: device bytes per row a chunk's copy of the stream holds
  int64_t rng_whole_bytes = 0;      // device bytes its draw takes, run whole on the device (not on the CPU)
  int64_t rng_stream_bytes = 0;     // rng_stream: the stream's bytes in host memory
  bool recompute = false;           // a node of an earlier loop run again here for a chunk's rows
                                    // (its results other than chunk-local values are dropped)

  PlannedNode(Node* n, int32_t i) : node(n), index(i), op(n->op) {}
};

struct Accumulator {
  int32_t slot = -1;
  LazyBuffer* buf = nullptr;
  TensorMeta meta;               // the whole value's view (the producing def's)
  uint32_t version = 0;          // the version the finished value is
  Reduce reduce = Reduce::kSum;
  Finalize::Kind finalize = Finalize::kNone;
  double divisor = 1.0;          // kDivConst
  LazyBuffer* divide_by = nullptr; // kDivOutput: a buffer finished before this one
  int64_t per_row = 0;           // Reduce::kMoments: elements each batch row contributes
  double ord = 2.0;              // Reduce::kNorm: the norm's order
};

// A batch-sharded buffer given full storage for the whole loop: written (or read) chunk by chunk
// through narrowed views, readable whole after the loop.
struct FullStore {
  LazyBuffer* buf = nullptr;
  bool host = false;      // in host memory (not counted against the device budget)
  uint32_t version = 0;   // its version when the loop ends
};

struct Stage {
  bool loop = false;
  std::vector<PlannedNode> nodes;
  // Loop stages:
  int64_t batch = 0;      // the batch's rows
  int32_t batch_id = 0;   // which batch (a plan may split several, each in its own loops)
  bool tensor_rows = false; // a loop over one tensor's rows, not a batch (plan/rows.h): `batch` is its rows
  int64_t chunk = 0;      // rows per chunk (the last one may be smaller)
  // What bounds `chunk` where the budget does (explain()): at node `node` of `nodes` (-1: nothing
  // said), `bytes` held whatever the chunk size and `per_row` more a row (plan/memory.h MemPoint).
  struct ChunkBound {
    int32_t node = -1;
    int64_t bytes = 0, per_row = 0;
  } bound;
  std::vector<Slot> slots;
  std::vector<Accumulator> accs;
  std::vector<FullStore> stores;
  // Buffers with full storage this loop writes row by row, and their versions when it ends.
  std::vector<std::pair<LazyBuffer*, uint32_t>> written;
  std::vector<LazyBuffer*> release_after; // whole buffers whose last use is in this stage
  // Whole stages: the buffers released after each node, node after node (one flat list: a reused
  // plan patches it in one walk).
  std::vector<LazyBuffer*> released;
  // Values an earlier loop computed that this loop computes again chunk by chunk (nodes marked
  // `recompute`) instead of reading them from storage: they did not fit the device budget.
  std::vector<LazyBuffer*> recomputed;
  int64_t chunks() const {
    return chunk > 0 ? (batch + chunk - 1) / chunk : 0;
  }
  c10::ArrayRef<LazyBuffer*> released_after(const PlannedNode& pn) const {
    return c10::ArrayRef<LazyBuffer*>(released).slice(pn.release_begin, pn.release_end - pn.release_begin);
  }
  // Sets `released` from (node position, buffer) pairs: each node's buffers in the order given.
  void set_released(const std::vector<std::pair<size_t, LazyBuffer*>>& after);
};

// A program node the planner replaced by synthesized ones (batch norm in training mode). If the plan
// stops early (out of memory) with some of them not run, the node is put back pending; if its
// `effect` (the running statistics' update) already ran, with that effect neutralized: argument
// `neutral_arg` set to `neutral` (momentum 0) and its writes turned into reads of what was written.
struct Expansion {
  int32_t index = -1;                 // the node's position in the detached program
  std::vector<const Node*> made;      // the synthesized nodes (owned by the plan)
  const Node* effect = nullptr;
  int32_t neutral_arg = -1;
  double neutral = 0.0;
};

// What a plan tells later plans about a value it leaves batch-sharded (DESIGN.md §7): version
// `version` of `buf` holds batch `batch` laid out as `layout`. The executor records it on the buffer
// (LazyBuffer's batch fact) when the buffer holds that version after the plan ran, so a later plan
// reads the value chunk by chunk instead of losing the batch.
struct BatchFact {
  LazyBuffer* buf = nullptr;
  uint32_t version = 0;
  RowLayout layout;
  uint64_t batch = 0;
};

// A fresh global batch id (never 0).
uint64_t new_batch_id();

struct Plan {
  std::vector<Stage> stages;
  std::vector<BatchFact> facts;            // batch facts of the values it leaves batch-sharded
  std::vector<Expansion> expansions;
  std::vector<LazyBuffer*> release_unused; // dead values no executed node touches
  std::vector<int32_t> retained;           // segment indices of nodes put back pending (not destroyed)
  size_t eliminated = 0;
  size_t executed_nodes = 0;
  bool split = false;
  int64_t budget = -1;                     // bytes lazymem may hold (-1: unlimited)
  int64_t resident = 0;                    // device bytes held when the plan starts
  int64_t predicted_peak = 0;              // device bytes at the predicted peak (resident included)
  std::vector<std::string> notes;          // why it split or not, barriers, what was retained
  int64_t batch = 0;                       // split: the batch's rows
  size_t barriers = 0;                     // split: nodes with batched operands that run whole
  std::vector<NodePtr> owned;              // nodes the planner synthesized (never put back)
  uint64_t template_id = 0;                // the plan cache's entry it came from or went to (0: none)
  bool reused = false;                     // instantiated from the plan cache (plan/reuse.h)
  // No chunk size fits by the memory model, yet everything outside the loops does: the loops run
  // one row per chunk (the model may overestimate a kernel's workspace; if one row runs out of
  // memory too, the error is raised without planning again).
  bool last_resort = false;
  // It recomputes values crossing passes by default, without the measured times to price holding
  // them in host memory instead (PlanInput::Recompute::kPriced): not kept for reuse once it has run,
  // so the next plan of the program is priced.
  bool unpriced = false;
  // Priced with times measured by probes (execute/ws_probe.h: one chunk of each recomputed node run
  // on zeros, before the first run measured them): not kept for reuse either, so the next plan is
  // priced with the times of real runs.
  bool probe_priced = false;
  // Text form: what splits and why, passes, chunks, where each batch-sharded value lives, partials
  // and their finishes; with `nodes`, every node with its bindings.
  std::string to_string(bool nodes = false) const;
};

// Whether use `i` of `pn` in loop stage `st`, when its value is held in host memory, has each chunk's
// rows copied to the device ahead of the node (execute/transfer.h PendingCopy: the next chunk's rows
// start crossing once the node has read this chunk's): rows of the chunk, read only, of a value no
// node of the stage writes, and not rows an earlier use's copy holds already (a shared read below).
// The memory model holds one such copy per use across the whole loop.
bool copied_ahead(const Stage& st, const PlannedNode& pn, size_t i);

// Rows a loop writes into a value held in host memory and reads again in the same chunk (a result the
// user keeps, such as logits, assembled in host memory while the loss reads it): the kernel's result
// for the chunk stays on the device from its writer (node `writer`, def `def` of st.nodes) through
// its last reader (node `last`), and those readers take it rather than copying the rows back in
// (execute/bind.h). A reader qualifies when it reads, and does not write, the version written, the
// same rows of the batch, and elements all within the writer's rows, which are one dense range (so a
// view of the kernel's result is the reader's view). Not for random writers or results divided after
// their kernel (post_div). The memory model holds the rows from the writer through the last reader.
//
// Shared reads (`read`): a value held in host memory that no node of the stage writes, read by several
// nodes of the chunk (a ReLU's output, read by the max pool's and the ReLU's backward): the first
// reader's device copy of its rows (node `writer`, use `def`) stays on the device through the last
// reader, and the later readers view it instead of copying the same rows in again. The same rules make
// a reader; the first reader's rows are one dense range.
struct KeptRows {
  size_t writer = 0, def = 0, last = 0;
  std::vector<std::pair<size_t, size_t>> readers; // (node, use) of st.nodes, in order
  bool read = false; // a shared read: `def` is a use of node `writer`
  // The kept rows' view and binding: the writer's def, or the first reader's use.
  const TensorMeta& meta(const Stage& st) const;
  const Bound& bound(const Stage& st) const;
};
// In loop stage `st`, with `on_host` telling which buffers are held in host memory there.
std::vector<KeptRows> kept_rows(const Stage& st, c10::function_ref<bool(const LazyBuffer*)> on_host);

// The copies across the host/device boundary one stage makes (execute/transfer.h): host-held values
// its kernels read (their chunks' rows, or whole per node run) and write back, uploads into device
// memory, results it assembles in host memory.
struct StageTransfers {
  int64_t h2d = 0, d2h = 0;       // bytes each way over the whole stage (every chunk)
  int64_t copies = 0;             // copies made
  int64_t ahead = 0;              // of them, started ahead of their reader (copied_ahead)
  std::vector<std::pair<const LazyBuffer*, int64_t>> values; // host-held values crossing, with their bytes
};
// Per stage, in order. Buffers held in host memory before the plan, or assembled there by its loops,
// count as host-held from then on.
std::vector<StageTransfers> plan_transfers(const Plan& plan);

} // namespace lazymem
