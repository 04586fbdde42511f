// plan: runs of element-wise nodes in blocks of their tensors' rows (see rows.h).
#include "plan/rows.h"

#include <algorithm>
#include <optional>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "ops/placement.h"
#include "plan/localize.h"

namespace lazymem {
namespace {

constexpr int64_t kMinRows = 2;

using Shape = c10::SmallVector<int64_t, 5>;

// The row layout of a view of `shape` whose row r is its buffer's row r, the view covering the
// buffer's storage row-major along dim 0 (a parameter, its gradient, its optimizer state); nullopt
// otherwise.
std::optional<RowLayout> rows_layout(const TensorMeta& m, const LazyBuffer& b) {
  if (m.sizes.empty() || m.sizes[0] < kMinRows) return std::nullopt;
  BatchDim at;
  at.dim = 0;
  std::optional<RowLayout> l = layout_of(m, b.nbytes.load(std::memory_order_relaxed), at, m.sizes[0]);
  if (!l || l->outer != 1) return std::nullopt;
  return l;
}

bool same_shape(const TensorMeta& m, const Shape& s) {
  return m.sizes.size() == s.size() && std::equal(s.begin(), s.end(), m.sizes.begin());
}

// The shape a node's run would be over: its first output's, else the first tensor it writes.
std::optional<Shape> lead_shape(const Node& n) {
  if (!n.defs.empty()) return n.defs[0].ref.meta.sizes;
  for (const Use& u : n.uses) {
    if (u.write) return u.ref.meta.sizes;
  }
  return std::nullopt;
}

// Whether `pn` is element-wise over tensors of `shape` (scalars read whole), each bound by rows.
// A tensor it only overwrites must already have storage (or get it earlier in the run: `made`).
bool eligible(const PlannedNode& pn, const Shape& shape, const std::unordered_set<const LazyBuffer*>& made) {
  const Node& n = *pn.node;
  if (n.random || n.effectful || n.upload || pn.placeholder_outputs || !is_pointwise_op(pn.op)) return false;
  if (n.defs.empty() && std::none_of(n.uses.begin(), n.uses.end(), [](const Use& u) { return u.write; })) return false;
  for (const Def& d : n.defs) {
    if (!same_shape(d.ref.meta, shape) || !rows_layout(d.ref.meta, *d.ref.buf)) return false;
  }
  for (const Use& u : n.uses) {
    if (same_shape(u.ref.meta, shape)) {
      if (!rows_layout(u.ref.meta, *u.ref.buf)) return false;
      if (u.write_only && !u.ref.buf->has_real() && !made.count(u.ref.buf.get())) return false;
    } else if (u.write || u.ref.meta.numel() > 1) {
      return false;
    }
  }
  return true;
}

struct Run {
  size_t first = 0, last = 0; // positions in the stage, [first, last)
  Shape shape;
};

// The runs of stage `st` around its nodes in `over`.
std::vector<Run> find_runs(const Stage& st, const std::unordered_set<const Node*>& over) {
  std::vector<Run> runs;
  std::unordered_set<const LazyBuffer*> made; // defined or written by a node of the run so far
  for (size_t p = 0; p < st.nodes.size(); ++p) {
    if (!over.count(st.nodes[p].node) || (!runs.empty() && p < runs.back().last)) continue;
    std::optional<Shape> shape = lead_shape(*st.nodes[p].node);
    if (!shape || shape->empty() || (*shape)[0] < kMinRows) continue;
    made.clear();
    if (!eligible(st.nodes[p], *shape, made)) continue;
    Run r{p, p + 1, *shape};
    const size_t floor = runs.empty() ? 0 : runs.back().last;
    while (r.first > floor && eligible(st.nodes[r.first - 1], r.shape, made)) --r.first;
    // Forward from the start, knowing what the run made so far.
    made.clear();
    size_t q = r.first;
    for (; q < st.nodes.size() && eligible(st.nodes[q], r.shape, made); ++q) {
      for (const Def& d : st.nodes[q].node->defs) made.insert(d.ref.buf.get());
      for (const Use& u : st.nodes[q].node->uses) {
        if (u.write) made.insert(u.ref.buf.get());
      }
    }
    if (q <= p) continue; // (a node before p needed storage nothing had made)
    r.last = q;
    runs.push_back(std::move(r));
  }
  return runs;
}

// The loop stage running `st`'s nodes [r.first, r.last) in blocks of rows; nullopt when a scalar
// it reads whole is a value the run also binds by rows or writes.
std::optional<Stage> loop_of(const Stage& st, const Run& r) {
  Stage loop;
  loop.loop = true;
  loop.tensor_rows = true;
  loop.batch = r.shape[0];
  loop.chunk = loop.batch;
  // Released within the run: chunk-local if the run defines it, else released after the loop.
  std::unordered_map<const LazyBuffer*, size_t> released_at;
  for (size_t p = r.first; p < r.last; ++p) {
    for (LazyBuffer* b : st.released_after(st.nodes[p])) released_at.emplace(b, p - r.first);
  }
  std::unordered_set<const LazyBuffer*> defined, by_rows, whole;
  for (size_t p = r.first; p < r.last; ++p) {
    for (const Def& d : st.nodes[p].node->defs) defined.insert(d.ref.buf.get());
  }
  std::unordered_map<const LazyBuffer*, int32_t> slot_of;
  std::vector<std::pair<LazyBuffer*, uint32_t>> written; // in order of first write
  auto note_written = [&](LazyBuffer* b, uint32_t version) {
    for (auto& w : written) {
      if (w.first == b) {
        w.second = version;
        return;
      }
    }
    written.emplace_back(b, version);
  };
  auto rows_bound = [&](const TensorMeta& m, LazyBuffer* b) {
    Bound bd;
    bd.dim = 0;
    by_rows.insert(b);
    if (defined.count(b) && released_at.count(b)) {
      auto [it, fresh] = slot_of.emplace(b, static_cast<int32_t>(loop.slots.size()));
      if (fresh) {
        Slot sl;
        sl.buf = b;
        sl.store = Store::kLocal;
        sl.layout = *rows_layout(m, *b);
        loop.slots.push_back(sl);
      }
      bd.bind = Bind::kLocal;
      bd.slot = it->second;
    } else {
      bd.bind = Bind::kNarrow;
    }
    return bd;
  };
  for (size_t p = r.first; p < r.last; ++p) {
    PlannedNode pn = st.nodes[p];
    const Node& n = *pn.node;
    pn.release_begin = pn.release_end = 0;
    pn.uses.assign(n.uses.size(), Bound{});
    pn.defs.assign(n.defs.size(), Bound{});
    for (size_t k = 0; k < n.uses.size(); ++k) {
      const Use& u = n.uses[k];
      if (!same_shape(u.ref.meta, r.shape)) {
        whole.insert(u.ref.buf.get());
        continue;
      }
      pn.uses[k] = rows_bound(u.ref.meta, u.ref.buf.get());
      if (u.write && pn.uses[k].bind == Bind::kNarrow) note_written(u.ref.buf.get(), u.write_version);
    }
    for (size_t j = 0; j < n.defs.size(); ++j) {
      const Def& d = n.defs[j];
      pn.defs[j] = rows_bound(d.ref.meta, d.ref.buf.get());
      if (pn.defs[j].bind == Bind::kNarrow) {
        note_written(d.ref.buf.get(), d.ref.version);
        loop.stores.push_back(FullStore{d.ref.buf.get(), false, d.ref.version});
      }
    }
    pn.rows = RowMap{};
    pn.row_node = true;
    loop.nodes.push_back(std::move(pn));
  }
  for (const LazyBuffer* b : whole) {
    if (by_rows.count(b)) return std::nullopt;
  }
  for (FullStore& f : loop.stores) {
    for (const auto& w : written) {
      if (w.first == f.buf) f.version = w.second;
    }
  }
  loop.written = std::move(written);
  for (const auto& [b, at] : released_at) {
    auto s = slot_of.find(b);
    if (s != slot_of.end()) {
      loop.nodes[at].free_slots.push_back(s->second);
    } else {
      loop.release_after.push_back(const_cast<LazyBuffer*>(b));
    }
  }
  std::sort(loop.release_after.begin(), loop.release_after.end(),
            [](const LazyBuffer* a, const LazyBuffer* b) { return a->id < b->id; });
  return loop;
}

// Stage `st`'s nodes [first, last) as a whole stage of their own, with their releases.
Stage whole_part(const Stage& st, size_t first, size_t last) {
  Stage w;
  std::vector<std::pair<size_t, LazyBuffer*>> after;
  for (size_t p = first; p < last; ++p) {
    w.nodes.push_back(st.nodes[p]);
    for (LazyBuffer* b : st.released_after(st.nodes[p])) after.emplace_back(p - first, b);
  }
  w.set_released(after);
  return w;
}

} // namespace

bool block_rows(Plan& plan, const MemoryModel& model, int64_t budget) {
  if (budget < 0) return false;
  std::unordered_map<int32_t, std::unordered_set<const Node*>> over; // stage -> nodes over the budget
  for (const MemPoint* p : model.over(budget)) {
    if (p->node) over[p->stage].insert(p->node);
  }
  if (over.empty()) return false;
  bool changed = false;
  std::vector<Stage> stages;
  stages.reserve(plan.stages.size());
  for (size_t s = 0; s < plan.stages.size(); ++s) {
    Stage& st = plan.stages[s];
    auto it = over.find(static_cast<int32_t>(s));
    std::vector<Run> runs;
    if (!st.loop && it != over.end()) runs = find_runs(st, it->second);
    std::vector<std::pair<Run, Stage>> loops;
    for (const Run& r : runs) {
      if (std::optional<Stage> l = loop_of(st, r)) loops.emplace_back(r, std::move(*l));
    }
    if (loops.empty()) {
      stages.push_back(std::move(st));
      continue;
    }
    changed = true;
    size_t at = 0;
    for (auto& [r, l] : loops) {
      if (r.first > at) stages.push_back(whole_part(st, at, r.first));
      stages.push_back(std::move(l));
      at = r.last;
    }
    if (at < st.nodes.size()) stages.push_back(whole_part(st, at, st.nodes.size()));
  }
  if (!changed) return false;
  plan.stages = std::move(stages);
  plan.split = true;
  plan.notes.push_back("element-wise runs over one tensor's rows (an optimizer step's per-tensor chain) that do not "
                       "fit whole run in blocks of rows");
  return true;
}

} // namespace lazymem
