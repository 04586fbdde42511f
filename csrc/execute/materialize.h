// execute: sync points. A sync point names the buffers whose values it needs; the program prefix
// that produces them is detached, planned and executed under the flush lock (one flush at a time;
// recording continues concurrently on other threads).
#pragma once

#include <cstdint>
#include <mutex>
#include <vector>

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

} // namespace lazymem
