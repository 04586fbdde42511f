// sync: the top layer. Every point where a value is needed — .item(), .cpu(), print, data-dependent
// ops run eagerly, synchronize(), auto-flush — goes through here: the pending program (or the
// prefix that produces what is needed) is detached, planned, executed under the flush lock (one
// flush at a time; recording continues concurrently on other threads), and what the plan leaves
// pending is put back.
#pragma once

#include <cstdint>
#include <mutex>
#include <vector>

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>

#include "ir/buffer.h"

namespace lazymem {

// Runs every pending node with seq <= upto.
void flush_until_seq(uint64_t upto);
// Runs what `bufs` need; afterwards each has real data at its latest version (or is version 0).
// Raises the stored error if any of them is poisoned.
void materialize(const std::vector<LazyBuffer*>& bufs);
// Holds the flush lock: buffers' real data is stable while it is held (sync points reading real
// data take it after materializing).
std::unique_lock<std::mutex> lock_flush();
// Runs everything pending when the auto-flush thresholds are exceeded (called after each record).
void maybe_auto_flush();

// The eager path: runs `op` for real on the backing device now (after materializing what it reads)
// and wraps its results as lazymem tensors holding real data.
void run_eager(const c10::OperatorHandle& op, torch::jit::Stack* stack);
// Records `op`, or runs it eagerly when the recorder cannot; then checks the auto-flush thresholds.
void record_or_run(const c10::OperatorHandle& op, torch::jit::Stack* stack, bool allow_constants = false);
// The PrivateUse1 boxed fallback.
void sync_fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack);

} // namespace lazymem
