// plan: propagation of the batch through the op rules (DESIGN.md §7). Seeds are the sources the
// solver (plan/solve.cpp) made batch-sharded, each in a batch of its own, or in the batch of the
// stored values it shares an id with. Placements then flow forward in program order, each node's
// rule saying how its outputs relate to the batch. Batches that an op pairs row by row with equal
// rows are one batch from then on; batches of different rows never pair (their places compare
// unequal, so rules that would pair them fail). A node with batched operands and no rule (or whose
// rule fails) is a barrier: it runs whole on gathered operands. Marking a value batch-sharded is
// always correct — its rows pair with the batch by index, which is all a rule assumes — so the only
// conflicts are one buffer with two row layouts, a loop node that would write a whole value once per
// chunk, and partial values mixed with batch-sharded ones. Sinking then turns replicated values used
// only row by row (a dropout mask, a mean's gradient) into batch-sharded ones computed per chunk, so
// they never exist at full size.
#include "plan/analysis.h"

#include <algorithm>
#include <map>
#include <sstream>

#include "core/config.h"
#include "plan/localize.h"

namespace lazymem {
namespace {

bool is_host_tensor(const c10::IValue& v) {
  if (!v.isTensor()) return false;
  const at::Tensor& t = v.toTensor();
  return t.defined() && t.device().type() != c10::DeviceType::PrivateUse1;
}

void build_operands(Analysis& a, NodeInfo& ni) {
  const Node& n = *ni.node;
  ni.ops.clear();
  ni.src.clear();
  for (size_t u = 0; u < n.uses.size(); ++u) {
    const Use& use = n.uses[u];
    Operand o;
    o.sizes = use.ref.meta.sizes;
    o.strides = use.ref.meta.strides;
    o.dtype = use.ref.meta.dtype;
    o.place = a.use_place(ni, u);
    o.write = use.write;
    o.arg = use.arg;
    o.elem = use.elem;
    ni.ops.push_back(o);
    ni.src.push_back(OperandSrc{static_cast<int32_t>(u), use.arg, use.elem});
  }
  for (size_t arg = 0; arg < n.args.size(); ++arg) {
    const c10::IValue& v = n.args[arg];
    auto add = [&](const at::Tensor& t, int32_t elem) {
      Operand o;
      o.sizes = t.sizes();
      o.strides = t.strides();
      o.dtype = t.scalar_type();
      o.constant = true;
      o.arg = static_cast<int32_t>(arg);
      o.elem = elem;
      ni.ops.push_back(o);
      ni.src.push_back(OperandSrc{-1, static_cast<int32_t>(arg), elem});
    };
    if (is_host_tensor(v)) {
      add(v.toTensor(), -1);
    } else if (v.isList()) {
      auto l = v.toList();
      for (size_t e = 0; e < l.size(); ++e) {
        c10::IValue x = l.get(e);
        if (is_host_tensor(x)) add(x.toTensor(), static_cast<int32_t>(e));
      }
    }
  }
}

bool any_batched(const NodeInfo& ni, const std::vector<Place>& want) {
  for (const Operand& o : ni.ops) {
    if (o.place.is_s()) return true;
  }
  for (const Place& p : want) {
    if (p.is_s()) return true;
  }
  return false;
}

// True when an operand or a demanded output is sharded along a dim with outer blocks.
bool has_outer(const NodeInfo& ni, const std::vector<Place>& want) {
  for (const Operand& o : ni.ops) {
    if (o.place.is_s() && o.place.outer != 1) return true;
  }
  for (const Place& p : want) {
    if (p.is_s() && p.outer != 1) return true;
  }
  return false;
}

} // namespace

bool apply_outcome(Analysis& a, int32_t i) {
  NodeInfo& ni = a.nodes[i];
  const Node& n = *ni.node;
  // A buffer already batch-sharded by another batch of the same rows: the two are one batch.
  auto same_batch = [&](BufInfo& b, int32_t batch) {
    return !b.place.is_s() || a.find(b.place.batch) == a.find(batch) || a.unite(b.place.batch, batch);
  };
  for (size_t j = 0; j < n.defs.size(); ++j) {
    if (ni.discard.size() > j && ni.discard[j]) continue;
    BufInfo& b = a.bufs[ni.def_buf[j]];
    const Place& o = ni.rr.outs[j];
    if (o.is_s()) {
      // The def holds the rows its map names (every row of the batch for the identity).
      const int64_t rows = o.map.identity() ? a.rows_of(o) : o.map.n;
      auto l = layout_of(n.defs[j].ref.meta, b.buf->nbytes.load(), BatchDim{o.dim, o.unit, o.outer}, rows);
      if (l) l->map = o.map;
      if (!l || (b.place.is_s() && !(b.layout == *l)) || b.place.is_p() || !same_batch(b, o.batch)) return false;
      b.place = Place::S(0);
      b.place.batch = static_cast<int8_t>(a.find(o.batch));
      b.layout = *l;
    } else if (o.is_p()) {
      if (b.place.is_s() || (b.place.is_p() && a.find(b.place.batch) != a.find(o.batch))) return false;
      b.place = o;
      b.place.batch = static_cast<int8_t>(a.find(o.batch));
      b.p_first = b.p_last = n.defs[j].ref.version;
      b.p_finish = ni.rr.finalize.size() > j && ni.rr.finalize[j].kind != Finalize::kNone;
    } else if (ni.loop && n.defs[j].ref.meta.numel() != 0) {
      return false; // a loop node's outputs are batch-sharded or partial (or empty: every chunk's alike)
    }
  }
  for (size_t k = 0; k < n.uses.size(); ++k) {
    const Use& u = n.uses[k];
    if (!u.write) continue;
    BufInfo& b = a.bufs[ni.use_buf[k]];
    const OperandMode& m = ni.rr.ins[k];
    if (m.mode == Mode::kRows) {
      if (b.place.is_p() || ni.batch < 0) return false;
      if (b.place.is_s()) {
        // Rows written through a view of a batch-sharded value (h[::2] += 1 writes its even rows):
        // the view must name rows of it, as the rule bound it.
        if (!a.use_place(ni, k).is_s() || !same_batch(b, ni.batch)) return false;
        continue;
      }
      const int64_t batch_rows = a.batches[a.find(ni.batch)].rows;
      std::optional<RowLayout> l;
      if (!ni.map.identity() && m.unit == 1 && m.outer == 1) {
        // Rows of a slice written into a fresh value (autograd's CopySlices scatters the gradient of
        // h[::2] into zeros of h's shape): the value holds every batch row, the slice's among them.
        const TensorMeta& v = u.ref.meta;
        const int64_t item = static_cast<int64_t>(c10::elementSize(v.dtype));
        const int64_t t = v.strides[m.dim];
        if (t > 0 && t % ni.map.step == 0) {
          RowLayout whole;
          whole.rows = batch_rows;
          whole.row_bytes = t / ni.map.step * item;
          const int64_t block = whole.rows * whole.row_bytes;
          if (block > 0 && static_cast<int64_t>(b.buf->nbytes.load()) % block == 0) {
            whole.outer = static_cast<int64_t>(b.buf->nbytes.load()) / block;
            auto bd = analyze_view(v, whole);
            if (bd && bd->dim == m.dim && bd->map(RowMap{}, batch_rows) == ni.map) l = whole;
          }
        }
      }
      if (!l) {
        l = layout_of(u.ref.meta, b.buf->nbytes.load(), BatchDim{m.dim, m.unit, m.outer},
                      ni.map.identity() ? batch_rows : ni.map.n);
        if (!l) return false;
        l->map = ni.map;
      }
      b.place = Place::S(0);
      b.place.batch = static_cast<int8_t>(a.find(ni.batch));
      b.layout = *l;
    } else if (m.mode == Mode::kPartial) {
      if (b.place.is_s() || ni.batch < 0) return false;
      if (b.place.is_p() && a.find(b.place.batch) != a.find(ni.batch)) return false;
      if (!b.place.is_p()) b.p_first = u.write_version;
      b.place = Place::P(Reduce::kSum);
      b.place.batch = static_cast<int8_t>(a.find(ni.batch));
      b.p_last = u.write_version;
    } else if (ni.loop && !ni.rr.writes_unchanged) {
      return false; // written whole once per chunk
    }
  }
  return true;
}

namespace {

bool apply(Analysis& a, int32_t i) {
  return apply_outcome(a, i);
}

void make_barrier(Analysis& a, int32_t i, const char* why) {
  NodeInfo& ni = a.nodes[i];
  for (auto& m : ni.rr.ins) m = OperandMode::whole();
  for (auto& o : ni.rr.outs) o = Place::R();
  ni.rr.rewrites.clear();
  ni.rr.replace_op = nullptr;
  ni.rr.needs_total_weight = false;
  for (auto& f : ni.rr.finalize) f = Finalize{};
  for (auto& d : ni.rr.post_div) d = 0;
  ni.loop = false;
  ni.barrier = true;
  if (why) ni.rr.why = why;
}

// The placement a buffer demands of its def (a seed produced by a functional op).
std::vector<Place> wants(Analysis& a, int32_t i) {
  NodeInfo& ni = a.nodes[i];
  std::vector<Place> w;
  for (size_t j = 0; j < ni.node->defs.size(); ++j) {
    const BufInfo& b = a.bufs[ni.def_buf[j]];
    Place p;
    if (b.place.is_s()) {
      if (auto bd = analyze_view(ni.node->defs[j].ref.meta, b.layout)) {
        p = Place::S(bd->dim, bd->unit, bd->outer);
        p.batch = static_cast<int8_t>(a.find(b.place.batch));
        p.map = bd->map(b.layout.map, a.rows_of(p));
      }
    }
    w.push_back(p);
  }
  return w;
}

// Evaluates and applies node i; a conflict makes it a barrier.
void settle(Analysis& a, int32_t i) {
  evaluate(a, i, wants(a, i));
  if (!apply(a, i)) {
    const char* why = a.nodes[i].rr.why;
    make_barrier(a, i, why ? why : "its outputs conflict with how the batch is laid out");
    apply(a, i);
  }
}

// Readers of every buffer, for sinking.
std::vector<std::vector<std::pair<int32_t, int32_t>>> readers(const Analysis& a) {
  std::vector<std::vector<std::pair<int32_t, int32_t>>> r(a.bufs.size());
  for (int32_t i : a.order) {
    const NodeInfo& ni = a.nodes[i];
    for (size_t k = 0; k < ni.node->uses.size(); ++k) {
      if (!ni.node->uses[k].full_overwrite()) r[ni.use_buf[k]].emplace_back(i, static_cast<int32_t>(k));
    }
  }
  return r;
}

// Replicated buffers used only row by row become batch-sharded, their producers running per chunk.
void sink(Analysis& a) {
  std::vector<std::vector<int32_t>> producers(a.bufs.size());
  for (int32_t i : a.order) {
    const NodeInfo& ni = a.nodes[i];
    for (int32_t b : ni.def_buf) producers[b].push_back(i);
    for (size_t k = 0; k < ni.node->uses.size(); ++k) {
      if (ni.node->uses[k].write) producers[ni.use_buf[k]].push_back(i);
    }
  }
  for (bool changed = true; changed;) {
    changed = false;
    auto rd = readers(a);
    for (size_t bi = a.bufs.size(); bi-- > 0;) {
      BufInfo& b = a.bufs[bi];
      if (!b.place.is_r() || b.resident || b.live || producers[bi].empty() || rd[bi].empty()) continue;
      std::optional<RowLayout> layout;
      int32_t batch = -1;
      bool ok = true;
      for (auto [i, k] : rd[bi]) {
        // In-place producers (div_ on a dropout mask) read it too: they move into the loop with it.
        if (std::find(producers[bi].begin(), producers[bi].end(), i) != producers[bi].end()) continue;
        const NodeInfo& ni = a.nodes[i];
        const OperandMode& m = ni.rr.ins[k];
        if (!ni.loop || m.mode != Mode::kRows || ni.batch < 0 || (batch >= 0 && a.find(ni.batch) != batch)) {
          ok = false;
          break;
        }
        batch = a.find(ni.batch);
        auto l = layout_of(ni.node->uses[k].ref.meta, b.buf->nbytes.load(), BatchDim{m.dim, m.unit, m.outer},
                           ni.map.identity() ? a.batches[batch].rows : ni.map.n);
        if (l) l->map = ni.map;
        if (!l || (layout && !(*layout == *l))) {
          ok = false;
          break;
        }
        layout = l;
      }
      for (int32_t p : producers[bi]) {
        const Node& n = *a.nodes[p].node;
        size_t outputs = n.defs.size();
        for (const Use& u : n.uses) outputs += u.write;
        if (outputs != 1 || a.nodes[p].barrier) ok = false;
      }
      if (!ok || !layout) continue;
      // Tentatively batch-sharded; every producer must then run per chunk.
      std::vector<NodeInfo> saved;
      for (int32_t p : producers[bi]) saved.push_back(a.nodes[p]);
      b.place = Place::S(0);
      b.place.batch = static_cast<int8_t>(batch);
      b.layout = *layout;
      bool all = true;
      for (int32_t p : producers[bi]) {
        evaluate(a, p, wants(a, p));
        if (!a.nodes[p].loop || a.nodes[p].barrier || !apply(a, p)) {
          all = false;
          break;
        }
      }
      if (!all) {
        b.place = Place::R();
        for (size_t q = 0; q < saved.size(); ++q) a.nodes[producers[bi][q]] = saved[q];
        continue;
      }
      changed = true;
    }
  }
}

// A value that became batch-sharded after a node filled it whole (zeros that rows are then written
// into, as autograd's CopySlices makes): the fill runs per chunk too when that is all it does.
void sink_fills(Analysis& a) {
  for (int32_t i : a.order) {
    NodeInfo& ni = a.nodes[i];
    const Node& n = *ni.node;
    if (ni.loop || ni.barrier || !n.defs.empty() || n.uses.size() != 1 || !n.uses[0].full_overwrite()) continue;
    if (!a.bufs[ni.use_buf[0]].place.is_s() || n.random || n.effectful) continue;
    const NodeInfo saved = ni;
    evaluate(a, i);
    if (!ni.loop || ni.barrier || !apply(a, i)) ni = saved;
  }
}

} // namespace

void propagate(Analysis& a) {
  a.batches.clear();
  for (BufInfo& b : a.bufs) {
    b.place = Place::R();
    b.seed = false;
  }
  for (const Source& src : a.sources) {
    if (src.choice < 0) continue;
    const RowLayout& l = src.layouts[src.choice];
    // Stored values with one batch id and the same rows start in one batch.
    int32_t batch = -1;
    for (size_t c = 0; c < a.batches.size() && src.id != 0; ++c) {
      if (a.batches[c].id == src.id && a.batches[c].rows == l.rows) batch = static_cast<int32_t>(c);
    }
    if (batch < 0) {
      if (a.batches.size() >= 120) continue; // (Place::batch is 8 bits: later sources stay unsplit)
      a.batches.push_back(BatchClass{l.rows, -1, src.id});
      batch = static_cast<int32_t>(a.batches.size() - 1);
    }
    BufInfo& b = a.bufs[src.buf];
    b.place = Place::S(0);
    b.place.batch = static_cast<int8_t>(batch);
    b.layout = l;
    b.seed = true;
  }
  std::vector<int32_t> order = a.order; // synthesis may insert nodes into a.order
  for (int32_t i : order) {
    a.nodes[i].discard.assign(a.nodes[i].node->defs.size(), false);
    settle(a, i);
    if (a.nodes[i].barrier && a.nodes[i].rr.expand && expand_node(a, i)) continue;
    if (a.nodes[i].rr.needs_total_weight && !synthesize_total_weight(a, i)) {
      make_barrier(a, i, "its total weight could not be computed ahead");
      apply(a, i);
    }
  }
  sink(a);
  sink_fills(a);
}


int32_t Analysis::buffer(LazyBuffer* b) {
  auto [it, inserted] = index.emplace(b, static_cast<int32_t>(bufs.size()));
  if (inserted) {
    BufInfo bi;
    bi.buf = b;
    // (Data in host memory — a value an earlier plan stored there — is data all the same: a batch-
    // sharded source held there is read chunk by chunk from there, never bound to a fresh slot.)
    bi.resident = b->has_real();
    bufs.push_back(bi);
  }
  return it->second;
}

int32_t Analysis::add_node(Node* n) {
  NodeInfo ni;
  ni.node = n;
  for (const Def& d : n->defs) ni.def_buf.push_back(buffer(d.ref.buf.get()));
  for (const Use& u : n->uses) ni.use_buf.push_back(buffer(u.ref.buf.get()));
  ni.discard.assign(n->defs.size(), false);
  nodes.push_back(std::move(ni));
  return static_cast<int32_t>(nodes.size() - 1);
}

bool Analysis::unite(int32_t x, int32_t y) {
  x = find(x);
  y = find(y);
  if (x == y) return true;
  if (batches[x].rows != batches[y].rows) return false;
  if (y < x) std::swap(x, y);
  batches[y].parent = x;
  if (batches[x].id == 0 || (batches[y].id != 0 && batches[y].id < batches[x].id)) batches[x].id = batches[y].id;
  return true;
}

Place Analysis::use_place(const NodeInfo& ni, size_t u) const {
  const BufInfo& b = bufs[ni.use_buf[u]];
  if (b.place.is_s()) {
    auto bd = analyze_view(ni.node->uses[u].ref.meta, b.layout);
    if (!bd) return Place::R();
    Place p = Place::S(bd->dim, bd->unit, bd->outer);
    p.batch = static_cast<int8_t>(find(b.place.batch));
    p.map = bd->map(b.layout.map, rows_of(p));
    return p;
  }
  if (b.place.is_p()) {
    // Partial only in the versions written by the loop; a finished value written after is R. A
    // partial finished by a division is only ever read finished.
    uint32_t v = ni.node->uses[u].ref.version;
    const bool finished = !finished_reads.empty() && finished_reads.count(ni.node) > 0;
    if (v < b.p_first || v > b.p_last || b.p_finish || finished) return Place::R();
    Place p = b.place;
    p.batch = static_cast<int8_t>(find(b.place.batch));
    return p;
  }
  return b.place;
}

bool Analysis::reads_partial(const NodeInfo& ni, size_t u) const {
  const BufInfo& b = bufs[ni.use_buf[u]];
  uint32_t v = ni.node->uses[u].ref.version;
  return b.place.is_p() && v >= b.p_first && v <= b.p_last;
}

namespace {

// Operands (and demanded outputs) of several batches with equal rows: the op pairs their rows, so
// they are one batch. The operands' places then name the merged batch.
void merge_met_batches(Analysis& a, NodeInfo& ni, const std::vector<Place>& want) {
  int32_t first = -1;
  bool several = false;
  auto see = [&](const Place& p) {
    if (p.is_r()) return;
    const int32_t c = a.find(p.batch);
    if (first < 0) first = c;
    several = several || c != first;
  };
  for (const Operand& o : ni.ops) see(o.place);
  for (const Place& p : want) see(p);
  if (!several) return;
  for (const Operand& o : ni.ops) {
    if (o.place.is_s()) a.unite(first, o.place.batch);
  }
  for (const Place& p : want) {
    if (p.is_s()) a.unite(first, p.batch);
  }
  for (Operand& o : ni.ops) {
    if (!o.place.is_r()) o.place.batch = static_cast<int8_t>(a.find(o.place.batch));
  }
}

// The batch a node runs over: that of the operands it reads by rows or as partials (all one, or it
// is a conflict), else of a demanded output. Every batch-sharded or partial output gets it.
bool settle_batch(Analysis& a, NodeInfo& ni, const std::vector<Place>& want) {
  int32_t batch = -1;
  for (size_t k = 0; k < ni.ops.size(); ++k) {
    const Place& p = ni.ops[k].place;
    if (ni.rr.ins[k].mode == Mode::kWhole || p.is_r()) continue;
    const int32_t c = a.find(p.batch);
    if (batch >= 0 && c != batch) return false;
    batch = c;
  }
  for (size_t j = 0; j < want.size() && batch < 0; ++j) {
    if (want[j].is_s() && j < ni.rr.outs.size() && ni.rr.outs[j].is_s()) batch = a.find(want[j].batch);
  }
  for (size_t j = 0; j < ni.rr.outs.size() && batch < 0; ++j) {
    if (!ni.rr.outs[j].is_r()) batch = a.find(ni.rr.outs[j].batch);
  }
  for (Place& o : ni.rr.outs) {
    if (!o.is_r()) o.batch = static_cast<int8_t>(std::max(batch, 0));
  }
  ni.batch = batch;
  // The node's rows: its batch-sharded outputs', else its operands read by rows.
  ni.map = RowMap{};
  bool found = false;
  for (const Place& o : ni.rr.outs) {
    if (o.is_s() && !found) {
      ni.map = o.map;
      found = true;
    }
  }
  for (size_t k = 0; k < ni.ops.size() && !found; ++k) {
    if (ni.rr.ins[k].mode == Mode::kRows && ni.ops[k].place.is_s()) {
      ni.map = ni.ops[k].place.map;
      found = true;
    }
  }
  return true;
}

} // namespace

void evaluate(Analysis& a, int32_t i, const std::vector<Place>& want) {
  NodeInfo& ni = a.nodes[i];
  const Node& n = *ni.node;
  build_operands(a, ni);
  merge_met_batches(a, ni, want);
  std::vector<Output> outs;
  for (const Def& d : n.defs) {
    Output o;
    o.sizes = d.ref.meta.sizes;
    o.dtype = d.ref.meta.dtype;
    o.ret = d.ret;
    o.elem = d.elem;
    outs.push_back(o);
  }
  RuleResult& r = ni.rr;
  r = RuleResult{};
  r.outs.assign(outs.size(), Place::R());
  r.ins.assign(ni.ops.size(), OperandMode::whole());
  r.finalize.assign(outs.size(), Finalize{});
  r.post_div.assign(outs.size(), 0.0);
  r.discard.assign(outs.size(), false);
  int64_t rows = 0;
  for (const Operand& o : ni.ops) {
    if (o.place.is_s() && rows == 0) rows = a.rows_of(o.place);
  }
  for (const Place& p : want) {
    if (p.is_s() && rows == 0) rows = a.rows_of(p);
  }
  RuleCall call{n.op, n.args, ni.ops, outs, rows, want};
  const RuleEntry* e = placement_rule(n.op);
  const bool batched = any_batched(ni, want);
  bool ok = false;
  auto forced = a.forced_barriers.find(ni.node);
  if (forced != a.forced_barriers.end()) {
    r.why = forced->second.c_str();
  } else if (e && has_outer(ni, want) && (!e->outer_aware || n.random)) {
    r.why = "the batch is a minor factor of a flattened dim (a time-major layout) and this op's rule does not "
            "take that";
  } else if (e) {
    ok = e->fn(call, r);
    if (ok && !settle_batch(a, ni, want)) {
      ok = false;
      r.why = "it pairs rows of two batches of different sizes";
    }
  }
  ni.family = e ? e->family : "";
  ni.barrier = false;
  if (!ok) {
    const char* why = (e || forced != a.forced_barriers.end()) ? r.why : "no placement rule for this op";
    make_barrier(a, i, why);
    ni.barrier = batched;
    ni.batch = -1;
  }
  ni.loop = false;
  if (!ni.barrier) {
    for (const OperandMode& m : r.ins) ni.loop = ni.loop || m.mode != Mode::kWhole;
    for (const Place& p : r.outs) ni.loop = ni.loop || !p.is_r();
  }
  if (!ni.loop) ni.batch = -1;
}

} // namespace lazymem
