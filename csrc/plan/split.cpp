// plan: building the split plan (see split.h): what runs now, what stays pending, where each
// batch-sharded value lives, and the loop that sizes the chunks (emission in plan/split_emit.cpp).
#include "plan/split.h"

#include <algorithm>
#include <optional>
#include <sstream>
#include <unordered_map>
#include <unordered_set>

#include "core/config.h"
#include "plan/probe.h"
#include "plan/split_builder.h"
#include "plan/timing.h"
#include "plan/workspace.h"

namespace lazymem {

bool SplitBuilder::build() {
  std::vector<LazyBuffer*> live;
  for (size_t b = 0; b < s_.index.size(); ++b) {
    if (s_.live[b]) live.push_back(s_.index.buffers[b]);
  }
  if (!place_batch(a_, in_.nodes, s_.run, live, in_.needed)) return refuse();
  index_producers();
  decide_pending();
  // Stages over what runs now.
  std::vector<int32_t> all = a_.order;
  a_.order.clear();
  for (int32_t i : all) {
    if (exec_[i]) a_.order.push_back(i);
  }
  stages_ = assign_stages(a_);
  if (stages_ < 0) return refuse();
  decide_storage();
  if (in_.recompute == PlanInput::Recompute::kAlways) {
    for (size_t b = 0; b < a_.bufs.size(); ++b) {
      if (recompute_candidate(static_cast<int32_t>(b))) try_recompute(static_cast<int32_t>(b));
    }
  }
  // Emit, then size the loops; a stored value that does not fit is recomputed (the plan emitted
  // again) or moved to host memory; a recomputation emission found impossible is stored instead.
  for (;;) {
    emit();
    if (!blamed_.empty()) {
      for (int32_t b : blamed_) {
        if (refused_[b]) continue; // blamed by another reader too
        if (!recompute_[b]) {
          a_.notes.push_back("recomputing b" + std::to_string(a_.bufs[b].buf->id) + " chunk by chunk would read a "
                             "value another node of the same pass has overwritten");
          return refuse();
        }
        recompute_[b] = 0;
        refused_[b] = 1;
      }
      blamed_.clear();
      update_full();
      if (!recomputations_valid()) { // (another's recomputation went through a value now stored)
        for (size_t b = 0; b < recompute_.size(); ++b) refused_[b] = refused_[b] || recompute_[b];
        recompute_.assign(recompute_.size(), 0);
        update_full();
      }
      reset_emission();
      continue;
    }
    const ChunkChoice c = choose_chunks(plan_, in_.budget, in_.force_chunks, a_.notes,
                                        [&](const FullStore& f) { return relieve(f); });
    if (c == ChunkChoice::kFits) {
      if (try_host_store()) {
        reset_emission();
        continue;
      }
      if (!price_recompute()) break;
      reset_emission();
      continue;
    }
    if (c == ChunkChoice::kNoFit && host_trial_ == HostTrial::kTrying) {
      try_host_store(/*fits=*/false); // undone: sized again as it was
      reset_emission();
      continue;
    }
    if (c == ChunkChoice::kNoFit && prefer_host_) {
      // Held in host memory they do not fit after all (their rows' device copies): recomputed.
      prefer_host_ = false;
      recompute_ = saved_recompute_;
      refused_ = saved_refused_;
      host_ = saved_host_;
      price_note_ += "; held in host memory they do not fit the budget: recomputed";
      update_full();
      reset_emission();
      continue;
    }
    if (c == ChunkChoice::kNoFit) return refuse();
    reset_emission();
  }
  note_split(plan_, a_);
  if (!price_note_.empty()) plan_.notes.push_back(price_note_);
  if (!host_note_.empty()) {
    // (Held there to save chunks, not because it does not fit: the note says which.)
    const std::string prefix = host_note_.substr(0, host_note_.find(')') + 1);
    plan_.notes.erase(std::remove_if(plan_.notes.begin(), plan_.notes.end(), [&](const std::string& n) {
                        return n.rfind(prefix, 0) == 0 && n.find("does not fit the device budget") != std::string::npos;
                      }),
                      plan_.notes.end());
    plan_.notes.push_back(host_note_);
  }
  return true;
}

bool SplitBuilder::refuse() {
  for (const std::string& n : a_.notes) plan_.notes.push_back("not split: " + n);
  plan_.notes.insert(plan_.notes.end(), a_.source_notes.begin(), a_.source_notes.end());
  return false;
}

void SplitBuilder::index_producers() {
  final_.assign(a_.bufs.size(), 0);
  for (int32_t i : a_.order) {
    const NodeInfo& ni = a_.nodes[i];
    const Node& n = *ni.node;
    for (size_t j = 0; j < n.defs.size(); ++j) {
      if (ni.discard[j]) continue;
      producer_[vkey(ni.def_buf[j], n.defs[j].ref.version)] = i;
      final_[ni.def_buf[j]] = std::max(final_[ni.def_buf[j]], n.defs[j].ref.version);
    }
    for (size_t k = 0; k < n.uses.size(); ++k) {
      if (!n.uses[k].write) continue;
      producer_[vkey(ni.use_buf[k], n.uses[k].write_version)] = i;
      final_[ni.use_buf[k]] = std::max(final_[ni.use_buf[k]], n.uses[k].write_version);
    }
  }
}

void SplitBuilder::decide_pending() {
  const size_t nb = a_.bufs.size(), nn = a_.nodes.size();
  std::vector<char> cand(nb, 0);
  if (in_.keep_pending) {
    for (size_t b = 0; b < nb; ++b) {
      const BufInfo& bi = a_.bufs[b];
      if (!bi.place.is_s() || !bi.live || bi.needed || bi.resident || final_[b] == 0) continue;
      int32_t p = producer(static_cast<int32_t>(b), final_[b]);
      // (An upload is read again from its host snapshot, however often it is kept pending.)
      if (p >= 0 && a_.nodes[p].loop && (!a_.nodes[p].node->kept || is_upload(p))) cand[b] = 1;
    }
  }
  for (int round = 0; round < 64; ++round) {
    // The nodes that recompute kept values: back from each value through row-by-row inputs.
    retain_.assign(nn, 0);
    std::vector<int32_t> work;
    for (size_t b = 0; b < nb; ++b) {
      if (!cand[b]) continue;
      int32_t p = producer(static_cast<int32_t>(b), final_[b]);
      if (p >= 0 && !retain_[p]) {
        retain_[p] = 1;
        work.push_back(p);
      }
    }
    std::vector<uint64_t> pins; // versions kept nodes read whole: they must survive the plan
    while (!work.empty()) {
      int32_t x = work.back();
      work.pop_back();
      const NodeInfo& ni = a_.nodes[x];
      for (size_t k = 0; k < ni.node->uses.size(); ++k) {
        const Use& u = ni.node->uses[k];
        if (u.full_overwrite()) continue;
        int32_t q = producer(ni.use_buf[k], u.ref.version);
        const Mode m = ni.rr.ins[k].mode;
        // (A value an earlier plan kept pending already is computed now and stored: not again.)
        if (q >= 0 && a_.nodes[q].loop && m != Mode::kWhole && (!a_.nodes[q].node->kept || is_upload(q))) {
          if (!retain_[q]) {
            retain_[q] = 1;
            work.push_back(q);
          }
        } else {
          pins.push_back(vkey(ni.use_buf[k], u.ref.version));
        }
      }
    }
    // Run now: what the sync point needs, every other surviving value, and the pinned inputs.
    dce(cand, pins);
    // A kept node is invalid if a pinned input of its cone is overwritten by what runs now, or it
    // writes a buffer that a node running now writes later.
    std::unordered_set<uint64_t> bad_pins;
    for (uint64_t k : pins) {
      int32_t buf = static_cast<int32_t>(k >> 32);
      uint32_t ver = static_cast<uint32_t>(k);
      if (exec_final_[buf] > ver) bad_pins.insert(k);
    }
    std::vector<char> tainted(nn, 0);
    for (int32_t x : a_.order) {
      if (!retain_[x]) continue;
      const NodeInfo& ni = a_.nodes[x];
      bool t = false;
      for (size_t k = 0; k < ni.node->uses.size() && !t; ++k) {
        const Use& u = ni.node->uses[k];
        if (u.full_overwrite()) continue;
        int32_t q = producer(ni.use_buf[k], u.ref.version);
        if (q >= 0 && retain_[q] && ni.rr.ins[k].mode != Mode::kWhole && a_.nodes[q].loop &&
            (!a_.nodes[q].node->kept || is_upload(q))) {
          t = tainted[q];
        } else {
          t = bad_pins.count(vkey(ni.use_buf[k], u.ref.version)) > 0;
        }
      }
      for (size_t k = 0; k < ni.node->uses.size() && !t; ++k) {
        if (ni.node->uses[k].write && exec_final_[ni.use_buf[k]] > ni.node->uses[k].write_version) t = true;
      }
      for (size_t j = 0; j < ni.node->defs.size() && !t; ++j) {
        if (exec_final_[ni.def_buf[j]] > ni.node->defs[j].ref.version) t = true;
      }
      if (x >= static_cast<int32_t>(in_.nodes.size())) t = true; // synthesized: never put back
      tainted[x] = t;
    }
    bool changed = false;
    for (size_t b = 0; b < nb; ++b) {
      if (cand[b] && tainted[producer(static_cast<int32_t>(b), final_[b])]) {
        cand[b] = 0;
        changed = true;
      }
    }
    if (!changed) {
      pins_.assign(pins.begin(), pins.end());
      break;
    }
  }
  kept_.assign(nb, 0);
  for (size_t b = 0; b < nb; ++b) kept_[b] = cand[b];
  for (int32_t i : a_.order) {
    if (retain_[i] && i < static_cast<int32_t>(in_.nodes.size())) plan_.retained.push_back(i);
  }
  pinned_.assign(nb, 0);
  for (uint64_t k : pins_) pinned_[static_cast<int32_t>(k >> 32)] = 1;
}

void SplitBuilder::dce(const std::vector<char>& kept, const std::vector<uint64_t>& pins) {
  const size_t nn = a_.nodes.size();
  std::unordered_set<uint64_t> need(pins.begin(), pins.end());
  for (size_t b = 0; b < a_.bufs.size(); ++b) {
    const BufInfo& bi = a_.bufs[b];
    if (((bi.live && !kept[b]) || bi.needed) && final_[b] > 0) need.insert(vkey(static_cast<int32_t>(b), final_[b]));
  }
  exec_.assign(nn, 0);
  for (auto it = a_.order.rbegin(); it != a_.order.rend(); ++it) {
    const int32_t x = *it;
    const NodeInfo& ni = a_.nodes[x];
    const Node& n = *ni.node;
    bool runs = n.effectful || (n.random && !ni.loop);
    for (size_t j = 0; j < n.defs.size() && !runs; ++j) {
      runs = !ni.discard[j] && need.count(vkey(ni.def_buf[j], n.defs[j].ref.version));
    }
    for (size_t k = 0; k < n.uses.size() && !runs; ++k) {
      runs = n.uses[k].write && need.count(vkey(ni.use_buf[k], n.uses[k].write_version));
    }
    if (!runs) continue;
    exec_[x] = 1;
    for (size_t k = 0; k < n.uses.size(); ++k) {
      if (!n.uses[k].full_overwrite()) need.insert(vkey(ni.use_buf[k], n.uses[k].ref.version));
    }
    for (const Finalize& f : ni.rr.finalize) {
      if (f.kind == Finalize::kDivOutput) need.insert(vkey(ni.def_buf[f.output], n.defs[f.output].ref.version));
    }
  }
  exec_final_.assign(a_.bufs.size(), 0);
  for (int32_t x : a_.order) {
    if (!exec_[x]) continue;
    const NodeInfo& ni = a_.nodes[x];
    for (size_t j = 0; j < ni.node->defs.size(); ++j) {
      if (!ni.discard[j]) exec_final_[ni.def_buf[j]] = std::max(exec_final_[ni.def_buf[j]], ni.node->defs[j].ref.version);
    }
    for (size_t k = 0; k < ni.node->uses.size(); ++k) {
      if (ni.node->uses[k].write) {
        exec_final_[ni.use_buf[k]] = std::max(exec_final_[ni.use_buf[k]], ni.node->uses[k].write_version);
      }
    }
  }
}

void SplitBuilder::decide_storage() {
  const size_t nb = a_.bufs.size();
  other_.assign(nb, 0);
  cross_.assign(nb, 0);
  recompute_.assign(nb, 0);
  refused_.assign(nb, 0);
  host_.assign(nb, 0);
  std::vector<int32_t> stage_of(nb, -1);
  auto touch = [&](int32_t b, int32_t stage, bool whole, bool uploaded) {
    if (!a_.bufs[b].place.is_s()) return;
    if (whole) other_[b] = 1;
    if (uploaded) return;
    if (stage_of[b] >= 0 && stage_of[b] != stage) cross_[b] = 1;
    stage_of[b] = stage;
  };
  writes_.assign(nb, {});
  for (int32_t i : a_.order) {
    const NodeInfo& ni = a_.nodes[i];
    const Node& n = *ni.node;
    for (size_t k = 0; k < n.uses.size(); ++k) {
      if (n.uses[k].write) writes_[ni.use_buf[k]].emplace_back(ni.stage, n.uses[k].write_version);
    }
    for (size_t j = 0; j < n.defs.size(); ++j) {
      if (!ni.discard[j]) writes_[ni.def_buf[j]].emplace_back(ni.stage, n.defs[j].ref.version);
    }
    if (is_upload(i) && ni.loop) continue; // (an upload run whole, a barrier, stores its value)
    for (size_t k = 0; k < n.uses.size(); ++k) {
      // Rows of an upload read again in each loop are not a crossing value; written in place they are.
      const int32_t p = n.uses[k].full_overwrite() ? -1 : producer(ni.use_buf[k], n.uses[k].ref.version);
      touch(ni.use_buf[k], ni.stage, !ni.loop || ni.rr.ins[k].mode == Mode::kWhole,
            p >= 0 && is_upload(p) && !n.uses[k].write);
    }
    for (size_t j = 0; j < n.defs.size(); ++j) {
      if (!ni.discard[j]) touch(ni.def_buf[j], ni.stage, !ni.loop, false);
    }
  }
  for (size_t b = 0; b < nb; ++b) {
    const BufInfo& bi = a_.bufs[b];
    if (!bi.place.is_s()) continue;
    if (bi.resident || bi.needed || (bi.live && !kept_[b]) || pinned_[b]) other_[b] = 1;
  }
  update_full();
}

void SplitBuilder::update_full() {
  full_.assign(a_.bufs.size(), 0);
  for (size_t b = 0; b < a_.bufs.size(); ++b) {
    full_[b] = a_.bufs[b].place.is_s() && (other_[b] || (cross_[b] && !recompute_[b]));
  }
}

bool SplitBuilder::overwritten(int32_t b, uint32_t version, int32_t s) const {
  for (auto [stage, v] : writes_[b]) {
    if (stage <= s && v > version) return true;
  }
  return false;
}

bool SplitBuilder::walk(int32_t b, uint32_t version, int32_t s, std::unordered_set<int32_t>& cone) const {
  const int32_t p = producer(b, version);
  if (p < 0 || !exec_[p]) return false;
  if (cone.count(p)) return true;
  const NodeInfo& ni = a_.nodes[p];
  const Node& n = *ni.node;
  // (A random loop node draws keyed by batch rows from a seed drawn once, the first time it runs:
  // run again for a chunk's rows, it draws the same numbers, whatever the chunking.)
  if (!ni.loop || ni.stage >= s || n.effectful || ni.barrier) return false;
  cone.insert(p);
  if (cone.size() > kMaxCone) return false;
  for (size_t j = 0; j < n.defs.size(); ++j) {
    if (!ni.discard[j] && !ni.rr.outs[j].is_s() && !ni.rr.outs[j].is_p()) return false; // a whole result
  }
  for (size_t k = 0; k < n.uses.size(); ++k) {
    const Use& u = n.uses[k];
    const Mode m = ni.rr.ins[k].mode;
    if (m == Mode::kPartial) return false;
    const bool rows = m == Mode::kRows && local(ni.use_buf[k]);
    if (u.write && !rows) return false;
    if (u.full_overwrite()) continue;
    if (rows ? !walk(ni.use_buf[k], u.ref.version, s, cone) : overwritten(ni.use_buf[k], u.ref.version, s)) {
      return false;
    }
  }
  return true;
}

bool SplitBuilder::recomputations_valid() const {
  for (int32_t i : a_.order) {
    const NodeInfo& ni = a_.nodes[i];
    if (!ni.loop) continue;
    for (size_t k = 0; k < ni.node->uses.size(); ++k) {
      const int32_t b = ni.use_buf[k];
      const Use& u = ni.node->uses[k];
      if (!recompute_[b] || u.full_overwrite()) continue;
      const int32_t p = producer(b, u.ref.version);
      if (p >= 0 && a_.nodes[p].stage == ni.stage) continue;
      std::unordered_set<int32_t> cone;
      if (!walk(b, u.ref.version, ni.stage, cone)) return false;
    }
  }
  return true;
}

bool SplitBuilder::try_recompute(int32_t b) {
  recompute_[b] = 1;
  update_full();
  if (recomputations_valid()) return true;
  recompute_[b] = 0;
  refused_[b] = 1;
  update_full();
  return false;
}

bool SplitBuilder::price_recompute() {
  if (in_.recompute != PlanInput::Recompute::kPriced || priced_) return false;
  priced_ = true;
  // What recomputing costs: each node run again, for every row of its loop, at its measured time.
  double recompute_s = 0;
  bool known = true;
  int64_t nodes = 0;
  for (const Stage& st : plan_.stages) {
    if (!st.loop) continue;
    for (const PlannedNode& pn : st.nodes) {
      if (!pn.recompute) continue;
      ++nodes;
      const std::optional<double> ns = node_ns_per_row(node_time_key(pn));
      if (!ns) {
        known = false;
        break;
      }
      recompute_s += *ns * 1e-9 * static_cast<double>(st.batch);
    }
  }
  if (nodes == 0) return false;
  if (!known) {
    plan_.unpriced = true;
    return false;
  }
  // What holding them in host memory costs: written out once, read back by every pass that reads them.
  double host_s = 0;
  int64_t bytes = 0;
  std::vector<std::pair<const LazyBuffer*, int64_t>> reads;
  for (const Stage& st : plan_.stages) {
    for (const LazyBuffer* b : st.recomputed) {
      auto it = std::find_if(reads.begin(), reads.end(), [&](const auto& r) { return r.first == b; });
      if (it == reads.end()) {
        reads.emplace_back(b, 1);
      } else {
        ++it->second;
      }
    }
  }
  for (const auto& [b, n] : reads) {
    const int64_t nb = static_cast<int64_t>(b->nbytes.load());
    host_s += predicted_copy_seconds(nb) * static_cast<double>(1 + n);
    bytes += nb * (1 + n);
  }
  const bool host = host_s < recompute_s;
  std::ostringstream os;
  os.precision(3);
  os << (host ? "holding " : "recomputing ") << reads.size() << (reads.size() == 1 ? " value" : " values")
     << " crossing passes " << (host ? "in host memory" : "chunk by chunk") << ": recomputing runs " << nodes
     << " nodes again (" << format_seconds(recompute_s) << " measured), host memory copies "
     << format_bytes(bytes) << " (" << format_seconds(host_s) << " predicted)";
  price_note_ = os.str();
  if (!host) return false;
  saved_recompute_ = recompute_;
  saved_refused_ = refused_;
  saved_host_ = host_;
  prefer_host_ = true;
  for (size_t b = 0; b < recompute_.size(); ++b) {
    if (recompute_[b]) {
      recompute_[b] = 0;
      refused_[b] = 1;
    }
  }
  update_full();
  return true;
}

bool SplitBuilder::try_host_store(bool fits) {
  const int64_t node_ns = in_.force_chunks > 0 ? 0 : in_.chunk_node_ns;
  if (node_ns <= 0 || in_.budget < 0 || host_trial_ == HostTrial::kDone) return false;
  if (host_trial_ == HostTrial::kTrying) {
    host_trial_ = HostTrial::kDone;
    const double saved = trial_before_ - chunk_overhead_seconds(plan_, node_ns);
    if (!fits || !plan_.split || plan_.last_resort || saved - trial_copies_ < 0.2 * trial_before_) {
      host_ = host_before_trial_; // not worth it: as it was
      return true;
    }
    std::ostringstream os;
    os << trial_name_ << " held in host memory rather than on the device: " << format_seconds(trial_copies_)
       << " of copies against " << format_seconds(saved) << " of per-chunk kernel costs saved (fewer chunks)";
    host_note_ = os.str();
    return false;
  }
  host_trial_ = HostTrial::kDone; // one trial per plan
  double copies = 0;
  const FullStore* f = largest_device_store(plan_, &copies);
  const double before = chunk_overhead_seconds(plan_, node_ns);
  if (!f || copies >= 0.8 * before) return false; // no chunk count makes up for it
  host_before_trial_ = host_;
  host_[a_.index.at(f->buf)] = 1;
  trial_before_ = before;
  trial_copies_ = copies;
  trial_name_ = "b" + std::to_string(f->buf->id) + " (" + format_bytes(f->buf->nbytes.load()) + ")";
  host_trial_ = HostTrial::kTrying;
  return true;
}

Relief SplitBuilder::relieve(const FullStore& f) {
  const int32_t b = a_.index.at(f.buf);
  if (in_.recompute != PlanInput::Recompute::kNever && !prefer_host_ && recompute_candidate(b) && try_recompute(b)) {
    return Relief::kRecompute;
  }
  host_[b] = 1;
  return Relief::kHost;
}

void SplitBuilder::reset_emission() {
  plan_.stages.clear();
  plan_.expansions.clear();
  plan_.release_unused.clear();
  plan_.split = false;
  unnarrowable_.clear();
}

std::unordered_map<const Node*, std::string> SplitBuilder::unsafe() {
  std::unordered_map<const Node*, std::string> bad;
  for (const Node* n : unnarrowable_) {
    bad.emplace(n, "it would write a chunk's rows of a stored time-major flatten in place, which no view gives");
  }
  for (auto& [node, why] : probe_plan(plan_, [&](const LazyBuffer* b) { return a_.index.at(b); })) {
    bad.emplace(node, std::move(why));
  }
  return bad;
}

bool make_split_plan(const PlanInput& in, const Schedule& s, Plan& plan) {
  std::unordered_map<const Node*, std::string> forced;
  std::unordered_set<const Node*> finished;
  const std::vector<std::string> notes = plan.notes;
  for (int attempt = 0, crossings = 0; attempt < 4; ++attempt) {
    plan = Plan{};
    plan.budget = in.budget;
    plan.resident = in.resident;
    plan.notes = notes;
    SplitBuilder b(in, s, plan, forced, finished);
    if (!b.build()) {
      // A partial read past its loop: that reader takes it finished, and the plan is made again
      // (a few rounds: each finishes more readers; they do not count as attempts).
      size_t before = finished.size();
      finished.insert(b.crossing().begin(), b.crossing().end());
      if (finished.size() == before || ++crossings > 8) return false;
      --attempt;
      continue;
    }
    auto bad = b.unsafe();
    if (bad.empty()) {
      plan.owned = b.take_owned();
      return true;
    }
    forced.insert(bad.begin(), bad.end());
  }
  plan.notes.push_back("not split: meta probes on the chunks' shapes kept disagreeing with the placement rules");
  return false;
}

} // namespace lazymem
