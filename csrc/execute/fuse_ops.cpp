// execute: the ops fuse.h runs as one loop (fuse_ops.h).
#include "execute/fuse_ops.h"

#include <cmath>
#include <limits>
#include <unordered_map>
#include <vector>

#include <ATen/core/dispatch/Dispatcher.h>

#include "execute/fuse.h"

namespace lazymem::fuse {
namespace {


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
  bool inplace = false;  // an in-place form: its result is self, updated
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
    // In place: self is read and written (the same elements: no other view of it in the chain).
    const Form self{Op::kAdd, A::kBinary, false, true, false, true};
    auto inplace = [&](const char* name, const char* overload, Op op, A args, bool alpha) {
      Form f = self;
      f.op = op;
      f.args = args;
      f.alpha = alpha;
      add(name, overload, f);
    };
    inplace("aten::add_", "Tensor", Op::kAdd, A::kBinary, true);
    inplace("aten::add_", "Scalar", Op::kAdd, A::kBinary, true);
    inplace("aten::sub_", "Tensor", Op::kSub, A::kBinary, true);
    inplace("aten::sub_", "Scalar", Op::kSub, A::kBinary, true);
    inplace("aten::mul_", "Tensor", Op::kMul, A::kBinary, false);
    inplace("aten::mul_", "Scalar", Op::kMul, A::kBinary, false);
    inplace("aten::div_", "Tensor", Op::kDiv, A::kBinary, false);
    inplace("aten::div_", "Scalar", Op::kDiv, A::kBinary, false);
    inplace("aten::neg_", "", Op::kNeg, A::kUnary, false);
    inplace("aten::reciprocal_", "", Op::kRecip, A::kUnary, false);
    inplace("aten::abs_", "", Op::kAbs, A::kUnary, false);
    inplace("aten::relu_", "", Op::kClampMin, A::kRelu, false);
    inplace("aten::clamp_", "", Op::kClamp, A::kClamp, false);
    inplace("aten::clamp_min_", "", Op::kClampMin, A::kClamp, false);
    inplace("aten::clamp_max_", "", Op::kClampMax, A::kClamp, false);
    inplace("aten::pow_", "Scalar", Op::kSquare, A::kPow, false);
    return v;
  }();
  return ops;
}


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

// The form of `op`, or nullptr: one hash of its schema's address (the operator table's entry).
const Form* form_of(const c10::OperatorHandle& op) {
  static const std::unordered_map<const c10::FunctionSchema*, const Form*> by_schema = [] {
    std::unordered_map<const c10::FunctionSchema*, const Form*> m;
    for (const Known& k : known_ops()) m.emplace(&k.handle.schema(), &k.form);
    return m;
  }();
  auto it = by_schema.find(&op.schema());
  return it == by_schema.end() ? nullptr : it->second;
}

} // namespace

Fusible analyze(const PlannedNode& pn) {
  Fusible f;
  const Node& n = *pn.node;
  if (n.random || n.effectful || n.upload || !n.device_args.empty() || n.uses.empty()) return f;
  const Form* form = form_of(pn.op);
  const bool writes = form && (form->out || form->inplace);
  if (!form || n.defs.size() != (writes ? 0u : 1u)) return f;
  if (writes) {
    // An out= form writes the whole of its tensor; an in-place one updates self. Nothing else.
    for (size_t i = 0; i < n.uses.size(); ++i) {
      const Use& u = n.uses[i];
      if (!u.write) continue;
      if (f.out >= 0 || u.elem != -1 || (form->out && !u.full_overwrite()) ||
          (form->inplace && (u.arg != 0 || u.write_only))) {
        return f;
      }
      f.out = static_cast<int32_t>(i);
    }
    if (f.out < 0) return f;
  }
  f.inplace = form->inplace;
  if (form->out) {
    // abs_(x) records abs.out(x, out=x): the out= tensor is self, updated in place (its one view).
    const TensorRef& w = n.uses[static_cast<size_t>(f.out)].ref;
    for (const Use& u : n.uses) {
      if (u.write || u.ref.buf != w.buf) continue;
      if (!same_view(u.ref.meta, w.meta)) return f;
      f.inplace = true;
    }
  }
  const TensorRef& result = result_of(n, f.out);
  const TensorMeta& m = result.meta;
  // (A result this chain allocates is the whole of its buffer; self updated in place may be a view.)
  if ((m.dtype != c10::ScalarType::Float && m.dtype != c10::ScalarType::Double) || m.conj || m.neg ||
      (m.offset != 0 && !f.inplace) || !m.row_major()) {
    return f;
  }
  const int64_t numel = m.numel();
  if (numel < 1 || numel > kMaxFusedElements ||
      (!f.inplace && result.buf->nbytes.load(std::memory_order_relaxed) !=
                         static_cast<size_t>(numel) * c10::elementSize(m.dtype))) {
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
    if (static_cast<int32_t>(i) == f.out && (!f.inplace || n.uses[i].arg != 0)) continue; // (the result only)
    const Use& u = n.uses[i];
    const TensorMeta& um = u.ref.meta;
    // (Of the result's numel, a dense operand is the result's shape up to leading 1s: no broadcast.)
    if ((u.write && !f.inplace) || u.elem != -1 || u.arg < 0 || static_cast<size_t>(u.arg) >= operands ||
        ops[u.arg].kind != Operand::kNone || um.dtype != m.dtype || um.conj || um.neg || um.numel() != numel ||
        !um.row_major()) {
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

} // namespace lazymem::fuse
