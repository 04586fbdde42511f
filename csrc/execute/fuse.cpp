// execute: pointwise chains run as one loop on the CPU backing (fuse.h).
#include "execute/fuse.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <unordered_map>
#include <vector>

#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/ScalarType.h>
#include <c10/util/Exception.h>

#include "core/config.h"
#include "core/runtime.h"
#include "execute/real.h"
#include "plan/timing.h"

namespace lazymem {
namespace {

// Each a correctly rounded IEEE operation, or exact, evaluated as eager's CPU kernel evaluates it.
enum class Op : uint8_t {
  kAdd, kSub, kMul, kDiv, kMaximum, kMinimum, // binary
  kThresholdBackward,                         // (self, grad): self <= p ? 0 : grad
  kNeg, kRecip, kAbs, kSquare, kCube, kInvSquare, // unary
  kClampMin, kClampMax, kClamp                // unary with bounds p (and q)
};

enum class Args : uint8_t {
  kBinary,    // (self, other[, alpha])
  kUnary,     // (self)
  kRelu,      // (self): clamp_min at 0
  kClamp,     // (self, min?, max?), or clamp_min/clamp_max (self, bound)
  kPow,       // (self, exponent): the exponents eager's kernel computes by products, sqrt or division
  kThreshold, // threshold_backward(grad, self, threshold)
};

struct Form {
  Op op = Op::kAdd;
  Args args = Args::kBinary;
  bool reversed = false; // rsub: other - self
  bool alpha = false;    // args[2] is alpha: fused only when it is 1
  bool out = false;      // an out= form: its result is the (fresh) tensor it writes whole
};

struct Known {
  c10::OperatorHandle handle;
  Form form;
};

const std::vector<Known>& known_ops() {
  static const std::vector<Known> ops = [] {
    std::vector<Known> v;
    auto add = [&](const char* name, const char* overload, Form f) {
      if (auto h = c10::Dispatcher::singleton().findSchema({name, overload})) v.push_back({*h, f});
    };
    using A = Args;
    add("aten::add", "Tensor", {Op::kAdd, A::kBinary, false, true});
    add("aten::add", "Scalar", {Op::kAdd, A::kBinary, false, true});
    add("aten::sub", "Tensor", {Op::kSub, A::kBinary, false, true});
    add("aten::sub", "Scalar", {Op::kSub, A::kBinary, false, true});
    add("aten::rsub", "Tensor", {Op::kSub, A::kBinary, true, true});
    add("aten::rsub", "Scalar", {Op::kSub, A::kBinary, true, true});
    add("aten::mul", "Tensor", {Op::kMul, A::kBinary});
    add("aten::mul", "Scalar", {Op::kMul, A::kBinary});
    add("aten::div", "Tensor", {Op::kDiv, A::kBinary});
    add("aten::div", "Scalar", {Op::kDiv, A::kBinary});
    add("aten::maximum", "", {Op::kMaximum, A::kBinary});
    add("aten::minimum", "", {Op::kMinimum, A::kBinary});
    add("aten::neg", "", {Op::kNeg, A::kUnary});
    add("aten::reciprocal", "", {Op::kRecip, A::kUnary});
    add("aten::abs", "", {Op::kAbs, A::kUnary});
    add("aten::abs", "out", {Op::kAbs, A::kUnary, false, false, true}); // (what at::abs records)
    add("aten::relu", "", {Op::kClampMin, A::kRelu});
    add("aten::clamp_min", "", {Op::kClampMin, A::kClamp});
    add("aten::clamp_max", "", {Op::kClampMax, A::kClamp});
    add("aten::clamp", "", {Op::kClamp, A::kClamp});
    add("aten::pow", "Tensor_Scalar", {Op::kSquare, A::kPow});
    add("aten::threshold_backward", "", {Op::kThresholdBackward, A::kThreshold});
    return v;
  }();
  return ops;
}

// A host number an op reads: converted to the op's dtype when it runs, as ATen converts a CPU scalar
// operand (static_cast from its own type, so an int64 is not rounded twice through a double).
struct Number {
  bool is_int = false;
  int64_t i = 0;
  double d = 0;
  template <typename T>
  T as() const {
    return is_int ? static_cast<T>(i) : static_cast<T>(d);
  }
};

bool number_of(const c10::IValue& v, Number& out) {
  if (v.isDouble()) {
    out.d = v.toDouble();
    return true;
  }
  if (v.isInt() || v.isBool()) {
    out.is_int = true;
    out.i = v.isInt() ? v.toInt() : static_cast<int64_t>(v.toBool());
    return true;
  }
  if (!v.isTensor()) return false;
  const at::Tensor& t = v.toTensor();
  if (!t.defined() || !t.device().is_cpu() || t.dim() != 0 || t.is_neg() || t.is_conj() || !t.has_storage()) return false;
  switch (t.scalar_type()) {
    case c10::ScalarType::Double: out.d = *t.const_data_ptr<double>(); return true;
    case c10::ScalarType::Float: out.d = *t.const_data_ptr<float>(); return true;
    case c10::ScalarType::Long: out.is_int = true; out.i = *t.const_data_ptr<int64_t>(); return true;
    case c10::ScalarType::Int: out.is_int = true; out.i = *t.const_data_ptr<int32_t>(); return true;
    case c10::ScalarType::Bool: out.is_int = true; out.i = *t.const_data_ptr<bool>(); return true;
    default: return false;
  }
}

// A Scalar argument the kernel converts with Scalar::to<T>() (clamp's bounds, the threshold): a
// finite double past float's range raises there ("cannot be converted ... without overflow"), so
// such a node runs plainly and raises as eager does.
bool converts(const Number& n, c10::ScalarType dtype) {
  return n.is_int || dtype != c10::ScalarType::Float || !std::isfinite(n.d) ||
         std::abs(n.d) <= static_cast<double>(std::numeric_limits<float>::max());
}

bool is_one(const c10::IValue& v) {
  return (v.isInt() && v.toInt() == 1) || (v.isDouble() && v.toDouble() == 1.0);
}

// Dense row-major (strides of size-1 dims do not matter).
bool row_major(const TensorMeta& m) {
  int64_t expected = 1;
  for (size_t d = m.sizes.size(); d-- > 0;) {
    if (m.sizes[d] == 1) continue;
    if (m.strides[d] != expected) return false;
    expected *= m.sizes[d];
  }
  return true;
}


// One operand of a fusible node: a host number, or a tensor the node reads (one of its uses).
struct Operand {
  enum Kind : uint8_t { kNone, kNumber, kTensor } kind = kNone;
  uint32_t use = 0;
  Number number;
};

struct Fusible {
  bool ok = false;
  Op op = Op::kAdd;
  Operand a, b;   // b: kNone for unary ops
  Number p, q;    // bounds (clamp), the threshold (threshold_backward)
  int32_t out = -1; // an out= form: the use it writes (else its def is the result)
  c10::ScalarType dtype = c10::ScalarType::Undefined;
  int64_t numel = 0;
};

// A fusible node's result: its def, or the use its out= form writes.
const TensorRef& result_of(const Node& n, int32_t out) {
  return out < 0 ? n.defs[0].ref : n.uses[static_cast<size_t>(out)].ref;
}

// pow(x, e): the exponents eager's kernel computes by products and a division (PowKernel.cpp); not
// 0.5 and -0.5 (its float sqrt is not correctly rounded on every CPU: 1 ulp from IEEE sqrt on the CI
// machine's AVX-512), nor std::pow's.
bool pow_op(const c10::IValue& e, Op& op) {
  Number n;
  if (!number_of(e, n) || e.isTensor() || e.isBool()) return false;
  const double v = n.is_int ? static_cast<double>(n.i) : n.d;
  if (v == 2.0) op = Op::kSquare;
  else if (v == 3.0) op = Op::kCube;
  else if (v == -2.0) op = Op::kInvSquare;
  else if (v == -1.0) op = Op::kRecip;
  else return false;
  return true;
}

Fusible analyze(const PlannedNode& pn) {
  Fusible f;
  const Node& n = *pn.node;
  if (n.random || n.effectful || n.upload || !n.device_args.empty() || n.uses.empty()) return f;
  const Form* form = nullptr;
  for (const Known& k : known_ops()) {
    if (k.handle == pn.op) {
      form = &k.form;
      break;
    }
  }
  if (!form || n.defs.size() != (form->out ? 0u : 1u)) return f;
  if (form->out) {
    // Writes the whole of its out= tensor, and nothing else.
    for (size_t i = 0; i < n.uses.size(); ++i) {
      const Use& u = n.uses[i];
      if (!u.write) continue;
      if (f.out >= 0 || !u.full_overwrite() || u.elem != -1) return f;
      f.out = static_cast<int32_t>(i);
    }
    if (f.out < 0) return f;
  }
  const TensorRef& result = result_of(n, f.out);
  const TensorMeta& m = result.meta;
  if ((m.dtype != c10::ScalarType::Float && m.dtype != c10::ScalarType::Double) || m.conj || m.neg || m.offset != 0 ||
      !row_major(m)) {
    return f;
  }
  const int64_t numel = m.numel();
  if (numel < 1 || numel > kMaxFusedElements ||
      result.buf->nbytes.load(std::memory_order_relaxed) !=
          static_cast<size_t>(numel) * c10::elementSize(m.dtype)) {
    return f;
  }
  f.op = form->op;
  // The operands (argument positions) and the op's numbers.
  size_t operands = 1;
  switch (form->args) {
    case Args::kBinary:
      operands = 2;
      if (form->alpha && (n.args.size() < 3 || !is_one(n.args[2]))) return f;
      break;
    case Args::kUnary:
      break;
    case Args::kRelu:
      f.p.is_int = true; // clamp_min(x, 0)
      break;
    case Args::kClamp: {
      // clamp(x, min?, max?) with one bound is clamp_min or clamp_max; with none, eager's error. A NaN
      // bound is not fused (what eager makes of it is its kernel's business).
      const c10::IValue none;
      const c10::IValue& lo = form->op == Op::kClampMax ? none : n.args.size() > 1 ? n.args[1] : none;
      const c10::IValue& hi = form->op == Op::kClampMax ? (n.args.size() > 1 ? n.args[1] : none)
                              : form->op == Op::kClamp && n.args.size() > 2 ? n.args[2] : none;
      Number* next = &f.p;
      for (const c10::IValue* bound : {&lo, &hi}) {
        if (bound->isNone()) continue;
        if (bound->isTensor() || !number_of(*bound, *next) || (!next->is_int && std::isnan(next->d))) return f;
        next = &f.q;
      }
      if ((lo.isNone() && hi.isNone()) || !converts(f.p, m.dtype) || !converts(f.q, m.dtype)) return f;
      f.op = !lo.isNone() && !hi.isNone() ? Op::kClamp : !lo.isNone() ? Op::kClampMin : Op::kClampMax;
      break;
    }
    case Args::kPow:
      if (n.args.size() < 2 || !pow_op(n.args[1], f.op)) return f;
      break;
    case Args::kThreshold:
      operands = 2;
      if (n.args.size() < 3 || n.args[2].isTensor() || !number_of(n.args[2], f.p) || !converts(f.p, m.dtype)) return f;
      break;
  }
  Operand ops[2];
  for (size_t i = 0; i < n.uses.size(); ++i) {
    if (static_cast<int32_t>(i) == f.out) continue;
    const Use& u = n.uses[i];
    const TensorMeta& um = u.ref.meta;
    // (Of the result's numel, a dense operand is the result's shape up to leading 1s: no broadcast.)
    if (u.write || u.elem != -1 || u.arg < 0 || static_cast<size_t>(u.arg) >= operands ||
        ops[u.arg].kind != Operand::kNone || um.dtype != m.dtype || um.conj || um.neg || um.numel() != numel ||
        !row_major(um)) {
      return f;
    }
    ops[u.arg].kind = Operand::kTensor;
    ops[u.arg].use = static_cast<uint32_t>(i);
  }
  for (size_t a = 0; a < operands; ++a) {
    if (ops[a].kind != Operand::kNone) continue;
    // (threshold_backward's operands are both tensors; a tensor argument that is no lazymem value
    // and not 0-dim is not fused)
    if (form->args == Args::kThreshold || a >= n.args.size() || !number_of(n.args[a], ops[a].number)) return f;
    ops[a].kind = Operand::kNumber;
  }
  // threshold_backward(grad, self, t) computes from (self, grad); rsub(self, other) is other - self.
  const bool swap = form->reversed || form->args == Args::kThreshold;
  f.a = swap ? ops[1] : ops[0];
  f.b = operands == 1 ? Operand() : (swap ? ops[0] : ops[1]);
  f.dtype = m.dtype;
  f.numel = numel;
  f.ok = true;
  return f;
}

size_t bytes(const LazyBuffer* b) {
  return b->nbytes.load(std::memory_order_relaxed);
}

// A stage's chains, found once per execution: where each starts and ends, and its nodes as analyzed.
struct Chains {
  std::vector<Fusible> nodes;
  std::vector<uint32_t> end;                 // per position: the end of the chain starting there (0: none)
  std::vector<std::array<int32_t, 2>> from;  // per position in a chain and operand: the position of
                                             // the chain's node defining it (-1: from outside)
  std::vector<char> escapes;                 // per position in a chain: its result outlives the chain

  // The longest run of fusible nodes from `i` of one dtype and size, cut where the results it would
  // allocate up front come to more than the plain runs of its nodes hold at their peak. Returns its
  // end (i: none).
  size_t grow(const Stage& st, size_t i) {
    defined_.clear();
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
        from[k][s] = -1;
        if (o.kind != Operand::kTensor) continue;
        const Use& u = n.uses[o.use];
        auto it = defined_.find(u.ref.buf.get());
        if (it == defined_.end()) continue;
        ok = ok && u.ref.meta.offset == 0; // (not a view into the middle of a value of the chain)
        from[k][s] = static_cast<int32_t>(it->second);
      }
      if (!ok) break;
      const LazyBuffer* out = result_of(n, f.out).buf.get();
      defined_.emplace(out, k);
      held += static_cast<int64_t>(bytes(out));
      escaping += static_cast<int64_t>(bytes(out));
      peak = std::max(peak, held);
      for (LazyBuffer* b : st.released_after(st.nodes[k])) {
        held -= static_cast<int64_t>(bytes(b));
        if (defined_.count(b)) escaping -= static_cast<int64_t>(bytes(b));
      }
      if (escaping <= peak) best = k + 1;
    }
    if (best == i) return i;
    for (size_t k = i; k < best; ++k) escapes[k] = 1;
    for (size_t k = i; k < best; ++k) {
      for (LazyBuffer* b : st.released_after(st.nodes[k])) {
        auto it = defined_.find(b);
        if (it != defined_.end() && it->second < best) escapes[it->second] = 0;
      }
    }
    return best;
  }

  explicit Chains(const Stage& st)
      : nodes(st.nodes.size()), end(st.nodes.size(), 0), from(st.nodes.size()), escapes(st.nodes.size(), 0) {
    for (size_t i = 0; i < st.nodes.size(); ++i) nodes[i] = analyze(st.nodes[i]);
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
  std::unordered_map<const LazyBuffer*, size_t> defined_; // grow's: a chain's results, by buffer
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

template <typename T, typename F>
void run_step(const Step<T>& s, int64_t at, int64_t n, T* regs, int64_t stride, F f) {
  T* d = s.rd >= 0 ? regs + s.rd * stride : s.d + at;
  const T* a = s.ra >= 0 ? regs + s.ra * stride : (s.a ? s.a + at : nullptr);
  const T* b = s.rb >= 0 ? regs + s.rb * stride : (s.b ? s.b + at : nullptr);
  if (a && b) {
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
  std::vector<T> regs(static_cast<size_t>(std::max(registers, 1) * stride));
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
    auto it = chains_.find(&st);
    if (it == chains_.end()) it = chains_.emplace(&st, Chains(st)).first;
    const Chains& c = it->second;
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
    // Operands from outside the chain: on the device, at the version recorded, not poisoned (else
    // the plain path runs and reports them).
    auto outside = [&](size_t k, const Operand& o) -> const T* {
      const Use& u = st.nodes[k].node->uses[o.use];
      const LazyBuffer& b = *u.ref.buf;
      if (!b.has_real() || b.real_on_host || b.real_version != u.ref.version || b.poison ||
          b.real.nbytes() < u.ref.meta.extent_bytes()) {
        return nullptr;
      }
      return static_cast<const T*>(b.real.data()) + u.ref.meta.offset;
    };
    std::vector<Step<T>> steps(q - p);
    for (size_t k = p; k < q; ++k) {
      const Fusible& f = c.nodes[k];
      if (f.out >= 0 && result_of(*st.nodes[k].node, f.out).buf->has_real()) { // (an out= tensor that exists)
        stats().fusion_fallbacks.fetch_add(1, std::memory_order_relaxed);
        return p;
      }
      Step<T>& s = steps[k - p];
      s.op = f.op;
      s.p = f.p.as<T>();
      s.q = f.q.as<T>();
      for (int o = 0; o < 2; ++o) {
        const Operand& op = o == 0 ? f.a : f.b;
        const T** ptr = o == 0 ? &s.a : &s.b;
        if (op.kind == Operand::kNumber) {
          (o == 0 ? s.na : s.nb) = op.number.as<T>();
        } else if (op.kind == Operand::kTensor && c.from[k][o] < 0) {
          if (!(*ptr = outside(k, op))) {
            stats().fusion_fallbacks.fetch_add(1, std::memory_order_relaxed);
            return p;
          }
        }
      }
    }
    // Results that outlive the chain get their storage now (before any ran: out of memory here,
    // the plain path runs the nodes and reports it).
    std::vector<c10::Storage> kept(q - p);
    try {
      for (size_t k = p; k < q; ++k) {
        if (c.escapes[k]) kept[k - p] = allocate_real(bytes(result_of(*st.nodes[k].node, c.nodes[k].out).buf.get()));
      }
    } catch (const c10::OutOfMemoryError&) {
      stats().fusion_fallbacks.fetch_add(1, std::memory_order_relaxed);
      return p;
    }
    // Registers for the values that die in the chain: taken at their node, free after their last reader.
    std::vector<size_t> last(q - p, 0);
    for (size_t k = p; k < q; ++k) {
      for (int o = 0; o < 2; ++o) {
        if (c.from[k][o] >= 0) last[static_cast<size_t>(c.from[k][o]) - p] = k - p;
      }
    }
    std::vector<int32_t> reg(q - p, -1), free_regs;
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
      if (c.escapes[k]) {
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
      if (!c.escapes[k] && last[k - p] == 0) free_regs.push_back(s.rd); // read by none
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
    stats().fused_chains.fetch_add(1, std::memory_order_relaxed);
    stats().fused_nodes.fetch_add(q - p, std::memory_order_relaxed);
    return q;
  }

  std::unordered_map<const Stage*, Chains> chains_;
};

} // namespace

std::unique_ptr<StageRunner> fusion_runner(const Plan& plan) {
  if (!config().fusion.load(std::memory_order_relaxed) || !backing_device().is_cpu()) return nullptr;
  for (const Stage& st : plan.stages) {
    if (!st.loop && st.nodes.size() >= 2) return std::make_unique<FusionRunner>();
  }
  return nullptr;
}

} // namespace lazymem
