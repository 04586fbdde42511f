// execute: a reused plan replayed as CUDA graphs (DESIGN.md §8).
//
// A plan the plan cache gave again (unsplit, one whole stage) runs plainly the first time it is
// seen here; from its next run on, its nodes run in *pieces*: maximal runs of nodes that can be
// captured, each captured once (a dry run of the executor under stream capture into a private
// memory pool) and then replayed in one launch, with the effects on the buffers applied node by node
// (StageWalk::bookkeep). Nodes that cannot be in a graph run plainly between pieces: random ops
// (their draws follow the program's order), uploads from the host, effects, host tensors of more
// than one element, a node whose kernel failed under capture (it synchronizes: embedding's backward
// reads a count), and a node whose non-tensor arguments changed since the capture (a scalar the
// optimizer computes each step). A graph bakes in addresses, so:
// - inputs whose storage moved between runs (a new batch) are copied into static copies first;
//   inputs that stayed (parameters, optimizer state, what an earlier piece wrote) are read in place,
//   and a piece whose stayed input moved is captured again;
// - a result of the last replay that someone still holds moves to new memory before the graph
//   overwrites its block (the holder keeps its values; the graph keeps its address).
// The pools' cached bytes count against the default budget (memory_budget()), and a plan that comes
// over half the budget runs plainly (capped: the allocator's cap must see every allocation).
#pragma once

#include <cstdint>
#include <memory>

#include "execute/executor.h"

namespace lazymem {

// The graph runner for one execution of `plan`, or nullptr where it runs plainly: no CUDA backend
// (core/cuda_backend.h), graphs off (config().cuda_graphs), not a reused plan of one whole stage,
// `capped`, or the first run of the plan here (what moves between runs is learned then). The
// caller holds the flush lock until the runner is gone.
std::unique_ptr<StageRunner> graph_runner(const Plan& plan, bool capped);
// Device bytes the graphs hold that no buffer does: their static copies of moving inputs, and the
// blocks they write results in while no value holds them. Not lazymem's values, nor library
// workspaces: what lazymem holds for planning (and a plan's fingerprint) leaves them out.
int64_t cuda_graph_unheld_bytes();
// Destroys every graph (their pools' memory goes back once no value holds a block of it).
void drop_cuda_graphs();
// Tests: graphs emulated on the CPU backing (graphs.cpp, Emulated): everything around a graph —
// pieces, plain nodes, moving inputs, held results, the buffers' bookkeeping — runs as on a GPU, and
// a replay checks that no node's arguments changed since its capture.
void set_graph_emulation(bool on);
bool graph_emulation();

} // namespace lazymem
