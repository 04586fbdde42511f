// plan: building the split plan (see split.h).
#include "plan/split.h"

#include <algorithm>
#include <functional>
#include <unordered_map>
#include <unordered_set>

#include "core/config.h"
#include "ops/op_rules.h"
#include "plan/analysis.h"
#include "plan/localize.h"
#include "plan/memory.h"
#include "plan/probe.h"

namespace lazymem {
namespace {

uint64_t vkey(int32_t buf, uint32_t version) {
  return (static_cast<uint64_t>(static_cast<uint32_t>(buf)) << 32) | version;
}

class SplitBuilder {
 public:
  SplitBuilder(const PlanInput& in, const Schedule& s, Plan& plan,
               const std::unordered_map<const Node*, std::string>& forced)
      : in_(in), s_(s), plan_(plan) {
    a_.forced_barriers = forced;
  }

  bool build() {
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
      if (c == ChunkChoice::kFits) break;
      if (c == ChunkChoice::kNoFit) return refuse();
      reset_emission();
    }
    note_split(plan_, a_);
    return true;
  }

 private:
  bool refuse() {
    for (const std::string& n : a_.notes) plan_.notes.push_back("not split: " + n);
    return false;
  }

  // Producers of every (buffer, version) among the running nodes, and each buffer's final version.
  void index_producers() {
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

  int32_t producer(int32_t buf, uint32_t version) const {
    auto it = producer_.find(vkey(buf, version));
    return it == producer_.end() ? -1 : it->second;
  }

  // Which batch-sharded values that survive the plan stay pending (recomputed when needed) rather
  // than stored, and which nodes run now.
  void decide_pending() {
    const size_t nb = a_.bufs.size(), nn = a_.nodes.size();
    std::vector<char> cand(nb, 0);
    if (in_.keep_pending) {
      for (size_t b = 0; b < nb; ++b) {
        const BufInfo& bi = a_.bufs[b];
        if (!bi.place.is_s() || !bi.live || bi.needed || bi.resident || final_[b] == 0) continue;
        int32_t p = producer(static_cast<int32_t>(b), final_[b]);
        if (p >= 0 && a_.nodes[p].loop) cand[b] = 1;
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
          if (q >= 0 && a_.nodes[q].loop && m != Mode::kWhole) {
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
          if (q >= 0 && retain_[q] && ni.rr.ins[k].mode != Mode::kWhole && a_.nodes[q].loop) {
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

  // Dead-code elimination for what runs now.
  void dce(const std::vector<char>& kept, const std::vector<uint64_t>& pins) {
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

  bool is_upload(int32_t i) const {
    return a_.nodes[i].node->upload;
  }

  // Full storage for batch-sharded values that must exist whole: results, values that survive the
  // plan and are not kept pending, values read or written whole (other_), and values that cross
  // stages (cross_) unless they are recomputed where they are read (uploads always are: each loop
  // that reads a leaf's rows uploads them again).
  void decide_storage() {
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
      if (is_upload(i)) continue;
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

  void update_full() {
    full_.assign(a_.bufs.size(), 0);
    for (size_t b = 0; b < a_.bufs.size(); ++b) {
      full_[b] = a_.bufs[b].place.is_s() && (other_[b] || (cross_[b] && !recompute_[b]));
    }
  }

  // ---- recomputation of values crossing stages ----

  // A buffer whose storage is only needed because loops after the one computing it read its rows.
  bool recompute_candidate(int32_t b) const {
    return cross_[b] && !other_[b] && !recompute_[b] && !refused_[b];
  }

  bool local(int32_t b) const {
    return a_.bufs[b].place.is_s() && !full_[b];
  }

  // Whether a node running before stage `s` ends writes a version of `b` after `version`.
  bool overwritten(int32_t b, uint32_t version, int32_t s) const {
    for (auto [stage, v] : writes_[b]) {
      if (stage <= s && v > version) return true;
    }
    return false;
  }

  // Whether the nodes computing `version` of `b` can run again for a chunk's rows in loop stage `s`,
  // collecting them in `cone`: each is a loop node of an earlier stage that draws no random numbers
  // and has no effect, writes nothing but chunk-local values (its whole or partial results are
  // dropped when it runs again) and reads either chunk-local values (computed again in turn) or
  // values still unchanged when `s` runs (weights, finished reductions, stored rows).
  static constexpr size_t kMaxCone = 128;
  bool walk(int32_t b, uint32_t version, int32_t s, std::unordered_set<int32_t>& cone) const {
    const int32_t p = producer(b, version);
    if (p < 0 || !exec_[p]) return false;
    if (cone.count(p)) return true;
    const NodeInfo& ni = a_.nodes[p];
    const Node& n = *ni.node;
    if (!ni.loop || ni.stage >= s || n.effectful || n.random || ni.barrier) return false;
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

  // Every recomputed value can be computed again in each loop that reads it.
  bool recomputations_valid() const {
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

  bool try_recompute(int32_t b) {
    recompute_[b] = 1;
    update_full();
    if (recomputations_valid()) return true;
    recompute_[b] = 0;
    refused_[b] = 1;
    update_full();
    return false;
  }

  // choose_chunks: the largest store on the device does not fit.
  Relief relieve(const FullStore& f) {
    const int32_t b = a_.index.at(f.buf);
    if (in_.recompute != PlanInput::Recompute::kNever && recompute_candidate(b) && try_recompute(b)) {
      return Relief::kRecompute;
    }
    host_[b] = 1;
    return Relief::kHost;
  }

  void reset_emission() {
    plan_.stages.clear();
    plan_.expansions.clear();
    plan_.release_unused.clear();
    plan_.split = false;
    unnarrowable_.clear();
  }

  // ---- emission ----

  struct LoopState {
    std::unordered_map<int32_t, int32_t> slot;   // buffer -> slot
    std::unordered_map<int32_t, size_t> last;    // slot -> index of its last access in the body
    std::unordered_map<int32_t, uint32_t> held;  // chunk-local buffer -> the version its slot holds
  };

  int32_t slot_of(Stage& st, LoopState& ls, int32_t b, Store store) {
    auto it = ls.slot.find(b);
    if (it != ls.slot.end()) return it->second;
    Slot sl;
    sl.buf = a_.bufs[b].buf;
    sl.store = store;
    if (store == Store::kLocal) {
      sl.layout = a_.bufs[b].layout;
    } else {
      sl.bytes = static_cast<int64_t>(sl.buf->nbytes.load());
    }
    st.slots.push_back(sl);
    int32_t s = static_cast<int32_t>(st.slots.size() - 1);
    ls.slot[b] = s;
    return s;
  }

  // Binding of node i's use k (or, with `def`, its def k) in a loop.
  Bound bind(Stage& st, LoopState& ls, int32_t i, size_t k, bool def) {
    const NodeInfo& ni = a_.nodes[i];
    const int32_t b = def ? ni.def_buf[k] : ni.use_buf[k];
    const BufInfo& bi = a_.bufs[b];
    Bound bd;
    if (def && ni.discard[k]) {
      bd.bind = Bind::kDiscard;
      return bd;
    }
    Mode mode;
    int8_t dim = -1;
    int64_t unit = 1, outer = 1;
    if (def) {
      const Place& p = ni.rr.outs[k];
      mode = p.is_s() ? Mode::kRows : (p.is_p() ? Mode::kPartial : Mode::kWhole);
      dim = p.dim;
      unit = p.unit;
      outer = p.outer;
    } else {
      const OperandMode& m = ni.rr.ins[k];
      mode = m.mode;
      dim = m.dim;
      unit = m.unit;
      outer = m.outer;
    }
    if (def && copying_ && (mode != Mode::kRows || !local(b))) {
      bd.bind = Bind::kDiscard; // run again for its chunk-local results only
      if (mode == Mode::kRows) {
        bd.dim = dim; // (rows of it, for the memory model and the workspace key)
        bd.unit = unit;
      }
      return bd;
    }
    if (mode == Mode::kWhole) return bd;
    bd.dim = dim;
    bd.unit = unit;
    if (mode == Mode::kPartial) {
      bd.bind = Bind::kPartial;
      bd.slot = slot_of(st, ls, b, Store::kPartial);
    } else if (bi.place.is_s() && !full_[b]) {
      bd.bind = Bind::kLocal;
      bd.slot = slot_of(st, ls, b, Store::kLocal);
    } else {
      bd.bind = Bind::kNarrow;
      bd.outer = outer;
      // A chunk's rows of a time-major flatten are no single view of the full value: gathered for a
      // read, scattered from a result; an in-place write or a rescaled result would need a view.
      const bool rescaled = def ? (ni.rr.post_div.size() > k && ni.rr.post_div[k] != 0) : false;
      if (outer != 1 && ((!def && ni.node->uses[k].write) || rescaled || ni.node->random)) {
        unnarrowable_.insert(ni.node);
      }
    }
    return bd;
  }

  // G rows per random-number block: enough elements per kernel call to amortize it, a power of two
  // up to 64; one row when the op also reads batch-sharded inputs (a block cannot be drawn apart).
  uint32_t rng_block(const NodeInfo& ni) const {
    if (ni.node->row_keyed) return ni.node->row_keyed->block;
    int64_t row = 0;
    bool reads_rows = false;
    for (size_t k = 0; k < ni.ops.size(); ++k) {
      const OperandMode& m = ni.rr.ins[k];
      if (m.mode != Mode::kRows) continue;
      if (!ni.ops[k].write) reads_rows = true;
      int64_t numel = 1;
      for (int64_t sz : ni.ops[k].sizes) numel *= sz;
      row = std::max(row, numel / std::max<int64_t>(a_.batch, 1));
    }
    for (size_t j = 0; j < ni.node->defs.size(); ++j) {
      if (!ni.rr.outs[j].is_s()) continue;
      reads_rows = true; // a functional random op reads its inputs' rows
      row = std::max(row, ni.node->defs[j].ref.meta.numel() / std::max<int64_t>(a_.batch, 1));
    }
    if (reads_rows || row <= 0) return 1;
    uint32_t g = 1;
    while (g < 64 && static_cast<int64_t>(g) * row < 65536) g *= 2;
    return g;
  }

  PlannedNode planned_loop_node(Stage& st, LoopState& ls, int32_t i, size_t body_index, bool copy) {
    const NodeInfo& ni = a_.nodes[i];
    const Node& n = *ni.node;
    PlannedNode pn(ni.node, i < static_cast<int32_t>(in_.nodes.size()) ? i : -1);
    pn.recompute = copy && !is_upload(i);
    copying_ = copy;
    if (ni.rr.replace_op) {
      std::string full(ni.rr.replace_op);
      auto dot = full.find('.');
      std::string name = full.substr(0, dot), overload = dot == std::string::npos ? "" : full.substr(dot + 1);
      pn.op = c10::Dispatcher::singleton().findSchemaOrThrow(name.c_str(), overload.c_str());
    }
    for (size_t k = 0; k < n.uses.size(); ++k) {
      pn.uses.push_back(bind(st, ls, i, k, false));
      if (pn.uses.back().slot >= 0) ls.last[pn.uses.back().slot] = body_index;
    }
    for (size_t j = 0; j < n.defs.size(); ++j) {
      pn.defs.push_back(bind(st, ls, i, j, true));
      if (pn.defs.back().slot >= 0) ls.last[pn.defs.back().slot] = body_index;
    }
    for (size_t k = n.uses.size(); k < ni.ops.size(); ++k) {
      const OperandMode& m = ni.rr.ins[k];
      if (m.mode == Mode::kRows) pn.consts.push_back(ConstNarrow{ni.ops[k].arg, ni.ops[k].elem, m.dim, m.unit});
    }
    pn.rewrites.assign(ni.rr.rewrites.begin(), ni.rr.rewrites.end());
    pn.post_div.assign(ni.rr.post_div.begin(), ni.rr.post_div.end());
    pn.post_div_written = ni.rr.post_div_written;
    pn.placeholder_outputs = op_rules(n.op).placeholder_outputs;
    if (n.random && !ni.rr.no_draws) pn.rng_block = rng_block(ni);
    copying_ = false;
    return pn;
  }

  void emit() {
    plan_.split = true;
    std::vector<std::vector<int32_t>> by_stage(std::max(stages_, 1));
    for (int32_t i : a_.order) by_stage[a_.nodes[i].stage].push_back(i);
    // Last access of every buffer with storage, as (stage, node) in the flattened plan.
    std::unordered_map<int32_t, std::pair<size_t, size_t>> last;
    std::vector<char> real(a_.bufs.size(), 0);
    for (size_t b = 0; b < a_.bufs.size(); ++b) real[b] = a_.bufs[b].resident;
    for (size_t s = 0; s < by_stage.size(); ++s) {
      if (by_stage[s].empty()) continue;
      Stage st;
      st.loop = s % 2 == 1;
      const size_t si = plan_.stages.size();
      if (!st.loop) {
        for (int32_t i : by_stage[s]) {
          const NodeInfo& ni = a_.nodes[i];
          PlannedNode pn(ni.node, i < static_cast<int32_t>(in_.nodes.size()) ? i : -1);
          pn.placeholder_outputs = op_rules(ni.node->op).placeholder_outputs;
          for (int32_t b : ni.use_buf) last[b] = {si, st.nodes.size()};
          for (size_t j = 0; j < ni.def_buf.size(); ++j) {
            if (!ni.discard[j]) last[ni.def_buf[j]] = {si, st.nodes.size()};
          }
          for (int32_t b : ni.use_buf) real[b] = 1;
          for (int32_t b : ni.def_buf) real[b] = 1;
          st.nodes.push_back(std::move(pn));
        }
        plan_.stages.push_back(std::move(st));
        continue;
      }
      st.batch = a_.batch;
      LoopState ls;
      std::unordered_map<int32_t, uint32_t> written; // full buffers written here -> last version
      auto add = [&](int32_t i, bool copy) {
        PlannedNode pn = planned_loop_node(st, ls, i, st.nodes.size(), copy);
        const NodeInfo& ni = a_.nodes[i];
        for (size_t k = 0; k < ni.use_buf.size(); ++k) {
          if (ni.node->uses[k].write && pn.uses[k].bind == Bind::kLocal) ls.held[ni.use_buf[k]] = ni.node->uses[k].write_version;
        }
        for (size_t j = 0; j < ni.def_buf.size(); ++j) {
          if (pn.defs[j].bind == Bind::kLocal) ls.held[ni.def_buf[j]] = ni.node->defs[j].ref.version;
        }
        for (size_t k = 0; k < ni.use_buf.size(); ++k) {
          const int32_t b = ni.use_buf[k];
          if (pn.uses[k].bind == Bind::kWhole || pn.uses[k].bind == Bind::kNarrow) last[b] = {si, st.nodes.size()};
          // Rows written into full storage; whole writes that leave the value unchanged (eval batch
          // norm) still make a new version, published when the loop ends.
          if (ni.node->uses[k].write && (pn.uses[k].bind == Bind::kNarrow || pn.uses[k].bind == Bind::kWhole)) {
            written[b] = ni.node->uses[k].write_version;
          }
        }
        for (size_t j = 0; j < ni.def_buf.size(); ++j) {
          if (pn.defs[j].bind == Bind::kNarrow) {
            written[ni.def_buf[j]] = ni.node->defs[j].ref.version;
            last[ni.def_buf[j]] = {si, st.nodes.size()};
          }
        }
        st.nodes.push_back(std::move(pn));
      };
      // Chunk-local values an earlier loop computed (a leaf's upload, a value recomputed instead of
      // stored): the nodes computing them run again for the chunk's rows, inputs first. `target`
      // is the value a node of this loop reads; false (and `target` blamed) if a version it needs
      // was overwritten in this loop already.
      std::function<bool(int32_t, uint32_t, int32_t)> ensure = [&](int32_t b, uint32_t version, int32_t target) {
        auto h = ls.held.find(b);
        if (h != ls.held.end() && h->second == version) return true;
        const int32_t p = producer(b, version);
        // Only uploads and the cones of values recomputed (checked by walk()) run again.
        if ((h != ls.held.end() && h->second > version) || p < 0 || (!is_upload(p) && !recompute_[target])) {
          blamed_.push_back(target);
          return false;
        }
        const NodeInfo& pi = a_.nodes[p];
        for (size_t k = 0; k < pi.use_buf.size(); ++k) {
          const Use& u = pi.node->uses[k];
          if (u.full_overwrite() || pi.rr.ins[k].mode != Mode::kRows || !local(pi.use_buf[k])) continue;
          if (!ensure(pi.use_buf[k], u.ref.version, target)) return false;
        }
        add(p, true);
        return true;
      };
      for (int32_t i : by_stage[s]) {
        const NodeInfo& ni = a_.nodes[i];
        if (is_upload(i) && st.nodes.size() > 0) {
          bool done = true; // uploaded already for a recomputation
          for (size_t k = 0; k < ni.use_buf.size(); ++k) {
            auto h = ls.held.find(ni.use_buf[k]);
            done = done && ni.node->uses[k].write && h != ls.held.end() && h->second == ni.node->uses[k].write_version;
          }
          for (size_t j = 0; j < ni.def_buf.size(); ++j) {
            auto h = ls.held.find(ni.def_buf[j]);
            done = done && h != ls.held.end() && h->second == ni.node->defs[j].ref.version;
          }
          if (done) continue;
        }
        for (size_t k = 0; k < ni.use_buf.size(); ++k) {
          const int32_t b = ni.use_buf[k];
          const Use& u = ni.node->uses[k];
          if (ni.rr.ins[k].mode != Mode::kRows || !local(b) || u.full_overwrite()) continue;
          const int32_t p = producer(b, u.ref.version);
          if (p < 0 || a_.nodes[p].stage == static_cast<int32_t>(s)) continue;
          auto h = ls.held.find(b);
          if (h != ls.held.end() && h->second == u.ref.version) continue;
          if (!ensure(b, u.ref.version, b)) break;
          if (!is_upload(p) && std::find(st.recomputed.begin(), st.recomputed.end(), a_.bufs[b].buf) == st.recomputed.end()) {
            st.recomputed.push_back(a_.bufs[b].buf);
          }
        }
        add(i, false);
      }
      // Partials: accumulate after their last partial write; free every slot after its last access.
      for (size_t q = 0; q < st.slots.size(); ++q) {
        Slot& sl = st.slots[q];
        if (sl.store != Store::kPartial) continue;
        const int32_t b = a_.index.at(sl.buf);
        const BufInfo& bi = a_.bufs[b];
        int32_t writer = producer(b, bi.p_last);
        size_t at = 0;
        for (size_t p = 0; p < st.nodes.size(); ++p) {
          if (st.nodes[p].node == a_.nodes[writer].node) at = p;
        }
        st.nodes[at].accumulate.push_back(static_cast<int32_t>(q));
        ls.last[q] = std::max(ls.last[q], at);
        Accumulator acc;
        acc.slot = static_cast<int32_t>(q);
        acc.buf = sl.buf;
        acc.version = bi.p_last;
        acc.reduce = bi.place.reduce;
        const int32_t def_node = producer(b, bi.p_first);
        const NodeInfo& dn = a_.nodes[def_node];
        acc.meta = dn.node->defs.empty() ? dn.node->uses[0].ref.meta : dn.node->defs[0].ref.meta;
        for (size_t j = 0; j < dn.node->defs.size(); ++j) {
          if (dn.def_buf[j] != b) continue;
          acc.meta = dn.node->defs[j].ref.meta;
          const Finalize& f = dn.rr.finalize[j];
          acc.finalize = f.kind;
          acc.divisor = f.value;
          acc.per_row = f.per_row;
          if (f.kind == Finalize::kNorm) acc.ord = f.value;
          if (f.kind == Finalize::kDivOutput) {
            acc.divide_by = dn.node->defs[f.output].ref.buf.get();
            last[a_.index.at(acc.divide_by)] = {si, st.nodes.size()}; // read when the loop ends
          }
        }
        sl.acc = static_cast<int32_t>(st.accs.size());
        st.accs.push_back(acc);
        last[b] = {si, st.nodes.size()};
        real[b] = 1;
      }
      for (auto [slot, at] : ls.last) st.nodes[at].free_slots.push_back(slot);
      for (auto [b, version] : written) {
        if (!real[b]) st.stores.push_back(FullStore{a_.bufs[b].buf, host_[b] != 0, version});
        st.written.emplace_back(a_.bufs[b].buf, version);
        real[b] = 1;
      }
      plan_.stages.push_back(std::move(st));
    }
    // Releases: after the last access, unless the value survives the plan or a kept node reads it.
    for (auto [b, at] : last) {
      const BufInfo& bi = a_.bufs[b];
      if ((bi.live && !kept_[b]) || bi.needed || pinned_[b]) continue;
      if (a_.bufs[b].place.is_s() && !full_[b]) continue; // chunk-local only: no storage to release
      Stage& st = plan_.stages[at.first];
      if (st.loop) {
        st.release_after.push_back(bi.buf);
      } else {
        st.nodes[at.second].release.push_back(bi.buf);
      }
    }
    // Dead values nothing here touches.
    for (size_t b = 0; b < a_.bufs.size(); ++b) {
      const BufInfo& bi = a_.bufs[b];
      if (bi.resident && !bi.live && !pinned_[b] && !last.count(static_cast<int32_t>(b))) {
        plan_.release_unused.push_back(bi.buf);
      }
    }
    for (const Expansion& e : a_.expansions) {
      if (e.index < static_cast<int32_t>(in_.nodes.size())) plan_.expansions.push_back(e);
    }
    plan_.executed_nodes = a_.order.size();
    plan_.eliminated = in_.nodes.size() - std::min(in_.nodes.size(), a_.order.size() + plan_.retained.size());
  }

 public:
  // Nodes that cannot run split (plan/probe.h, and in-place writes to stored time-major rows): they
  // run whole in the next attempt.
  std::unordered_map<const Node*, std::string> unsafe() {
    std::unordered_map<const Node*, std::string> bad;
    for (const Node* n : unnarrowable_) {
      bad.emplace(n, "it would write a chunk's rows of a stored time-major flatten in place, which no view gives");
    }
    for (auto& [node, why] : probe_plan(plan_, [&](const LazyBuffer* b) { return a_.index.at(b); })) {
      bad.emplace(node, std::move(why));
    }
    return bad;
  }

 private:
  const PlanInput& in_;
  const Schedule& s_;
  Plan& plan_;
  Analysis a_;
  int32_t stages_ = 0;
  std::unordered_map<uint64_t, int32_t> producer_;
  std::vector<uint32_t> final_, exec_final_;
  std::vector<char> exec_, retain_, kept_, pinned_, full_, host_;
  // Buffers whose full storage is needed for other reasons than crossing stages (other_), that
  // cross stages (cross_), recomputed where they are read instead (recompute_), that cannot be
  // (refused_); each buffer's writes as (stage, version); recomputations an emission found
  // impossible.
  std::vector<char> other_, cross_, recompute_, refused_;
  std::vector<std::vector<std::pair<int32_t, uint32_t>>> writes_;
  std::vector<int32_t> blamed_;
  bool copying_ = false; // planned_loop_node binds a node run again (recompute)
  std::vector<uint64_t> pins_;
  std::unordered_set<const Node*> unnarrowable_;

 public:
  std::vector<NodePtr> take_owned() {
    return std::move(a_.owned);
  }
};

} // namespace

bool make_split_plan(const PlanInput& in, const Schedule& s, Plan& plan) {
  std::unordered_map<const Node*, std::string> forced;
  const std::vector<std::string> notes = plan.notes;
  for (int attempt = 0; attempt < 4; ++attempt) {
    plan = Plan{};
    plan.budget = in.budget;
    plan.resident = in.resident;
    plan.notes = notes;
    SplitBuilder b(in, s, plan, forced);
    if (!b.build()) return false;
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
