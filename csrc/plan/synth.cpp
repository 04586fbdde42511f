// plan: nodes the planner synthesizes. NLL with a mean reduction (cross entropy's default) divides
// by the total weight of the targets that are not ignored: sum over i with t_i != ignore_index of
// w[t_i] (the count without class weights). Its backward needs the global total before any chunk's
// gradient can be computed, but the total depends on the targets alone: a few cheap nodes compute it
// first (batch_split_theory.md §3.3, the targets pre-pass), writing the very buffer the NLL node
// would have produced, so the loss is the chunks' summed losses over it and the backward runs in the
// same loop as the forward with eager's per-row formula. All targets ignored gives 0/0 = NaN, as eager.
#include "plan/analysis.h"

#include <algorithm>

#include <ATen/core/dispatch/Dispatcher.h>

namespace lazymem {
namespace {

TensorMeta contiguous(c10::IntArrayRef sizes, c10::ScalarType dtype) {
  TensorMeta m;
  m.sizes.assign(sizes.begin(), sizes.end());
  m.strides.resize(sizes.size());
  int64_t st = 1;
  for (size_t k = sizes.size(); k-- > 0;) {
    m.strides[k] = st;
    st *= std::max<int64_t>(sizes[k], 1);
  }
  m.dtype = dtype;
  return m;
}

c10::OperatorHandle op(const char* name, const char* overload) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, overload);
}

// A node of `o` reading `ins` (argument position, reference) with scalar `args` filled in, defining
// `out` (a fresh plan-local buffer unless given).
struct Builder {
  Analysis& a;
  const Node& serves;
  std::vector<int32_t> made;

  TensorRef node(const c10::OperatorHandle& o, std::vector<c10::IValue> args,
                 std::vector<std::pair<int32_t, TensorRef>> ins, const TensorMeta& out_meta, BufferPtr out = {}) {
    auto n = std::make_unique<Node>(o);
    n->seq = serves.seq;
    n->site = serves.site;
    n->grad_mode = serves.grad_mode;
    n->args = std::move(args);
    for (auto& [arg, ref] : ins) {
      Use u;
      u.arg = arg;
      u.ref = ref;
      n->uses.push_back(std::move(u));
    }
    if (!out) out = c10::make_intrusive<LazyBuffer>(out_meta.extent_bytes());
    out->version = std::max<uint32_t>(out->version, 1);
    n->defs.push_back(Def{0, -1, TensorRef{out, out_meta, 1}});
    TensorRef result{out, out_meta, 1};
    int32_t i = a.add_node(n.get());
    a.nodes[i].runs = true;
    a.owned.push_back(std::move(n));
    made.push_back(i);
    return result;
  }
};

const Use* use_at(const Node& n, int32_t arg) {
  for (const Use& u : n.uses) {
    if (u.arg == arg && u.elem < 0) return &u;
  }
  return nullptr;
}

} // namespace

bool synthesize_total_weight(Analysis& a, int32_t nll) {
  const Node& n = *a.nodes[nll].node;
  const Use* target = use_at(n, 1);
  const Use* weight = use_at(n, 2);
  if (!target || n.defs.size() < 2) return false;
  const c10::IValue& w = n.args[2];
  const bool no_weight = w.isNone() || (w.isTensor() && !w.toTensor().defined());
  if (!weight && !no_weight) return false; // a host-constant weight: not expected
  const c10::IValue& ig = n.args[4];
  if (!ig.isInt() && !(ig.isSymInt() && ig.toSymInt().maybe_as_int())) return false;
  const int64_t ignore = ig.isInt() ? ig.toInt() : *ig.toSymInt().maybe_as_int();
  const Def& tw = n.defs[1];
  const c10::ScalarType dtype = tw.ref.meta.dtype;
  const c10::IntArrayRef tsizes = target->ref.meta.sizes;
  Builder b{a, n, {}};
  c10::IValue none;
  TensorRef valid = b.node(op("aten::ne", "Scalar"), {none, c10::IValue(ignore)}, {{0, target->ref}},
                           contiguous(tsizes, c10::kBool));
  TensorRef counted = valid;
  if (weight) {
    // w[t] where the target is valid, 0 elsewhere (ignored targets may be out of the weight's range).
    TensorRef safe = b.node(op("aten::where", "ScalarOther"), {none, none, c10::IValue(int64_t{0})},
                            {{0, valid}, {1, target->ref}}, contiguous(tsizes, target->ref.meta.dtype));
    TensorRef wt = b.node(op("aten::take", ""), {none, none}, {{0, weight->ref}, {1, safe}},
                          contiguous(tsizes, weight->ref.meta.dtype));
    counted = b.node(op("aten::mul", "Tensor"), {none, none}, {{0, wt}, {1, valid}}, contiguous(tsizes, dtype));
  }
  b.node(op("aten::sum", ""), {none, c10::IValue(dtype)}, {{0, counted}}, tw.ref.meta, tw.ref.buf);
  // They run right before the NLL node, in this order.
  auto at = std::find(a.order.begin(), a.order.end(), nll);
  a.order.insert(at, b.made.begin(), b.made.end());
  for (int32_t i : b.made) a.nodes[i].serves = nll;
  // The NLL node no longer produces the total weight when split.
  a.nodes[nll].discard[1] = true;
  bool ok = true;
  for (int32_t i : b.made) {
    evaluate(a, i);
    if (a.nodes[i].barrier || !a.nodes[i].loop || !apply_outcome(a, i)) {
      ok = false;
      break;
    }
  }
  ok = ok && a.bufs[a.index.at(tw.ref.buf.get())].place.is_p();
  if (!ok) {
    for (int32_t i : b.made) {
      a.nodes[i].runs = false;
      a.order.erase(std::find(a.order.begin(), a.order.end(), i));
    }
    a.nodes[nll].discard[1] = false;
  }
  return ok;
}

} // namespace lazymem
