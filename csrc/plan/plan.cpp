// plan: the planner's entry point and the Plan's text form.
#include "plan/planner.h"

#include <algorithm>
#include <atomic>
#include <optional>
#include <sstream>

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
void group_lanes(const PlanInput& in, const std::vector<const Node*>& nodes, Schedule& s, Plan& plan) {
  const std::vector<LaneChain> chains = find_lane_chains(nodes, s);
  size_t most = 0;
  for (const LaneChain& c : chains) most = std::max(most, c.lanes);
  if (most < 2) return;
  for (size_t groups = 2;; groups = std::min(groups * 2, most)) {
    Schedule t = s;
    run_lanes_in_groups(t, nodes, chains, groups);
    Plan p = whole_plan(in, t);
    p.predicted_peak = model_memory(p).peak(p);
    if (p.predicted_peak <= in.budget || groups >= most) {
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
  if (in.budget >= 0 && plan.predicted_peak > in.budget) {
    group_lanes(in, nodes, s, plan);
    model = model_memory(plan);
    plan.predicted_peak = model.peak(plan, &at);
  }
  const bool over = in.budget >= 0 && plan.predicted_peak > in.budget;
  if (!over && in.force_chunks <= 0) { // fits: exactly eager's kernels in program order
    note_unsplit_facts(in.nodes, s, in.needed, plan);
    return plan;
  }
  if (over && at && at->node) {
    plan.notes.push_back("does not fit unsplit: predicted peak " + format_bytes(plan.predicted_peak) + " at " +
                         at->node->describe() + " exceeds the budget of " + format_bytes(in.budget));
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

uint64_t new_batch_id() {
  static std::atomic<uint64_t> next{0};
  return next.fetch_add(1, std::memory_order_relaxed) + 1;
}

void Stage::set_released(const std::vector<std::pair<size_t, LazyBuffer*>>& after) {
  std::vector<uint32_t> end(nodes.size() + 1, 0); // counts, then each node's begin
  for (const auto& a : after) ++end[a.first + 1];
  for (size_t p = 0; p < nodes.size(); ++p) {
    end[p + 1] += end[p];
    nodes[p].release_begin = nodes[p].release_end = end[p];
  }
  released.assign(after.size(), nullptr);
  for (const auto& a : after) released[nodes[a.first].release_end++] = a.second;
}

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

namespace {

const char* bind_name(Bind b) {
  switch (b) {
    case Bind::kWhole:
      return "whole";
    case Bind::kLocal:
      return "rows";
    case Bind::kNarrow:
      return "rows of full";
    case Bind::kPartial:
      return "partial";
    case Bind::kDiscard:
      return "dropped";
  }
  return "?";
}

std::string node_line(const PlannedNode& pn) {
  std::ostringstream os;
  const Node& n = *pn.node;
  os << "#" << n.seq << " " << pn.op.operator_name().name;
  if (!pn.op.operator_name().overload_name.empty()) os << "." << pn.op.operator_name().overload_name;
  os << "(";
  for (size_t i = 0; i < n.uses.size(); ++i) {
    os << (i ? ", " : "") << "b" << n.uses[i].ref.buf->id << (n.uses[i].write ? "!" : "");
    if (!pn.uses.empty() && pn.uses[i].bind != Bind::kWhole) os << ":" << bind_name(pn.uses[i].bind);
  }
  os << ")";
  if (!n.defs.empty()) {
    os << " -> ";
    for (size_t j = 0; j < n.defs.size(); ++j) {
      os << (j ? ", " : "") << "b" << n.defs[j].ref.buf->id;
      if (!pn.defs.empty() && pn.defs[j].bind != Bind::kWhole) os << ":" << bind_name(pn.defs[j].bind);
    }
  }
  if (pn.recompute) os << " [recomputed]";
  if (pn.rng_block) os << " [random, rows keyed in blocks of " << pn.rng_block << "]";
  if (!pn.rewrites.empty()) os << " [" << pn.rewrites.size() << " args per chunk]";
  if (pn.op != n.op) os << " [runs as " << pn.op.operator_name().name << "]";
  return os.str();
}

} // namespace

void note_split(Plan& plan, const Analysis& a) {
  std::ostringstream os;
  int64_t loops = 0, chunks = 0;
  std::vector<std::pair<int32_t, int64_t>> batches; // (batch, rows) in order of first loop
  for (const Stage& st : plan.stages) {
    if (!st.loop) continue;
    ++loops;
    chunks = std::max<int64_t>(chunks, st.chunks());
    bool seen = false;
    for (const auto& b : batches) seen = seen || b.first == st.batch_id;
    if (!seen) batches.emplace_back(st.batch_id, st.batch);
  }
  if (batches.size() <= 1) {
    os << "split along a batch of " << (batches.empty() ? a.batch : batches[0].second) << " rows: ";
  } else {
    os << "split along " << batches.size() << " batches (";
    for (size_t k = 0; k < batches.size(); ++k) {
      os << (k ? ", " : "") << "batch " << batches[k].first << ": " << batches[k].second << " rows";
    }
    os << "), each in its own loops: ";
  }
  os << loops << (loops == 1 ? " pass" : " passes") << ", up to " << chunks << " chunks";
  plan.notes.insert(plan.notes.begin(), os.str());
  plan.notes.insert(plan.notes.begin() + 1, a.source_notes.begin(), a.source_notes.end());
  for (int32_t i : a.order) {
    const NodeInfo& ni = a.nodes[i];
    if (!ni.barrier) continue;
    plan.notes.push_back("barrier: " + ni.node->describe() + " runs whole: " + (ni.rr.why ? ni.rr.why : "no rule"));
  }
  if (!plan.retained.empty()) {
    plan.notes.push_back(std::to_string(plan.retained.size()) +
                         " nodes stay pending: batch-sharded values that survive are recomputed chunk by chunk "
                         "when needed, not stored");
  }
  for (const Stage& st : plan.stages) {
    for (const FullStore& f : st.stores) {
      if (f.host) plan.notes.push_back("b" + std::to_string(f.buf->id) + " (" + format_bytes(f.buf->nbytes.load()) +
                                       ") is assembled in host memory: it does not fit the device budget");
    }
  }
  std::vector<const LazyBuffer*> recomputed;
  int64_t recomputed_bytes = 0;
  size_t again = 0;
  for (const Stage& st : plan.stages) {
    for (const PlannedNode& pn : st.nodes) again += pn.recompute;
    for (const LazyBuffer* b : st.recomputed) {
      if (std::find(recomputed.begin(), recomputed.end(), b) != recomputed.end()) continue;
      recomputed.push_back(b);
      recomputed_bytes += static_cast<int64_t>(b->nbytes.load());
    }
  }
  if (!recomputed.empty()) {
    plan.notes.push_back(std::to_string(recomputed.size()) + " values crossing passes (" + format_bytes(recomputed_bytes) +
                         ") are recomputed chunk by chunk in the passes that read them (" + std::to_string(again) +
                         " node runs) instead of stored");
  }
  plan.barriers = a.barriers;
  plan.batch = a.batch;
}

std::string Plan::to_string(bool nodes) const {
  std::ostringstream os;
  os << (split ? "split" : "unsplit") << " plan: " << executed_nodes << " nodes run, " << eliminated
     << " eliminated";
  if (!retained.empty()) os << ", " << retained.size() << " kept pending";
  os << "; predicted peak " << format_bytes(predicted_peak);
  if (budget >= 0) os << " of a " << format_bytes(budget) << " budget";
  if (reused) os << " (reused: the program has the structure of an earlier one)";
  os << "\n";
  for (const std::string& n : notes) os << "  " << n << "\n";
  if (!facts.empty()) {
    int64_t bytes = 0;
    for (const BatchFact& f : facts) bytes += static_cast<int64_t>(f.buf->nbytes.load());
    os << "  " << facts.size() << (facts.size() == 1 ? " value keeps its" : " values keep their") << " batch for later plans ("
       << format_bytes(bytes) << "), read chunk by chunk\n";
  }
  for (size_t i = 0; i < stages.size(); ++i) {
    const Stage& st = stages[i];
    if (!st.loop) {
      os << "  stage " << i << ": " << st.nodes.size() << " nodes run once\n";
    } else {
      os << "  stage " << i << ": pass over " << st.batch << " rows";
      if (st.batch_id != 0) os << " of batch " << st.batch_id;
      os << " in " << st.chunks() << " chunks of " << st.chunk
         << ", " << st.nodes.size() << " nodes\n";
      // Chunk-local values: every one with `nodes`, else the largest and a total.
      std::vector<const Slot*> local, partial;
      int64_t per_chunk = 0;
      for (const Slot& sl : st.slots) {
        if (sl.store == Store::kLocal) {
          local.push_back(&sl);
          per_chunk += sl.layout.bytes(st.chunk);
        } else {
          if (sl.acc >= 0) partial.push_back(&sl); // (partials never finished stay chunk-local)
        }
      }
      std::sort(local.begin(), local.end(), [&](const Slot* a, const Slot* b) {
        return a->layout.bytes(st.chunk) > b->layout.bytes(st.chunk);
      });
      const size_t show = nodes ? local.size() : std::min<size_t>(local.size(), 3);
      if (!local.empty()) {
        os << "    " << local.size() << " batch-sharded values chunk-local, " << format_bytes(per_chunk)
           << " per chunk if all were live; largest:";
        for (size_t k = 0; k < show; ++k) {
          os << (k ? "," : "") << " b" << local[k]->buf->id << " " << format_bytes(local[k]->layout.bytes(st.chunk));
        }
        os << "\n";
      }
      int64_t acc_bytes = 0;
      for (const Slot* sl : partial) acc_bytes += sl->bytes;
      if (!partial.empty()) {
        os << "    " << partial.size() << " partials accumulated (" << format_bytes(acc_bytes) << ")";
        os << (nodes ? ":" : "") << "\n";
      }
      for (const Slot* sl : partial) {
        const Accumulator& a = st.accs[sl->acc];
        const bool finished = a.finalize != Finalize::kNone;
        if (!nodes && !finished) continue; // plain sums are listed at debug level 2
        os << "      b" << sl->buf->id << " P(" << reduce_name(a.reduce) << ") " << format_bytes(sl->bytes);
        if (a.finalize == Finalize::kDivConst) os << ", then divided by " << a.divisor;
        if (a.finalize == Finalize::kDivOutput) os << ", then divided by b" << a.divide_by->id;
        os << "\n";
      }
      for (const FullStore& f : st.stores) {
        os << "    b" << f.buf->id << " batch-sharded, assembled whole in " << (f.host ? "host memory" : "device memory")
           << ": " << format_bytes(static_cast<int64_t>(f.buf->nbytes.load())) << "\n";
      }
      if (!st.recomputed.empty()) {
        size_t again = 0;
        for (const PlannedNode& pn : st.nodes) again += pn.recompute;
        os << "    recomputed chunk by chunk from an earlier pass (" << again << (again == 1 ? " node" : " nodes")
           << " run again), not stored:";
        for (const LazyBuffer* b : st.recomputed) os << " b" << b->id << " " << format_bytes(static_cast<int64_t>(b->nbytes.load()));
        os << "\n";
      }
    }
    if (nodes) {
      for (const PlannedNode& pn : st.nodes) os << "      " << node_line(pn) << "\n";
    }
  }
  return os.str();
}

} // namespace lazymem
