// execute: pointwise chains run as one loop on the CPU backing (fuse.h).
#include "execute/fuse.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <unordered_map>
#include <vector>

#include <c10/core/ScalarType.h>
#include <c10/util/Exception.h>

#include "core/config.h"
#include "core/runtime.h"
#include "execute/fuse_ops.h"
#include "execute/real.h"
#include "plan/timing.h"

namespace lazymem {
namespace {

using fuse::Fusible;
using fuse::Op;
using fuse::Operand;
using fuse::result_of;
using fuse::same_view;

size_t bytes(const LazyBuffer* b) {
  return b->nbytes.load(std::memory_order_relaxed);
}

// This thread's instance `I` of a T, kept from one execution to the next (capacity reused).
template <typename T, int I = 0>
T& scratch() {
  thread_local T t;
  return t;
}

// A stage's chains, found once per execution: where each starts and ends, and its nodes as analyzed.
struct Chains {
  std::vector<Fusible> nodes;
  std::vector<uint32_t> end;                 // per position: the end of the chain starting there (0: none)
  // Per position in a chain and operand: the position of the chain's node whose result holds it
  // (kOutside: a tensor from outside the chain at the version recorded; kUpdated: one the chain
  // updated in place before).
  static constexpr int32_t kOutside = -1, kUpdated = -2;
  std::vector<std::array<int32_t, 2>> from;
  std::vector<char> escapes;                 // per position in a chain: its result outlives the chain

  // The longest run of fusible nodes from `i` of one dtype and size, cut where the results it would
  // allocate up front come to more than the plain runs of its nodes hold at their peak. Returns its
  // end (i: none).
  size_t grow(const Stage& st, size_t i) {
    // The chain's results by buffer (LazyBuffer::fuse_stamp/fuse_pos): owner(b) is the position of
    // the node whose result holds b's value, or -1.
    static std::atomic<uint64_t> stamps{0};
    const uint64_t stamp = stamps.fetch_add(1, std::memory_order_relaxed) + 1;
    auto owner = [stamp](const LazyBuffer* b) -> int64_t {
      return b->fuse_stamp == stamp ? static_cast<int64_t>(b->fuse_pos) : -1;
    };
    outside_.clear();
    int64_t held = 0, peak = 0, escaping = 0; // bytes beyond what the stage holds at the chain's start
    size_t best = i;
    // (A prefix past the cut fits again only once values of the chain die: not looked for further
    // than kLookPast nodes, so that finding the chains stays linear in the stage's nodes.)
    constexpr size_t kLookPast = 64;
    for (size_t k = i; k < st.nodes.size() && k < best + kLookPast; ++k) {
      const Fusible& f = nodes[k];
      if (!f.ok || f.dtype != nodes[i].dtype || f.numel != nodes[i].numel) break;
      const Node& n = *st.nodes[k].node;
      bool ok = true;
      for (int s = 0; s < 2; ++s) {
        const Operand& o = s == 0 ? f.a : f.b;
        from[k][s] = kOutside;
        if (o.kind != Operand::kTensor) continue;
        const TensorRef& r = n.uses[o.use].ref;
        if (const int64_t at = owner(r.buf.get()); at >= 0) {
          ok = ok && r.meta.offset == 0; // (not a view into the middle of a value of the chain)
          from[k][s] = static_cast<int32_t>(at);
          continue;
        }
        // From outside: every view of a tensor the chain updates in place must be the same elements
        // (blocks of one view are not those of another).
        auto [e, fresh] = outside_.try_emplace(r.buf.get(), Outside{&r.meta, true, false});
        if (!fresh) e->second.same = e->second.same && same_view(*e->second.meta, r.meta);
        ok = ok && (!e->second.updated || e->second.same);
        if (e->second.updated) from[k][s] = kUpdated;
      }
      if (f.inplace) {
        const LazyBuffer* self = n.uses[static_cast<size_t>(f.out)].ref.buf.get();
        auto e = outside_.find(self);
        if (e != outside_.end()) {
          ok = ok && e->second.same;
          e->second.updated = true;
        }
      }
      // (An out= tensor written first here: not one the chain read or wrote before.)
      if (!f.inplace) {
        const LazyBuffer* out = result_of(n, f.out).buf.get();
        ok = ok && owner(out) < 0 && !outside_.count(out);
      }
      if (!ok) break;
      if (!f.inplace) {
        LazyBuffer* out = result_of(n, f.out).buf.get();
        out->fuse_stamp = stamp;
        out->fuse_pos = static_cast<uint32_t>(k);
        held += static_cast<int64_t>(bytes(out));
        escaping += static_cast<int64_t>(bytes(out));
        peak = std::max(peak, held);
      }
      for (LazyBuffer* b : st.released_after(st.nodes[k])) {
        held -= static_cast<int64_t>(bytes(b));
        if (owner(b) >= 0) escaping -= static_cast<int64_t>(bytes(b));
      }
      if (escaping <= peak) best = k + 1;
    }
    if (best == i) return i;
    // Which results outlive [i, best): those not released inside it (in-place nodes hold none).
    for (size_t k = i; k < best; ++k) escapes[k] = !nodes[k].inplace;
    for (size_t k = i; k < best; ++k) {
      for (LazyBuffer* b : st.released_after(st.nodes[k])) {
        if (const int64_t at = owner(b); at >= 0 && static_cast<size_t>(at) < best) escapes[static_cast<size_t>(at)] = 0;
      }
    }
    return best;
  }

  // Finds the chains of `st` (the vectors keep their capacity from stage to stage: a stage of 10,000
  // tiny nodes freed and allocated a megabyte per sync, and glibc consolidated its free lists each time).
  void build(const Stage& st) {
    nodes.resize(st.nodes.size());
    end.assign(st.nodes.size(), 0);
    from.resize(st.nodes.size());
    escapes.assign(st.nodes.size(), 0);
    for (size_t i = 0; i < st.nodes.size(); ++i) nodes[i] = fuse::analyze(st.nodes[i]);
    for (size_t i = 0; i < st.nodes.size();) {
      const size_t e = nodes[i].ok ? grow(st, i) : i;
      if (e > i) {
        end[i] = static_cast<uint32_t>(e);
        i = e;
      } else {
        ++i;
      }
    }
  }

 private:
  struct Outside {
    const TensorMeta* meta; // the first view read
    bool same;              // every view read so far is that one
    bool updated;           // the chain updated it in place
  };
  std::unordered_map<const LazyBuffer*, Outside> outside_; // grow's: tensors from outside, by buffer
};

constexpr int64_t kBlock = 512; // elements per pass over the chain's nodes

// One fused node, ready to run: each operand a number, a register (a value that dies in the chain)
// or memory that moves with the block (an operand from outside, a result that outlives the chain).
template <typename T>
struct Step {
  Op op = Op::kAdd;
  const T* a = nullptr;
  const T* b = nullptr;
  T* d = nullptr;
  int32_t ra = -1, rb = -1, rd = -1; // registers (-1: the pointer, or the number when it is null)
  T na = 0, nb = 0;
  T p = 0, q = 0; // bounds, threshold
  bool inplace = false; // d is a (self updated in place)
};

template <typename T, typename F>
void loop_vv(T* __restrict d, const T* __restrict a, const T* __restrict b, int64_t n, F f) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    for (int j = 0; j < 8; ++j) d[i + j] = f(a[i + j], b[i + j]);
  }
  for (; i < n; ++i) d[i] = f(a[i], b[i]);
}
template <typename T, typename F>
void loop_vn(T* __restrict d, const T* __restrict a, T b, int64_t n, F f) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    for (int j = 0; j < 8; ++j) d[i + j] = f(a[i + j], b);
  }
  for (; i < n; ++i) d[i] = f(a[i], b);
}
template <typename T, typename F>
void loop_nv(T* __restrict d, T a, const T* __restrict b, int64_t n, F f) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    for (int j = 0; j < 8; ++j) d[i + j] = f(a, b[i + j]);
  }
  for (; i < n; ++i) d[i] = f(a, b[i]);
}

// In place: d is the first operand (b may be d too: x.mul_(x)).
template <typename T, typename F>
void loop_dv(T* d, const T* b, int64_t n, F f) {
  for (int64_t i = 0; i < n; ++i) d[i] = f(d[i], b[i]);
}
template <typename T, typename F>
void loop_dn(T* __restrict d, T b, int64_t n, F f) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    for (int j = 0; j < 8; ++j) d[i + j] = f(d[i + j], b);
  }
  for (; i < n; ++i) d[i] = f(d[i], b);
}

template <typename T, typename F>
void run_step(const Step<T>& s, int64_t at, int64_t n, T* regs, int64_t stride, F f) {
  T* d = s.rd >= 0 ? regs + s.rd * stride : s.d + at;
  const T* a = s.ra >= 0 ? regs + s.ra * stride : (s.a ? s.a + at : nullptr);
  const T* b = s.rb >= 0 ? regs + s.rb * stride : (s.b ? s.b + at : nullptr);
  if (s.inplace) {
    if (b) {
      loop_dv(d, b, n, f);
    } else {
      loop_dn(d, s.nb, n, f);
    }
  } else if (a && b) {
    loop_vv(d, a, b, n, f);
  } else if (a) {
    loop_vn(d, a, s.nb, n, f);
  } else {
    loop_nv(d, s.na, b, n, f);
  }
}

template <typename T>
void run_steps(const std::vector<Step<T>>& steps, int64_t numel, int32_t registers) {
  const int64_t stride = std::min(kBlock, numel);
  std::vector<T>& regs = scratch<std::vector<T>>();
  regs.resize(static_cast<size_t>(std::max(registers, 1) * stride));
  for (int64_t at = 0; at < numel; at += stride) {
    const int64_t n = std::min(stride, numel - at);
    for (const Step<T>& s : steps) {
      T* r = regs.data();
      const T p = s.p, q = s.q;
      // (std::max(x, p) is (x < p) ? p : x, as both of eager's paths for clamp_min; a NaN x stays.)
      switch (s.op) {
        case Op::kAdd: run_step(s, at, n, r, stride, [](T x, T y) { return x + y; }); break;
        case Op::kSub: run_step(s, at, n, r, stride, [](T x, T y) { return x - y; }); break;
        case Op::kMul: run_step(s, at, n, r, stride, [](T x, T y) { return x * y; }); break;
        case Op::kDiv: run_step(s, at, n, r, stride, [](T x, T y) { return x / y; }); break;
        case Op::kMaximum:
          run_step(s, at, n, r, stride, [](T x, T y) { return x != x ? x : y != y ? y : x < y ? y : x; });
          break;
        case Op::kMinimum:
          run_step(s, at, n, r, stride, [](T x, T y) { return x != x ? x : y != y ? y : y < x ? y : x; });
          break;
        case Op::kThresholdBackward: run_step(s, at, n, r, stride, [p](T x, T y) { return x <= p ? T(0) : y; }); break;
        case Op::kNeg: run_step(s, at, n, r, stride, [](T x, T) { return -x; }); break;
        case Op::kRecip: run_step(s, at, n, r, stride, [](T x, T) { return T(1) / x; }); break;
        case Op::kAbs: run_step(s, at, n, r, stride, [](T x, T) { return std::abs(x); }); break;
        case Op::kSquare: run_step(s, at, n, r, stride, [](T x, T) { return x * x; }); break;
        case Op::kCube: run_step(s, at, n, r, stride, [](T x, T) { return x * x * x; }); break;
        case Op::kInvSquare: run_step(s, at, n, r, stride, [](T x, T) { return T(1) / (x * x); }); break;
        case Op::kClampMin: run_step(s, at, n, r, stride, [p](T x, T) { return x < p ? p : x; }); break;
        case Op::kClampMax: run_step(s, at, n, r, stride, [p](T x, T) { return p < x ? p : x; }); break;
        case Op::kClamp:
          run_step(s, at, n, r, stride, [p, q](T x, T) {
            const T y = x < p ? p : x;
            return q < y ? q : y;
          });
          break;
      }
    }
  }
}

class FusionRunner final : public StageRunner {
 public:
  size_t run_from(size_t p, StageWalk& walk) override {
    const Stage& st = walk.stage();
    if (&st != stage_) { // (the plan's whole stages come one after another)
      chains_.build(st);
      stage_ = &st;
    }
    const Chains& c = chains_;
    if (c.end[p] == 0) return p;
    return c.nodes[p].dtype == c10::ScalarType::Float ? run<float>(st, c, p, walk) : run<double>(st, c, p, walk);
  }

  int64_t pool_bytes() const override {
    return 0;
  }

 private:
  template <typename T>
  size_t run(const Stage& st, const Chains& c, size_t p, StageWalk& walk) {
    const size_t q = c.end[p];
    // Operands from outside the chain: on the device, at the version recorded (one the chain
    // updated in place before: at the version it read then), not poisoned (else the plain path runs
    // and reports them).
    auto outside = [&](size_t k, const Operand& o, bool updated) -> T* {
      const Use& u = st.nodes[k].node->uses[o.use];
      LazyBuffer& b = *u.ref.buf;
      if (!b.has_real() || b.real_on_host || (!updated && b.real_version != u.ref.version) || b.poison ||
          b.real.nbytes() < u.ref.meta.extent_bytes()) {
        return nullptr;
      }
      return static_cast<T*>(b.real.mutable_data()) + u.ref.meta.offset;
    };
    std::vector<Step<T>>& steps = scratch<std::vector<Step<T>>>();
    steps.assign(q - p, Step<T>());
    for (size_t k = p; k < q; ++k) {
      const Fusible& f = c.nodes[k];
      if (f.out >= 0 && !f.inplace && result_of(*st.nodes[k].node, f.out).buf->has_real()) { // (an out= tensor that exists)
        stats().fusion_fallbacks.fetch_add(1, std::memory_order_relaxed);
        return p;
      }
      Step<T>& s = steps[k - p];
      s.op = f.op;
      s.p = f.p.as<T>();
      s.q = f.q.as<T>();
      s.inplace = f.inplace;
      for (int o = 0; o < 2; ++o) {
        const Operand& op = o == 0 ? f.a : f.b;
        const T** ptr = o == 0 ? &s.a : &s.b;
        if (op.kind == Operand::kNumber) {
          (o == 0 ? s.na : s.nb) = op.number.as<T>();
        } else if (op.kind == Operand::kTensor && c.from[k][o] < 0) {
          T* at = outside(k, op, c.from[k][o] == Chains::kUpdated);
          if (!at) {
            stats().fusion_fallbacks.fetch_add(1, std::memory_order_relaxed);
            return p;
          }
          *ptr = at;
          if (o == 0 && f.inplace) s.d = at; // (self, updated where it is)
        }
      }
    }
    // Results that outlive the chain get their storage now (before any ran: out of memory here,
    // the plain path runs the nodes and reports it).
    std::vector<c10::Storage>& kept = scratch<std::vector<c10::Storage>>();
    kept.assign(q - p, c10::Storage()); // (emptied again when the chain is done)
    try {
      for (size_t k = p; k < q; ++k) {
        if (c.escapes[k]) kept[k - p] = allocate_real(bytes(result_of(*st.nodes[k].node, c.nodes[k].out).buf.get()));
      }
    } catch (const c10::OutOfMemoryError&) {
      kept.clear(); // (what was allocated goes back before the plain run)
      stats().fusion_fallbacks.fetch_add(1, std::memory_order_relaxed);
      return p;
    }
    // Registers for the values that die in the chain: taken at their node, free after their last reader.
    std::vector<size_t>& last = scratch<std::vector<size_t>>();
    last.assign(q - p, 0);
    for (size_t k = p; k < q; ++k) {
      for (int o = 0; o < 2; ++o) {
        if (c.from[k][o] >= 0) last[static_cast<size_t>(c.from[k][o]) - p] = k - p;
      }
    }
    std::vector<int32_t>& reg = scratch<std::vector<int32_t>, 0>();
    std::vector<int32_t>& free_regs = scratch<std::vector<int32_t>, 1>();
    reg.assign(q - p, -1);
    free_regs.clear();
    int32_t registers = 0;
    for (size_t k = p; k < q; ++k) {
      Step<T>& s = steps[k - p];
      for (int o = 0; o < 2; ++o) {
        const int32_t src = c.from[k][o];
        if (src < 0) continue;
        const size_t v = static_cast<size_t>(src) - p;
        int32_t& r = o == 0 ? s.ra : s.rb;
        const T*& ptr = o == 0 ? s.a : s.b;
        r = reg[v];
        if (r < 0) ptr = static_cast<const T*>(kept[v].data());
      }
      if (s.inplace) {
        // Self: where its value is (outside the chain: s.d is set; a register; or kept storage).
        const int32_t src = c.from[k][0];
        if (src >= 0 && reg[static_cast<size_t>(src) - p] >= 0) s.rd = reg[static_cast<size_t>(src) - p];
        if (src >= 0 && reg[static_cast<size_t>(src) - p] < 0) s.d = static_cast<T*>(kept[static_cast<size_t>(src) - p].mutable_data());
      } else if (c.escapes[k]) {
        s.d = static_cast<T*>(kept[k - p].mutable_data());
      } else {
        if (free_regs.empty()) free_regs.push_back(registers++);
        s.rd = reg[k - p] = free_regs.back();
        free_regs.pop_back();
      }
      // (After the result took its register: a register is never both read and written by a step.)
      for (int o = 0; o < 2; ++o) {
        const int32_t src = c.from[k][o];
        if (src >= 0 && last[static_cast<size_t>(src) - p] == k - p && reg[static_cast<size_t>(src) - p] >= 0) {
          free_regs.push_back(reg[static_cast<size_t>(src) - p]);
          reg[static_cast<size_t>(src) - p] = -2; // (freed once, even when both operands read it)
        }
      }
      if (!s.inplace && !c.escapes[k] && last[k - p] == 0) free_regs.push_back(s.rd); // read by none
    }
    const auto t0 = std::chrono::steady_clock::now();
    run_steps(steps, c.nodes[p].numel, registers);
    const int64_t ns = std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count();
    for (size_t k = p; k < q; ++k) {
      const PlannedNode& pn = st.nodes[k];
      observe_node_time(node_time_key(pn), 1, ns / static_cast<int64_t>(q - p));
      // (Its result's storage in its slot: def 0, or the use an out= form writes.)
      c10::SmallVector<c10::Storage, 2> results;
      if (kept[k - p]) {
        results.resize(static_cast<size_t>(std::max(c.nodes[k].out, 0)) + 1);
        results.back() = std::move(kept[k - p]);
      }
      walk.bookkeep(k, results);
    }
    kept.clear();
    stats().fused_chains.fetch_add(1, std::memory_order_relaxed);
    stats().fused_nodes.fetch_add(q - p, std::memory_order_relaxed);
    return q;
  }

  // This thread's (executions on a thread run one at a time, under the flush lock).
  Chains& chains_ = scratch<Chains>();
  const Stage* stage_ = nullptr;
};

} // namespace

std::unique_ptr<StageRunner> fusion_runner(const Plan& plan) {
  if (!config().fusion.load(std::memory_order_relaxed) || !backing_device().is_cpu()) return nullptr;
  for (const Stage& st : plan.stages) {
    if (!st.loop && !st.nodes.empty()) return std::make_unique<FusionRunner>();
  }
  return nullptr;
}

} // namespace lazymem
