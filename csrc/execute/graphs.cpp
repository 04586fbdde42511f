// execute: a reused plan replayed as CUDA graphs (graphs.h).
#include "execute/graphs.h"

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <list>
#include <map>
#include <mutex>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include <ATen/ATen.h>

#include "core/check.h"
#include "core/config.h"
#include "core/cuda_backend.h"
#include "core/runtime.h"
#include "execute/graph_hash.h"
#include "execute/memory.h"
#include "execute/real.h"

namespace lazymem {
namespace {

constexpr uint64_t kPlain = kGraphPlain;
constexpr size_t kMaxEntries = 64;         // plans with graphs kept (least recently run dropped)

// Slot s of a node: def s, or use s - defs.size().
LazyBuffer* slot_buffer(const PlannedNode& pn, size_t s) {
  const Node& n = *pn.node;
  return s < n.defs.size() ? n.defs[s].ref.buf.get() : n.uses[s - n.defs.size()].ref.buf.get();
}
size_t slots(const PlannedNode& pn) {
  return pn.node->defs.size() + pn.node->uses.size();
}

// A byte view of a whole storage on the backing device.
at::Tensor bytes_of(const c10::Storage& s, size_t n) {
  at::Tensor t = at::empty({0}, at::TensorOptions().dtype(at::kByte).device(backing_device()));
  t.set_(s, 0, {static_cast<int64_t>(n)}, {1});
  return t;
}

struct Input {
  uint32_t node = 0, slot = 0;
  bool written = false;   // the piece writes it
  bool moves = false;     // copied into `copy` before each replay (and back after, when written)
  const void* at = nullptr; // where the graph reads it (inputs that stay)
  c10::Storage copy;
};

// Nodes [begin, end) of the stage, one graph.
struct Piece {
  size_t begin = 0, end = 0;
  CudaBackend* backend = nullptr; // whose graph it is
  void* graph = nullptr;
  std::vector<uint64_t> hashes;   // its nodes' argument hashes at capture (what the graph baked in)
  int64_t pool_bytes = 0;
  std::vector<Input> inputs;
  // Per node of the piece, per slot: the storage the graph writes the buffer's value in (undefined:
  // none — a buffer that held data before the piece, or one that dies inside it).
  std::vector<std::vector<c10::Storage>> results;
  std::vector<std::pair<uint32_t, uint32_t>> outs; // (node - begin, slot) of each result
};

struct Entry {
  bool never = false;
  std::vector<uint64_t> hashes;             // per node, at the last run
  std::vector<char> plain;                  // per node: runs plainly
  std::vector<std::pair<uint32_t, uint32_t>> start; // (node, slot) of each buffer holding data at the start
  std::vector<const void*> start_at;        // ...its address at the last run
  std::vector<char> start_moves;            // ...and whether it ever moved
  std::map<size_t, Piece> pieces;           // by first node
  std::list<uint64_t>::iterator lru;
};

std::atomic<int64_t> g_graphs{0}; // graphs alive (cuda_graph_unheld_bytes: none, nothing to count)

void destroy(Piece& p) {
  if (!p.graph) return;
  g_graphs.fetch_sub(1, std::memory_order_relaxed);
  p.backend->destroy(p.graph);
  p.graph = nullptr;
  stats().cuda_graph_pool_bytes.fetch_sub(p.pool_bytes, std::memory_order_relaxed);
  p.pool_bytes = 0;
  p.inputs.clear();
  p.results.clear();
  p.outs.clear();
}

void destroy(Entry& e) {
  for (auto& [b, p] : e.pieces) destroy(p);
  e.pieces.clear();
}

// The CPU stand-in for CUDA graphs (set_graph_emulation; tests): "capture" is the dry run, whose
// in-place writes to inputs are undone, and a "replay" runs the piece's nodes plainly with every
// result bound to the storage a graph would write and every moving input to its copy — the
// addresses a graph bakes in — and checks that no node's arguments changed since capture.
std::atomic<bool> g_emulate{env_flag("LAZYMEM_EMULATE_CUDA_GRAPHS").value_or(false)}; // (whole test suites)
class Emulated final : public CudaBackend {
 public:
  void* capture_begin(c10::DeviceIndex) override {
    return this;
  }
  void capture_end(void*) override {}
  void replay(void*) override {}
  void destroy(void*) noexcept override {}
  void peak_reset(c10::DeviceIndex) override {}
  int64_t peak_since_reset() const override {
    return 0;
  }
};
Emulated g_emulated;

struct Cache {
  std::mutex mu;
  std::unordered_map<uint64_t, Entry> entries;
  std::list<uint64_t> order; // most recently run first
};
Cache& cache() {
  static Cache* c = new Cache(); // never destroyed: graphs outlive no CUDA context at exit
  return *c;
}

// A buffer's state, put back after a capture (a dry run: no kernel ran).
struct Saved {
  LazyBuffer* buf;
  c10::Storage real;
  uint32_t real_version;
  uint64_t exec_epoch;
  std::exception_ptr poison;
  bool real_on_host;
};

class Runner final : public StageRunner {
 public:
  Runner(Entry& e, std::unique_lock<std::mutex> lock, CudaBackend* backend)
      : e_(e), lock_(std::move(lock)), be_(backend), emulate_(backend == &g_emulated) {}

  size_t run_from(size_t p, StageWalk& walk) override {
    if (p < plain_until_ || e_.plain[p]) {
      stats().cuda_graph_plain_nodes.fetch_add(1, std::memory_order_relaxed);
      return p;
    }
    auto it = e_.pieces.find(p);
    if (it == e_.pieces.end()) {
      size_t end = p + 1;
      while (end < e_.plain.size() && !e_.plain[end]) ++end;
      it = e_.pieces.emplace(p, Piece{}).first;
      it->second.begin = p;
      it->second.end = end;
    }
    Piece& piece = it->second;
    const size_t begin = piece.begin, end = piece.end;
    if (!piece.graph && (no_capture_ || !capture(piece, walk))) return plain_from(begin, end); // (may erase it)
    if (!prepare(piece, walk)) {
      destroy(piece); // captured again next run
      stats().cuda_graph_fallbacks.fetch_add(1, std::memory_order_relaxed);
      return plain_from(begin, end);
    }
    if (emulate_) {
      emulate(piece, walk);
    } else {
      be_->replay(piece.graph);
    }
    for (const Input& in : piece.inputs) {
      if (!in.moves || !in.written) continue;
      const c10::Storage& real = buffer(walk, in)->real;
      bytes_of(real, std::min(real.nbytes(), in.copy.nbytes())).copy_(bytes_of(in.copy, in.copy.nbytes()));
    }
    for (size_t q = piece.begin; q < piece.end; ++q) walk.bookkeep(q, piece.results[q - piece.begin]);
    pool_bytes_ += piece.pool_bytes;
    stats().cuda_graph_replays.fetch_add(1, std::memory_order_relaxed);
    stats().cuda_graph_nodes.fetch_add(piece.end - piece.begin, std::memory_order_relaxed);
    return piece.end;
  }

  int64_t pool_bytes() const override {
    return pool_bytes_;
  }

 private:
  // Nodes [begin, end) run plainly this time.
  size_t plain_from(size_t begin, size_t end) {
    plain_until_ = end;
    stats().cuda_graph_plain_nodes.fetch_add(1, std::memory_order_relaxed);
    return begin;
  }

  static LazyBuffer* buffer(StageWalk& walk, const Input& in) {
    return slot_buffer(walk.stage().nodes[in.node], in.slot);
  }

  // The piece's buffers as they are now, so that a dry run can be undone.
  static std::vector<Saved> save(const Stage& st, const Piece& piece) {
    std::vector<Saved> out;
    std::unordered_set<LazyBuffer*> seen;
    auto add = [&](LazyBuffer* b) {
      if (seen.insert(b).second) out.push_back({b, b->real, b->real_version, b->exec_epoch, b->poison, b->real_on_host});
    };
    for (size_t q = piece.begin; q < piece.end; ++q) {
      const PlannedNode& pn = st.nodes[q];
      for (size_t s = 0; s < slots(pn); ++s) add(slot_buffer(pn, s));
      for (LazyBuffer* b : st.released_after(pn)) add(b);
    }
    return out;
  }
  static void restore(const std::vector<Saved>& saved) {
    for (const Saved& s : saved) {
      LazyBuffer& b = *s.buf;
      if (b.real.unsafeGetStorageImpl() != s.real.unsafeGetStorageImpl()) b.set_real(s.real, s.real_on_host);
      b.real_version = s.real_version;
      b.exec_epoch = s.exec_epoch;
      b.poison = s.poison;
    }
  }

  // Captures the piece: a dry run of its nodes under stream capture, undone afterwards (the replay
  // that follows runs them). False when a node cannot be captured: it runs plainly from now on.
  bool capture(Piece& piece, StageWalk& walk) {
    const Stage& st = walk.stage();
    // The piece's inputs: buffers holding data when it starts, in the order it first names them.
    std::unordered_map<LazyBuffer*, size_t> first; // buffer -> its input, or SIZE_MAX (none)
    piece.inputs.clear();
    for (size_t q = piece.begin; q < piece.end; ++q) {
      const PlannedNode& pn = st.nodes[q];
      for (size_t s = 0; s < slots(pn); ++s) {
        LazyBuffer* b = slot_buffer(pn, s);
        const bool writes = s < pn.node->defs.size() || pn.node->uses[s - pn.node->defs.size()].write;
        auto [it, fresh] = first.emplace(b, SIZE_MAX);
        if (fresh && b->has_real()) {
          it->second = piece.inputs.size();
          piece.inputs.push_back({static_cast<uint32_t>(q), static_cast<uint32_t>(s), false, false, nullptr, {}});
        }
        if (writes && it->second != SIZE_MAX) piece.inputs[it->second].written = true;
      }
    }
    // Inputs that move between runs: a buffer that held data at the plan's start and moved once,
    // or one a plain node of this plan wrote (a new allocation each run). What earlier pieces
    // wrote stays in their pools.
    std::unordered_map<const LazyBuffer*, size_t> start;
    for (size_t i = 0; i < e_.start.size(); ++i) {
      start.emplace(slot_buffer(st.nodes[e_.start[i].first], e_.start[i].second), i);
    }
    std::unordered_set<const c10::StorageImpl*> pooled;
    for (const auto& [b, other] : e_.pieces) {
      for (auto [q, s] : other.outs) pooled.insert(other.results[q][s].unsafeGetStorageImpl());
    }
    for (Input& in : piece.inputs) {
      LazyBuffer* b = buffer(walk, in);
      auto it = start.find(b);
      in.moves = it != start.end() ? e_.start_moves[it->second] != 0 : !pooled.count(b->real.unsafeGetStorageImpl());
      in.at = b->real.data();
    }
    const std::vector<Saved> saved = save(st, piece);
    const ExecOutcome before = walk.outcome();
    int64_t copies = 0;
    try {
      for (Input& in : piece.inputs) {
        if (!in.moves) continue;
        LazyBuffer* b = buffer(walk, in);
        in.copy = allocate_real(b->real.nbytes());
        // (Its values too: a capture launches nothing, but an emulated one runs the kernels.)
        bytes_of(in.copy, in.copy.nbytes()).copy_(bytes_of(b->real, in.copy.nbytes()));
        copies += static_cast<int64_t>(in.copy.nbytes());
        b->set_real(in.copy); // the graph reads (and writes) the copy; restore() puts the storage back
      }
    } catch (const c10::OutOfMemoryError&) { // no room for the copies: plainly, this time
      restore(saved);
      piece.inputs.clear();
      no_capture_ = true;
      return false;
    }
    // Emulated, the dry run runs kernels: what it writes in place in inputs is put back after it.
    std::vector<std::pair<c10::Storage, at::Tensor>> undo;
    if (emulate_) {
      for (const Input& in : piece.inputs) {
        if (in.written && !in.moves) {
          const c10::Storage& real = buffer(walk, in)->real;
          undo.emplace_back(real, bytes_of(real, real.nbytes()).clone());
        }
      }
    }
    const c10::Device dev = backing_device();
    const int64_t reserved = reserved_on(dev);
    size_t failed = SIZE_MAX;
    std::string why;
    void* graph = nullptr;
    try {
      graph = be_->capture_begin(dev.index());
    } catch (const std::exception& e) {
      why = e.what();
      failed = piece.end; // the capture as a whole
    }
    if (graph) {
      try {
        for (size_t q = piece.begin; q < piece.end && failed == SIZE_MAX; ++q) {
          const std::exception_ptr err = walk.outcome().first_error;
          if (!walk.run_plain(q, /*measure=*/false)) {
            failed = q;
            why = "out of memory";
          } else if (walk.outcome().first_error != err) {
            failed = q;
            try {
              std::rethrow_exception(walk.outcome().first_error);
            } catch (const std::exception& e) {
              why = e.what();
            }
          }
        }
      } catch (const std::exception& e) {
        why = e.what();
        failed = piece.end;
      }
      try { // always ends the capture: the stream must not stay capturing
        void* g = std::exchange(graph, nullptr); // (capture_end destroys it when it throws)
        be_->capture_end(g);
        graph = g;
      } catch (const std::exception& e) {
        if (why.empty()) why = e.what();
        if (failed == SIZE_MAX) failed = piece.end;
      }
    }
    for (auto& [real, contents] : undo) bytes_of(real, real.nbytes()).copy_(contents);
    if (failed == SIZE_MAX) {
      // The buffers the graph gives data: each buffer without data before the piece and with it
      // after, at the last node that names it (it writes it, or reads storage it allocated).
      piece.results.assign(piece.end - piece.begin, {});
      std::unordered_set<LazyBuffer*> done;
      for (size_t q = piece.end; q-- > piece.begin;) {
        const PlannedNode& pn = st.nodes[q];
        for (size_t s = 0; s < slots(pn); ++s) {
          LazyBuffer* b = slot_buffer(pn, s);
          if (!b->has_real() || first.at(b) != SIZE_MAX || !done.insert(b).second) continue;
          auto& r = piece.results[q - piece.begin];
          if (r.empty()) r.resize(slots(pn));
          r[s] = b->real;
          piece.outs.emplace_back(static_cast<uint32_t>(q - piece.begin), static_cast<uint32_t>(s));
        }
      }
      piece.graph = graph;
      g_graphs.fetch_add(1, std::memory_order_relaxed);
      piece.backend = be_;
      piece.hashes.assign(e_.hashes.begin() + piece.begin, e_.hashes.begin() + piece.end);
      piece.pool_bytes = std::max<int64_t>(0, reserved_on(dev) - reserved) + copies;
      stats().cuda_graph_pool_bytes.fetch_add(piece.pool_bytes, std::memory_order_relaxed);
      stats().cuda_graph_captures.fetch_add(1, std::memory_order_relaxed);
    } else if (graph) {
      be_->destroy(graph);
    }
    restore(saved);
    walk.outcome() = before;
    if (failed == SIZE_MAX) return true;
    // Not capturable: the failing node runs plainly from now on (all of them, when the capture as
    // a whole failed); nothing ran, and this run's remaining nodes run plainly.
    if (failed == piece.end) {
      for (size_t q = piece.begin; q < piece.end; ++q) e_.plain[q] = 1;
    } else {
      e_.plain[failed] = 1;
    }
    if (config().debug) {
      std::fprintf(stderr, "[lazymem] CUDA graph: %s runs plainly (%s)\n",
                   failed == piece.end ? "a piece" : st.nodes[failed].node->describe().c_str(), why.substr(0, 200).c_str());
    }
    piece.inputs.clear();
    e_.pieces.erase(piece.begin);
    no_capture_ = true;
    stats().cuda_graph_fallbacks.fetch_add(1, std::memory_order_relaxed);
    return false;
  }

  // Before a replay: the inputs are where the graph reads them and the results' blocks are free.
  // False (nothing changed) when the piece must be captured again.
  bool prepare(Piece& piece, StageWalk& walk) {
    try {
      return prepare_or_throw(piece, walk);
    } catch (const c10::OutOfMemoryError&) { // no room to move a held result out: plainly
      return false;
    }
  }
  bool prepare_or_throw(Piece& piece, StageWalk& walk) {
    const Stage& st = walk.stage();
    for (const Input& in : piece.inputs) {
      LazyBuffer* b = buffer(walk, in);
      if (!b->has_real() || b->real_on_host || b->poison) return false;
      if (!in.moves && b->real.data() != in.at) return false;
    }
    for (auto [q, s] : piece.outs) {
      if (slot_buffer(st.nodes[piece.begin + q], s)->has_real()) return false;
    }
    for (auto [q, s] : piece.outs) {
      c10::Storage& r = piece.results[q][s];
      if (r.use_count() > 1) evacuate(r);
    }
    for (const Input& in : piece.inputs) {
      if (!in.moves) continue;
      const c10::Storage& real = buffer(walk, in)->real;
      bytes_of(in.copy, in.copy.nbytes()).narrow(0, 0, std::min(real.nbytes(), in.copy.nbytes()))
          .copy_(bytes_of(real, std::min(real.nbytes(), in.copy.nbytes())));
    }
    return true;
  }

  // The emulated replay (see Emulated).
  void emulate(const Piece& piece, StageWalk& walk) {
    const Stage& st = walk.stage();
    const std::vector<Saved> saved = save(st, piece);
    const ExecOutcome before = walk.outcome();
    for (const Input& in : piece.inputs) {
      if (in.moves) buffer(walk, in)->set_real(in.copy);
    }
    for (size_t q = piece.begin; q < piece.end; ++q) {
      const auto& r = piece.results[q - piece.begin];
      for (size_t s = 0; s < r.size(); ++s) {
        if (r[s]) slot_buffer(st.nodes[q], s)->set_real(r[s]);
      }
    }
    for (size_t q = piece.begin; q < piece.end; ++q) {
      LAZYMEM_INTERNAL_ASSERT(graph_node_hash(st.nodes[q]) == piece.hashes[q - piece.begin], "a CUDA graph would replay ",
                              st.nodes[q].node->describe(), " with the arguments it was captured with, which changed");
      walk.run_plain(q, /*measure=*/false);
    }
    restore(saved);
    walk.outcome() = before;
  }

  // A value of the last replay still held (a loss kept for logging): it moves to new memory with
  // its contents, and the graph keeps its block under a new storage.
  static void evacuate(c10::Storage& r) {
    c10::Storage fresh = allocate_real(r.nbytes());
    bytes_of(fresh, r.nbytes()).copy_(bytes_of(r, r.nbytes()));
    c10::StorageImpl* held = r.unsafeGetStorageImpl();
    c10::StorageImpl* mine = fresh.unsafeGetStorageImpl();
    c10::DataPtr block = held->set_data_ptr(mine->set_data_ptr(c10::DataPtr(nullptr, backing_device())));
    mine->set_data_ptr(std::move(block));
    r = std::move(fresh);
  }

  Entry& e_;
  std::unique_lock<std::mutex> lock_;
  CudaBackend* be_;
  const bool emulate_;
  size_t plain_until_ = 0;  // nodes before this run plainly (a piece that could not replay)
  bool no_capture_ = false; // a capture failed this run: no other is tried
  int64_t pool_bytes_ = 0;
};

} // namespace

std::unique_ptr<StageRunner> graph_runner(const Plan& plan, bool capped) {
  if (!config().cuda_graphs.load(std::memory_order_relaxed)) return nullptr;
  CudaBackend* backend = backing_device().is_cuda() ? cuda_backend()
                         : g_emulate.load(std::memory_order_relaxed) ? &g_emulated
                                                                      : nullptr;
  if (!backend) return nullptr;
  if (capped || !plan.reused || plan.split || plan.template_id == 0 || plan.stages.size() != 1 ||
      plan.stages[0].loop || !plan.retained.empty()) {
    return nullptr;
  }
  const Stage& st = plan.stages[0];
  Cache& c = cache();
  std::unique_lock<std::mutex> lock(c.mu);
  auto [it, fresh] = c.entries.try_emplace(plan.template_id);
  Entry& e = it->second;
  if (fresh) {
    c.order.push_front(plan.template_id);
    e.lru = c.order.begin();
    while (c.entries.size() > kMaxEntries) {
      auto old = c.entries.find(c.order.back());
      destroy(old->second);
      c.entries.erase(old);
      c.order.pop_back();
    }
  } else {
    c.order.splice(c.order.begin(), c.order, e.lru);
  }
  if (e.never) return nullptr;
  const size_t n = st.nodes.size();
  std::vector<uint64_t> hashes(n);
  for (size_t p = 0; p < n; ++p) hashes[p] = graph_node_hash(st.nodes[p]);
  if (fresh) {
    // First run here: plainly, learning what it reads.
    e.hashes = std::move(hashes);
    e.plain.assign(n, 0);
    for (size_t p = 0; p < n; ++p) e.plain[p] = e.hashes[p] == kPlain;
    std::unordered_set<const LazyBuffer*> seen;
    for (size_t p = 0; p < n; ++p) {
      for (size_t s = 0; s < slots(st.nodes[p]); ++s) {
        const LazyBuffer* b = slot_buffer(st.nodes[p], s);
        if (seen.insert(b).second && b->has_real()) {
          e.start.emplace_back(p, s);
          e.start_at.push_back(b->real.data());
        }
      }
    }
    e.start_moves.assign(e.start.size(), 0);
    return nullptr;
  }
  if (hashes.size() != e.hashes.size()) {
    e.never = true;
    destroy(e);
    return nullptr;
  }
  size_t plain = 0;
  for (size_t p = 0; p < n; ++p) {
    if (hashes[p] != e.hashes[p] && !e.plain[p]) {
      // Changed arguments (a step-dependent scalar): plain from now on; its piece goes.
      e.plain[p] = 1;
      for (auto pit = e.pieces.begin(); pit != e.pieces.end();) {
        if (pit->second.begin <= p && p < pit->second.end) {
          destroy(pit->second);
          pit = e.pieces.erase(pit);
        } else {
          ++pit;
        }
      }
    }
    e.hashes[p] = hashes[p];
    plain += e.plain[p];
  }
  for (size_t i = 0; i < e.start.size(); ++i) {
    const LazyBuffer* b = slot_buffer(st.nodes[e.start[i].first], e.start[i].second);
    if (!b->has_real()) { // not the program it learned
      e.never = true;
      destroy(e);
      return nullptr;
    }
    if (b->real.data() != e.start_at[i]) {
      e.start_moves[i] = 1; // read from a copy from now on (prepare() finds its piece's address moved)
      e.start_at[i] = b->real.data();
    }
  }
  if (plain * 2 > n) { // mostly plain: not worth the checks
    e.never = true;
    destroy(e);
    return nullptr;
  }
  return std::make_unique<Runner>(e, std::move(lock), backend);
}

void set_graph_emulation(bool on) {
  drop_cuda_graphs();
  g_emulate.store(on, std::memory_order_relaxed);
}

bool graph_emulation() {
  return g_emulate.load(std::memory_order_relaxed);
}

int64_t cuda_graph_unheld_bytes() {
  if (g_graphs.load(std::memory_order_relaxed) == 0) return 0; // (every run_segment asks)
  Cache& c = cache();
  std::lock_guard<std::mutex> lock(c.mu);
  int64_t n = 0;
  for (const auto& [id, e] : c.entries) {
    for (const auto& [b, piece] : e.pieces) {
      for (const Input& in : piece.inputs) n += in.copy ? static_cast<int64_t>(in.copy.nbytes()) : 0;
      for (auto [q, s] : piece.outs) {
        const c10::Storage& r = piece.results[q][s];
        if (r.use_count() == 1) n += static_cast<int64_t>(r.nbytes());
      }
    }
  }
  return n;
}

void drop_cuda_graphs() {
  Cache& c = cache();
  std::lock_guard<std::mutex> lock(c.mu);
  for (auto& [id, e] : c.entries) destroy(e);
  c.entries.clear();
  c.order.clear();
}

} // namespace lazymem
