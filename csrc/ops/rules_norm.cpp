// ops: normalizations. LayerNorm (and RMSNorm, which decomposes into pointwise ops and a mean over
// the last dims) and GroupNorm normalize each sample by itself: the output and the saved statistics
// keep the batch, and the weight and bias gradients sum over it, P(+) (batch_split_theory.md §3.5,
// §4 row 12). GroupNorm's N argument is the batch: rewritten to the chunk's rows. BatchNorm in eval
// mode is per-channel affine with replicated running statistics. In training mode its statistics
// span the whole batch: the rule asks the planner to expand the node (plan/synth.cpp) into a
// statistics pass (lazymem::bn_moments, merged exactly), the finish and running-statistics update
// once, and the normalization per chunk; its backward likewise into a pass summing the gradient and
// its product with the centered input, then the input's gradient per chunk (ops/split_ops.cpp).
#include "ops/rule_util.h"

namespace lazymem::rules {
namespace {

// The batch among `args`, before dim `limit` (the normalized dims); weights must not carry it.
std::optional<Place> batch_of(const RuleCall& c, RuleResult& r, std::initializer_list<int> args, int64_t limit) {
  return bind_batch(c, r, args, limit, /*demand=*/true);
}

// A norm backward's (grad_input, grad_weight, grad_bias): the input's gradient keeps the batch, the
// affine parameters' sum over it (outputs masked off are not defs, hence the return positions).
void grad_outputs(const RuleCall& c, RuleResult& r, const Place& input) {
  for (size_t j = 0; j < c.outs.size(); ++j) r.outs[j] = c.outs[j].ret == 0 ? input : Place::P(Reduce::kSum);
}

// native_layer_norm(input, normalized_shape, weight, bias, eps) -> (out, mean, rstd)
bool layer_norm(const RuleCall& c, RuleResult& r) {
  if (nothing_batched(c)) return replicated(c, r);
  const int64_t axis = c.ins[0].dim() - static_cast<int64_t>(int_list(c.args[1]).size());
  auto p = batch_of(c, r, {0}, axis);
  if (!p) return false;
  if (!p->is_s()) return replicated(c, r);
  for (auto& o : r.outs) o = *p;
  return true;
}

// native_layer_norm_backward(grad_out, input, normalized_shape, mean, rstd, weight, bias, mask)
//   -> (grad_input, grad_weight, grad_bias)
bool layer_norm_backward(const RuleCall& c, RuleResult& r) {
  if (nothing_batched(c)) return replicated(c, r);
  const int64_t axis = c.ins[c.operand_index(1)].dim() - static_cast<int64_t>(int_list(c.args[2]).size());
  auto p = batch_of(c, r, {0, 1, 3, 4}, axis);
  if (!p) return false;
  if (!p->is_s()) return replicated(c, r);
  // The CPU kernel reads the saved mean and rstd through their data pointers as if contiguous: a
  // chunk of them must be one block, so no dim of size > 1 may come before the batch's (split along
  // the sequence of a (B, T, D) input, its chunks read other rows' statistics: wrong gradients).
  const Operand& in = c.ins[c.operand_index(1)];
  for (int64_t d = 0; d < p->dim && d < in.dim(); ++d) {
    if (in.sizes[d] != 1) return fail(r, "layer norm's backward reads its saved statistics as contiguous rows");
  }
  if (p->outer != 1) return fail(r, "layer norm's backward reads its saved statistics as contiguous rows");
  grad_outputs(c, r, *p);
  return true;
}

// native_group_norm(input, weight, bias, N, C, HxW, group, eps) -> (out, mean, rstd)
bool group_norm(const RuleCall& c, RuleResult& r) {
  if (nothing_batched(c)) return replicated(c, r);
  auto p = batch_of(c, r, {0}, 1);
  if (!p) return false;
  if (!p->is_s()) return replicated(c, r);
  if (p->unit != 1) return fail(r, "a flattened batch");
  for (auto& o : r.outs) o = p->at(0);
  r.rewrites.push_back(ArgRewrite{3, -1, ArgRewrite::kRows, 0, 1});
  return true;
}

// native_group_norm_backward(grad_out, input, mean, rstd, weight, N, C, HxW, group, mask)
bool group_norm_backward(const RuleCall& c, RuleResult& r) {
  if (nothing_batched(c)) return replicated(c, r);
  auto p = batch_of(c, r, {0, 1, 2, 3}, 1);
  if (!p) return false;
  if (!p->is_s()) return replicated(c, r);
  if (p->unit != 1) return fail(r, "a flattened batch");
  grad_outputs(c, r, p->at(0));
  r.rewrites.push_back(ArgRewrite{5, -1, ArgRewrite::kRows, 0, 1});
  return true;
}

// A training batch norm over the batch: the planner expands it into passes (plan/synth.cpp).
bool expand(RuleResult& r, const Place& p) {
  if (p.dim != 0 || p.outer != 1) return fail(r, "batch norm over a batch that is not dim 0");
  r.expand = true;
  return fail(r, "batch norm in training mode needs the whole batch's statistics (expanded into passes)");
}

bool training(const RuleCall& c, int arg) {
  return !c.args[arg].isBool() || c.args[arg].toBool();
}

// native_batch_norm(input, weight, bias, running_mean, running_var, training, momentum, eps)
//   -> (out, save_mean, save_invstd); _native_batch_norm_legit_no_training has no `training`;
//   cudnn_batch_norm has native_batch_norm's arguments and an empty reserve space as a fourth output.
bool batch_norm(const RuleCall& c, RuleResult& r) {
  if (nothing_batched(c)) return replicated(c, r);
  const bool legit = c.op.operator_name().name == "aten::_native_batch_norm_legit_no_training";
  auto p = batch_of(c, r, {0}, 1);
  if (!p) return false;
  if (!p->is_s()) return replicated(c, r);
  if (!legit && training(c, 5)) return expand(r, *p);
  r.writes_unchanged = true; // running statistics are updated in training mode only
  // The saved statistics are placeholders in eval mode: every chunk's are the same.
  for (size_t j = 0; j < c.outs.size(); ++j) r.outs[j] = c.outs[j].ret == 0 ? *p : Place::P(Reduce::kNone);
  return true;
}

// native_batch_norm_backward(grad_out, input, weight, running_mean, running_var, save_mean,
//   save_invstd, train, eps, mask) -> (grad_input, grad_weight, grad_bias); cudnn_batch_norm_backward
//   (input, grad_out, ...) is a training one.
bool batch_norm_backward(const RuleCall& c, RuleResult& r) {
  if (nothing_batched(c)) return replicated(c, r);
  auto p = batch_of(c, r, {0, 1}, 1);
  if (!p) return false;
  if (!p->is_s()) return replicated(c, r);
  if (c.op.operator_name().name == "aten::cudnn_batch_norm_backward" || training(c, 7)) return expand(r, *p);
  grad_outputs(c, r, *p);
  return true;
}

// ---- the ops a training batch norm expands into (ops/split_ops.cpp) ----

// Elements per batch row of a [N, C, ...] operand sharded as `p`, per channel: over the rows it
// holds (a slice of the batch holds fewer than the batch's; dividing by the batch's gave 0 and the
// chunks' moments merged as 0 / 0).
int64_t per_row(const Operand& x, const Place& p, int64_t batch) {
  int64_t numel = 1;
  for (int64_t s : x.sizes) numel *= s;
  const int64_t rows = p.map.identity() ? batch : p.map.n;
  return x.sizes.size() < 2 || x.sizes[1] == 0 || rows == 0 ? 0 : numel / x.sizes[1] / rows;
}

// bn_moments(x, dtype) -> [2, C], merged over chunks.
bool bn_moments(const RuleCall& c, RuleResult& r) {
  if (nothing_batched(c)) return replicated(c, r);
  auto p = batch_of(c, r, {0}, 1);
  if (!p) return false;
  if (!p->is_s()) return replicated(c, r);
  r.outs[0] = Place::P(Reduce::kMoments);
  r.finalize[0].kind = Finalize::kMoments;
  r.finalize[0].per_row = per_row(c.ins[0], *p, c.batch);
  return true;
}

// bn_backward_reduce(grad_out, x, mean, invstd, dtype) -> [2, C], summed over chunks.
bool bn_backward_reduce(const RuleCall& c, RuleResult& r) {
  if (nothing_batched(c)) return replicated(c, r);
  auto p = batch_of(c, r, {0, 1}, 1);
  if (!p) return false;
  if (!p->is_s()) return replicated(c, r);
  r.outs[0] = Place::P(Reduce::kSum);
  return true;
}

// bn_apply(x, mean, invstd, weight, bias) and bn_backward_elemt(grad_out, x, ...): per sample.
template <int... Args>
bool bn_rows(const RuleCall& c, RuleResult& r) {
  if (nothing_batched(c)) return replicated(c, r);
  auto p = batch_of(c, r, {Args...}, 1);
  if (!p) return false;
  if (!p->is_s()) return replicated(c, r);
  r.outs[0] = *p;
  return true;
}

// bn_finish, bn_update_running, bn_backward_params: per-channel values, run once.
bool bn_once(const RuleCall& c, RuleResult& r) {
  if (nothing_batched(c)) return replicated(c, r);
  return fail(r, "a per-channel batch norm value carries the batch");
}

const bool registered = [] {
  register_placement_rules("norm", {"aten::native_layer_norm"}, &layer_norm);
  register_placement_rules("norm", {"aten::native_layer_norm_backward"}, &layer_norm_backward);
  register_placement_rules("norm", {"aten::native_group_norm"}, &group_norm);
  register_placement_rules("norm", {"aten::native_group_norm_backward"}, &group_norm_backward);
  register_placement_rules("norm",
                           {"aten::native_batch_norm", "aten::_native_batch_norm_legit_no_training",
                            "aten::cudnn_batch_norm"},
                           &batch_norm);
  register_placement_rules("norm", {"aten::native_batch_norm_backward", "aten::cudnn_batch_norm_backward"},
                           &batch_norm_backward);
  register_placement_rules("norm", {"lazymem::bn_moments"}, &bn_moments);
  register_placement_rules("norm", {"lazymem::bn_backward_reduce"}, &bn_backward_reduce);
  register_placement_rules("norm", {"lazymem::bn_apply"}, &bn_rows<0>);
  register_placement_rules("norm", {"lazymem::bn_backward_elemt"}, &bn_rows<0, 1>);
  register_placement_rules("norm", {"lazymem::bn_finish", "lazymem::bn_update_running", "lazymem::bn_backward_params"},
                           &bn_once);
  return true;
}();

} // namespace
} // namespace lazymem::rules
