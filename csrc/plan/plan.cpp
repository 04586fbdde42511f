// plan: the Plan value — batch ids, each whole stage's releases, and the text form explain() prints.
#include "plan/plan.h"

#include <algorithm>
#include <atomic>
#include <sstream>

#include "core/config.h"
#include "ops/op_rules.h"
#include "plan/localize.h"
#include "plan/timing.h"

namespace lazymem {

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
  if (pn.rng_stream) os << " [random: eager's draws, generated whole once, rows read per chunk]";
  if (pn.rng_block) os << " [random, rows keyed in blocks of " << pn.rng_block << "]";
  if (!pn.rewrites.empty()) os << " [" << pn.rewrites.size() << " args per chunk]";
  if (pn.op != n.op) os << " [runs as " << pn.op.operator_name().name << "]";
  return os.str();
}

} // namespace

namespace {

// Whether no node of `st` writes `b`.
bool read_only(const Stage& st, const LazyBuffer* b) {
  for (const PlannedNode& other : st.nodes) {
    for (const Def& d : other.node->defs) {
      if (d.ref.buf.get() == b) return false;
    }
    for (const Use& w : other.node->uses) {
      if (w.write && w.ref.buf.get() == b) return false;
    }
  }
  return true;
}

// A use that reads rows of the chunk of a value, and nothing else of it, without writing it.
bool reads_rows(const PlannedNode& pn, size_t i) {
  if (pn.uses.size() <= i) return false;
  const Bound& bd = pn.uses[i];
  return bd.bind == Bind::kNarrow && bd.outer == 1 && bd.dim >= 0 && !pn.node->uses[i].write && !pn.node->upload;
}

bool within_rows(const TensorMeta& dm, const Bound& db, const TensorMeta& um, const Bound& ub, int64_t rows);

// The shared reads of `b` (read only in `st`): uses in order, each joining the first earlier one (of
// an earlier node) whose rows of the same version hold its rows, or starting a group of its own.
std::vector<KeptRows> shared_reads(const Stage& st, const LazyBuffer* b) {
  std::vector<KeptRows> groups;
  for (size_t n = 0; n < st.nodes.size(); ++n) {
    const PlannedNode& r = st.nodes[n];
    for (size_t u = 0; u < r.uses.size(); ++u) {
      const Use& use = r.node->uses[u];
      if (use.ref.buf.get() != b || !reads_rows(r, u)) continue;
      const Bound& ub = r.uses[u];
      bool joined = false;
      for (KeptRows& g : groups) {
        const PlannedNode& w = st.nodes[g.writer];
        const Use& first = w.node->uses[g.def];
        const Bound& fb = w.uses[g.def];
        const int64_t rows = fb.map.identity() ? st.batch : fb.map.n;
        if (g.writer == n || first.ref.version != use.ref.version || fb.map != ub.map ||
            !within_rows(first.ref.meta, fb, use.ref.meta, ub, rows)) {
          continue;
        }
        g.readers.emplace_back(n, u);
        g.last = n;
        joined = true;
        break;
      }
      if (!joined) groups.push_back(KeptRows{n, u, n, {}, true});
    }
  }
  return groups;
}

bool shared_reader(const Stage& st, size_t j, size_t i) {
  for (const KeptRows& g : shared_reads(st, st.nodes[j].node->uses[i].ref.buf.get())) {
    if (std::find(g.readers.begin(), g.readers.end(), std::make_pair(j, i)) != g.readers.end()) return true;
  }
  return false;
}

} // namespace

bool copied_ahead(const Stage& st, const PlannedNode& pn, size_t i) {
  if (!st.loop || pn.uses.size() <= i) return false;
  const Bound& bd = pn.uses[i];
  const Use& u = pn.node->uses[i];
  if (bd.bind != Bind::kNarrow || bd.outer != 1 || u.write || pn.node->upload) return false;
  if (!read_only(st, u.ref.buf.get())) return false;
  // A reader of rows an earlier use's copy holds takes that copy (KeptRows::read): nothing to copy.
  const size_t j = static_cast<size_t>(&pn - st.nodes.data());
  return !(j < st.nodes.size() && reads_rows(pn, i) && shared_reader(st, j, i));
}

const TensorMeta& KeptRows::meta(const Stage& st) const {
  const Node& n = *st.nodes[writer].node;
  return read ? n.uses[def].ref.meta : n.defs[def].ref.meta;
}

const Bound& KeptRows::bound(const Stage& st) const {
  const PlannedNode& pn = st.nodes[writer];
  return read ? pn.uses[def] : pn.defs[def];
}

namespace {

// The offset of the reader's first element past the writer's rows' first, and the reader's last
// element's distance from its first (-1: none), for rows [first, first + count).
std::pair<int64_t, int64_t> reach(const TensorMeta& dm, const Bound& db, const TensorMeta& um, const Bound& ub,
                                  int64_t first, int64_t count) {
  const TensorMeta d = narrow_rows(dm, db.dim, db.unit, first, count);
  const TensorMeta u = narrow_rows(um, ub.dim, ub.unit, first, count);
  int64_t span = 0;
  for (size_t k = 0; k < u.sizes.size(); ++k) {
    if (u.sizes[k] == 0) return {0, -1};
    span += (u.sizes[k] - 1) * std::max<int64_t>(u.strides[k], 0);
  }
  return {u.offset - d.offset, span};
}

// Whether the reader's rows of a value (view `um` bound by `ub`) are elements of the writer's rows
// (`dm` bound by `db`), one dense range, in every chunk. The writer's rows hold `per` elements a row;
// the reader's start `delta` elements into them and reach `slope` elements further a row, plus `base`:
// all affine in the rows, so two rows tell it: the same delta for a chunk starting at row 0 or 1 (the
// reader's rows start where the writer's do), and delta + span < the writer's elements for one row and
// for every count (slope <= per).
bool within_rows(const TensorMeta& dm, const Bound& db, const TensorMeta& um, const Bound& ub, int64_t rows) {
  if (dm.dtype != um.dtype || dm.conj != um.conj || dm.neg != um.neg) return false;
  for (int64_t s : um.strides) {
    if (s < 0) return false;
  }
  const TensorMeta d1 = narrow_rows(dm, db.dim, db.unit, 0, 1);
  if (!d1.row_major()) return false;
  const auto [delta, span1] = reach(dm, db, um, ub, 0, 1);
  if (span1 < 0 || delta < 0 || delta + span1 >= d1.numel()) return false;
  if (rows < 2) return true;
  if (!narrow_rows(dm, db.dim, db.unit, 0, 2).row_major()) return false;
  const auto [delta1, span_at1] = reach(dm, db, um, ub, 1, 1);
  const auto [delta2, span2] = reach(dm, db, um, ub, 0, 2);
  const int64_t per = d1.numel();
  return delta1 == delta && span_at1 == span1 && delta2 == delta && span2 >= 0 && span2 - span1 <= per &&
      delta + span2 < 2 * per;
}

} // namespace

std::vector<KeptRows> kept_rows(const Stage& st, c10::function_ref<bool(const LazyBuffer*)> on_host) {
  std::vector<KeptRows> out;
  if (!st.loop) return out;
  for (size_t j = 0; j < st.nodes.size(); ++j) {
    const PlannedNode& w = st.nodes[j];
    if (w.defs.empty() || w.node->random || w.rng_block > 0 || w.rng_stream || w.node->row_keyed) continue;
    for (size_t i = 0; i < w.defs.size(); ++i) {
      const Bound& db = w.defs[i];
      const Def& d = w.node->defs[i];
      const LazyBuffer* b = d.ref.buf.get();
      if (db.bind != Bind::kNarrow || db.outer != 1 || db.dim < 0 || !on_host(b)) continue;
      if (i < w.post_div.size() && w.post_div[i] != 0) continue;
      const int64_t rows = db.map.identity() ? st.batch : db.map.n;
      KeptRows k{j, i, j, {}};
      for (size_t n = j + 1; n < st.nodes.size(); ++n) {
        const PlannedNode& r = st.nodes[n];
        bool writes = false; // a node writing the value reads it as eager does, aliased: not from the kept rows
        for (const Use& u : r.node->uses) writes = writes || (u.write && u.ref.buf.get() == b);
        for (const Def& e : r.node->defs) writes = writes || e.ref.buf.get() == b;
        if (writes) break; // (and what it writes is a later version)
        for (size_t u = 0; u < r.uses.size(); ++u) {
          const Use& use = r.node->uses[u];
          const Bound& ub = r.uses[u];
          if (use.ref.buf.get() != b || use.ref.version != d.ref.version || ub.bind != Bind::kNarrow || ub.outer != 1 ||
              ub.dim < 0 || ub.map != db.map || !within_rows(d.ref.meta, db, use.ref.meta, ub, rows)) {
            continue;
          }
          k.readers.emplace_back(n, u);
          k.last = n;
        }
      }
      if (!k.readers.empty()) out.push_back(std::move(k));
    }
  }
  // Shared reads of host-held values the stage only reads, each value once.
  std::vector<const LazyBuffer*> seen;
  for (const PlannedNode& r : st.nodes) {
    for (size_t u = 0; u < r.uses.size(); ++u) {
      const LazyBuffer* b = r.node->uses[u].ref.buf.get();
      if (!reads_rows(r, u) || !on_host(b) || std::find(seen.begin(), seen.end(), b) != seen.end()) continue;
      seen.push_back(b);
      if (!read_only(st, b)) continue;
      for (KeptRows& g : shared_reads(st, b)) {
        if (!g.readers.empty()) out.push_back(std::move(g));
      }
    }
  }
  return out;
}

std::vector<StageTransfers> plan_transfers(const Plan& plan) {
  std::vector<const LazyBuffer*> host;
  auto on_host = [&](const LazyBuffer* b) {
    return std::find(host.begin(), host.end(), b) != host.end() || (b->has_real() && b->real_on_host);
  };
  std::vector<StageTransfers> out(plan.stages.size());
  for (size_t s = 0; s < plan.stages.size(); ++s) {
    const Stage& st = plan.stages[s];
    StageTransfers& t = out[s];
    for (const FullStore& f : st.stores) {
      if (f.host) host.push_back(f.buf);
    }
    const int64_t runs = st.loop ? st.chunks() : 1;
    std::vector<std::pair<size_t, size_t>> kept; // reads of rows the chunk wrote there: no copy
    for (const KeptRows& k : kept_rows(st, on_host)) kept.insert(kept.end(), k.readers.begin(), k.readers.end());
    auto note = [&](const LazyBuffer* b, int64_t bytes) {
      for (auto& [v, n] : t.values) {
        if (v == b) {
          n += bytes;
          return;
        }
      }
      t.values.emplace_back(b, bytes);
    };
    for (const PlannedNode& pn : st.nodes) {
      const Node& n = *pn.node;
      for (size_t i = 0; i < n.uses.size(); ++i) {
        const Use& u = n.uses[i];
        if (!n.upload && !on_host(u.ref.buf.get())) continue; // (most operands: nothing crosses)
        const bool whole = pn.uses.empty() || pn.uses[i].bind == Bind::kWhole;
        const int64_t view = static_cast<int64_t>(u.ref.meta.numel() * c10::elementSize(u.ref.meta.dtype));
        if (n.upload && u.write) {
          if (!on_host(u.ref.buf.get())) {
            t.h2d += view; // the snapshot's bytes, whole or row by row
            t.copies += st.loop && !whole ? runs : 1;
          }
          continue;
        }
        if (!on_host(u.ref.buf.get())) continue;
        if (std::find(kept.begin(), kept.end(), std::make_pair(static_cast<size_t>(&pn - st.nodes.data()), i)) !=
            kept.end()) {
          continue;
        }
        // Rows of the chunk (the view's bytes over the pass), or the whole view per chunk.
        const int64_t in = whole ? view * runs : view, copies = st.loop ? runs : 1;
        if (!u.write_only) t.h2d += in;
        if (u.write) t.d2h += in;
        t.copies += copies * ((u.write_only ? 0 : 1) + (u.write ? 1 : 0));
        if (st.loop && copied_ahead(st, pn, i)) t.ahead += copies;
        note(u.ref.buf.get(), in);
      }
      for (size_t j = 0; j < n.defs.size(); ++j) {
        const Def& d = n.defs[j];
        if (!on_host(d.ref.buf.get()) || (!pn.defs.empty() && pn.defs[j].bind == Bind::kDiscard)) continue;
        const int64_t bytes = static_cast<int64_t>(d.ref.meta.numel() * c10::elementSize(d.ref.meta.dtype));
        t.d2h += bytes;
        t.copies += st.loop ? runs : 1;
        note(d.ref.buf.get(), bytes);
      }
    }
  }
  return out;
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
  const std::vector<StageTransfers> transfers = plan_transfers(*this);
  {
    int64_t h2d = 0, d2h = 0;
    for (const StageTransfers& t : transfers) {
      h2d += t.h2d;
      d2h += t.d2h;
    }
    if (h2d + d2h > 0) {
      const double bw = config().link_bandwidth.load(std::memory_order_relaxed);
      os << "  transfers: " << format_bytes(h2d) << " host to device, " << format_bytes(d2h)
         << " device to host; predicted copy time " << format_seconds(predicted_copy_seconds(h2d) + predicted_copy_seconds(d2h))
         << (bw > 0 ? " (the modeled link, " : " (assuming ") << (bw > 0 ? bw : 25e9) / 1e9 << " GB/s each way)\n";
    }
  }
  for (size_t i = 0; i < stages.size(); ++i) {
    const Stage& st = stages[i];
    auto show_transfers = [&] {
      const StageTransfers& t = transfers[i];
      if (t.h2d + t.d2h == 0) return;
      os << "    transfers: " << format_bytes(t.h2d) << " in, " << format_bytes(t.d2h) << " out in " << t.copies
         << (t.copies == 1 ? " copy" : " copies") << ", predicted "
         << format_seconds(predicted_copy_seconds(t.h2d) + predicted_copy_seconds(t.d2h));
      if (t.ahead > 0) os << " (" << t.ahead << " started a chunk ahead, while the chunk before computes)";
      for (size_t k = 0; k < t.values.size(); ++k) {
        os << (k ? "," : ";") << " b" << t.values[k].first->id << " " << format_bytes(t.values[k].second);
      }
      os << "\n";
    };
    if (!st.loop) {
      os << "  stage " << i << ": " << st.nodes.size() << " nodes run once\n";
      show_transfers();
    } else {
      os << "  stage " << i << ": pass over " << st.batch << " rows";
      if (st.tensor_rows) {
        os << " of its tensors (element-wise)";
      } else if (st.batch_id != 0) {
        os << " of batch " << st.batch_id;
      }
      os << " in " << st.chunks() << " chunks of " << st.chunk
         << ", " << st.nodes.size() << " nodes\n";
      if (st.bound.node >= 0 && static_cast<size_t>(st.bound.node) < st.nodes.size()) {
        const Node& at = *st.nodes[static_cast<size_t>(st.bound.node)].node;
        os << "    chunk rows bounded at #" << at.seq << " " << at.op.operator_name().name << ": "
           << format_bytes(st.bound.bytes) << " held there whatever the chunk size, " << format_bytes(st.bound.per_row)
           << " more a row\n";
      }
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
        os << "    " << local.size() << (st.tensor_rows ? " values chunk-local, " : " batch-sharded values chunk-local, ")
           << format_bytes(per_chunk)
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
      show_transfers();
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
    } else {
      // torch.distributed collectives (dist/collectives.cpp): where each runs, once, in record order,
      // and the bytes of the tensors it writes (not its ordering token).
      for (const PlannedNode& pn : st.nodes) {
        if (!op_rules(pn.op).collective) continue;
        const std::optional<int> token = pn.op.schema().argumentIndexWithName("token");
        int64_t bytes = 0;
        for (const Use& u : pn.node->uses) {
          if (u.write && u.arg != token.value_or(-1)) bytes += u.ref.meta.numel() * c10::elementSize(u.ref.meta.dtype);
        }
        const std::string& name = pn.op.operator_name().name; // lazymem::c10d_<collective>_
        os << "    collective: " << name.substr(14, name.size() - 15) << " (op #" << pn.node->seq
           << " of the recorded program, " << format_bytes(bytes) << "), once" << (st.loop ? " per chunk" : "") << "\n";
      }
    }
  }
  return os.str();
}

} // namespace lazymem
