// plan: emitting the split plan (see split_builder.h): stages in order, each loop's body with every
// operand bound (chunk-local slot, rows of full storage, partial, whole), the nodes run again for
// values recomputed instead of stored, accumulators, stores and releases.
#include <algorithm>

#include "ops/op_rules.h"
#include "plan/split_builder.h"

namespace lazymem {

int32_t SplitBuilder::slot_of(Stage& st, LoopState& ls, int32_t b, Store store) {
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

Bound SplitBuilder::bind(Stage& st, LoopState& ls, int32_t i, size_t k, bool def) {
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
  RowMap map = ni.map; // (an operand that is not batch-sharded, read by rows: the node's rows of it)
  if (def) {
    const Place& p = ni.rr.outs[k];
    mode = p.is_s() ? Mode::kRows : (p.is_p() ? Mode::kPartial : Mode::kWhole);
    dim = p.dim;
    unit = p.unit;
    outer = p.outer;
    if (p.is_s()) map = p.map;
  } else {
    const OperandMode& m = ni.rr.ins[k];
    mode = m.mode;
    dim = m.dim;
    unit = m.unit;
    outer = m.outer;
    const Place p = a_.use_place(ni, k);
    if (p.is_s()) map = p.map;
  }
  if (def && copying_ && (mode != Mode::kRows || !local(b))) {
    bd.bind = Bind::kDiscard; // run again for its chunk-local results only
    if (mode == Mode::kRows) {
      bd.dim = dim; // (rows of it, for the memory model and the workspace key)
      bd.unit = unit;
      bd.map = map;
    }
    return bd;
  }
  if (mode == Mode::kWhole) return bd;
  bd.dim = dim;
  bd.unit = unit;
  bd.map = map;
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

// G rows per random-number block: enough elements per kernel call to amortize it, a power of two up
// to 64; one row when the op also reads batch-sharded inputs (a block cannot be drawn apart).
uint32_t SplitBuilder::rng_block(const NodeInfo& ni) const {
  if (ni.node->row_keyed) return ni.node->row_keyed->block;
  int64_t row = 0;
  bool reads_rows = false;
  const int64_t batch = ni.batch >= 0 ? a_.batches[a_.find(ni.batch)].rows : 1;
  for (size_t k = 0; k < ni.ops.size(); ++k) {
    const OperandMode& m = ni.rr.ins[k];
    if (m.mode != Mode::kRows) continue;
    if (!ni.ops[k].write) reads_rows = true;
    int64_t numel = 1;
    for (int64_t sz : ni.ops[k].sizes) numel *= sz;
    row = std::max(row, numel / std::max<int64_t>(batch, 1));
  }
  for (size_t j = 0; j < ni.node->defs.size(); ++j) {
    if (!ni.rr.outs[j].is_s()) continue;
    reads_rows = true; // a functional random op reads its inputs' rows
    row = std::max(row, ni.node->defs[j].ref.meta.numel() / std::max<int64_t>(batch, 1));
  }
  if (reads_rows || row <= 0) return 1;
  uint32_t g = 1;
  while (g < 64 && static_cast<int64_t>(g) * row < 65536) g *= 2;
  return g;
}

// How a random loop node draws: from a stream of eager's numbers when its form is eager's on the
// backing device, else keyed by row blocks. The stream's device bytes, for the memory model: a
// chunk's copy of its rows for forms that compute on them (fills copy straight into their result),
// and, off the CPU (where the stream is generated on the device, then moved to host memory), the
// whole stream while it is generated.
void SplitBuilder::set_random_draws(const NodeInfo& ni, PlannedNode& pn) const {
  const Node& n = *ni.node;
  const RngForm f = n.rng_form;
  // Off the CPU, the draw (or, keyed by rows, eager's kernel run once to advance the generator as
  // eager does) runs whole on the device on operands of the node's geometry: all of them at once.
  int64_t operands = 0;
  for (const Use& u : n.uses) operands += static_cast<int64_t>(u.ref.meta.numel() * c10::elementSize(u.ref.meta.dtype));
  for (const Def& d : n.defs) operands += static_cast<int64_t>(d.ref.meta.numel() * c10::elementSize(d.ref.meta.dtype));
  if (!in_.cpu_backing) pn.rng_whole_bytes = operands;
  if (!rng_form_streams(f) || (!in_.cpu_backing && !rng_form_device_generic(f))) {
    pn.rng_block = rng_block(ni);
    return;
  }
  pn.rng_stream = true;
  // The value the stream is shaped as: the input (dropout, multinomial), else the result.
  const TensorMeta* m = nullptr;
  if (f == RngForm::kDropout || f == RngForm::kMultinomial) {
    if (!n.uses.empty()) m = &n.uses[0].ref.meta;
  } else {
    for (const Use& u : n.uses) {
      if (u.write) m = &u.ref.meta;
    }
    if (!m && !n.defs.empty()) m = &n.defs[0].ref.meta;
  }
  if (!m) return;
  const int64_t numel = m->numel();
  const int64_t elem = static_cast<int64_t>(c10::elementSize(m->dtype));
  int64_t kept = elem; // per element, in host memory (execute/streams.cpp)
  int64_t temp = 0;    // per element, a chunk's device copy of its rows
  const std::string& name = n.op.schema().name();
  if (f == RngForm::kFill && (name == "aten::bernoulli_" || name == "aten::bernoulli")) {
    kept = 1; // 0 or 1: kept as bool
  } else if (f == RngForm::kBernoulliP) {
    bool dbl = false; // uniforms in double for a double p, else in float; then a bool per element
    for (const Use& u : n.uses) {
      if (!u.write) dbl = u.ref.meta.dtype == c10::kDouble;
    }
    kept = dbl ? 8 : 4;
    temp = kept + 1;
  } else if (f == RngForm::kDropout) {
    kept = 1;
    temp = elem;
  } else if (f == RngForm::kMultinomial) {
    temp = elem;
  }
  const int64_t batch = ni.batch >= 0 ? a_.batches[a_.find(ni.batch)].rows : 1;
  const int64_t rows = std::max<int64_t>(ni.map.identity() ? batch : ni.map.n, 1);
  pn.rng_row_bytes = (numel * temp + rows - 1) / rows;
  pn.rng_stream_bytes = numel * kept;
  if (!in_.cpu_backing) pn.rng_whole_bytes = std::max(operands, numel * std::max(elem, kept) * 2);
}

PlannedNode SplitBuilder::planned_loop_node(Stage& st, LoopState& ls, int32_t i, size_t body_index, bool copy) {
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
    if (m.mode != Mode::kRows) continue;
    ConstNarrow c{ni.ops[k].arg, ni.ops[k].elem, m.dim, m.unit};
    // An upload into chunk-local storage of blocks: its host source, of the destination's shape, is
    // gathered the way that storage holds the rows (else the chunk's shapes differ and the meta
    // probe makes the upload a barrier, run and stored whole: seed 830539's halves).
    if (n.upload && c.elem < 0 && !pn.uses.empty() && pn.uses[0].bind == Bind::kLocal && pn.uses[0].slot >= 0 &&
        n.args[c.arg].isTensor()) {
      const RowLayout& l = st.slots[pn.uses[0].slot].layout;
      const at::Tensor& src = n.args[c.arg].toTensor();
      if (l.outer > 1 && c.dim >= 0 && c.dim < src.dim() && pn.uses[0].dim == c.dim &&
          src.size(c.dim) == l.outer * l.rows * c.unit) {
        c.outer = l.outer;
      }
    }
    pn.consts.push_back(c);
  }
  pn.rows = ni.map;
  pn.row_node = !pn.consts.empty();
  for (const Bound& bd : pn.uses) pn.row_node = pn.row_node || bd.bind == Bind::kLocal || bd.bind == Bind::kNarrow;
  for (const Bound& bd : pn.defs) {
    pn.row_node = pn.row_node || bd.bind == Bind::kLocal || bd.bind == Bind::kNarrow ||
        (bd.bind == Bind::kDiscard && bd.dim >= 0);
  }
  pn.rewrites.assign(ni.rr.rewrites.begin(), ni.rr.rewrites.end());
  pn.post_div.assign(ni.rr.post_div.begin(), ni.rr.post_div.end());
  pn.post_div_written = ni.rr.post_div_written;
  pn.placeholder_outputs = op_rules(n.op).placeholder_outputs;
  if (n.random && !ni.rr.no_draws) set_random_draws(ni, pn);
  copying_ = false;
  return pn;
}


void SplitBuilder::emit() {
  plan_.split = true;
  std::vector<std::vector<int32_t>> by_stage(std::max(stages_, 1));
  for (int32_t i : a_.order) by_stage[a_.nodes[i].stage].push_back(i);
  last_.clear();
  real_.assign(a_.bufs.size(), 0);
  for (size_t b = 0; b < a_.bufs.size(); ++b) real_[b] = a_.bufs[b].resident;
  for (size_t s = 0; s < by_stage.size(); ++s) {
    if (by_stage[s].empty()) continue;
    if (stage_batch(a_, static_cast<int32_t>(s)) >= 0) {
      emit_loop(static_cast<int32_t>(s), by_stage[s]);
    } else {
      emit_whole(by_stage[s]);
    }
  }
  emit_releases();
  emit_facts();
  for (const Expansion& e : a_.expansions) {
    if (e.index < static_cast<int32_t>(in_.nodes.size())) plan_.expansions.push_back(e);
  }
  plan_.executed_nodes = a_.order.size();
  plan_.eliminated = in_.nodes.size() - std::min(in_.nodes.size(), a_.order.size() + plan_.retained.size());
}

void SplitBuilder::emit_whole(const std::vector<int32_t>& nodes) {
  Stage st;
  const size_t si = plan_.stages.size();
  for (int32_t i : nodes) {
    const NodeInfo& ni = a_.nodes[i];
    PlannedNode pn(ni.node, i < static_cast<int32_t>(in_.nodes.size()) ? i : -1);
    pn.placeholder_outputs = op_rules(ni.node->op).placeholder_outputs;
    for (int32_t b : ni.use_buf) last_[b] = {si, st.nodes.size()};
    for (size_t j = 0; j < ni.def_buf.size(); ++j) {
      if (!ni.discard[j]) last_[ni.def_buf[j]] = {si, st.nodes.size()};
    }
    for (int32_t b : ni.use_buf) real_[b] = 1;
    for (int32_t b : ni.def_buf) real_[b] = 1;
    st.nodes.push_back(std::move(pn));
  }
  plan_.stages.push_back(std::move(st));
}

void SplitBuilder::add(Stage& st, LoopState& ls, int32_t i, bool copy) {
  PlannedNode pn = planned_loop_node(st, ls, i, st.nodes.size(), copy);
  const NodeInfo& ni = a_.nodes[i];
  const std::pair<size_t, size_t> here{ls.si, st.nodes.size()};
  for (size_t k = 0; k < ni.use_buf.size(); ++k) {
    const int32_t b = ni.use_buf[k];
    const Use& u = ni.node->uses[k];
    const Bind bind = pn.uses[k].bind;
    if (u.write && bind == Bind::kLocal) ls.held[b] = u.write_version;
    if (bind == Bind::kWhole || bind == Bind::kNarrow) last_[b] = here;
    // Rows written into full storage; whole writes that leave the value unchanged (eval batch norm)
    // still make a new version, published when the loop ends.
    if (u.write && (bind == Bind::kNarrow || bind == Bind::kWhole)) ls.written[b] = u.write_version;
  }
  for (size_t j = 0; j < ni.def_buf.size(); ++j) {
    const int32_t b = ni.def_buf[j];
    if (pn.defs[j].bind == Bind::kLocal) ls.held[b] = ni.node->defs[j].ref.version;
    if (pn.defs[j].bind == Bind::kNarrow) {
      ls.written[b] = ni.node->defs[j].ref.version;
      last_[b] = here;
    }
  }
  st.nodes.push_back(std::move(pn));
}

bool SplitBuilder::ensure(Stage& st, LoopState& ls, int32_t b, uint32_t version, int32_t target) {
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
    if (!ensure(st, ls, pi.use_buf[k], u.ref.version, target)) return false;
  }
  add(st, ls, p, true);
  return true;
}

void SplitBuilder::emit_loop(int32_t s, const std::vector<int32_t>& nodes) {
  Stage st;
  st.loop = true;
  st.batch_id = a_.find(stage_batch(a_, s));
  st.batch = a_.batches[st.batch_id].rows;
  LoopState ls;
  ls.si = plan_.stages.size();
  for (int32_t i : nodes) {
    const NodeInfo& ni = a_.nodes[i];
    if (is_upload(i) && !st.nodes.empty()) {
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
      if (p < 0 || a_.nodes[p].stage == s) continue;
      auto h = ls.held.find(b);
      if (h != ls.held.end() && h->second == u.ref.version) continue;
      if (!ensure(st, ls, b, u.ref.version, b)) break;
      if (!is_upload(p) && std::find(st.recomputed.begin(), st.recomputed.end(), a_.bufs[b].buf) == st.recomputed.end()) {
        st.recomputed.push_back(a_.bufs[b].buf);
      }
    }
    add(st, ls, i, false);
  }
  emit_partials(st, ls);
  for (auto [slot, at] : ls.last) st.nodes[at].free_slots.push_back(slot);
  for (auto [b, version] : ls.written) {
    if (!real_[b]) st.stores.push_back(FullStore{a_.bufs[b].buf, host_[b] != 0, version});
    st.written.emplace_back(a_.bufs[b].buf, version);
    real_[b] = 1;
  }
  plan_.stages.push_back(std::move(st));
}

void SplitBuilder::emit_partials(Stage& st, LoopState& ls) {
  // A partial only ever read as a partial within the loop (a tied weight's two gradient terms, summed
  // there into the one that survives) is never finished: no accumulator holds it.
  std::vector<char> finished(a_.bufs.size(), 0);
  for (int32_t i : a_.order) {
    const NodeInfo& ni = a_.nodes[i];
    for (size_t k = 0; k < ni.node->uses.size(); ++k) {
      if (ni.node->uses[k].full_overwrite() || !a_.reads_partial(ni, k)) continue;
      if (ni.rr.ins[k].mode != Mode::kPartial || ni.stage != a_.nodes[producer(ni.use_buf[k], a_.bufs[ni.use_buf[k]].p_first)].stage) {
        finished[ni.use_buf[k]] = 1;
      }
    }
    for (size_t j = 0; j < ni.rr.finalize.size(); ++j) {
      const Finalize& f = ni.rr.finalize[j];
      if (f.kind == Finalize::kDivOutput) finished[ni.def_buf[f.output]] = 1;
    }
  }
  for (size_t q = 0; q < st.slots.size(); ++q) {
    Slot& sl = st.slots[q];
    if (sl.store != Store::kPartial) continue;
    const int32_t b = a_.index.at(sl.buf);
    const BufInfo& bi = a_.bufs[b];
    if (!finished[b] && !bi.live && !bi.needed && !pinned_[b]) continue;
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
        last_[a_.index.at(acc.divide_by)] = {ls.si, st.nodes.size()}; // read when the loop ends
      }
    }
    sl.acc = static_cast<int32_t>(st.accs.size());
    st.accs.push_back(acc);
    last_[b] = {ls.si, st.nodes.size()};
    real_[b] = 1;
  }
}

void SplitBuilder::emit_releases() {
  // After the last access, unless the value survives the plan or a kept node reads it.
  std::vector<std::vector<std::pair<size_t, LazyBuffer*>>> after(plan_.stages.size()); // whole stages
  for (auto [b, at] : last_) {
    const BufInfo& bi = a_.bufs[b];
    if ((bi.live && !kept_[b]) || bi.needed || pinned_[b]) continue;
    if (a_.bufs[b].place.is_s() && !full_[b]) continue; // chunk-local only: no storage to release
    Stage& st = plan_.stages[at.first];
    if (st.loop) {
      st.release_after.push_back(bi.buf);
    } else {
      after[at.first].emplace_back(at.second, bi.buf);
    }
  }
  for (size_t s = 0; s < after.size(); ++s) {
    if (!plan_.stages[s].loop) plan_.stages[s].set_released(after[s]);
  }
  // Dead values nothing here touches.
  for (size_t b = 0; b < a_.bufs.size(); ++b) {
    const BufInfo& bi = a_.bufs[b];
    if (bi.resident && !bi.live && !pinned_[b] && !last_.count(static_cast<int32_t>(b))) {
      plan_.release_unused.push_back(bi.buf);
    }
  }
}

} // namespace lazymem

namespace lazymem {

void SplitBuilder::emit_facts() {
  plan_.facts.clear();
  for (size_t b = 0; b < a_.program_bufs; ++b) {
    const BufInfo& bi = a_.bufs[b];
    // (Pinned: read by nodes kept pending, which a later plan runs: its source.)
    if (!bi.place.is_s() || !((bi.live && !kept_[b]) || bi.needed || pinned_[b])) continue;
    if (!full_[b] && !bi.resident) continue;
    const uint32_t version = exec_final_[b] > 0 ? exec_final_[b] : bi.buf->real_version;
    if (version == 0) continue;
    BatchClass& c = a_.batches[a_.find(bi.place.batch)];
    if (c.id == 0) c.id = new_batch_id();
    plan_.facts.push_back(BatchFact{bi.buf, version, bi.layout, c.id});
  }
}

} // namespace lazymem
