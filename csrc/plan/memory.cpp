// plan: the memory model.
#include "plan/memory.h"
#include "plan/rows.h"

#include <algorithm>
#include <atomic>
#include <sstream>
#include <unordered_map>
#include <utility>
#include <vector>

#include "core/config.h"
#include "plan/timing.h"
#include "plan/workspace.h"

namespace lazymem {
namespace {

struct Affine {
  int64_t bytes = 0;
  int64_t per_row = 0;
  Affine& operator+=(const Affine& o) {
    bytes += o.bytes;
    per_row += o.per_row;
    return *this;
  }
  Affine& operator-=(const Affine& o) {
    bytes -= o.bytes;
    per_row -= o.per_row;
    return *this;
  }
  Affine operator+(const Affine& o) const {
    Affine a = *this;
    a += o;
    return a;
  }
};

// Bytes per batch row of a view whose batch dim is `dim` (unit elements per row); a view of some rows
// (a slice along the batch) has its own rows, one every `step` batch rows.
int64_t bytes_per_row(const TensorMeta& m, const Bound& bd, int64_t batch) {
  const int64_t rows = bd.map.identity() ? batch : bd.map.n * bd.map.step;
  if (bd.dim < 0 || rows <= 0) return 0;
  return (m.numel() * static_cast<int64_t>(c10::elementSize(m.dtype)) + rows - 1) / rows;
}

// A chunk-local storage: its rows in a chunk of c batch rows are at most c / step + 1 (c for a map
// of step 1, the identity included).
struct SlotBytes {
  int64_t bytes;
  int64_t per_row;
};
SlotBytes local_bytes(const RowLayout& l) {
  const int64_t row = l.outer * l.row_bytes;
  if (l.map.step <= 1) return {0, row};
  return {row, (row + l.map.step - 1) / l.map.step};
}

class Simulator {
 public:
  explicit Simulator(const Plan& plan) : plan_(plan) {
    static std::atomic<uint64_t> stamps{0};
    stamp_ = stamps.fetch_add(1, std::memory_order_relaxed) + 1;
  }

  MemoryModel run() {
    cur_.bytes = plan_.resident;
    for (LazyBuffer* b : plan_.release_unused) {
      if (b->has_real() && !b->real_on_host) cur_.bytes -= static_cast<int64_t>(b->real.nbytes());
    }
    const Workspace& ws = Workspace::get();
    ws_ = &ws;
    for (size_t s = 0; s < plan_.stages.size(); ++s) {
      const Stage& st = plan_.stages[s];
      if (st.loop) {
        loop(st, static_cast<int32_t>(s));
      } else {
        whole(st, static_cast<int32_t>(s));
      }
    }
    return std::move(model_);
  }

 private:
  // Bytes `b` holds on the device now, per the simulation.
  int64_t held(LazyBuffer* b) {
    if (b->plan_stamp != stamp_) {
      b->plan_stamp = stamp_;
      b->plan_bytes = b->has_real() && !b->real_on_host ? static_cast<int64_t>(b->real.nbytes()) : -1;
    }
    return b->plan_bytes;
  }
  // Allocates `b` whole if it holds nothing yet; returns the bytes allocated.
  int64_t touch(LazyBuffer* b, size_t need) {
    if (held(b) >= 0) return 0;
    b->plan_bytes = static_cast<int64_t>(std::max(b->nbytes.load(std::memory_order_relaxed), need));
    return b->plan_bytes;
  }
  void release(LazyBuffer* b) {
    int64_t h = held(b);
    if (h > 0) cur_.bytes -= h;
    b->plan_bytes = -1;
  }

  Affine workspace(const PlannedNode& pn, bool loop) {
    if (!ws_->known_op(&pn.op.schema())) return {};
    auto a = ws_->predict(workspace_key(pn));
    return loop ? Affine{a.alpha, a.beta} : Affine{a.alpha, 0};
  }

  void point(int32_t stage, bool loop, const Affine& a, const Node* n) {
    model_.points.push_back(MemPoint{stage, loop, a.bytes, loop ? a.per_row : 0, n});
  }

  // Whether `b` is held in host memory at this point of the plan: from an earlier plan (and not
  // released since), or assembled there by a loop of this one. A kernel reads its device copy.
  bool on_host(const LazyBuffer* b) const {
    if (std::find(host_.begin(), host_.end(), b) != host_.end()) return true;
    return b->has_real() && b->real_on_host && b->plan_stamp != stamp_;
  }
  // A use of a host-held value that crosses to the device (an upload writes its home directly).
  bool copied_in(const Node& n, const Use& u) const {
    return on_host(u.ref.buf.get()) && !(n.upload && u.write);
  }

  void whole(const Stage& st, int32_t s) {
    for (const PlannedNode& pn : st.nodes) {
      const Node& n = *pn.node;
      Affine out, copies;
      for (const Def& d : n.defs) {
        if (on_host(d.ref.buf.get())) {
          copies.bytes += static_cast<int64_t>(d.ref.meta.extent_bytes()); // written on the device, then copied home
        } else {
          out.bytes += touch(d.ref.buf.get(), 0);
        }
      }
      for (const Use& u : n.uses) {
        if (copied_in(n, u)) {
          copies.bytes += static_cast<int64_t>(u.ref.meta.extent_bytes()); // its device copy, for this node
        } else if (!on_host(u.ref.buf.get())) {
          out.bytes += touch(u.ref.buf.get(), u.ref.meta.extent_bytes());
        }
      }
      point(s, false, cur_ + out + copies + workspace(pn, false), &n);
      cur_ += out;
      for (LazyBuffer* b : st.released_after(pn)) release(b);
    }
  }

  void loop(const Stage& st, int32_t s) {
    for (const FullStore& f : st.stores) {
      if (!f.host) {
        cur_.bytes += touch(f.buf, 0);
      } else {
        host_.push_back(f.buf);
      }
    }
    // The device copies of host-held rows started a chunk ahead (copied_ahead): one per use, held
    // across the whole loop (the next chunk's starts as soon as the node has read this chunk's).
    Affine ahead;
    std::vector<std::pair<const PlannedNode*, size_t>> ahead_uses;
    for (const PlannedNode& pn : st.nodes) {
      for (size_t i = 0; i < pn.uses.size(); ++i) {
        if (copied_in(*pn.node, pn.node->uses[i]) && copied_ahead(st, pn, i)) {
          ahead.per_row += bytes_per_row(pn.node->uses[i].ref.meta, pn.uses[i], st.batch);
          ahead_uses.emplace_back(&pn, i);
        }
      }
    }
    auto held_ahead = [&](const PlannedNode& pn, size_t i) {
      return std::find(ahead_uses.begin(), ahead_uses.end(), std::make_pair(&pn, i)) != ahead_uses.end();
    };
    // Rows written to host memory and read again in the chunk: held on the device from the writer
    // through the last reader, which copies nothing in.
    const std::vector<KeptRows> kept = kept_rows(st, [&](const LazyBuffer* b) { return on_host(b); });
    auto kept_read = [&](size_t node, size_t i) {
      for (const KeptRows& k : kept) {
        if (std::find(k.readers.begin(), k.readers.end(), std::make_pair(node, i)) != k.readers.end()) return true;
      }
      return false;
    };
    auto kept_def = [&](size_t node, size_t i) {
      return std::any_of(kept.begin(), kept.end(),
                         [&](const KeptRows& k) { return !k.read && k.writer == node && k.def == i; });
    };
    // A shared read's first reader: its copy of the rows stays from its node on.
    auto kept_copy = [&](size_t node) {
      Affine a;
      for (const KeptRows& k : kept) {
        if (k.read && k.writer == node) a.per_row += bytes_per_row(k.meta(st), k.bound(st), st.batch);
      }
      return a;
    };
    cur_ += ahead;
    std::vector<char> adopted(st.slots.size(), 0); // partials that became accumulators
    auto slot_bytes = [&](int32_t i) {
      const Slot& sl = st.slots[i];
      if (sl.store != Store::kLocal) return Affine{sl.bytes, 0};
      const SlotBytes b = local_bytes(sl.layout);
      return Affine{b.bytes, b.per_row};
    };
    for (int pass = 0; pass < 2; ++pass) { // the first chunk, then a steady one (accumulators held)
      std::vector<char> live(st.slots.size(), 0);
      for (size_t j = 0; j < st.nodes.size(); ++j) {
        const PlannedNode& pn = st.nodes[j];
        const Node& n = *pn.node;
        Affine out, transient, copies;
        for (size_t i = 0; i < n.uses.size(); ++i) {
          const Bound& bd = pn.uses[i];
          if (bd.bind == Bind::kLocal || bd.bind == Bind::kPartial) {
            if (!live[bd.slot]) {
              out += slot_bytes(bd.slot);
              live[bd.slot] = 1;
            }
          } else if (bd.bind == Bind::kWhole) {
            if (copied_in(n, n.uses[i])) {
              copies.bytes += static_cast<int64_t>(n.uses[i].ref.meta.extent_bytes()); // its device copy
            } else if (!on_host(n.uses[i].ref.buf.get())) {
              out.bytes += touch(n.uses[i].ref.buf.get(), n.uses[i].ref.meta.extent_bytes());
            }
          } else if (bd.bind == Bind::kNarrow && (bd.outer != 1 || copied_in(n, n.uses[i])) && !held_ahead(pn, i) &&
                     !kept_read(j, i)) {
            // A gathered copy, or the chunk's rows of a host-held value copied to the device.
            copies.per_row += bytes_per_row(n.uses[i].ref.meta, bd, st.batch);
          }
        }
        for (size_t i = 0; i < n.defs.size(); ++i) {
          const Bound& bd = pn.defs[i];
          const TensorMeta& m = n.defs[i].ref.meta;
          if (bd.bind == Bind::kLocal || bd.bind == Bind::kPartial) {
            if (!live[bd.slot]) {
              out += slot_bytes(bd.slot);
              live[bd.slot] = 1;
            }
          } else if (bd.bind == Bind::kNarrow || bd.bind == Bind::kDiscard) {
            // The kernel's own output lives until it is copied into place (or dropped).
            int64_t row = bytes_per_row(m, bd, st.batch);
            if (row > 0 && kept_def(j, i)) {
              out.per_row += row; // (until its last reader in the chunk)
            } else if (row > 0) {
              transient.per_row += row;
            } else {
              transient.bytes += static_cast<int64_t>(n.defs[i].ref.buf->nbytes.load());
            }
          } else {
            out.bytes += touch(n.defs[i].ref.buf.get(), 0);
          }
        }
        // A random node reading its stream: a chunk's copy of its rows on the device, and off the CPU
        // the whole stream while it is generated there (the first chunk; counted in every chunk).
        transient.per_row += pn.rng_row_bytes;
        transient.bytes += pn.rng_whole_bytes;
        // Learned workspace includes lazymem's own transients (a result copied into place), so the
        // known transient is a lower bound, not an addition.
        Affine w = workspace(pn, true);
        w.bytes = std::max(w.bytes, transient.bytes);
        w.per_row = std::max(w.per_row, transient.per_row);
        point(s, true, cur_ + out + copies + w, &n);
        cur_ += out;
        cur_ += kept_copy(j);
        for (int32_t slot : pn.accumulate) {
          if (pass == 0 && !adopted[slot]) {
            adopted[slot] = 1; // the first partial becomes the accumulator: it stays
            LazyBuffer* b = st.slots[slot].buf;
            b->plan_stamp = stamp_;
            b->plan_bytes = st.slots[slot].bytes;
            live[slot] = 2;
          }
        }
        for (int32_t slot : pn.free_slots) {
          if (live[slot] == 1) cur_ -= slot_bytes(slot);
          live[slot] = 0;
        }
        for (const KeptRows& k : kept) {
          if (k.last == j) cur_.per_row -= bytes_per_row(k.meta(st), k.bound(st), st.batch);
        }
      }
      for (size_t i = 0; i < live.size(); ++i) {
        if (live[i] == 1) cur_ -= slot_bytes(static_cast<int32_t>(i));
      }
    }
    cur_ -= ahead;
    for (LazyBuffer* b : st.release_after) release(b);
  }

  const Plan& plan_;
  const Workspace* ws_ = nullptr;
  std::vector<const LazyBuffer*> host_; // assembled in host memory by this plan's loops
  uint64_t stamp_ = 0;
  Affine cur_;
  MemoryModel model_;
};

} // namespace

MemoryModel model_memory(const Plan& plan) {
  return Simulator(plan).run();
}

int64_t MemoryModel::peak(const Plan& plan, const MemPoint** where) const {
  int64_t best = plan.resident;
  const MemPoint* at = nullptr;
  for (const MemPoint& p : points) {
    int64_t v = p.at(p.loop ? plan.stages[p.stage].chunk : 0);
    if (!at || v > best) {
      best = std::max(best, v);
      at = &p;
    }
  }
  if (where) *where = at;
  return best;
}

int64_t MemoryModel::max_chunk(int32_t stage, int64_t batch, int64_t budget) const {
  int64_t c = batch;
  for (const MemPoint& p : points) {
    if (p.stage != stage) continue;
    if (p.bytes > budget) return 0;
    if (p.per_row > 0) c = std::min(c, (budget - p.bytes) / p.per_row);
  }
  return std::max<int64_t>(c, 0);
}

const MemPoint* MemoryModel::bounding(int32_t stage, int64_t budget) const {
  const MemPoint* best = nullptr;
  int64_t rows = 0;
  for (const MemPoint& p : points) {
    if (p.stage != stage || p.per_row <= 0) continue;
    const int64_t r = (budget - p.bytes) / p.per_row;
    if (!best || r < rows) {
      best = &p;
      rows = r;
    }
  }
  return best;
}

void MemoryModel::annotate(Plan& plan) const {
  std::unordered_map<const Node*, int64_t> at;
  for (const MemPoint& p : points) {
    int64_t v = p.at(p.loop ? plan.stages[p.stage].chunk : 0);
    int64_t& best = at[p.node];
    best = std::max(best, v);
  }
  for (Stage& st : plan.stages) {
    for (PlannedNode& pn : st.nodes) pn.predicted = at[pn.node];
  }
}

int64_t balanced_chunk(int64_t batch, int64_t cmax, int64_t align) {
  if (cmax >= batch) return batch;
  if (cmax < 1) return 0;
  const int64_t n = (batch + cmax - 1) / cmax;
  int64_t c = (batch + n - 1) / n;
  const int64_t up = (c + align - 1) / align * align, down = c / align * align;
  if (up <= cmax) {
    c = up;
  } else if (down >= align && (batch + down - 1) / down == n) {
    c = down; // aligned without an extra chunk
  }
  return std::min(c, batch);
}

std::vector<const MemPoint*> MemoryModel::over(int64_t budget) const {
  std::vector<const MemPoint*> out;
  for (const MemPoint& p : points) {
    if (!p.loop && p.bytes > budget) out.push_back(&p);
  }
  return out;
}

ChunkChoice choose_chunks(Plan& plan, int64_t budget, int64_t forced, std::vector<std::string>& notes,
                          const std::function<Relief(const FullStore&)>& relieve) {
  for (;;) { // each round moves one store off the device, or returns
    MemoryModel model = model_memory(plan);
    bool ok = true;
    for (size_t s = 0; s < plan.stages.size(); ++s) {
      Stage& st = plan.stages[s];
      if (!st.loop) continue;
      const int64_t B = st.batch;
      if (forced > 0) {
        st.chunk = std::max<int64_t>(1, (B + forced - 1) / forced);
        continue;
      }
      int64_t cmax = budget < 0 ? B : model.max_chunk(static_cast<int32_t>(s), B, budget);
      if (cmax < 1) {
        ok = false;
        st.chunk = 1;
        continue;
      }
      st.chunk = balanced_chunk(B, cmax);
      st.bound = Stage::ChunkBound{};
      if (cmax < B) {
        if (const MemPoint* p = model.bounding(static_cast<int32_t>(s), budget)) {
          for (size_t j = 0; j < st.nodes.size(); ++j) {
            if (st.nodes[j].node != p->node) continue;
            st.bound = Stage::ChunkBound{static_cast<int32_t>(j), p->bytes, p->per_row};
            break;
          }
        }
      }
    }
    const MemPoint* where = nullptr;
    plan.predicted_peak = model.peak(plan, &where);
    model.annotate(plan);
    if (ok && (forced > 0 || budget < 0 || plan.predicted_peak <= budget)) return ChunkChoice::kFits;
    // Values stored whole on the device do not fit: the largest is recomputed where it is read (the
    // caller's choice) or goes to host memory (a result larger than the budget is assembled there and
    // downloaded from there; a value crossing passes is written there and read back chunk by chunk).
    FullStore* biggest = nullptr;
    for (Stage& st : plan.stages) {
      for (FullStore& f : st.stores) {
        if (f.host) continue;
        if (!biggest || f.buf->nbytes.load() > biggest->buf->nbytes.load()) biggest = &f;
      }
    }
    if (!biggest) {
      // Element-wise runs of a whole stage over one tensor's rows that do not fit (an optimizer
      // step's per-tensor chain, even one tensor at a time): in blocks of rows (plan/rows.h), sized
      // in the next round.
      if (forced <= 0 && budget >= 0 && block_rows(plan, model, budget)) continue;
      std::ostringstream os;
      os << "no chunk size fits the budget of " << format_bytes(budget);
      if (where && where->node) {
        os << ": at " << where->node->describe() << " " << format_bytes(where->bytes)
           << " must be held whatever the chunk size";
      }
      // Only the loops do not fit, by a model that may overestimate what a kernel needs: those run
      // one row per chunk (chosen above) rather than whole, which surely needs more; that run decides.
      if (!ok && model.over(budget).empty()) {
        plan.last_resort = true;
        plan.notes.push_back(os.str() + " by the memory model; as a last resort the loop runs one row per chunk");
        return ChunkChoice::kFits;
      }
      notes.push_back(os.str());
      return ChunkChoice::kNoFit;
    }
    if (relieve && relieve(*biggest) == Relief::kRecompute) return ChunkChoice::kReplan;
    biggest->host = true;
  }
}

double chunk_overhead_seconds(const Plan& plan, int64_t node_ns) {
  double ns = 0;
  for (const Stage& st : plan.stages) {
    if (st.loop) ns += static_cast<double>(st.chunks()) * static_cast<double>(st.nodes.size()) * static_cast<double>(node_ns);
  }
  return ns * 1e-9;
}

const FullStore* largest_device_store(const Plan& plan, double* copy_seconds) {
  const FullStore* biggest = nullptr;
  size_t at = 0;
  for (size_t s = 0; s < plan.stages.size(); ++s) {
    for (const FullStore& f : plan.stages[s].stores) {
      if (f.host || (biggest && f.buf->nbytes.load() <= biggest->buf->nbytes.load())) continue;
      biggest = &f;
      at = s;
    }
  }
  if (!biggest) return nullptr;
  int readers = 0; // later loops reading it copy its rows back
  for (size_t s = at + 1; s < plan.stages.size(); ++s) {
    bool reads = false;
    for (const PlannedNode& pn : plan.stages[s].nodes) {
      for (const Use& u : pn.node->uses) reads = reads || u.ref.buf.get() == biggest->buf;
      if (reads) break;
    }
    readers += reads;
  }
  *copy_seconds = predicted_copy_seconds(static_cast<int64_t>(biggest->buf->nbytes.load())) * (1 + readers);
  return biggest;
}

} // namespace lazymem
