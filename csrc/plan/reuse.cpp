// plan: plans reused across steps (see plan/reuse.h).
//
// A stored plan is the Plan itself with every buffer and node pointer replaced by a code: program
// buffers by 1 + their canonical number, buffers the planner created for synthesized nodes by a
// fresh number with the top bit set, program nodes by 1 + their position, synthesized nodes by
// their position in Plan::owned with the top bit set. Versions in the plan (accumulators, full
// storages, rows written) are stored relative to their buffer's first reference. Instantiating
// decodes the codes against the new program's buffers and nodes and rebuilds the synthesized nodes
// from sketches. The encoded plan is never executed.
#include "plan/reuse.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <functional>
#include <list>
#include <mutex>
#include <unordered_map>

#include "core/config.h"
#include "ops/op_rules.h"
#include "plan/memory.h"
#include "plan/workspace.h"

namespace lazymem {
namespace {

constexpr uint64_t kFresh = uint64_t{1} << 62;
constexpr uint64_t kOwned = uint64_t{1} << 62;

// ---- the fingerprint ----

struct KeyWriter {
  std::vector<uint64_t>& k;
  bool ok = true;
  size_t n = 0; // words written (k is kept larger)
  size_t cap = 0;
  uint64_t* p = nullptr;

  // Writes from the start of `key`, which keeps its size (its room) unless it must grow.
  explicit KeyWriter(std::vector<uint64_t>& key, size_t expect) : k(key) {
    p = k.data();
    cap = k.size();
    reserve(std::max<size_t>(expect, 64));
  }
  __attribute__((noinline)) void grow(size_t need) {
    k.resize(std::max(need, 2 * k.size()));
    p = k.data();
    cap = k.size();
  }
  // Room for `more` words written with raw().
  void reserve(size_t more) {
    if (__builtin_expect(n + more > cap, 0)) grow(n + more);
  }
  void raw(uint64_t v) {
    p[n++] = v;
  }
  void put(uint64_t v) {
    if (__builtin_expect(n == cap, 0)) grow(n + 1);
    p[n++] = v;
  }
  void put_i(int64_t v) {
    put(static_cast<uint64_t>(v));
  }
  void put_d(double d) {
    uint64_t bits;
    std::memcpy(&bits, &d, sizeof(bits));
    put(bits);
  }

  void meta(const TensorMeta& m) {
    put(m.sizes.size() | (static_cast<uint64_t>(m.dtype) << 8) | (uint64_t{m.conj} << 16) | (uint64_t{m.neg} << 17));
    for (int64_t s : m.sizes) put_i(s);
    for (int64_t s : m.strides) put_i(s);
    put_i(m.offset);
  }
  void host_tensor(const at::Tensor& t) {
    if (!t.defined()) {
      put(1);
      return;
    }
    put(2 | (static_cast<uint64_t>(t.scalar_type()) << 8) | (static_cast<uint64_t>(t.device().type()) << 16) |
        (static_cast<uint64_t>(t.dim()) << 32));
    for (int64_t s : t.sizes()) put_i(s);
    for (int64_t s : t.strides()) put_i(s);
    put_i(t.storage_offset());
  }
  // An argument; floating-point values only when they can change placements (`floats`).
  void value(const c10::IValue& v, bool floats) {
    if (v.isNone()) {
      put(10);
    } else if (v.isInt()) {
      put(11);
      put_i(v.toInt());
    } else if (v.isBool()) {
      put(12 + v.toBool());
    } else if (v.isDouble()) {
      put(14);
      if (floats) put_d(v.toDouble());
    } else if (v.isSymInt()) {
      auto i = v.toSymInt().maybe_as_int();
      if (!i) {
        ok = false;
        return;
      }
      put(11);
      put_i(*i);
    } else if (v.isSymFloat()) {
      put(14);
      if (floats) put_d(v.toSymFloat().guard_float(__FILE__, __LINE__));
    } else if (v.isComplexDouble()) {
      put(15);
      if (floats) {
        put_d(v.toComplexDouble().real());
        put_d(v.toComplexDouble().imag());
      }
    } else if (v.isString()) {
      put(16);
      put(std::hash<std::string>{}(v.toStringRef()));
    } else if (v.isDevice()) {
      put(17 | (static_cast<uint64_t>(v.toDevice().type()) << 8) |
          (static_cast<uint64_t>(static_cast<uint8_t>(v.toDevice().index())) << 16));
    } else if (v.isTensor()) {
      host_tensor(v.toTensor());
    } else if (v.isGenerator()) {
      put(18);
    } else if (v.isList()) {
      c10::ArrayRef<c10::IValue> l = v.toListRef();
      put(19 | (static_cast<uint64_t>(l.size()) << 8));
      for (size_t i = 0; i < l.size() && ok; ++i) value(l[i], floats);
    } else if (v.isTuple()) {
      const auto& e = v.toTupleRef().elements();
      put(20 | (static_cast<uint64_t>(e.size()) << 8));
      for (const auto& x : e) value(x, floats);
    } else {
      ok = false; // an argument the fingerprint cannot describe: not cached
    }
  }
};

uint64_t mix(uint64_t h, uint64_t v) {
  h ^= v + 0x9e3779b97f4a7c15ULL + (h << 6) + (h >> 2);
  return h;
}

std::atomic<uint64_t> g_stamps{uint64_t{1} << 60}; // apart from the memory model's stamps

} // namespace

void fingerprint(const PlanInput& in, Fingerprint& fp) {
  fp.words = 0;
  fp.hash = 0;
  fp.buffers.clear();
  fp.base.clear();
  fp.budget = -1;
  fp.cacheable = false;
  thread_local size_t per_node = 24; // words per node last time
  KeyWriter w(fp.key, in.nodes.size() * (per_node + 4) + 64);
  const uint64_t stamp = g_stamps.fetch_add(1, std::memory_order_relaxed) + 1;
  // Canonical numbers live in the buffers' planner scratch for the duration (under the flush lock).
  fp.buffers.reserve(in.nodes.size() + 16);
  fp.base.reserve(in.nodes.size() + 16);
  auto canon = [&](LazyBuffer* b, uint32_t version) -> int64_t {
    if (b->plan_stamp != stamp) {
      b->plan_stamp = stamp;
      b->plan_bytes = static_cast<int64_t>(fp.buffers.size());
      fp.buffers.push_back(b);
      fp.base.push_back(version);
    }
    return b->plan_bytes;
  };
  auto rel = [&](int64_t c, uint32_t version) {
    return static_cast<uint64_t>(static_cast<int64_t>(version) - static_cast<int64_t>(fp.base[c]));
  };
  // The program was recorded a while ago and the kernels since have evicted it from the caches:
  // each node's object, then its references, then their buffers are fetched a few nodes ahead.
  auto refs_ahead = [](const Node* n) {
    for (const Use& u : n->uses) {
      __builtin_prefetch(&u.ref.buf);
      __builtin_prefetch(&u.write_version);
    }
    for (const Def& d : n->defs) {
      __builtin_prefetch(&d.ref.buf);
      __builtin_prefetch(&d.ref.version);
    }
  };
  auto buffers_ahead = [](const Node* n) {
    for (const Use& u : n->uses) __builtin_prefetch(&u.ref.buf->plan_stamp);
    for (const Def& d : n->defs) __builtin_prefetch(&d.ref.buf->plan_stamp);
  };
  const size_t count = in.nodes.size();
  for (size_t i = 0; i < count; ++i) {
    const Node* n = in.nodes[i];
    if (i + 8 < count) {
      __builtin_prefetch(in.nodes[i + 8]);
      __builtin_prefetch(reinterpret_cast<const char*>(in.nodes[i + 8]) + 64);
    }
    if (i + 4 < count) refs_ahead(in.nodes[i + 4]);
    if (i + 2 < count) buffers_ahead(in.nodes[i + 2]);
    if (n->sig != 0) {
      // Recorded from a cached meta result: its id stands for the op, arguments and geometry (a 0
      // word first, never a schema pointer); what changes between steps follows.
      w.reserve(4 + 2 * n->defs.size() + 3 * n->uses.size());
      w.raw(0);
      w.raw(n->sig);
      w.raw(uint64_t{n->grad_mode} | (uint64_t{n->row_keyed != nullptr} << 1));
      if (n->row_keyed) w.raw(n->row_keyed->block);
      for (const Def& d : n->defs) {
        const int64_t c = canon(d.ref.buf.get(), d.ref.version);
        w.raw(static_cast<uint64_t>(c));
        w.raw(rel(c, d.ref.version));
      }
      for (const Use& u : n->uses) {
        const int64_t c = canon(u.ref.buf.get(), u.ref.version);
        w.raw(static_cast<uint64_t>(c));
        w.raw(rel(c, u.ref.version));
        if (u.write) w.raw(rel(c, u.write_version));
      }
      continue;
    }
    w.put(reinterpret_cast<uintptr_t>(&n->op.schema()));
    w.put(uint64_t{n->upload} | (uint64_t{n->random} << 1) | (uint64_t{n->effectful} << 2) |
          (uint64_t{n->grad_mode} << 3) | (uint64_t{n->row_keyed != nullptr} << 4) |
          (static_cast<uint64_t>(n->uses.size()) << 8) | (static_cast<uint64_t>(n->defs.size()) << 24) |
          (static_cast<uint64_t>(n->args.size()) << 40));
    if (n->row_keyed) w.put(n->row_keyed->block);
    // Floating-point arguments of pointwise and _foreach_ ops (AdamW's per-step scalars) cannot
    // change placements; elsewhere (batch norm's momentum, a norm's order) they are part of the key.
    bool floats = true;
    for (const c10::IValue& a : n->args) {
      if (a.isDouble()) {
        floats = !op_rules(n->op).float_values_shape_free;
        break;
      }
    }
    const int32_t state_arg = op_rules(n->op).state_arg;
    for (size_t i = 0; i < n->args.size(); ++i) {
      if (static_cast<int32_t>(i) == state_arg) {
        w.put(10); // per-call state (a collector's token), not structure
      } else {
        w.value(n->args[i], floats);
      }
    }
    for (const Def& d : n->defs) {
      const int64_t c = canon(d.ref.buf.get(), d.ref.version);
      w.put(static_cast<uint32_t>(d.ret) | (static_cast<uint64_t>(static_cast<uint32_t>(d.elem)) << 32));
      w.put_i(c);
      w.put(rel(c, d.ref.version));
      w.meta(d.ref.meta);
    }
    for (const Use& u : n->uses) {
      const int64_t c = canon(u.ref.buf.get(), u.ref.version);
      w.put(static_cast<uint32_t>(u.arg) | (static_cast<uint64_t>(static_cast<uint32_t>(u.elem)) << 32));
      w.put_i(c);
      w.put(rel(c, u.ref.version) ^ (uint64_t{u.write} << 62) ^ (uint64_t{u.write_only} << 63));
      if (u.write) w.put(rel(c, u.write_version));
      w.put(u.covered_nbytes);
      w.meta(u.ref.meta);
    }
  }
  std::vector<char> needed(fp.buffers.size(), 0);
  for (LazyBuffer* b : in.needed) {
    if (b->plan_stamp != stamp) return; // needed but not in the program: not cached
    needed[b->plan_bytes] = 1;
  }
  for (size_t c = 0; c < fp.buffers.size(); ++c) {
    const LazyBuffer* b = fp.buffers[c];
    if (c + 4 < fp.buffers.size()) {
      __builtin_prefetch(&fp.buffers[c + 4]->nbytes);
      __builtin_prefetch(&fp.buffers[c + 4]->real);
    }
    if (c + 2 < fp.buffers.size() && fp.buffers[c + 2]->has_real()) {
      __builtin_prefetch(fp.buffers[c + 2]->real.unsafeGetStorageImpl());
    }
    if (b->poison) return;
    w.put(b->nbytes.load(std::memory_order_relaxed));
    w.put(uint64_t{b->has_real()} | (uint64_t{b->real_on_host} << 1) | (static_cast<uint64_t>(b->batch_hint) << 2) |
          (uint64_t{in.live_out(*b)} << 4) | (uint64_t{needed[c] != 0} << 5));
    if (b->has_real()) {
      w.put(b->real.nbytes());
      w.put(rel(static_cast<int64_t>(c), b->real_version));
    }
    // A leaf uploaded by an earlier materialization whose data is still the upload (plan/batch.cpp).
    if (b->upload_version != 0 && b->has_real() && b->real_version == b->upload_version) {
      w.put_i(b->upload_rows);
      w.put_i(b->upload_stride_bytes);
    }
    if (b->batch_hint == LazyBuffer::BatchHint::kMarked) {
      w.put_i(b->mark_rows);
      w.put_i(b->mark_stride_bytes);
    }
  }
  // The budget is not in the key (free memory moves a little between steps): a stored plan is
  // reused while its predicted peak fits and the budget has not grown much (see reuse_plan).
  fp.budget = in.budget;
  w.put(uint64_t{in.budget < 0});
  w.put_i(in.resident);
  w.put_i(in.force_chunks);
  w.put(uint64_t{in.keep_pending} | (uint64_t{config().debug.load(std::memory_order_relaxed) >= 3} << 1) |
        (static_cast<uint64_t>(in.recompute) << 2));
  w.put(Workspace::get().generation());
  fp.words = w.n;
  fp.cacheable = w.ok;
  per_node = in.nodes.empty() ? per_node : fp.words / in.nodes.size() + 1;
  // The hash only picks the candidate entry (keys are compared whole): a sample of the key.
  uint64_t h = fp.words;
  const size_t step = std::max<size_t>(1, fp.words / 64);
  for (size_t i = 0; i < fp.words; i += step) h = mix(h, fp.key[i]);
  fp.hash = h;
}

namespace {

// ---- the stored plan ----

struct RefSketch {
  uint64_t buf = 0;   // a buffer code
  TensorMeta meta;
  int64_t version = 0; // relative to the buffer's base (program buffers) or absolute (fresh ones)
};

struct NodeSketch {
  int32_t serves = -1; // the program node whose seq, site and grad mode it takes
  c10::OperatorHandle op;
  std::vector<c10::IValue> args;
  std::vector<std::pair<Use, RefSketch>> uses; // Use fields other than its ref; the ref as a sketch
  std::vector<std::pair<Def, RefSketch>> defs;
  int64_t write_versions_base = 0;
  explicit NodeSketch(c10::OperatorHandle o) : op(std::move(o)) {}
};

struct Template {
  uint64_t id = 0;
  Fingerprint fp;
  Plan plan;                       // encoded
  std::vector<uint64_t> codes;     // the encoded plan's pointer codes and versions in visit() order
  std::vector<NodeSketch> owned;   // parallel to the plan's owned nodes
  // The owned nodes' references flat, in order (per node its uses, then its defs): buffer code and
  // relative version (and relative write version for uses); what a spare's node is patched with.
  std::vector<uint64_t> owned_refs;
  std::vector<size_t> fresh_bytes; // per fresh buffer
  std::optional<Plan> spare;       // an instantiation that has run, handed back: patched in place
};

// Applies `fb` to every buffer pointer and `fn` to every node pointer of `p`; `fv(buf, version)`
// to every version paired with a buffer (called before `fb` on that buffer).
template <class FB, class FN, class FV>
void visit(Plan& p, FB&& fb, FN&& fn, FV&& fv) {
  for (Stage& st : p.stages) {
    for (PlannedNode& pn : st.nodes) {
      fn(pn.node);
      for (LazyBuffer*& b : pn.release) fb(b);
    }
    for (Slot& s : st.slots) fb(s.buf);
    for (Accumulator& a : st.accs) {
      fv(a.buf, a.version);
      fb(a.buf);
      if (a.divide_by) fb(a.divide_by);
    }
    for (FullStore& f : st.stores) {
      fv(f.buf, f.version);
      fb(f.buf);
    }
    for (auto& [b, v] : st.written) {
      fv(b, v);
      fb(b);
    }
    for (LazyBuffer*& b : st.release_after) fb(b);
    for (LazyBuffer*& b : st.recomputed) fb(b);
  }
  for (Expansion& e : p.expansions) {
    for (const Node*& m : e.made) {
      Node* x = const_cast<Node*>(m);
      fn(x);
      m = x;
    }
    if (e.effect) {
      Node* x = const_cast<Node*>(e.effect);
      fn(x);
      e.effect = x;
    }
  }
  for (LazyBuffer*& b : p.release_unused) fb(b);
}

Plan copy_body(const Plan& p) {
  Plan c;
  c.stages = p.stages;
  c.expansions = p.expansions;
  c.release_unused = p.release_unused;
  c.retained = p.retained;
  c.eliminated = p.eliminated;
  c.executed_nodes = p.executed_nodes;
  c.split = p.split;
  c.budget = p.budget;
  c.resident = p.resident;
  c.predicted_peak = p.predicted_peak;
  c.notes = p.notes;
  c.batch = p.batch;
  c.barriers = p.barriers;
  c.template_id = p.template_id;
  return c;
}

template <class T>
T* as_ptr(uint64_t code) {
  return reinterpret_cast<T*>(static_cast<uintptr_t>(code));
}
uint64_t code_of(const void* p) {
  return static_cast<uint64_t>(reinterpret_cast<uintptr_t>(p));
}

struct Cache {
  std::mutex mu;
  std::list<Template> entries; // most recently used first
  uint64_t next_id = 0;
  static constexpr size_t kCapacity = 8;
};

Cache& cache() {
  static Cache* c = new Cache();
  return *c;
}

} // namespace

void remember_plan(const PlanInput& in, Fingerprint&& fp, Plan& plan) {
  if (!fp.cacheable) return;
  Template t;
  // Codes of this program's buffers and nodes.
  std::unordered_map<const LazyBuffer*, uint64_t> bufs;
  bufs.reserve(fp.buffers.size() * 2);
  for (size_t c = 0; c < fp.buffers.size(); ++c) bufs.emplace(fp.buffers[c], c + 1);
  std::unordered_map<const Node*, uint64_t> nodes;
  nodes.reserve(in.nodes.size() + plan.owned.size());
  for (size_t i = 0; i < in.nodes.size(); ++i) nodes.emplace(in.nodes[i], i + 1);
  for (size_t k = 0; k < plan.owned.size(); ++k) nodes.emplace(plan.owned[k].get(), kOwned | k);
  std::unordered_map<const LazyBuffer*, uint64_t> fresh;
  bool ok = true;
  auto buf_code = [&](const LazyBuffer* b) -> uint64_t {
    auto it = bufs.find(b);
    if (it != bufs.end()) return it->second;
    auto [f, inserted] = fresh.emplace(b, kFresh | t.fresh_bytes.size());
    if (inserted) t.fresh_bytes.push_back(b->nbytes.load(std::memory_order_relaxed));
    return f->second;
  };
  auto base_of = [&](uint64_t code) -> int64_t {
    return code & kFresh ? 0 : static_cast<int64_t>(fp.base[code - 1]);
  };
  auto sketch_ref = [&](const TensorRef& r) {
    RefSketch s;
    s.buf = buf_code(r.buf.get());
    s.meta = r.meta;
    s.version = static_cast<int64_t>(r.version) - base_of(s.buf);
    return s;
  };
  // Synthesized nodes: their refs as sketches (a program node's defs, a fresh buffer's); each takes
  // the seq of the program node it serves.
  std::unordered_map<uint64_t, int32_t> by_seq;
  if (!plan.owned.empty()) {
    for (size_t i = 0; i < in.nodes.size(); ++i) by_seq.emplace(in.nodes[i]->seq, static_cast<int32_t>(i));
  }
  for (const NodePtr& n : plan.owned) {
    NodeSketch s(n->op);
    s.args = n->args;
    auto served = by_seq.find(n->seq);
    if (served == by_seq.end()) {
      ok = false;
    } else {
      s.serves = served->second;
    }
    for (const Use& u : n->uses) {
      RefSketch r = sketch_ref(u.ref);
      Use bare = u;
      bare.ref = TensorRef{};
      bare.write_version = static_cast<uint32_t>(static_cast<int64_t>(u.write_version) - base_of(r.buf));
      s.uses.emplace_back(std::move(bare), std::move(r));
    }
    for (const Def& d : n->defs) {
      Def bare = d;
      bare.ref = TensorRef{};
      s.defs.emplace_back(std::move(bare), sketch_ref(d.ref));
    }
    for (const auto& [bare, r] : s.uses) {
      t.owned_refs.insert(t.owned_refs.end(), {r.buf, static_cast<uint64_t>(r.version),
                                               static_cast<uint64_t>(static_cast<int64_t>(bare.write_version))});
    }
    for (const auto& [bare, r] : s.defs) t.owned_refs.insert(t.owned_refs.end(), {r.buf, static_cast<uint64_t>(r.version)});
    t.owned.push_back(std::move(s));
  }
  if (!ok) return;
  t.plan = copy_body(plan);
  visit(
      t.plan, [&](LazyBuffer*& b) { b = as_ptr<LazyBuffer>(buf_code(b)); },
      [&](Node*& n) {
        auto it = nodes.find(n);
        if (it == nodes.end()) {
          ok = false;
          return;
        }
        n = as_ptr<Node>(it->second);
      },
      [&](LazyBuffer* b, uint32_t& v) {
        v = static_cast<uint32_t>(static_cast<int64_t>(v) - base_of(buf_code(b)));
      });
  if (!ok) return;
  visit(
      t.plan, [&](LazyBuffer*& b) { t.codes.push_back(code_of(b)); }, [&](Node*& n) { t.codes.push_back(code_of(n)); },
      [&](LazyBuffer*, uint32_t& v) { t.codes.push_back(v); });
  t.fp = std::move(fp);
  t.fp.key.resize(t.fp.words); // (stored exactly)
  t.fp.key.shrink_to_fit();
  Cache& c = cache();
  std::lock_guard<std::mutex> lock(c.mu);
  t.id = ++c.next_id;
  plan.template_id = t.id;
  t.plan.template_id = t.id;
  c.entries.push_front(std::move(t));
  if (c.entries.size() > Cache::kCapacity) c.entries.pop_back();
}

std::optional<Plan> reuse_plan(const PlanInput& in, const Fingerprint& fp) {
  if (!fp.cacheable) return std::nullopt;
  Cache& c = cache();
  std::lock_guard<std::mutex> lock(c.mu);
  auto it = c.entries.begin();
  // A plan made under another budget is as good while it fits and the budget has not grown by
  // more than a tenth (a fresh plan might then split less, or not at all).
  auto budget_ok = [&](const Template& t) {
    if (fp.budget < 0 || t.fp.budget == fp.budget) return true;
    return t.plan.predicted_peak <= fp.budget && fp.budget <= t.fp.budget + t.fp.budget / 10;
  };
  for (; it != c.entries.end(); ++it) {
    if (it->fp.hash == fp.hash && it->fp.words == fp.words &&
        std::memcmp(it->fp.key.data(), fp.key.data(), fp.words * sizeof(uint64_t)) == 0 && budget_ok(*it)) {
      break;
    }
  }
  if (it == c.entries.end()) {
    if (config().debug.load(std::memory_order_relaxed) >= 2 && !c.entries.empty()) {
      // Where this program first differs from the most recent stored one (LAZYMEM_DEBUG=2).
      const std::vector<uint64_t>& last = c.entries.front().fp.key;
      size_t i = 0;
      while (i < last.size() && i < fp.words && last[i] == fp.key[i]) ++i;
      std::fprintf(stderr, "[lazymem] plan not reused: fingerprint of %zu words differs from the last stored (%zu words) "
                   "at word %zu%s\n", fp.words, last.size(), i,
                   i + 6 >= fp.words ? " (the budget, memory held, or learned kernel workspace)" : "");
    }
    return std::nullopt;
  }
  c.entries.splice(c.entries.begin(), c.entries, it); // most recently used
  const Template& t = *it;
  std::vector<BufferPtr> fresh;
  fresh.reserve(t.fresh_bytes.size());
  for (size_t nbytes : t.fresh_bytes) {
    BufferPtr b = c10::make_intrusive<LazyBuffer>(nbytes);
    b->version = std::max<uint32_t>(b->version, 1);
    fresh.push_back(std::move(b));
  }
  auto buffer = [&](uint64_t code) -> LazyBuffer* {
    return code & kFresh ? fresh[code & ~kFresh].get() : fp.buffers[code - 1];
  };
  auto base_of = [&](uint64_t code) -> int64_t {
    return code & kFresh ? 0 : static_cast<int64_t>(fp.base[code - 1]);
  };
  auto ref = [&](const RefSketch& s) {
    return TensorRef{c10::intrusive_ptr<LazyBuffer>::reclaim_copy(buffer(s.buf)), s.meta,
                     static_cast<uint32_t>(s.version + base_of(s.buf))};
  };
  Plan plan;
  std::vector<NodePtr> spare_nodes; // the spare's synthesized nodes the program did not take
  if (it->spare) {
    plan = std::move(*it->spare);
    it->spare.reset();
    spare_nodes = std::move(plan.owned);
    for (size_t s = 0; s < plan.stages.size(); ++s) plan.stages[s].chunk = t.plan.stages[s].chunk;
  } else {
    plan = copy_body(t.plan);
  }
  plan.reused = true;
  plan.budget = in.budget;
  plan.owned.clear();
  plan.owned.reserve(t.owned.size());
  const uint64_t* refs = t.owned_refs.data();
  for (size_t k = 0; k < t.owned.size(); ++k) {
    const NodeSketch& s = t.owned[k];
    const Node& serves = *in.nodes[s.serves];
    NodePtr n = k < spare_nodes.size() ? std::move(spare_nodes[k]) : nullptr;
    if (n) {
      // Made from this sketch before (op, arguments and metas as stored): only the buffers and
      // versions change.
      auto version = [&](uint64_t code, uint64_t rel) {
        return static_cast<uint32_t>(static_cast<int64_t>(rel) + base_of(code));
      };
      for (Use& u : n->uses) {
        u.ref.buf = c10::intrusive_ptr<LazyBuffer>::reclaim_copy(buffer(refs[0]));
        u.ref.version = version(refs[0], refs[1]);
        u.write_version = version(refs[0], refs[2]);
        refs += 3;
      }
      for (Def& d : n->defs) {
        d.ref.buf = c10::intrusive_ptr<LazyBuffer>::reclaim_copy(buffer(refs[0]));
        d.ref.version = version(refs[0], refs[1]);
        refs += 2;
      }
    } else {
      refs += 3 * s.uses.size() + 2 * s.defs.size();
      n = std::make_unique<Node>(s.op);
      n->args = s.args;
      for (const auto& [bare, r] : s.uses) {
        Use u = bare;
        u.ref = ref(r);
        u.write_version = static_cast<uint32_t>(static_cast<int64_t>(bare.write_version) + base_of(r.buf));
        n->uses.push_back(std::move(u));
      }
      for (const auto& [bare, r] : s.defs) {
        Def d = bare;
        d.ref = ref(r);
        n->defs.push_back(std::move(d));
      }
    }
    n->seq = serves.seq;
    n->site = serves.site;
    n->grad_mode = serves.grad_mode;
    plan.owned.push_back(std::move(n));
  }
  // Every pointer and version from the codes, in the order visit() met them when the plan was stored.
  size_t k = 0;
  uint64_t buf_code = 0;
  visit(
      plan, [&](LazyBuffer*& b) { b = buffer(t.codes[k++]); },
      [&](Node*& n) {
        const uint64_t code = t.codes[k++];
        n = code & kOwned ? plan.owned[code & ~kOwned].get() : in.nodes[code - 1];
      },
      [&](LazyBuffer*, uint32_t& v) {
        // The version's code comes first, then its buffer's (peeked for the base).
        buf_code = t.codes[k + 1];
        v = static_cast<uint32_t>(static_cast<int64_t>(t.codes[k++]) + base_of(buf_code));
      });
  return plan;
}

void recycle_plan(Plan&& plan) {
  if (plan.template_id == 0) return;
  Cache& c = cache();
  std::lock_guard<std::mutex> lock(c.mu);
  for (Template& t : c.entries) {
    if (t.id != plan.template_id) continue;
    // Synthesized nodes the program did not take (pending again) are kept for the next
    // instantiation, without their buffers (which must not outlive their tensors).
    for (NodePtr& n : plan.owned) {
      if (!n) continue;
      for (Use& u : n->uses) u.ref.buf.reset();
      for (Def& d : n->defs) d.ref.buf.reset();
    }
    t.spare = std::move(plan);
    return;
  }
}

void plan_learned_chunk(uint64_t template_id, size_t stage, int64_t chunk) {
  Cache& c = cache();
  std::lock_guard<std::mutex> lock(c.mu);
  for (Template& t : c.entries) {
    if (t.id == template_id && stage < t.plan.stages.size() && t.plan.stages[stage].loop) {
      t.plan.stages[stage].chunk = std::min(t.plan.stages[stage].chunk, chunk);
    }
  }
}

void clear_plan_cache() {
  Cache& c = cache();
  std::lock_guard<std::mutex> lock(c.mu);
  c.entries.clear();
}

size_t plan_cache_size() {
  Cache& c = cache();
  std::lock_guard<std::mutex> lock(c.mu);
  return c.entries.size();
}

} // namespace lazymem
