// plan: the planner's entry point. A program that fits runs whole, exactly eager's kernels in
// program order (its per-tensor chains in groups of tensors when only that makes it fit); one that
// does not is split along the batch (plan/split.h). Plans are reused across steps (plan/reuse.h).
#include "plan/planner.h"

#include <algorithm>
#include <optional>

#include "core/config.h"
#include "ops/op_rules.h"
#include "plan/analysis.h"
#include "plan/lanes.h"
#include "plan/memory.h"
#include "plan/reuse.h"
#include "plan/schedule.h"
#include "plan/split.h"

namespace lazymem {
namespace {

// One whole stage: the schedule's nodes in program order, each buffer released after its last use.
Plan whole_plan(const PlanInput& in, const Schedule& s) {
  Plan plan;
  plan.budget = in.budget;
  plan.resident = in.resident;
  plan.eliminated = s.eliminated;
  plan.executed_nodes = s.run.size();
  plan.release_unused = s.release_unused;
  Stage st;
  st.nodes.reserve(s.run.size());
  for (size_t p = 0; p < s.run.size(); ++p) {
    Node* n = in.nodes[s.run[p]];
    PlannedNode pn(n, s.run[p]);
    pn.release_begin = static_cast<uint32_t>(st.released.size());
    st.released.insert(st.released.end(), s.release[p].begin(), s.release[p].end());
    pn.release_end = static_cast<uint32_t>(st.released.size());
    pn.placeholder_outputs = op_rules(n->op).placeholder_outputs;
    st.nodes.push_back(std::move(pn));
  }
  plan.stages.push_back(std::move(st));
  return plan;
}

// A small program of which nothing runs: no random draw, no effect, nothing it writes survives (what
// is left when a value read earlier is dropped before synchronize(): its upload was kept pending).
// The plan plan_anew would make — every node eliminated, every buffer that does not survive
// released — without scheduling or a fingerprint. nullopt when something may run. (Asking
// plan_segment instead costs a BatchNorm CNN's later steps 2-3 us more, a tenth of their planning;
// test_schedule checks that the two agree.)
std::optional<Plan> nothing_runs(const PlanInput& in) {
  constexpr size_t kMaxNodes = 16; // (buffers are deduplicated by a linear search)
  if (in.nodes.size() > kMaxNodes || !in.needed.empty()) return std::nullopt;
  c10::SmallVector<LazyBuffer*, 32> dead;
  c10::SmallVector<const LazyBuffer*, 8> live;
  // False when `b` survives the plan.
  auto note = [&](LazyBuffer* b) {
    if (std::find(dead.begin(), dead.end(), b) != dead.end()) return true;
    if (std::find(live.begin(), live.end(), b) != live.end()) return false;
    if (in.live_out(*b)) {
      live.push_back(b);
      return false;
    }
    dead.push_back(b);
    return true;
  };
  for (const Node* n : in.nodes) {
    if (n->random || n->effectful) return std::nullopt;
    for (const Def& d : n->defs) {
      if (!note(d.ref.buf.get())) return std::nullopt;
    }
    for (const Use& u : n->uses) {
      if (!note(u.ref.buf.get()) && u.write) return std::nullopt;
    }
  }
  Plan plan;
  plan.budget = in.budget;
  plan.resident = in.resident;
  plan.eliminated = in.nodes.size();
  plan.release_unused.assign(dead.begin(), dead.end());
  plan.stages.emplace_back();
  plan.predicted_peak = in.resident; // (nothing is allocated: what the memory model gives)
  return plan;
}

// A program over the budget whose per-tensor chains (an optimizer step's _foreach_ ops) run in
// groups of tensors (plan/lanes.h): the fewest groups that fit, or as many as there are tensors.
// The schedule and plan are replaced unless that raises the peak.
void group_lanes(const PlanInput& in, int64_t limit, const std::vector<const Node*>& nodes, Schedule& s, Plan& plan) {
  const std::vector<LaneChain> chains = find_lane_chains(nodes, s);
  size_t most = 0;
  for (const LaneChain& c : chains) most = std::max(most, c.lanes);
  if (most < 2) return;
  for (size_t groups = 2;; groups = std::min(groups * 2, most)) {
    Schedule t = s;
    run_lanes_in_groups(t, nodes, chains, groups);
    Plan p = whole_plan(in, t);
    p.predicted_peak = model_memory(p).peak(p);
    if (p.predicted_peak <= limit || groups >= most) {
      // (When even one tensor at a time does not make the whole fit, the batch is split next: its
      // final whole stage, the step, then holds one tensor's temporaries.)
      if (p.predicted_peak <= plan.predicted_peak) {
        p.notes = std::move(plan.notes);
        p.notes.push_back(describe_lane_groups(chains, groups) + " (the whole list at once does not fit)");
        s = std::move(t);
        plan = std::move(p);
      }
      return;
    }
  }
}

// Plans from scratch.
Plan plan_anew(const PlanInput& in) {
  std::vector<const Node*> nodes(in.nodes.begin(), in.nodes.end());
  Schedule s = plan_segment(nodes, in.live_out);
  Plan plan = whole_plan(in, s);
  MemoryModel model = model_memory(plan);
  const MemPoint* at = nullptr;
  plan.predicted_peak = model.peak(plan, &at);
  if (config().debug >= 3) model.annotate(plan);
  // Unsplit (lane groups are), a plan may use whole_budget; a split one, budget.
  const int64_t whole = in.budget < 0 ? -1 : std::max(in.budget, in.whole_budget);
  if (whole >= 0 && plan.predicted_peak > whole) {
    group_lanes(in, whole, nodes, s, plan);
    model = model_memory(plan);
    plan.predicted_peak = model.peak(plan, &at);
  }
  if (whole >= 0 && plan.predicted_peak > whole && in.force_chunks <= 0) {
    // What does not fit may be only element-wise runs over one tensor's rows (an optimizer step
    // whose single parameter's temporaries do not fit): those in blocks of rows, the rest unsplit.
    Plan rows = whole_plan(in, s);
    rows.notes = plan.notes;
    std::vector<std::string> notes;
    if (choose_chunks(rows, in.budget, 0, notes) == ChunkChoice::kFits && rows.split && !rows.last_resort) {
      plan = std::move(rows);
    }
  }
  const bool over = whole >= 0 && plan.predicted_peak > whole;
  if (!over && in.force_chunks <= 0) { // fits: eager's kernels in program order (element-wise runs maybe in blocks)
    note_unsplit_facts(in.nodes, s, in.needed, plan);
    return plan;
  }
  if (over && at && at->node) {
    // What no schedule frees: the values held before the program and the new values that outlive it
    // (an optimizer's first step creates its state).
    int64_t outlive = 0;
    for (size_t b = 0; b < s.index.size(); ++b) {
      const LazyBuffer* buf = s.index.buffers[b];
      if (s.live[b] && !buf->has_real()) outlive += static_cast<int64_t>(buf->nbytes.load());
    }
    plan.notes.push_back("does not fit unsplit: predicted peak " + format_bytes(plan.predicted_peak) + " at " +
                         at->node->describe() + " exceeds the budget of " + format_bytes(in.budget) + ", of which " +
                         format_bytes(in.resident) + " is held before the program runs" +
                         (in.library > 0 ? " (" + format_bytes(in.library) + " of it workspaces that CUDA libraries keep for "
                                          "the streams lazymem ran on; torch._C._cuda_clearCublasWorkspaces() "
                                          "frees cuBLAS's once no CUDA graph uses them)" : "") +
                         " and " + format_bytes(outlive) +
                         " by new values that outlive it");
  }
  Plan split;
  split.budget = in.budget;
  split.resident = in.resident;
  split.notes = plan.notes;
  if (make_split_plan(in, s, split)) return split;
  plan.notes = std::move(split.notes);
  return plan;
}

} // namespace

Plan make_plan(const PlanInput& in) {
  if (std::optional<Plan> nothing = nothing_runs(in)) return std::move(*nothing);
  if (!config().plan_cache.load(std::memory_order_relaxed)) return plan_anew(in);
  // The fingerprint's room is kept per thread; it is moved into the cache only with a new plan.
  thread_local Fingerprint fp;
  fingerprint(in, fp);
  if (std::optional<Plan> reused = reuse_plan(in, fp)) {
    stats().plans_reused.fetch_add(1, std::memory_order_relaxed);
    return std::move(*reused);
  }
  Plan plan = plan_anew(in);
  remember_plan(in, std::move(fp), plan);
  return plan;
}

} // namespace lazymem
