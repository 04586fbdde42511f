// sync: a timeline of pipelined execution (issue 30), for tools that ask where a pipelined step waits
// (tools/gpu_check.py check 10): when the recording thread handed each batch or found the worker busy
// at a batch's last op, when the worker ran each batch, and when materializations on recording threads
// began and ended. Off unless asked (one relaxed load per event); then the last 4,096 events.
#pragma once

#include <cstdint>
#include <vector>

namespace lazymem {

enum class PipeEvent : uint8_t {
  kHanded,      // a batch handed to the worker (nodes: its size)
  kDue,         // a batch's last op recorded while the worker was busy (handed later)
  kWorkerStart, // the worker took a batch
  kWorkerEnd,   // ... and ran it
  kSyncStart,   // a materialization on a recording thread (a read, synchronize) began: it waits for
  kSyncEnd,     // the flush lock (the worker's batch), then runs what is pending
};

void set_pipeline_trace(bool on);
void pipeline_trace(PipeEvent event, uint64_t nodes = 0);

struct PipeTraceEntry {
  PipeEvent event;
  int64_t t_ns;   // std::chrono::steady_clock (CLOCK_MONOTONIC: Python's time.monotonic_ns())
  uint64_t nodes;
};
// The events since the last call, oldest first (the ring is emptied).
std::vector<PipeTraceEntry> take_pipeline_trace();
const char* pipe_event_name(PipeEvent event);

} // namespace lazymem
