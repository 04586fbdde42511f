// sync: the top layer. Every point where a value is needed — .item(), .cpu(), print, data-dependent
// ops run eagerly, synchronize(), auto-flush — goes through here: the pending program (or the
// prefix that produces what is needed) is detached, planned, executed under the flush lock (one
// flush at a time; recording continues concurrently on other threads), and what the plan leaves
// pending is put back.
#pragma once

#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>

#include "ir/buffer.h"
#include "ir/program.h"

namespace torch {
class Library;
} // namespace torch

namespace lazymem {

// What a sync point asks for: the values it reads (needed), how much of the pending program it
// detaches, and whether batch-sharded values that survive but are not needed may stay pending
// (recomputed when needed) when the program has to be split.
struct SyncRequest {
  std::vector<LazyBuffer*> needed;
  uint64_t upto = UINT64_MAX;
  bool keep_pending = true;
  bool background = false; // the pipeline's worker (no GIL; no thread waits on it)
  // A read (materialize): raises only its own values' errors, even when `needed` is empty because the
  // pipeline's worker computes them.
  bool read = false;
  // The pipeline's batch: its live-out set as stamped at the hand-off (Program::snapshot_live).
  const Program::LiveSnapshot* live = nullptr;
};
void sync(const SyncRequest& req);

// Runs every pending node with seq <= upto.
void flush_until_seq(uint64_t upto);
// Runs everything pending, leaving nothing pending (torch.lazymem.synchronize, torch_lazymem.sync).
void synchronize_all();
// Runs what `bufs` need; afterwards each has real data at its latest version (or is version 0).
// Raises the stored error if any of them is poisoned.
void materialize(const std::vector<LazyBuffer*>& bufs);
// Holds the flush lock: buffers' real data is stable while it is held (sync points reading real
// data take it after materializing).
std::unique_lock<std::mutex> lock_flush();
// The flush lock if no thread holds it (owns_lock() false otherwise); never waits.
std::unique_lock<std::mutex> try_lock_flush();
// Runs everything pending when the auto-flush thresholds are exceeded (called after each record).
void maybe_auto_flush();
// Waits until the pipeline's worker has run what it was handed (exit; tests).
void pipeline_drain();
// Tests: while held, the worker stays busy after running the batch it was handed (a batch's last op
// then finds it busy). Never drain while held.
void pipeline_hold(bool held);
// The last materialization's plan as text, with its measured peak (torch_lazymem.explain).
std::string last_plan();

// The eager path: runs `op` for real on the backing device now (after materializing what it reads)
// and wraps its results as lazymem tensors holding real data.
void run_eager(const c10::OperatorHandle& op, torch::jit::Stack* stack);
// Records `op`, or runs it eagerly when the recorder cannot; then checks the auto-flush thresholds.
void record_or_run(const c10::OperatorHandle& op, torch::jit::Stack* stack, bool allow_constants = false);
// The PrivateUse1 boxed fallback.
void sync_fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack);
// Registers on PrivateUse1 the captures that hold for backing devices of type `t` only (and removes
// the other type's): composite-implicit ops with an autograd formula whose own kernel only `t` has
// (sync/register.cpp). Called whenever the backing device is chosen or changed.
void capture_for_backing(c10::DeviceType t);
// Registers on `lib` (aten, PrivateUse1) the unboxed kernels of the most recorded ops (sync/unboxed.cpp):
// they record as the boxed fallback does, without copying their tensor arguments.
void register_unboxed_kernels(torch::Library& lib);
// How many it registered (tests: each listed op has one, or its registration was refused).
int unboxed_kernels_registered();

} // namespace lazymem
