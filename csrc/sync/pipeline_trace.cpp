// sync: the pipeline's timeline (pipeline_trace.h).
#include "sync/pipeline_trace.h"

#include <atomic>
#include <chrono>
#include <mutex>

namespace lazymem {
namespace {

constexpr size_t kCapacity = 4096;
std::atomic<bool> g_on{false};
std::mutex g_mu;
std::vector<PipeTraceEntry> g_ring; // (g_mu) at most kCapacity, g_next the oldest once full
size_t g_next = 0;

} // namespace

void set_pipeline_trace(bool on) {
  std::lock_guard<std::mutex> lock(g_mu);
  g_on.store(on, std::memory_order_relaxed);
  g_ring.clear();
  g_next = 0;
}

void pipeline_trace(PipeEvent event, uint64_t nodes) {
  if (!g_on.load(std::memory_order_relaxed)) return;
  const int64_t t = std::chrono::duration_cast<std::chrono::nanoseconds>(
                        std::chrono::steady_clock::now().time_since_epoch()).count();
  std::lock_guard<std::mutex> lock(g_mu);
  if (g_ring.size() < kCapacity) {
    g_ring.push_back({event, t, nodes});
  } else {
    g_ring[g_next] = {event, t, nodes};
    g_next = (g_next + 1) % kCapacity;
  }
}

std::vector<PipeTraceEntry> take_pipeline_trace() {
  std::lock_guard<std::mutex> lock(g_mu);
  std::vector<PipeTraceEntry> out(g_ring.begin() + static_cast<std::ptrdiff_t>(g_next), g_ring.end());
  out.insert(out.end(), g_ring.begin(), g_ring.begin() + static_cast<std::ptrdiff_t>(g_next));
  g_ring.clear();
  g_next = 0;
  return out;
}

const char* pipe_event_name(PipeEvent event) {
  switch (event) {
    case PipeEvent::kHanded: return "handed";
    case PipeEvent::kDue: return "due";
    case PipeEvent::kWorkerStart: return "worker_start";
    case PipeEvent::kWorkerEnd: return "worker_end";
    case PipeEvent::kSyncStart: return "sync_start";
    case PipeEvent::kSyncEnd: return "sync_end";
  }
  return "?";
}

} // namespace lazymem
