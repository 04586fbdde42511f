// plan: the batch — seeds by provenance and propagation through the op rules (DESIGN.md §7).
//
// Seeds are data leaves: buffers uploaded from the host that hold neither module state nor values
// that require grad, dim 0 the batch; or buffers torch_lazymem.mark_batch marked. Sizes never
// identify the batch: the batch size is the seeds' dim-0 size, and when leaves of different sizes
// would each drive batch-sharded work the plan does not split. Placements then flow forward in
// program order, each node's rule saying how its outputs relate to the batch. A node with batched
// operands and no rule (or whose rule fails) is a barrier: it runs whole on gathered operands.
// Marking a value batch-sharded is always correct — its rows pair with the batch by index, which is
// all a rule assumes — so the only conflicts are one buffer with two row layouts, a loop node that
// would write a whole value once per chunk, and partial values mixed with batch-sharded ones.
// Sinking then turns replicated values used only row by row (a dropout mask, a mean's gradient)
// into batch-sharded ones computed per chunk, so they never exist at full size.
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
  for (size_t j = 0; j < n.defs.size(); ++j) {
    if (ni.discard.size() > j && ni.discard[j]) continue;
    BufInfo& b = a.bufs[ni.def_buf[j]];
    const Place& o = ni.rr.outs[j];
    if (o.is_s()) {
      auto l = layout_of(n.defs[j].ref.meta, b.buf->nbytes.load(), BatchDim{o.dim, o.unit, o.outer}, a.batch);
      if (!l || (b.place.is_s() && !(b.layout == *l)) || b.place.is_p()) return false;
      b.place = Place::S(0);
      b.layout = *l;
    } else if (o.is_p()) {
      if (b.place.is_s()) return false;
      b.place = o;
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
      if (b.place.is_p()) return false;
      auto l = layout_of(u.ref.meta, b.buf->nbytes.load(), BatchDim{m.dim, m.unit, m.outer}, a.batch);
      if (!l || (b.place.is_s() && !(b.layout == *l))) return false;
      b.place = Place::S(0);
      b.layout = *l;
    } else if (m.mode == Mode::kPartial) {
      if (b.place.is_s()) return false;
      if (!b.place.is_p()) b.p_first = u.write_version;
      b.place = Place::P(Reduce::kSum);
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
      if (auto bd = analyze_view(ni.node->defs[j].ref.meta, b.layout)) p = Place::S(bd->dim, bd->unit, bd->outer);
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

struct Candidate {
  int32_t buf;
  int64_t rows;
  RowLayout layout;
  bool marked;
};

// Data leaves and marks among the plan's buffers.
std::vector<Candidate> candidates(Analysis& a) {
  std::vector<Candidate> out;
  for (size_t b = 0; b < a.bufs.size(); ++b) {
    LazyBuffer* buf = a.bufs[b].buf;
    if (buf->batch_hint == LazyBuffer::BatchHint::kMarked) {
      RowLayout l;
      l.rows = buf->mark_rows;
      l.row_bytes = buf->mark_stride_bytes;
      int64_t block = l.rows * l.row_bytes;
      if (l.rows < 2 || block <= 0 || static_cast<int64_t>(buf->nbytes.load()) % block != 0) continue;
      l.outer = static_cast<int64_t>(buf->nbytes.load()) / block;
      out.push_back(Candidate{static_cast<int32_t>(b), l.rows, l, true});
    }
  }
  auto leaf = [&](int32_t b, const TensorMeta& m) {
    if (a.bufs[b].buf->batch_hint != LazyBuffer::BatchHint::kAuto || m.sizes.empty() || m.sizes[0] < 2) return;
    for (const Candidate& c : out) {
      if (c.buf == b) return;
    }
    auto l = layout_of(m, a.bufs[b].buf->nbytes.load(), BatchDim{0, 1}, m.sizes[0]);
    if (l) out.push_back(Candidate{b, m.sizes[0], *l, false});
  };
  for (int32_t i : a.order) {
    const Node& n = *a.nodes[i].node;
    if (n.upload && !n.uses.empty() && n.uses[0].full_overwrite()) leaf(a.nodes[i].use_buf[0], n.uses[0].ref.meta);
  }
  // Leaves uploaded by an earlier materialization whose real data is still the upload.
  for (size_t b = 0; b < a.bufs.size(); ++b) {
    LazyBuffer* buf = a.bufs[b].buf;
    if (buf->upload_version == 0 || !buf->has_real() || buf->real_version != buf->upload_version) continue;
    if (buf->batch_hint != LazyBuffer::BatchHint::kAuto || buf->upload_rows < 2) continue;
    bool seen = false;
    for (const Candidate& c : out) seen = seen || c.buf == static_cast<int32_t>(b);
    RowLayout l;
    l.rows = buf->upload_rows;
    l.row_bytes = buf->upload_stride_bytes;
    const int64_t block = l.rows * l.row_bytes;
    if (seen || block <= 0 || static_cast<int64_t>(buf->nbytes.load()) % block != 0) continue;
    l.outer = static_cast<int64_t>(buf->nbytes.load()) / block;
    out.push_back(Candidate{static_cast<int32_t>(b), l.rows, l, false});
  }
  return out;
}

void propagate(Analysis& a, const std::vector<Candidate>& seeds) {
  for (BufInfo& b : a.bufs) {
    b.place = Place::R();
    b.seed = false;
  }
  for (const Candidate& c : seeds) {
    a.bufs[c.buf].place = Place::S(0);
    a.bufs[c.buf].layout = c.layout;
    a.bufs[c.buf].seed = true;
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
}

size_t loop_nodes(const Analysis& a) {
  size_t n = 0;
  for (int32_t i : a.order) n += a.nodes[i].loop && !a.nodes[i].node->upload;
  return n;
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
      bool ok = true;
      for (auto [i, k] : rd[bi]) {
        // In-place producers (div_ on a dropout mask) read it too: they move into the loop with it.
        if (std::find(producers[bi].begin(), producers[bi].end(), i) != producers[bi].end()) continue;
        const NodeInfo& ni = a.nodes[i];
        const OperandMode& m = ni.rr.ins[k];
        if (!ni.loop || m.mode != Mode::kRows) {
          ok = false;
          break;
        }
        auto l = layout_of(ni.node->uses[k].ref.meta, b.buf->nbytes.load(), BatchDim{m.dim, m.unit, m.outer}, a.batch);
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

} // namespace

int32_t Analysis::buffer(LazyBuffer* b) {
  auto [it, inserted] = index.emplace(b, static_cast<int32_t>(bufs.size()));
  if (inserted) {
    BufInfo bi;
    bi.buf = b;
    bi.resident = b->has_real() && !b->real_on_host;
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

Place Analysis::use_place(const NodeInfo& ni, size_t u) const {
  const BufInfo& b = bufs[ni.use_buf[u]];
  if (b.place.is_s()) {
    auto bd = analyze_view(ni.node->uses[u].ref.meta, b.layout);
    return bd ? Place::S(bd->dim, bd->unit, bd->outer) : Place::R();
  }
  if (b.place.is_p()) {
    // Partial only in the versions written by the loop; a finished value written after is R. A
    // partial finished by a division is only ever read finished.
    uint32_t v = ni.node->uses[u].ref.version;
    return v >= b.p_first && v <= b.p_last && !b.p_finish ? b.place : Place::R();
  }
  return b.place;
}

bool Analysis::reads_partial(const NodeInfo& ni, size_t u) const {
  const BufInfo& b = bufs[ni.use_buf[u]];
  uint32_t v = ni.node->uses[u].ref.version;
  return b.place.is_p() && v >= b.p_first && v <= b.p_last;
}

void evaluate(Analysis& a, int32_t i, const std::vector<Place>& want) {
  NodeInfo& ni = a.nodes[i];
  const Node& n = *ni.node;
  build_operands(a, ni);
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
  RuleCall call{n.op, n.args, ni.ops, outs, a.batch, want};
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
  }
  ni.family = e ? e->family : "";
  ni.barrier = false;
  if (!ok) {
    const char* why = (e || forced != a.forced_barriers.end()) ? r.why : "no placement rule for this op";
    make_barrier(a, i, why);
    ni.barrier = batched;
  }
  ni.loop = false;
  if (!ni.barrier) {
    for (const OperandMode& m : r.ins) ni.loop = ni.loop || m.mode != Mode::kWhole;
    for (const Place& p : r.outs) ni.loop = ni.loop || !p.is_r();
  }
}

bool place_batch(Analysis& a, const std::vector<Node*>& nodes, const std::vector<int32_t>& runs,
                 const std::vector<LazyBuffer*>& live, const std::vector<LazyBuffer*>& needed) {
  for (Node* n : nodes) a.add_node(n);
  for (int32_t i : runs) {
    a.nodes[i].runs = true;
    a.order.push_back(i);
  }
  for (LazyBuffer* b : live) a.bufs[a.buffer(b)].live = true;
  for (LazyBuffer* b : needed) a.bufs[a.buffer(b)].needed = true;
  std::vector<Candidate> all = candidates(a);
  if (all.empty()) {
    a.notes.push_back("no data leaf: nothing uploaded from the host (or marked with torch_lazymem.mark_batch) "
                      "feeds this program, so it has no batch to split");
    return false;
  }
  // Marks decide; otherwise leaves grouped by size, each group tried alone.
  std::map<int64_t, std::vector<Candidate>> groups;
  bool marked = false;
  for (const Candidate& c : all) marked = marked || c.marked;
  for (const Candidate& c : all) {
    if (!marked || c.marked) groups[c.rows].push_back(c);
  }
  std::vector<int64_t> relevant;
  const std::vector<int32_t> order = a.order;
  const size_t program_nodes = a.nodes.size();
  auto reset = [&] {
    a.order = order;
    a.owned.clear();
    a.nodes.resize(program_nodes); // drop nodes synthesized by an earlier try
  };
  for (auto& [rows, seeds] : groups) {
    if (groups.size() == 1) {
      relevant.push_back(rows);
      break;
    }
    a.batch = rows;
    reset();
    propagate(a, seeds);
    if (loop_nodes(a) > 0) relevant.push_back(rows);
  }
  if (relevant.size() != 1) {
    if (relevant.size() > 1) {
      std::ostringstream os;
      os << "data leaves disagree on the batch size (";
      for (size_t k = 0; k < relevant.size(); ++k) os << (k ? ", " : "") << relevant[k];
      os << " rows): not split; mark the batch with torch_lazymem.mark_batch(tensor, dim), or exclude a "
            "tensor that is not data (a weight uploaded before requires_grad_(), a lookup table) with "
            "mark_batch(tensor, None)";
      a.notes.push_back(os.str());
      stats().batch_conflicts.fetch_add(1, std::memory_order_relaxed);
    } else {
      a.notes.push_back("no op can be split along the data leaves' dim 0");
    }
    return false;
  }
  a.batch = relevant[0];
  reset();
  propagate(a, groups[a.batch]);
  sink(a);
  a.barriers = 0;
  for (int32_t i : a.order) a.barriers += a.nodes[i].barrier;
  if (loop_nodes(a) == 0) {
    a.notes.push_back("every op that reads the batch runs whole (no placement rule splits them)");
    return false;
  }
  return true;
}

} // namespace lazymem
