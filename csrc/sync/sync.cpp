// sync: the sync entry — detach, plan, execute, put back what the plan leaves pending.
#include "sync/sync.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <mutex>

#include "core/check.h"
#include "core/config.h"
#include "core/runtime.h"
#include "execute/executor.h"
#include "execute/memory.h"
#include "execute/replay.h"
#include "ir/program.h"
#include "plan/planner.h"

namespace lazymem {
namespace {

std::mutex g_flush_mu;
thread_local bool t_in_flush = false;

struct InFlush {
  InFlush() {
    t_in_flush = true;
  }
  ~InFlush() {
    t_in_flush = false;
  }
};

const bool g_hooks_installed = [] {
  flush_hooks().flush_until = [](uint64_t seq) { flush_until_seq(seq); };
  return true;
}();

int64_t device_bytes_held() {
  return backing_device().is_cpu() ? device_counter().allocated() : resident_bytes();
}

void record_stats(const Plan& plan, const ExecOutcome& out) {
  auto& st = stats();
  if (out.executed) st.materializations.fetch_add(1, std::memory_order_relaxed);
  st.nodes_executed.fetch_add(out.executed, std::memory_order_relaxed);
  st.nodes_eliminated.fetch_add(plan.eliminated, std::memory_order_relaxed);
  st.peak_bytes.store(out.peak, std::memory_order_relaxed);
  st.predicted_peak_bytes.store(plan.predicted_peak, std::memory_order_relaxed);
}

// Puts back, in program order, every node the plan leaves pending: the ones it retains and, after an
// out-of-memory error, every node that did not complete.
size_t put_back(Segment& seg, const Plan& plan, const ExecOutcome& out) {
  std::vector<int32_t> back(plan.retained.begin(), plan.retained.end());
  if (out.oom) {
    for (size_t s = out.stage; s < plan.stages.size(); ++s) {
      const Stage& st = plan.stages[s];
      size_t first = (s == out.stage && !st.loop) ? out.node : 0;
      for (size_t p = first; p < st.nodes.size(); ++p) back.push_back(st.nodes[p].index);
    }
  }
  if (back.empty()) return 0;
  std::sort(back.begin(), back.end());
  back.erase(std::unique(back.begin(), back.end()), back.end());
  std::vector<NodePtr> nodes;
  nodes.reserve(back.size());
  for (int32_t i : back) nodes.push_back(std::move(seg.nodes[i]));
  Program::get().restore_prefix(std::move(nodes));
  return back.size();
}

// Plans and runs a detached segment. Caller holds the flush lock.
void run_segment(Segment& seg) {
  PlanInput in;
  in.nodes.reserve(seg.nodes.size());
  for (const auto& n : seg.nodes) in.nodes.push_back(n.get());
  in.live_out = [&](const LazyBuffer& b) { return seg.is_live_out(b); };
  in.resident = device_bytes_held();
  in.budget = memory_budget();
  in.force_chunks = config().force_chunks.load(std::memory_order_relaxed);
  const auto t0 = std::chrono::steady_clock::now();
  Plan plan = make_plan(in);
  if (config().debug >= 2) std::fprintf(stderr, "[lazymem] %s", plan.to_string().c_str());
  ExecOutcome out = execute(plan);
  record_stats(plan, out);
  size_t pending = put_back(seg, plan, out);
  if (config().debug) {
    double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    std::fprintf(stderr, "[lazymem] materialized: %zu nodes run, %zu eliminated, peak %s (predicted %s), %.2f ms\n",
                 out.executed, plan.eliminated, format_bytes(out.peak).c_str(),
                 format_bytes(plan.predicted_peak).c_str(), ms);
  }
  if (out.oom) {
    std::string prefix = "lazymem: out of memory while materializing " + out.oom_site + ". Nothing was lost: " +
        std::to_string(pending) +
        " recorded ops are still pending and run when memory is available (free tensors or raise the "
        "capacity, then read the value again). ";
    try {
      std::rethrow_exception(out.oom);
    } catch (const std::exception& e) {
      std::rethrow_exception(annotate_node_error(e, prefix));
    }
  }
  if (out.first_error) std::rethrow_exception(out.first_error);
}

} // namespace

void flush_until_seq(uint64_t upto) {
  if (upto == 0) return;
  LAZYMEM_CHECK(!t_in_flush, "a lazymem value was needed while lazymem was already materializing on "
                "this thread (for example from a kernel or a hook run during replay); this is not supported");
  std::lock_guard<std::mutex> lock(g_flush_mu);
  InFlush guard;
  Segment seg = Program::get().take_prefix(upto);
  if (seg.nodes.empty()) return;
  run_segment(seg);
}

std::unique_lock<std::mutex> lock_flush() {
  LAZYMEM_CHECK(!t_in_flush, "a lazymem value was read while lazymem was materializing on this thread");
  return std::unique_lock<std::mutex>(g_flush_mu);
}

void materialize(const std::vector<LazyBuffer*>& bufs) {
  uint64_t upto = 0;
  for (LazyBuffer* b : bufs) upto = std::max(upto, Program::get().pending_writer(*b));
  flush_until_seq(upto);
  std::lock_guard<std::mutex> lock(g_flush_mu);
  for (LazyBuffer* b : bufs) {
    if (b->poison) std::rethrow_exception(b->poison);
  }
}

void maybe_auto_flush() {
  const Config& c = config();
  uint64_t max_nodes = c.flush_threshold_nodes.load(std::memory_order_relaxed);
  uint64_t max_bytes = c.flush_threshold_bytes.load(std::memory_order_relaxed);
  if (!max_nodes && !max_bytes) return;
  if (t_in_flush) return;
  Program& p = Program::get();
  bool over = (max_nodes && p.pending_count() >= max_nodes) || (max_bytes && p.pending_def_bytes() >= max_bytes);
  if (!over) return;
  stats().auto_flushes.fetch_add(1, std::memory_order_relaxed);
  flush_until_seq(p.last_seq());
}

} // namespace lazymem
