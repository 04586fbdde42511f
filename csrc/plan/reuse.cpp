// plan: plans reused across steps (see plan/reuse.h).
//
// A stored plan is the Plan itself with every buffer and node pointer replaced by a code: program
// buffers by 1 + their canonical number, buffers the planner created for synthesized nodes by a
// fresh number with the top bit set, program nodes by 1 + their position, synthesized nodes by
// their position in Plan::owned with the top bit set. Versions in the plan (accumulators, full
// storages, rows written) are stored relative to their buffer's first reference. Instantiating
// decodes the codes against the new program's buffers and nodes and rebuilds the synthesized nodes
// from sketches (or patches those of a plan handed back). The encoded plan is never executed. The
// fingerprint that keys the stored plans is in plan/fingerprint.cpp.
#include "plan/reuse.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <list>
#include <mutex>
#include <unordered_map>

#include "core/config.h"

namespace lazymem {
namespace {

constexpr uint64_t kFresh = uint64_t{1} << 62;
constexpr uint64_t kOwned = uint64_t{1} << 62;

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
    for (PlannedNode& pn : st.nodes) fn(pn.node);
    for (LazyBuffer*& b : st.released) fb(b);
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
  for (BatchFact& f : p.facts) {
    fv(f.buf, f.version);
    fb(f.buf);
  }
}

Plan copy_body(const Plan& p) {
  Plan c;
  c.stages = p.stages;
  c.facts = p.facts;
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

// What an entry holds, in words: its key, its encoded plan's codes, its synthesized nodes' references,
// its buffers' numbering, and an allowance per planned node (the plan body, the nodes' sketches).
size_t weight_of(const Template& t) {
  size_t planned = 0;
  for (const Stage& st : t.plan.stages) planned += st.nodes.size();
  return t.fp.key.size() + t.codes.size() + t.owned_refs.size() + t.fp.buffers.size() + t.fp.base.size() / 2 +
      16 * (planned + t.owned.size());
}

// Every plan of a step stays: a pipelined step hands its worker batches that are programs of their
// own (the first ones growing from 8 ops, then at the pipeline's batch size), and a large model's
// step spans many of them. With room for 8 a step of more batches evicted each plan before the next
// step could reuse it, and every batch was planned anew every step.
struct Cache {
  std::mutex mu;
  std::list<Template> entries; // most recently used first
  uint64_t next_id = 0;
  size_t weight = 0;           // of the entries (weight_of)
  static constexpr size_t kMaxEntries = 256;
  static constexpr size_t kMaxWeight = size_t{4} << 20; // words: about 32 MiB
};

void erase_entry(Cache& c, std::list<Template>::iterator it) {
  c.weight -= weight_of(*it);
  c.entries.erase(it);
}

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
  c.weight += weight_of(t);
  c.entries.push_front(std::move(t));
  while (c.entries.size() > 1 && (c.entries.size() > Cache::kMaxEntries || c.weight > Cache::kMaxWeight)) {
    erase_entry(c, std::prev(c.entries.end()));
  }
}

std::optional<Plan> reuse_plan(const PlanInput& in, const Fingerprint& fp) {
  if (!fp.cacheable) return std::nullopt;
  Cache& c = cache();
  std::lock_guard<std::mutex> lock(c.mu);
  auto it = c.entries.begin();
  // A plan made under another budget is as good while it fits and the budget has not grown by
  // more than a tenth (a fresh plan might then split less, or not at all).
  auto budget_ok = [&](const Template& t) {
    if (fp.budget < 0 || (t.fp.budget == fp.budget && t.fp.whole_budget == fp.whole_budget)) return true;
    const int64_t limit = t.plan.split ? fp.budget : std::max(fp.budget, fp.whole_budget);
    return t.plan.predicted_peak <= limit && fp.budget <= t.fp.budget + t.fp.budget / 10;
  };
  // Held bytes other than the plan's: the same plan if unsplit (nothing in it depends on them but
  // whether it fits), shifted by the difference.
  auto resident_ok = [&](const Template& t) {
    if (t.fp.resident == fp.resident) return true;
    if (t.plan.split || !t.plan.retained.empty()) return false;
    return fp.budget < 0 ||
        t.plan.predicted_peak - t.fp.resident + fp.resident <= std::max(fp.budget, fp.whole_budget);
  };
  for (; it != c.entries.end(); ++it) {
    if (it->fp.hash == fp.hash && it->fp.words == fp.words &&
        std::memcmp(it->fp.key.data(), fp.key.data(), fp.words * sizeof(uint64_t)) == 0 && budget_ok(*it) &&
        resident_ok(*it)) {
      break;
    }
  }
  if (it == c.entries.end()) {
    if (config().debug.load(std::memory_order_relaxed) >= 2 && !c.entries.empty()) {
      // Where this program first differs from the most recent stored one of its length, else the
      // most recent (LAZYMEM_DEBUG=2).
      auto same = std::find_if(c.entries.begin(), c.entries.end(), [&](const Template& t) { return t.fp.words == fp.words; });
      const std::vector<uint64_t>& last = (same != c.entries.end() ? *same : c.entries.front()).fp.key;
      size_t i = 0;
      while (i < last.size() && i < fp.words && last[i] == fp.key[i]) ++i;
      std::fprintf(stderr, "[lazymem] plan not reused: fingerprint of %zu words differs from the last stored (%zu words) "
                   "at word %zu%s\n", fp.words, last.size(), i,
                   i + 5 >= fp.words ? " (the settings or learned kernel workspace)" : "");
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
  plan.predicted_peak = t.plan.predicted_peak + fp.resident - t.fp.resident; // (a spare was shifted for its own)
  plan.resident = fp.resident;
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

void forget_plan(uint64_t template_id) {
  if (template_id == 0) return;
  Cache& c = cache();
  std::lock_guard<std::mutex> lock(c.mu);
  for (auto it = c.entries.begin(); it != c.entries.end(); ++it) {
    if (it->id == template_id) {
      erase_entry(c, it);
      return;
    }
  }
}

void clear_plan_cache() {
  Cache& c = cache();
  std::lock_guard<std::mutex> lock(c.mu);
  c.entries.clear();
  c.weight = 0;
}

size_t plan_cache_size() {
  Cache& c = cache();
  std::lock_guard<std::mutex> lock(c.mu);
  return c.entries.size();
}

} // namespace lazymem
