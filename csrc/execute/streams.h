// execute: random nodes' draws, in program order, equal to eager's in any chunking (DESIGN.md §7
// RNG). A random node that runs whole draws from its generator's backing generator, as eager does.
// One that runs chunk by chunk with a stream form (core/rng_form.h) has its form's draw generated
// whole once, from the same generator state eager's kernel would see, and kept on the node (its
// stream); each chunk, recomputation, retry and later plan reads the rows it needs and applies the
// form's element-wise ops. Draws happen in program order: before a node draws, every earlier random
// node of the materialization that has not drawn yet (kept pending by the plan, or no rows in the
// first chunk) has its stream generated, or its row-keyed seed drawn.
#pragma once

#include <c10/util/ArrayRef.h>

#include "execute/bind.h"
#include "ir/node.h"

namespace lazymem {

// The random nodes of one execution's segment, in program order: installed for the execution (RAII,
// on this thread); replay asks it before a node draws.
class DrawOrder {
 public:
  explicit DrawOrder(c10::ArrayRef<Node*> random_nodes);
  ~DrawOrder();
  DrawOrder(const DrawOrder&) = delete;
  DrawOrder& operator=(const DrawOrder&) = delete;
  // Takes the draws of every node before `n` (in program order, same generator) that has not drawn
  // yet. A no-op outside an execution.
  static void before(const Node& n);
  // After a complete execution: every node that has not drawn yet (the plan left it pending) takes
  // its draws now, as eager took them when it was called; a later manual_seed or draw follows them.
  void finish();

 private:
  c10::ArrayRef<Node*> nodes_;
  size_t next_ = 0;
  DrawOrder* outer_ = nullptr;
};

// Whether the node's stream is what it draws on this backing device (its form is eager's here).
bool streams_here(const Node& n);

// The seed of a node whose draws are keyed by batch rows (a form not eager's on this backing device),
// taken from its generator in its turn; off the CPU the generator then advances as eager's kernel
// advances it, so the draws after it are eager's.
uint64_t row_keyed_seed(const Node& n);

// Generates the node's stream now (its form's draw, whole, from its generator), unless it drew.
void generate_stream(Node& n);

// Runs a random node from its stream (generated now if it has none): the rows the binder binds in a
// chunk, everything in a whole stage.
void replay_from_stream(const PlannedNode& pn, Binder& binder);

} // namespace lazymem
