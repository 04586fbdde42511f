// sync: the sync entry — detach, plan, execute, put back what the plan leaves pending.
#include "sync/sync.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <unordered_set>

#include <c10/core/impl/VirtualGuardImpl.h>

#include "core/check.h"
#include "core/config.h"
#include "core/runtime.h"
#include "execute/executor.h"
#include "execute/fuse.h"
#include "execute/graphs.h"
#include "execute/memory.h"
#include "execute/replay.h"
#include "execute/ws_probe.h"
#include "ir/program.h"
#include "plan/planner.h"
#include "plan/reuse.h"
#include "sync/pipeline.h"

namespace lazymem {
namespace {

// Plans made again after running out of memory, per sync. Each one learns at least the refused
// allocation or runs part of the program, so a few suffice; chunks retry on their own (executor).
constexpr int kMaxReplans = 4;

std::mutex g_flush_mu;
thread_local bool t_in_flush = false;
std::mutex g_explain_mu;
std::string g_explain = "no materialization yet\n";
std::atomic<size_t> g_pending_floor{0};

struct InFlush {
  InFlush() {
    t_in_flush = true;
  }
  ~InFlush() {
    t_in_flush = false;
  }
};

// Takes the flush lock. A thread that must wait for it (another thread is materializing) waits
// without the GIL when it holds it (FlushHooks::without_gil): the materializing thread may need the
// GIL (a callback into Python), and the pipeline's worker holds the flush lock without it.
std::unique_lock<std::mutex> acquire_flush() {
  std::unique_lock<std::mutex> lk(g_flush_mu, std::try_to_lock);
  if (lk.owns_lock()) return lk;
  if (flush_hooks().without_gil) {
    flush_hooks().without_gil([&] { lk.lock(); });
  } else {
    lk.lock();
  }
  return lk;
}



const bool g_hooks_installed = [] {
  flush_hooks().flush_until = [](uint64_t seq) { flush_until_seq(seq); };
  flush_hooks().synchronize = [] { synchronize_all(); };
  flush_hooks().explain = [] { return last_plan(); };
  return true;
}();


void record_stats(const Plan& plan, const ExecOutcome& out) {
  auto& st = stats();
  if (plan.split) {
    int64_t loops = 0, chunks = 0;
    std::unordered_set<const LazyBuffer*> recomputed;
    for (const Stage& s : plan.stages) {
      if (!s.loop || s.nodes.empty()) continue;
      ++loops;
      if (s.tensor_rows) st.row_loops.fetch_add(1, std::memory_order_relaxed);
      chunks = std::max<int64_t>(chunks, s.chunks());
      recomputed.insert(s.recomputed.begin(), s.recomputed.end());
      for (const FullStore& f : s.stores) st.values_in_host_memory.fetch_add(f.host, std::memory_order_relaxed);
    }
    st.values_recomputed.fetch_add(recomputed.size(), std::memory_order_relaxed);
    if (loops) { // a plan whose batch-sharded work all stays pending ran no loop
      st.splits.fetch_add(1, std::memory_order_relaxed);
      st.passes.store(loops, std::memory_order_relaxed);
      st.chunks.store(chunks, std::memory_order_relaxed);
    }
    st.barriers.fetch_add(plan.barriers, std::memory_order_relaxed);
    st.nodes_kept_pending.fetch_add(plan.retained.size(), std::memory_order_relaxed);
  }
  if (out.executed) st.materializations.fetch_add(1, std::memory_order_relaxed);
  st.nodes_executed.fetch_add(out.executed, std::memory_order_relaxed);
  st.nodes_eliminated.fetch_add(plan.eliminated, std::memory_order_relaxed);
  st.peak_bytes.store(out.peak, std::memory_order_relaxed);
  st.predicted_peak_bytes.store(plan.predicted_peak, std::memory_order_relaxed);
}

// Puts back, in program order, every node the plan leaves pending: the ones it retains and, after an
// out-of-memory error, every node that did not complete.
size_t put_back(Segment& seg, Plan& plan, const ExecOutcome& out) {
  std::vector<int32_t> back(plan.retained.begin(), plan.retained.end());
  for (int32_t i : plan.retained) seg.nodes[i]->kept = true;
  std::vector<NodePtr> synthesized; // each takes the place (and seq) of the node it was made for
  if (out.oom) {
    std::unordered_set<const Node*> undone;
    for (size_t s = out.stage; s < plan.stages.size(); ++s) {
      const Stage& st = plan.stages[s];
      size_t first = (s == out.stage && !st.loop) ? out.node : 0;
      for (size_t p = first; p < st.nodes.size(); ++p) {
        undone.insert(st.nodes[p].node);
        if (st.nodes[p].index >= 0) back.push_back(st.nodes[p].index); // synthesized nodes are remade
      }
    }
    // A node replaced by synthesized ones that did not all run: the one that did not run is pending
    // in its place (it reads what the others wrote), or, when several did not, the node itself is
    // again, without an effect of it that already ran (the running statistics' update).
    for (const Expansion& e : plan.expansions) {
      std::vector<const Node*> left;
      for (const Node* m : e.made) {
        if (undone.count(m)) left.push_back(m);
      }
      if (left.empty()) continue;
      if (left.size() == 1) {
        for (NodePtr& o : plan.owned) {
          if (o.get() == left[0]) synthesized.push_back(std::move(o));
        }
        continue;
      }
      back.push_back(e.index);
      if (e.effect && !undone.count(e.effect)) {
        Node& n = *seg.nodes[e.index];
        n.sig = 0; // no longer what was recorded
        n.args[e.neutral_arg] = c10::IValue(e.neutral);
        for (Use& u : n.uses) {
          if (!u.write) continue;
          u.write = false;
          u.write_only = false;
          u.ref.version = u.write_version;
        }
      }
    }
  }
  if (back.empty() && synthesized.empty()) return 0;
  std::sort(back.begin(), back.end());
  back.erase(std::unique(back.begin(), back.end()), back.end());
  std::vector<NodePtr> nodes;
  nodes.reserve(back.size() + synthesized.size());
  for (int32_t i : back) nodes.push_back(std::move(seg.nodes[i]));
  for (NodePtr& n : synthesized) nodes.push_back(std::move(n));
  std::stable_sort(nodes.begin(), nodes.end(), [](const NodePtr& x, const NodePtr& y) { return x->seq < y->seq; });
  const size_t count = nodes.size();
  Program::get().restore_prefix(std::move(nodes));
  return count;
}

// Undoes an execution that ran out of memory and was restartable: drops what it wrote and puts
// every node of the segment back, so the next plan starts from the same state as this one did.
size_t put_back_all(Segment& seg, uint64_t epoch) {
  std::vector<NodePtr> nodes;
  nodes.reserve(seg.nodes.size());
  for (NodePtr& n : seg.nodes) {
    for (const Def& d : n->defs) {
      if (d.ref.buf->exec_epoch == epoch) d.ref.buf->drop_real();
    }
    for (const Use& u : n->uses) {
      if (u.write && u.ref.buf->exec_epoch == epoch) u.ref.buf->drop_real();
    }
    nodes.push_back(std::move(n));
  }
  const size_t count = nodes.size();
  Program::get().restore_prefix(std::move(nodes));
  return count;
}

// A plan predicted over a budget no allocator enforces (see budget_enforced) does not run: running
// it would hold more than the budget promises. Nothing ran; the nodes are pending again.
[[noreturn]] void refuse_over_budget(Segment& seg, Plan& plan, int64_t budget, int64_t target) {
  std::string why;
  for (const std::string& n : plan.notes) why += n + ". ";
  const std::string limit = target == budget
      ? "the memory budget of " + format_bytes(budget)
      : format_bytes(target) + " (of a " + format_bytes(budget) + " memory budget; the rest is left to the CUDA "
          "caching allocator's rounding and cached blocks)";
  const size_t pending = put_back_all(seg, 0);
  TORCH_CHECK_WITH(OutOfMemoryError, false, "lazymem: out of memory: the program's plan needs ",
                   format_bytes(plan.predicted_peak), " at its peak by the memory model, over ", limit, ". ", why,
                   "Nothing ran and nothing was lost: ", pending,
                   " recorded ops are still pending (raise the budget with torch_lazymem.set_memory_budget, or free "
                   "tensors, then read the value again)");
}

// A batch the pipeline's worker does not run (run_segment): nothing ran, every node is pending
// again, and pipelining stops until the recording thread's next materialization.
bool give_back_batch(Segment& seg) {
  Pipeline::get().disarm();
  stats().pipeline_given_back.fetch_add(1, std::memory_order_relaxed);
  put_back_all(seg, 0);
  return false;
}

// The plan and what was measured, as torch_lazymem.explain() prints it.
void remember(const Plan& plan, const ExecOutcome& out, double ms, double plan_ms) {
  std::string text = plan.to_string();
  text += "  measured peak " + format_bytes(out.peak) + " (predicted " + format_bytes(plan.predicted_peak) + ")";
  if (out.peak_node) text += " at " + out.peak_node->describe();
  char buf[96];
  std::snprintf(buf, sizeof(buf), ", %.2f ms (planning %.2f ms)\n", ms, plan_ms);
  text += buf;
  std::lock_guard<std::mutex> lock(g_explain_mu);
  g_explain = std::move(text);
}

// A plan's notes as one text for an error message, each said once, in order: one that repeats (a
// chain of per-tensor ops noted per chain) with how many times.
std::string joined_notes(const std::vector<std::string>& notes) {
  std::vector<std::pair<const std::string*, int>> once;
  for (const std::string& n : notes) {
    auto it = std::find_if(once.begin(), once.end(), [&](const auto& o) { return *o.first == n; });
    if (it == once.end()) {
      once.emplace_back(&n, 1);
    } else {
      ++it->second;
    }
  }
  std::string out;
  for (const auto& [n, times] : once) out += *n + (times > 1 ? " (" + std::to_string(times) + " times)" : "") + ". ";
  return out;
}

// Plans and runs a detached segment. Caller holds the flush lock. Returns true when it ran out of
// memory and should be planned again (`attempt` < kMaxReplans; otherwise it raises): everything not
// done is pending again, and a new plan may fit — the model learned the failing kernel's workspace,
// the run made progress (what is left is smaller), or it is the first failure (memory another
// process held for a moment, an injected failure). `first_why`: the first attempt's plan notes (set
// by it), which the error of a later one quotes where they differ: a retry from where the first run
// stopped plans what is left, which may no longer show why the program did not fit (the batch it
// split by already consumed: "no data leaf").
bool run_segment(Segment& seg, const SyncRequest& req, int attempt, std::string& first_why) {
  init_backing_device(); // kernels allocate their outputs themselves
  PlanInput in;
  in.nodes.reserve(seg.nodes.size());
  for (const auto& n : seg.nodes) in.nodes.push_back(n.get());
  in.live_out = [&](const LazyBuffer& b) { return seg.is_live_out(b); };
  in.needed = req.needed;
  if (seg.tape.valid) in.tape = &seg.tape;
  in.keep_pending = req.keep_pending;
  // A pipelined batch is planned with the memory held at its hand-off, like its live-out set: the
  // same every step, so its plan is reused. Only frees could have happened since (every run takes a
  // new snapshot), unless something outside a run allocated: then what is held now.
  in.resident = device_bytes_held();
  if (seg.live_snapshot) in.resident = std::max(in.resident, req.live->resident);
  in.library = backing_device().is_cpu() ? 0 : library_bytes(); // (the out-of-memory note names them)
  const int64_t budget = memory_budget();
  in.budget = plan_target(budget);
  in.whole_budget = whole_plan_target(budget);
  in.force_chunks = config().force_chunks.load(std::memory_order_relaxed);
  in.cpu_backing = backing_device().is_cpu();
  // Off unless set (LAZYMEM_CHUNK_NODE_NS): on an H200 about 8,000 ns (lazymem's tiny ops ran at
  // 8-9 us each; the capped GPT-2 step at 4x eager's batch in 32 one-row chunks took 6-10 us per
  // node and chunk beyond 4 eager steps), and with it the capped 4x step ran in 16 chunks at 0.49x
  // eager per sample instead of 32 at 0.40x, but that run (which also had the pipeline's repeat rule
  // before its clamp to the budget in force) failed tools/gpu_check.py's float64 GPT-2 split, which
  // neither reproduces on the CPU: on once a GPU run passes with it.
  const int64_t node_ns = config().chunk_node_ns.load(std::memory_order_relaxed);
  in.chunk_node_ns = std::max<int64_t>(node_ns, 0);
  const int recompute = config().recompute.load(std::memory_order_relaxed);
  in.recompute = recompute == 0                                              ? PlanInput::Recompute::kNever
                 : config().force_recompute.load(std::memory_order_relaxed) ? PlanInput::Recompute::kAlways
                 : recompute < 0                                            ? PlanInput::Recompute::kPriced
                                                                            : PlanInput::Recompute::kWhenTooBig;
  const auto t0 = std::chrono::steady_clock::now();
  Plan plan = make_plan(in);
  // Kernels that allocate inside, new to the workspace model: measured on a row or two first, and
  // planned again knowing them (once per op and shapes in a process).
  for (int probes = 0; probes < 3 && probe_workspace(plan); ++probes) {
    recycle_plan(std::move(plan));
    plan = make_plan(in);
  }
  // Recomputing values crossing passes, unpriced: its nodes timed on a chunk each, and priced.
  if (probe_node_times(plan)) {
    forget_plan(plan.template_id); // (else the cache hands the unpriced plan back)
    recycle_plan(std::move(plan));
    plan = make_plan(in);
    plan.probe_priced = true;
    plan.notes.push_back("the program's first plan: the recomputing nodes' times were probed on one chunk of zeros "
                         "each; the next plan prices with the times of real runs");
  }
  const auto planned = std::chrono::steady_clock::now();
  const bool repeats = plan.reused || (seg.live_snapshot && Pipeline::get().repeats(seg, req.live->offset));
  if (req.background && (plan.split || !plan.retained.empty() ||
                         plan.predicted_peak > Pipeline::get().batch_limit(in.budget, in.whole_budget, repeats))) {
    // Not an unsplit plan within the pipeline's limit: the worker runs eager's kernels in program
    // order only, and leaves this batch to the recording thread's next materialization. (Split plans
    // run on the worker while recording went on drew wrong random numbers in the forced-chunk RNG
    // tests.)
    if (config().debug) {
      std::fprintf(stderr, "[lazymem] pipeline: a batch of %zu ops given back (%s, predicted peak %s, limit %s)\n",
                   seg.nodes.size(), plan.split ? "split" : !plan.retained.empty() ? "keeps ops pending"
                   : repeats ? "repeating the last step" : "new plan", format_bytes(plan.predicted_peak).c_str(),
                   format_bytes(Pipeline::get().batch_limit(in.budget, in.whole_budget, repeats)).c_str());
    }
    recycle_plan(std::move(plan));
    return give_back_batch(seg);
  }
  const int64_t limit = plan.split ? in.budget : std::max(in.budget, in.whole_budget);
  if (in.budget >= 0 && plan.predicted_peak > limit && !budget_enforced()) refuse_over_budget(seg, plan, budget, limit);
  if (budget >= 0 && !plan.reused && !in.cpu_backing) release_cached_blocks(budget - plan.predicted_peak);
  stats().plan_ns.fetch_add(std::chrono::duration_cast<std::chrono::nanoseconds>(planned - t0).count(),
                            std::memory_order_relaxed);
  stats().nodes_planned.fetch_add(in.nodes.size(), std::memory_order_relaxed);
  if (config().debug >= 2) std::fprintf(stderr, "[lazymem] %s", plan.to_string(/*nodes=*/true).c_str());
  std::vector<Node*> random_nodes; // they draw in program order, whatever the plan runs when
  for (const auto& n : seg.nodes) {
    if (n->random && !n->drawn && rng_form_draws(n->rng_form)) random_nodes.push_back(n.get());
  }
  if (req.background) stats().pipelined_flushes.fetch_add(1, std::memory_order_relaxed);
  // Under memory pressure the graphs' pools give their cached blocks back.
  if (plan.split && stats().cuda_graph_pool_bytes.load(std::memory_order_relaxed) > 0) drop_cuda_graphs();
  ExecOutcome out;
  {
    // The caching allocator holds the run to the budget (CUDA), where the plan comes near it.
    const bool capped = budget >= 0 && plan.predicted_peak > budget / 2;
    ScopedAllocatorCap cap(budget, capped);
    // Graphs' pools hold memory between steps: not where the user capped memory.
    std::unique_ptr<StageRunner> runner = graph_runner(plan, capped || memory_capped());
    if (!runner) runner = fusion_runner(plan); // (the CPU backing: pointwise chains as one loop)
    out = execute(plan, random_nodes, runner.get());
  }
  if (out.oom && stats().cuda_graph_pool_bytes.load(std::memory_order_relaxed) > 0) drop_cuda_graphs();
  // A loop that ran out of memory finished with smaller chunks: so does the plan next time.
  for (auto [stage, chunk] : out.smaller_chunks) plan_learned_chunk(plan.template_id, stage, chunk);
  // Its nodes' times are measured now: the next plan of the program prices recomputing.
  if (plan.unpriced || plan.probe_priced) forget_plan(plan.template_id);
  record_stats(plan, out);
  stats().oom_retries.fetch_add(out.chunk_retries, std::memory_order_relaxed);
  // Out of memory because a kernel needed more workspace than known: a new plan knows it now. From
  // the start when nothing irreversible ran (the leaves are still there to split by), else from
  // where it stopped.
  // A last resort that ran out of memory too (one row per chunk) is not planned again.
  // Nor one that tore a value (updated some of its rows in place): it cannot run again exactly.
  if (attempt == 0 && out.oom) first_why = joined_notes(plan.notes);
  const bool retry = out.oom && attempt < kMaxReplans && out.torn.empty() &&
                     (attempt == 0 || (!plan.last_resort && (out.oom_learned || out.executed > 0)));
  size_t pending = retry && out.restartable ? put_back_all(seg, out.epoch) : put_back(seg, plan, out);
  const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  const double plan_ms = std::chrono::duration<double, std::milli>(planned - t0).count();
  remember(plan, out, ms, plan_ms);
  if (config().debug == 1 && plan.split) std::fprintf(stderr, "[lazymem] %s", plan.to_string().c_str());
  if (config().debug) {
    std::fprintf(stderr, "[lazymem] materialized: %zu nodes run, %zu eliminated, peak %s (predicted %s), %.2f ms\n",
                 out.executed, plan.eliminated, format_bytes(out.peak).c_str(),
                 format_bytes(plan.predicted_peak).c_str(), ms);
  }
  if (retry) {
    if (config().debug) {
      std::fprintf(stderr, "[lazymem] out of memory at %s; planning again %s\n", out.oom_site.c_str(),
                   out.restartable ? "from the start" : "from there");
    }
    recycle_plan(std::move(plan));
    return true;
  }
  if (out.oom) {
    Pipeline::get().disarm();
    std::string why = joined_notes(plan.notes);
    if (attempt > 0 && !first_why.empty() && first_why != why) {
      why += "As first planned, before " + std::to_string(attempt) + (attempt == 1 ? " retry" : " retries") +
             ": " + first_why;
    }
    if (!out.torn.empty()) {
      std::string names;
      for (LazyBuffer* b : out.torn) names += (names.empty() ? "b" : ", b") + std::to_string(b->id);
      const std::string lost = out.torn_in_node
          ? "lazymem: " + names + " was being updated in place by " + out.oom_site + " when the device ran out "
            "of memory inside its kernel; the kernel may have updated part of it, and an in-place update "
            "cannot run twice, so it is lost (a larger capacity avoids this)"
          : "lazymem: " + names + " was being updated in place chunk by chunk along the batch "
            "when the device ran out of memory at " + out.oom_site + "; some of its rows were updated, and an "
            "in-place update cannot run twice on the same rows, so it is lost (a larger capacity or a smaller "
            "batch avoids this)";
      std::exception_ptr ep;
      try {
        TORCH_CHECK_WITH(OutOfMemoryError, false, lost);
      } catch (...) {
        ep = std::current_exception();
      }
      for (LazyBuffer* b : out.torn) b->poison = ep;
      why += lost + ". ";
    }
    std::string prefix = "lazymem: out of memory while materializing " + out.oom_site + ". " + why +
        "Nothing was lost: " + std::to_string(pending) +
        " recorded ops are still pending and run when memory is available (free tensors or raise the "
        "capacity, then read the value again). ";
    try {
      std::rethrow_exception(out.oom);
    } catch (const std::exception& e) {
      std::rethrow_exception(annotate_node_error(e, prefix));
    }
  }
  // Pipelining: armed by a run that fit unsplit, disarmed by any other. A step's peak is that of its
  // worker's batches and its read together (stats()'s peak_bytes too).
  const int64_t peak = std::max(out.peak, plan.predicted_peak);
  const bool fits = !plan.split && !out.oom && (in.budget < 0 || peak <= std::max(in.budget, in.whole_budget));
  const Pipeline::Peaks step = Pipeline::get().note_step(seg, /*ends_step=*/!req.background, fits, {peak, out.peak});
  stats().peak_bytes.store(step.measured, std::memory_order_relaxed);
  if (!req.background) {
    Pipeline::get().read_ran();
    Pipeline::get().rearm(fits, step.planned, in.budget, in.whole_budget);
  } else if (plan.split || out.oom || out.peak > Pipeline::get().batch_limit(in.budget, in.whole_budget, repeats)) {
    Pipeline::get().disarm();
  }
  // A read raises only its own values' errors (materialize checks them); flushes that need
  // everything (synchronize, auto-flush, generator state) raise the first one.
  recycle_plan(std::move(plan)); // (its next instantiation patches it instead of copying)
  if (out.first_error && req.needed.empty() && !req.read) std::rethrow_exception(out.first_error);
  return false;
}

// A read or synchronize on a recording thread that finds nothing pending after the worker was handed
// batches: the worker ran the whole step. It ends the step as a read that ran the tail would, so
// the next step's batches are compared with this one's nodes from its start (not with a step that
// went on across reads, which no later step repeats: its batches would keep to half the budget).
void end_step_run_by_worker(const Segment& empty) {
  Pipeline& p = Pipeline::get();
  if (!p.handed_since_read()) return;
  const bool fits = p.armed(); // a batch given back or out of memory left nodes pending and disarmed
  const Pipeline::Peaks step = p.note_step(empty, /*ends_step=*/true, fits, {});
  stats().peak_bytes.store(step.measured, std::memory_order_relaxed);
  p.read_ran();
  const int64_t budget = memory_budget();
  p.rearm(fits, step.planned, plan_target(budget), whole_plan_target(budget));
}

} // namespace

bool in_flush_on_this_thread() {
  return t_in_flush;
}

void sync(const SyncRequest& req) {
  // Nothing to run; but a read or synchronize after the worker ran a whole step ends the step.
  if (req.upto == 0 && (req.background || t_in_flush || !Pipeline::get().handed_since_read())) return;
  LAZYMEM_CHECK(!t_in_flush, "a lazymem value was needed while lazymem was already materializing on "
                "this thread (for example from a kernel or a hook run during replay); this is not supported");
  // The allocator's cap the pipeline held for its worker is the user's again after a synchronous run
  // (the worker waits for the flush lock, so it runs nothing meanwhile).
  struct ReleaseCap {
    bool on;
    ~ReleaseCap() {
      if (on) Pipeline::get().release_cap();
    }
  } release_cap{!req.background};
  struct Traced {
    bool on;
    ~Traced() {
      if (on) pipeline_trace(PipeEvent::kSyncEnd);
    }
  } traced{!req.background};
  if (!req.background) {
    pipeline_trace(PipeEvent::kSyncStart);
    Pipeline::get().drop_released(); // (what the worker ran before: dropped before this run's plan)
  }
  std::unique_lock<std::mutex> lock = acquire_flush();
  InFlush guard;
  if (!req.background && !req.read && req.needed.empty()) {
    if (std::exception_ptr e = Pipeline::get().take_error()) std::rethrow_exception(e);
  }
  std::string first_why;
  for (int attempt = 0;; ++attempt) {
    Segment seg = Program::get().take_prefix(req.upto, req.live);
    if (seg.nodes.empty()) {
      if (attempt == 0 && !req.background) end_step_run_by_worker(seg);
      return;
    }
    const bool again = run_segment(seg, req, attempt, first_why);
    Program::get().recycle_tape(std::move(seg.tape));
    // What ran is emptied and its shells kept for the next records (ir/node.h recycle_nodes): no
    // allocation for a node, its arguments, uses or defs while a step like the last is recorded.
    // The worker's nodes and buffers were made by the recording thread: they go back to it.
    std::vector<BufferPtr> released;
    recycle_nodes(seg.nodes, released);
    if (req.background) Pipeline::get().hand_back(std::move(released));
    if (!again) return;
    stats().oom_retries.fetch_add(1, std::memory_order_relaxed);
  }
}

void flush_until_seq(uint64_t upto) {
  sync(SyncRequest{{}, upto, /*keep_pending=*/true});
}

void synchronize_all() {
  sync(SyncRequest{{}, UINT64_MAX, /*keep_pending=*/false});
}

std::unique_lock<std::mutex> lock_flush() {
  LAZYMEM_CHECK(!t_in_flush, "a lazymem value was read while lazymem was materializing on this thread");
  return acquire_flush();
}

std::unique_lock<std::mutex> try_lock_flush() {
  return std::unique_lock<std::mutex>(g_flush_mu, std::try_to_lock);
}

void materialize(const std::vector<LazyBuffer*>& bufs) {
  bool pending = false;
  for (LazyBuffer* b : bufs) pending = pending || Program::get().pending_writer(*b) != 0;
  // A value that is needed runs with everything recorded so far: the rest of a training step runs in
  // the same plan (a split runs it in the same chunk loop) instead of storing what it will read.
  // Pipelined, the worker may have taken the value's writer: the read still runs what is pending, so
  // that a step ends at its read and the worker's batches (counted from here) repeat step after
  // step, their plans the plan cache's (the values are then not the plan's to compute: its
  // fingerprint names none, and it is reused).
  // (With nothing pending, the worker ran the step: the read still ends it, see end_step_run_by_worker.)
  const bool rest = !pending && Pipeline::get().handed_since_read();
  if (pending || rest) {
    sync(SyncRequest{pending ? bufs : std::vector<LazyBuffer*>{}, Program::get().last_seq(), /*keep_pending=*/true,
                     /*background=*/false, /*read=*/true});
  }
  std::unique_lock<std::mutex> lock = acquire_flush();
  for (LazyBuffer* b : bufs) {
    if (b->poison) std::rethrow_exception(b->poison);
  }
}

std::string last_plan() {
  std::lock_guard<std::mutex> lock(g_explain_mu);
  return g_explain;
}

void pipeline_drain() {
  Pipeline::get().drain();
}

void pipeline_hold(bool held) {
  Pipeline::get().hold(held);
}

void maybe_auto_flush() {
  Pipeline::get().maybe_hand_off();
  const Config& c = config();
  uint64_t max_nodes = c.flush_threshold_nodes.load(std::memory_order_relaxed);
  uint64_t max_bytes = c.flush_threshold_bytes.load(std::memory_order_relaxed);
  if (!max_nodes && !max_bytes) return;
  if (t_in_flush) return;
  Program& p = Program::get();
  // Nodes a split left pending do not count again: the threshold applies to what was recorded since.
  const size_t floor = g_pending_floor.load(std::memory_order_relaxed);
  const size_t count = p.pending_count();
  bool over = (max_nodes && count >= floor + max_nodes) || (max_bytes && p.pending_def_bytes() >= max_bytes);
  if (!over) return;
  stats().auto_flushes.fetch_add(1, std::memory_order_relaxed);
  flush_until_seq(p.last_seq());
  g_pending_floor.store(p.pending_count(), std::memory_order_relaxed);
}

} // namespace lazymem
