// plan: nodes the planner synthesizes. NLL with a mean reduction (cross entropy's default) divides
// by the total weight of the targets that are not ignored: sum over i with t_i != ignore_index of
// w[t_i] (the count without class weights). Its backward needs the global total before any chunk's
// gradient can be computed, but the total depends on the targets alone: a few cheap nodes compute it
// first (batch_split_theory.md §3.3, the targets pre-pass), writing the very buffer the NLL node
// would have produced, so the loss is the chunks' summed losses over it and the backward runs in the
// same loop as the forward with eager's per-row formula. All targets ignored gives 0/0 = NaN, as eager.
//
// Batch norm in training mode (§3.1): expand_node replaces the node by a statistics pass
// (lazymem::bn_moments per chunk, merged by Chan's update), the saved statistics and the running
// statistics' update run once, and the normalization per chunk; its backward by a pass summing
// grad_out and grad_out * (x - mean), the weight and bias gradients once, and the input's gradient
// per chunk (ops/split_ops.cpp). Softmax and log-softmax over the batch become a log-sum-exp pass
// and the rows per chunk, their backward a summing pass and the rows; variance and standard
// deviation a moments pass and a finish (ops/split_stats.cpp). The synthesized nodes write the very
// buffers (and versions) the node would have, so everything downstream is unchanged.
#include "plan/analysis.h"

#include <algorithm>

#include <ATen/core/dispatch/Dispatcher.h>

#include "ops/rule_util.h"

namespace lazymem {
namespace {

c10::OperatorHandle op(const char* name, const char* overload) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, overload);
}

// Nodes synthesized for the node `serves`: each reads `ins` (argument position, reference), defines
// `outs` (return position, reference: a fresh plan-local buffer or one of the served node's defs) and
// writes `writes` (uses with write versions). commit() puts them in the program before a node and
// gives them placements; on any barrier or conflict it takes them all out again.
struct Builder {
  Analysis& a;
  const Node& serves;
  std::vector<int32_t> made;

  static TensorRef fresh(const TensorMeta& m) {
    BufferPtr b = c10::make_intrusive<LazyBuffer>(m.extent_bytes());
    b->version = std::max<uint32_t>(b->version, 1);
    return TensorRef{b, m, 1};
  }

  int32_t node(const c10::OperatorHandle& o, std::vector<c10::IValue> args,
               std::vector<std::pair<int32_t, TensorRef>> ins, std::vector<std::pair<int32_t, TensorRef>> outs,
               std::vector<Use> writes = {}) {
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
    for (Use& w : writes) n->uses.push_back(std::move(w));
    for (auto& [ret, ref] : outs) n->defs.push_back(Def{ret, -1, ref});
    int32_t i = a.add_node(n.get());
    a.nodes[i].runs = true;
    a.owned.push_back(std::move(n));
    made.push_back(i);
    return i;
  }

  TensorRef one(const c10::OperatorHandle& o, std::vector<c10::IValue> args,
                std::vector<std::pair<int32_t, TensorRef>> ins, const TensorMeta& out_meta, BufferPtr out = {}) {
    TensorRef r = out ? TensorRef{out, out_meta, 1} : fresh(out_meta);
    if (out) out->version = std::max<uint32_t>(out->version, 1);
    node(o, std::move(args), std::move(ins), {{0, r}});
    return r;
  }

  // Commits the nodes in place of node `index`, which they replace (see commit), and records the
  // expansion; `effect` (a made node's position, or -1) is undone by setting its argument
  // `neutral_arg` to 0 should the plan stop early.
  bool replace(int32_t index, const std::vector<bool>& loop, int32_t effect = -1, int32_t neutral_arg = -1) {
    if (!commit(index, loop)) return false;
    Expansion e;
    e.index = index;
    for (int32_t i : made) e.made.push_back(a.nodes[i].node);
    if (effect >= 0) {
      e.effect = a.nodes[effect].node;
      e.neutral_arg = neutral_arg;
    }
    a.expansions.push_back(std::move(e));
    return true;
  }

  // Inserts the nodes before node `before` in the run order and settles them; `loop[k]` says whether
  // made[k] must run per chunk. False (and nothing changed) if one is a barrier or conflicts.
  bool commit(int32_t before, const std::vector<bool>& loop) {
    std::vector<std::pair<int32_t, BufInfo>> saved;
    for (int32_t i : made) {
      const NodeInfo& ni = a.nodes[i];
      for (int32_t b : ni.def_buf) saved.emplace_back(b, a.bufs[b]);
      for (size_t k = 0; k < ni.use_buf.size(); ++k) {
        if (ni.node->uses[k].write) saved.emplace_back(ni.use_buf[k], a.bufs[ni.use_buf[k]]);
      }
    }
    auto at = std::find(a.order.begin(), a.order.end(), before);
    a.order.insert(at, made.begin(), made.end());
    for (int32_t i : made) a.nodes[i].serves = before;
    bool ok = true;
    for (size_t k = 0; k < made.size() && ok; ++k) {
      evaluate(a, made[k]);
      const NodeInfo& ni = a.nodes[made[k]];
      ok = !ni.barrier && ni.loop == loop[k] && apply_outcome(a, made[k]);
    }
    if (ok) return true;
    for (int32_t i : made) {
      a.nodes[i].runs = false;
      a.order.erase(std::find(a.order.begin(), a.order.end(), i));
    }
    for (auto it = saved.rbegin(); it != saved.rend(); ++it) a.bufs[it->first] = it->second;
    return false;
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
  TensorRef valid = b.one(op("aten::ne", "Scalar"), {none, c10::IValue(ignore)}, {{0, target->ref}},
                          TensorMeta::contiguous(tsizes, c10::kBool));
  TensorRef counted = valid;
  if (weight) {
    // w[t] where the target is valid, 0 elsewhere (ignored targets may be out of the weight's range).
    TensorRef safe = b.one(op("aten::where", "ScalarOther"), {none, none, c10::IValue(int64_t{0})},
                           {{0, valid}, {1, target->ref}}, TensorMeta::contiguous(tsizes, target->ref.meta.dtype));
    TensorRef wt = b.one(op("aten::take", ""), {none, none}, {{0, weight->ref}, {1, safe}},
                         TensorMeta::contiguous(tsizes, weight->ref.meta.dtype));
    counted = b.one(op("aten::mul", "Tensor"), {none, none}, {{0, wt}, {1, valid}}, TensorMeta::contiguous(tsizes, dtype));
  }
  b.one(op("aten::sum", ""), {none, c10::IValue(dtype)}, {{0, counted}}, tw.ref.meta, tw.ref.buf);
  // They run right before the NLL node, which no longer produces the total weight when split: per
  // chunk when the targets carry the batch, else once (targets made on the device, `arange(B)`).
  a.nodes[nll].discard[1] = true;
  const bool rows = a.use_place(a.nodes[nll], static_cast<size_t>(target - n.uses.data())).is_s();
  const int32_t total = a.index.at(tw.ref.buf.get());
  const BufInfo before = a.bufs[total];
  if (!rows) a.bufs[total].place = Place::R(); // (the NLL node's own outcome made it partial)
  const bool ok = b.commit(nll, std::vector<bool>(b.made.size(), rows)) && a.bufs[total].place.is_p() == rows;
  if (!ok) {
    a.nodes[nll].discard[1] = false;
    a.bufs[total] = before;
  }
  return ok;
}

namespace {

const Def* def_at(const Node& n, int32_t ret) {
  for (const Def& d : n.defs) {
    if (d.ret == ret && d.elem < 0) return &d;
  }
  return nullptr;
}

// The value of argument `arg` for a synthesized node: its use (a lazymem tensor), else the
// argument itself (None, or a host constant).
void pass_arg(const Node& n, int32_t arg, std::vector<c10::IValue>& args,
              std::vector<std::pair<int32_t, TensorRef>>& ins, int32_t to) {
  if (const Use* u = use_at(n, arg)) {
    ins.emplace_back(to, u->ref);
  } else {
    args[to] = n.args[arg];
  }
}

double float_arg(const c10::IValue& v) {
  return v.isDouble() ? v.toDouble() : v.isSymFloat() ? v.toSymFloat().guard_float(__FILE__, __LINE__) : 0.0;
}

TensorMeta stats_meta(int64_t channels, c10::ScalarType dtype) {
  const int64_t sizes[] = {2, channels};
  return TensorMeta::contiguous(sizes, dtype);
}

// native_batch_norm(x, weight, bias, running_mean!, running_var!, training, momentum, eps)
//   -> (out, save_mean, save_invstd); cudnn_batch_norm has the same arguments and a fourth output,
//   its reserve space: empty for the plain batch norm (record/composite/batch_norm.cpp), made empty
//   here too, as cudnn_batch_norm_backward expands without reading it.
bool expand_forward(Analysis& a, int32_t i) {
  const Node& n = *a.nodes[i].node;
  const Use* x = use_at(n, 0);
  const Use* rm = use_at(n, 3);
  const Use* rv = use_at(n, 4);
  const Def* out = def_at(n, 0);
  const Def* mean = def_at(n, 1);
  const Def* invstd = def_at(n, 2);
  if (!x || !out || !mean || !invstd || x->ref.meta.sizes.size() < 2 || (rm == nullptr) != (rv == nullptr)) return false;
  if ((rm && !rm->write) || (rv && !rv->write) || n.uses.size() > 5) return false;
  const int64_t channels = x->ref.meta.sizes[1];
  if (mean->ref.meta.numel() != channels || invstd->ref.meta.numel() != channels) return false;
  const int64_t count = channels == 0 ? 0 : x->ref.meta.numel() / channels;
  const double momentum = float_arg(n.args[6]), eps = float_arg(n.args[7]);
  const c10::ScalarType dtype = mean->ref.meta.dtype;
  c10::IValue none;
  Builder b{a, n, {}};
  std::vector<bool> loop;
  TensorRef stats = b.one(op("lazymem::bn_moments", ""), {none, c10::IValue(dtype)}, {{0, x->ref}},
                          stats_meta(channels, dtype));
  loop.push_back(true);
  b.node(op("lazymem::bn_finish", ""), {none, c10::IValue(eps)}, {{0, stats}}, {{0, mean->ref}, {1, invstd->ref}});
  loop.push_back(false);
  if (const Def* reserve = def_at(n, 3)) {
    if (reserve->ref.meta.numel() != 0) return false;
    b.node(op("aten::new_empty", ""), {none, c10::IValue(std::vector<int64_t>{0}), c10::IValue(c10::kByte), none, none, none},
           {{0, mean->ref}}, {{0, reserve->ref}});
    loop.push_back(false);
  }
  int32_t effect = -1;
  if (rm) {
    Use wm = *rm, wv = *rv;
    wm.arg = 0;
    wv.arg = 1;
    effect = b.node(op("lazymem::bn_update_running", ""), {none, none, none, c10::IValue(momentum), c10::IValue(count)},
                    {{2, stats}}, {}, {wm, wv});
    loop.push_back(false);
  }
  std::vector<c10::IValue> args(5);
  std::vector<std::pair<int32_t, TensorRef>> ins{{0, x->ref}, {1, mean->ref}, {2, invstd->ref}};
  pass_arg(n, 1, args, ins, 3);
  pass_arg(n, 2, args, ins, 4);
  b.node(op("lazymem::bn_apply", ""), std::move(args), std::move(ins), {{0, out->ref}});
  loop.push_back(true);
  return b.replace(i, loop, effect, /*neutral_arg=*/6); // momentum 0: the running statistics stay as they are
}

// native_batch_norm_backward(grad_out, x, weight, running_mean, running_var, save_mean, save_invstd,
//   train, eps, output_mask) -> (grad_input, grad_weight, grad_bias); cudnn_batch_norm_backward(x,
//   grad_out, weight, running_mean, running_var, save_mean, save_invstd, eps, reserve) (training
//   only; the reserve space is not needed): `cudnn` swaps the first two.
bool expand_backward(Analysis& a, int32_t i, bool cudnn) {
  const Node& n = *a.nodes[i].node;
  const Use* g = use_at(n, cudnn ? 1 : 0);
  const Use* x = use_at(n, cudnn ? 0 : 1);
  const Use* mean = use_at(n, 5);
  const Use* invstd = use_at(n, 6);
  if (!g || !x || !mean || !invstd || x->ref.meta.sizes.size() < 2) return false;
  const int64_t channels = x->ref.meta.sizes[1];
  if (mean->ref.meta.numel() != channels || invstd->ref.meta.numel() != channels) return false;
  const int64_t count = channels == 0 ? 0 : x->ref.meta.numel() / channels;
  const c10::ScalarType dtype = mean->ref.meta.dtype;
  const Def* gi = def_at(n, 0);
  const Def* gw = def_at(n, 1);
  const Def* gb = def_at(n, 2);
  c10::IValue none;
  Builder b{a, n, {}};
  std::vector<bool> loop;
  TensorRef red = b.one(op("lazymem::bn_backward_reduce", ""), {none, none, none, none, c10::IValue(dtype)},
                        {{0, g->ref}, {1, x->ref}, {2, mean->ref}, {3, invstd->ref}}, stats_meta(channels, dtype));
  loop.push_back(true);
  if (gw || gb) {
    std::vector<std::pair<int32_t, TensorRef>> outs;
    if (gw) outs.emplace_back(0, gw->ref);
    if (gb) outs.emplace_back(1, gb->ref);
    b.node(op("lazymem::bn_backward_params", ""), {none}, {{0, red}}, std::move(outs));
    loop.push_back(false);
  }
  if (gi) {
    std::vector<c10::IValue> args{none, none, none, none, none, none, c10::IValue(count)};
    std::vector<std::pair<int32_t, TensorRef>> ins{{0, g->ref}, {1, x->ref}, {2, mean->ref}, {3, invstd->ref}};
    pass_arg(n, 2, args, ins, 4);
    ins.emplace_back(5, red);
    b.node(op("lazymem::bn_backward_elemt", ""), std::move(args), std::move(ins), {{0, gi->ref}});
    loop.push_back(true);
  }
  return b.replace(i, loop);
}

// x's sizes with `dims` kept as 1 (the shape of a keepdim reduction), after `lead` leading dims.
std::vector<int64_t> kept(c10::IntArrayRef sizes, const std::vector<int64_t>& dims, std::vector<int64_t> lead = {}) {
  std::vector<int64_t> out = std::move(lead);
  for (int64_t d = 0; d < static_cast<int64_t>(sizes.size()); ++d) {
    out.push_back(std::find(dims.begin(), dims.end(), d) != dims.end() ? 1 : sizes[d]);
  }
  return out;
}

// _softmax(x, dim, half_to_float) / _log_softmax: lse = logsumexp(x, dim, keepdim) over a pass
// (merged by logaddexp), then exp(x - lse) or x - lse per chunk.
bool expand_softmax(Analysis& a, int32_t i, bool log) {
  const Node& n = *a.nodes[i].node;
  const Use* x = use_at(n, 0);
  const Def* out = def_at(n, 0);
  if (!x || !out || !n.args[1].isInt() || !n.args[2].isBool() || n.args[2].toBool()) return false;
  if (!c10::isFloatingType(x->ref.meta.dtype) || out->ref.meta.dtype != x->ref.meta.dtype) return false;
  const int64_t dim = rules::wrap_dim(n.args[1].toInt(), static_cast<int64_t>(x->ref.meta.sizes.size()));
  c10::IValue none;
  Builder b{a, n, {}};
  TensorRef lse = b.one(op("aten::logsumexp", ""), {none, c10::IValue(std::vector<int64_t>{dim}), c10::IValue(true)},
                        {{0, x->ref}}, TensorMeta::contiguous(kept(x->ref.meta.sizes, {dim}), x->ref.meta.dtype));
  b.node(op("lazymem::softmax_from_lse", ""), {none, none, c10::IValue(log)}, {{0, x->ref}, {1, lse}},
         {{0, out->ref}});
  return b.replace(i, {true, true});
}

// _softmax_backward_data(grad, out, dim, input_dtype) / _log_softmax_backward_data: the sum over
// the batch in a pass, then the input's gradient per chunk.
bool expand_softmax_backward(Analysis& a, int32_t i, bool log) {
  const Node& n = *a.nodes[i].node;
  const Use* g = use_at(n, 0);
  const Use* y = use_at(n, 1);
  const Def* gi = def_at(n, 0);
  if (!g || !y || !gi || !n.args[2].isInt()) return false;
  const c10::ScalarType dt = g->ref.meta.dtype;
  if (!c10::isFloatingType(dt) || y->ref.meta.dtype != dt || gi->ref.meta.dtype != dt) return false;
  const int64_t dim = rules::wrap_dim(n.args[2].toInt(), static_cast<int64_t>(g->ref.meta.sizes.size()));
  c10::IValue none;
  Builder b{a, n, {}};
  TensorRef s = b.one(op("lazymem::softmax_backward_reduce", ""), {none, none, c10::IValue(dim), c10::IValue(log)},
                      {{0, g->ref}, {1, y->ref}}, TensorMeta::contiguous(kept(g->ref.meta.sizes, {dim}), dt));
  b.node(op("lazymem::softmax_backward_apply", ""), {none, none, none, c10::IValue(log)},
         {{0, g->ref}, {1, y->ref}, {2, s}}, {{0, gi->ref}});
  return b.replace(i, {true, true});
}

// var / std / var_mean / std_mean .correction(x, dim?, correction?, keepdim): Chan-merged moments
// over a pass, then the finish once.
bool expand_moments(Analysis& a, int32_t i, bool sqrt) {
  const Node& n = *a.nodes[i].node;
  const Use* x = use_at(n, 0);
  const Def* first = def_at(n, 0);
  const Def* second = def_at(n, 1);
  if (!x || !first || !c10::isFloatingType(x->ref.meta.dtype) || !n.args[3].isBool()) return false;
  const c10::IntArrayRef sizes = x->ref.meta.sizes;
  std::vector<int64_t> dims;
  const c10::IValue& dv = n.args[1];
  if (dv.isIntList() && !dv.toIntList().empty()) {
    for (int64_t d : dv.toIntList()) dims.push_back(rules::wrap_dim(d, static_cast<int64_t>(x->ref.meta.sizes.size())));
  } else if (dv.isNone() || dv.isIntList()) {
    for (int64_t d = 0; d < static_cast<int64_t>(sizes.size()); ++d) dims.push_back(d);
  } else {
    return false;
  }
  const c10::IValue& cv = n.args[2];
  const double correction = cv.isNone() ? 1.0 : cv.toScalar().toDouble();
  int64_t count = 1;
  for (int64_t d : dims) count *= sizes[d];
  const c10::ScalarType dt = first->ref.meta.dtype;
  if (dt != x->ref.meta.dtype) return false;
  c10::IValue none;
  Builder b{a, n, {}};
  TensorRef m = b.one(op("lazymem::moments", ""), {none, c10::IValue(dims), c10::IValue(dt)}, {{0, x->ref}},
                      TensorMeta::contiguous(kept(sizes, dims, {2}), dt));
  std::vector<std::pair<int32_t, TensorRef>> outs{{0, first->ref}};
  if (second) outs.emplace_back(1, second->ref);
  b.node(op("lazymem::moments_finish", ""),
         {none, c10::IValue(correction), c10::IValue(count), c10::IValue(dims), n.args[3], c10::IValue(sqrt)},
         {{0, m}}, std::move(outs));
  return b.replace(i, {true, false});
}

} // namespace

bool expand_node(Analysis& a, int32_t i) {
  const std::string& name = a.nodes[i].node->op.schema().name();
  const std::string& overload = a.nodes[i].node->op.schema().overload_name();
  bool ok = false;
  if (name == "aten::native_batch_norm" || name == "aten::cudnn_batch_norm") ok = expand_forward(a, i);
  if (name == "aten::native_batch_norm_backward") ok = expand_backward(a, i, false);
  if (name == "aten::cudnn_batch_norm_backward") ok = expand_backward(a, i, true);
  if (name == "aten::_softmax" || name == "aten::_log_softmax") ok = expand_softmax(a, i, name == "aten::_log_softmax");
  if (name == "aten::_softmax_backward_data" || name == "aten::_log_softmax_backward_data") {
    ok = expand_softmax_backward(a, i, name == "aten::_log_softmax_backward_data");
  }
  if (overload == "correction" && (name == "aten::var" || name == "aten::var_mean")) ok = expand_moments(a, i, false);
  if (overload == "correction" && (name == "aten::std" || name == "aten::std_mean")) ok = expand_moments(a, i, true);
  if (!ok) return false;
  // The node itself no longer runs: its defs and writes are the synthesized nodes'.
  NodeInfo& ni = a.nodes[i];
  ni.runs = false;
  ni.barrier = false;
  ni.loop = false;
  a.order.erase(std::find(a.order.begin(), a.order.end(), i));
  return true;
}

} // namespace lazymem
