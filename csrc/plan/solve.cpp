// plan: the batch solved for, not guessed (DESIGN.md §7, notes/batch_everywhere.md §3). Sources
// are the values that enter the plan from outside it: uploads (pending, or run by an earlier
// materialization with their batch fact), values an earlier plan stored with a batch fact, and
// buffers marked with torch_lazymem.mark_batch. Each source gets one of its dims (a row layout) or
// none; propagation through the op rules (plan/batch.cpp) says what that assignment splits.
// Correctness comes from the rules alone — any assignment they accept is exact — so the search only
// decides what fits: the fewest bytes held whatever the chunk size, then the fewest barriers, then
// the fewest batches. It starts from the hints (dim 0 of an upload, a stored value's own layout, a
// mark, which is never changed) and, unless that is already clean, tries each source's other
// options in turn, smallest sources first, keeping a change when it improves the score.
#include <algorithm>
#include <cstdio>
#include <sstream>

#include "core/config.h"
#include "plan/analysis.h"
#include "plan/localize.h"

namespace lazymem {
namespace {

constexpr int kMaxEvaluations = 40;
constexpr size_t kMaxSources = 24; // beyond these (smallest last), sources keep their hint

int64_t nbytes(const LazyBuffer* b) {
  return static_cast<int64_t>(b->nbytes.load(std::memory_order_relaxed));
}

// The options of a source with view `m` over a buffer of `bytes`: every dim of at least two rows
// whose rows cover the storage [outer][rows][row].
void add_dims(Source& s, const TensorMeta& m, size_t bytes) {
  for (size_t d = 0; d < m.sizes.size() && d < 8; ++d) {
    if (m.sizes[d] < 2) continue;
    auto l = layout_of(m, bytes, BatchDim{static_cast<int8_t>(d), 1, 1}, m.sizes[d]);
    if (!l) continue;
    if (d == 0) s.hint = static_cast<int32_t>(s.dims.size());
    s.dims.push_back(static_cast<int8_t>(d));
    s.layouts.push_back(*l);
  }
}

// A batch fact recorded on the buffer and still valid (its value is the version the fact describes).
bool valid_fact(const LazyBuffer& b) {
  return b.fact_version != 0 && b.has_real() && b.real_version == b.fact_version && b.fact_rows >= 2 &&
      b.fact_row_bytes > 0 && static_cast<int64_t>(b.nbytes.load()) % (b.fact_rows * b.fact_row_bytes) == 0;
}

std::vector<Source> collect_sources(Analysis& a) {
  std::vector<Source> out;
  std::vector<char> seen(a.bufs.size(), 0);
  for (size_t b = 0; b < a.program_bufs; ++b) {
    LazyBuffer* buf = a.bufs[b].buf;
    if (buf->batch_hint != LazyBuffer::BatchHint::kMarked) continue;
    RowLayout l;
    l.rows = buf->mark_rows;
    l.row_bytes = buf->mark_stride_bytes;
    const int64_t block = l.rows * l.row_bytes;
    if (l.rows < 2 || block <= 0 || nbytes(buf) % block != 0) continue;
    l.outer = nbytes(buf) / block;
    Source s;
    s.buf = static_cast<int32_t>(b);
    s.kind = Source::kMarked;
    s.dims.push_back(-1);
    s.layouts.push_back(l);
    s.hint = 0;
    out.push_back(std::move(s));
    seen[b] = 1;
  }
  for (int32_t i : a.order) {
    const Node& n = *a.nodes[i].node;
    if (!n.upload || n.uses.empty() || !n.uses[0].full_overwrite()) continue;
    const int32_t b = a.nodes[i].use_buf[0];
    if (seen[b] || a.bufs[b].buf->batch_hint != LazyBuffer::BatchHint::kAuto) continue;
    Source s;
    s.buf = b;
    add_dims(s, n.uses[0].ref.meta, a.bufs[b].buf->nbytes.load());
    if (s.layouts.empty()) continue;
    seen[b] = 1;
    out.push_back(std::move(s));
  }
  // Values made on the device whose rows may be a batch, not one unless that helps (hint: none):
  // - arange(B) (transformers' masks index `padding_mask[batch_idx, kv_idx]` with batch_idx = arange(B));
  // - indices drawn there (multinomial(w, B), randint(0, N, (B,)), randperm(N)): a sampled step gathers
  //   its batch X[idx] from a dataset held on the device, so idx's rows are the batch and the gathers
  //   are batch-sharded by it; the drawing node runs whole where its draws cannot be split
  //   (multinomial) and its output is read by rows. (Mixup's x[perm] must not make perm the batch.)
  for (int32_t i : a.order) {
    const Node& n = *a.nodes[i].node;
    const c10::FunctionSchema& schema = n.op.schema();
    const std::string& name = schema.name();
    int32_t b = -1;
    const TensorMeta* m = nullptr;
    bool index = true;
    if (name == "aten::multinomial" && !n.defs.empty() && n.defs[0].ret == 0) {
      b = a.nodes[i].def_buf[0];
      m = &n.defs[0].ref.meta;
    } else if (!n.uses.empty() && n.uses[0].full_overwrite() &&
               (name == "aten::random_" || name == "aten::randperm" || name == "aten::randint" ||
                (name == "aten::arange" && schema.overload_name() == "start_out" && n.uses.size() == 1))) {
      b = a.nodes[i].use_buf[0];
      m = &n.uses[0].ref.meta;
      index = name != "aten::arange";
    }
    if (b < 0 || seen[b] || a.bufs[b].buf->batch_hint != LazyBuffer::BatchHint::kAuto) continue;
    if (index && (!c10::isIntegralType(m->dtype, /*includeBool=*/false) || m->sizes.size() != 1)) continue;
    Source s;
    s.buf = b;
    s.kind = Source::kFactory;
    add_dims(s, *m, a.bufs[b].buf->nbytes.load());
    s.hint = -1;
    if (s.layouts.empty()) continue;
    seen[b] = 1;
    out.push_back(std::move(s));
  }
  for (size_t b = 0; b < a.program_bufs; ++b) {
    LazyBuffer* buf = a.bufs[b].buf;
    if (seen[b] || buf->batch_hint != LazyBuffer::BatchHint::kAuto || !valid_fact(*buf)) continue;
    Source s;
    s.buf = static_cast<int32_t>(b);
    s.kind = buf->fact_hint ? Source::kUpload : Source::kStored;
    RowLayout l;
    l.rows = buf->fact_rows;
    l.row_bytes = buf->fact_row_bytes;
    l.outer = nbytes(buf) / (l.rows * l.row_bytes);
    s.dims.push_back(-1);
    s.layouts.push_back(l);
    s.id = buf->fact_batch;
    s.hint = 0;
    seen[b] = 1;
    out.push_back(std::move(s));
  }
  return out;
}

struct Score {
  int64_t held = 0;     // bytes of values computed whole, and of batch-sharded values read whole
  size_t barriers = 0;
  size_t batches = 0;   // batches split by some node (each its own loops)
  size_t whole_reads = 0;
  size_t loop_nodes = 0; // nodes that run per chunk, uploads aside
  bool operator<(const Score& o) const {
    if (held != o.held) return held < o.held;
    if (barriers != o.barriers) return barriers < o.barriers;
    // A batch-sharded value read whole is uploaded in chunks only to be assembled: no gain.
    if (whole_reads != o.whole_reads) return whole_reads < o.whole_reads;
    return batches < o.batches;
  }
  bool clean() const {
    return barriers == 0 && whole_reads == 0 && batches <= 1;
  }
  // Nothing splits: no node runs per chunk (the sources' first guesses feed no op with a rule).
  bool idle() const {
    return loop_nodes == 0;
  }
};

Score score(const Analysis& a) {
  Score s;
  std::vector<char> counted(a.bufs.size(), 0);
  std::vector<char> loops(a.batches.size(), 0);
  auto hold = [&](int32_t b) {
    if (counted[b]) return;
    counted[b] = 1;
    s.held += nbytes(a.bufs[b].buf);
  };
  for (int32_t i : a.order) {
    const NodeInfo& ni = a.nodes[i];
    const Node& n = *ni.node;
    s.barriers += ni.barrier;
    if (ni.loop && ni.batch >= 0) loops[a.find(ni.batch)] = 1;
    s.loop_nodes += ni.loop && !n.upload;
    if (n.upload) {
      if (!n.uses.empty() && !a.bufs[ni.use_buf[0]].place.is_s()) hold(ni.use_buf[0]);
      continue;
    }
    for (size_t j = 0; j < n.defs.size(); ++j) {
      if (!ni.discard[j] && ni.rr.outs[j].is_r()) hold(ni.def_buf[j]);
    }
    for (size_t k = 0; k < n.uses.size(); ++k) {
      if (n.uses[k].full_overwrite() || ni.rr.ins[k].mode != Mode::kWhole) continue;
      if (!a.use_place(ni, k).is_s()) continue;
      ++s.whole_reads;
      hold(ni.use_buf[k]);
    }
  }
  for (char l : loops) s.batches += l;
  return s;
}

std::string describe_source(const Analysis& a, const Source& s) {
  std::ostringstream os;
  const LazyBuffer* b = a.bufs[s.buf].buf;
  os << "b" << b->id << " (" << format_bytes(nbytes(b)) << ", "
     << (s.kind == Source::kMarked   ? "marked"
         : s.kind == Source::kStored ? "stored by an earlier plan"
         : s.kind == Source::kFactory ? "made on the device"
                                      : "upload")
     << ")";
  return os.str();
}

} // namespace

bool place_batch(Analysis& a, const std::vector<Node*>& nodes, const std::vector<int32_t>& runs,
                 const std::vector<LazyBuffer*>& live, const std::vector<LazyBuffer*>& needed) {
  for (Node* n : nodes) a.add_node(n);
  for (int32_t i : runs) {
    a.nodes[i].runs = true;
    a.order.push_back(i);
  }
  for (LazyBuffer* b : live) a.bufs[a.buffer(b)].live = true;
  // What the sync point reads survives the plan, whether or not the segment touches it (an eager op
  // that reads a stored value nothing pending writes): nothing may release it.
  for (LazyBuffer* b : needed) {
    BufInfo& bi = a.bufs[a.buffer(b)];
    bi.needed = true;
    bi.live = true;
  }
  a.program_bufs = a.bufs.size();
  a.sources = collect_sources(a);
  if (a.sources.empty()) {
    a.notes.push_back("no data leaf: nothing uploaded from the host (or marked with torch_lazymem.mark_batch, or "
                      "stored batch-sharded by an earlier plan) feeds this program, so it has no batch to split");
    return false;
  }
  const std::vector<int32_t> order = a.order;
  const size_t program_nodes = a.nodes.size();
  // Each try starts from the program alone: nodes (and buffers) synthesized by an earlier try go.
  auto run = [&] {
    a.order = order;
    a.owned.clear();
    a.expansions.clear();
    a.nodes.resize(program_nodes);
    for (size_t b = a.program_bufs; b < a.bufs.size(); ++b) a.index.erase(a.bufs[b].buf);
    a.bufs.resize(a.program_bufs);
    propagate(a);
    return score(a);
  };
  for (Source& s : a.sources) s.choice = s.hint;
  // The first node that runs whole under the current choices, and why (explain(), debug output).
  auto first_barrier = [&] {
    for (int32_t i : a.order) {
      if (!a.nodes[i].barrier) continue;
      return a.nodes[i].node->describe() + ": " + (a.nodes[i].rr.why ? a.nodes[i].rr.why : "");
    }
    return std::string();
  };
  Score best = run();
  const Score at_hints = best;
  const std::string first_at_hints = first_barrier();
  // A first guess that conflicts, or that splits nothing while other sources could (indices drawn on
  // the device, tried only where they help): search.
  const bool factory = std::any_of(a.sources.begin(), a.sources.end(),
                                   [](const Source& s) { return s.kind == Source::kFactory; });
  if (!best.clean() || (best.idle() && factory)) {
    if (!best.clean()) stats().batch_conflicts.fetch_add(1, std::memory_order_relaxed);
    // Smallest sources first: flipping a class-weight vector or a support set to none is cheap and
    // clears the conflicts it causes; the large inputs then try their other dims.
    std::vector<size_t> by_size(a.sources.size());
    for (size_t k = 0; k < by_size.size(); ++k) by_size[k] = k;
    std::stable_sort(by_size.begin(), by_size.end(), [&](size_t x, size_t y) {
      return nbytes(a.bufs[a.sources[x].buf].buf) < nbytes(a.bufs[a.sources[y].buf].buf);
    });
    if (by_size.size() > kMaxSources) by_size.erase(by_size.begin(), by_size.end() - kMaxSources);
    int evaluations = 1;
    bool last_is_best = true;
    for (int round = 0; round < 3 && evaluations < kMaxEvaluations; ++round) {
      bool improved = false;
      for (size_t k : by_size) {
        Source& s = a.sources[k];
        if (s.kind == Source::kMarked) continue;
        const int32_t kept = s.choice;
        int32_t chosen = kept;
        for (int32_t opt = -1; opt < static_cast<int32_t>(s.layouts.size()); ++opt) {
          if (opt == kept || evaluations >= kMaxEvaluations) continue;
          s.choice = opt;
          const Score sc = run();
          ++evaluations;
          if (config().debug >= 2) {
            const std::string first = first_barrier();
            std::fprintf(stderr, "[lazymem] batch solver: b%llu option %d: held %lld, %zu barriers%s%s, %zu batches\n",
                         static_cast<unsigned long long>(a.bufs[s.buf].buf->id), opt, static_cast<long long>(sc.held),
                         sc.barriers, first.empty() ? "" : " (first: ", first.empty() ? "" : (first + ")").c_str(),
                         sc.batches);
          }
          last_is_best = sc < best;
          if (last_is_best) {
            best = sc;
            chosen = opt;
            improved = true;
          }
        }
        if (s.choice != chosen) {
          s.choice = chosen;
          last_is_best = false;
        }
      }
      if (!improved) break;
    }
    if (!last_is_best) run();
  }
  // explain(): every source, the dim chosen and why.
  for (size_t k = 0; k < a.sources.size(); ++k) {
    Source& s = a.sources[k];
    std::ostringstream os;
    os << "source " << describe_source(a, s) << ": ";
    const BufInfo& b = a.bufs[s.buf];
    if (s.choice >= 0 && b.place.is_s()) {
      os << "batch " << a.find(b.place.batch) << " (" << a.batches[a.find(b.place.batch)].rows << " rows)";
      if (s.dims[s.choice] >= 0) os << " on dim " << static_cast<int>(s.dims[s.choice]);
      if (s.kind == Source::kMarked) os << ", as marked";
      if (s.choice != s.hint && s.hint >= 0 && s.dims[s.hint] >= 0) {
        os << ": dim " << static_cast<int>(s.dims[s.hint]) << " would leave " << at_hints.barriers
           << " ops whole and " << format_bytes(at_hints.held) << " held";
      }
    } else if (s.choice >= 0) {
      os << "not a batch (nothing it feeds splits along it)";
    } else {
      os << "not a batch";
      if (s.hint >= 0) {
        os << ": as one, " << at_hints.barriers << " ops would run whole and " << format_bytes(at_hints.held)
           << " be held (" << format_bytes(best.held) << " without)";
      }
    }
    s.why = os.str();
    a.source_notes.push_back(s.why);
  }
  a.barriers = 0;
  size_t loop_nodes = 0;
  for (int32_t i : a.order) {
    a.barriers += a.nodes[i].barrier;
    loop_nodes += a.nodes[i].loop && !a.nodes[i].node->upload;
  }
  a.batch = 0;
  for (const BatchClass& c : a.batches) {
    if (c.parent < 0) a.batch = std::max(a.batch, c.rows);
  }
  if (loop_nodes == 0) {
    std::string note = "every op that reads the batch runs whole (no placement rule splits them)";
    if (!first_at_hints.empty()) note += "; with each source's first guess at its batch, the first: " + first_at_hints;
    a.notes.push_back(std::move(note));
    return false;
  }
  return true;
}

} // namespace lazymem
