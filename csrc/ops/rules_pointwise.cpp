// ops: pointwise ops and casts. Every operand is broadcast against the output (numpy rules): the
// output is batch-sharded along the dim its sharded operands are, replicated operands aligned with
// that dim are used row by row, broadcast ones whole (batch_split_theory.md §4 row 1). Partial
// operands pass through the linear ones only — a sum of partials, a partial scaled by a replicated
// value, a cast or copy of a partial (row 2); any other op uses them finished. Covers every op
// tagged pointwise in native_functions.yaml (and its in-place and out= forms) plus copies, fills
// and casts.
#include "ops/rule_util.h"

#include <string>

namespace lazymem::rules {
namespace {

// Linear in its partial operands: the sum over chunks of op(partials) is op(sum of partials).
bool linear(const RuleCall& c, RuleResult& r) {
  std::string name = c.op.operator_name().name;
  if (!name.empty() && name.back() == '_') name.pop_back();
  size_t partial = 0, tensors = 0;
  int64_t first_partial = -1;
  for (size_t i = 0; i < c.ins.size(); ++i) {
    const Operand& o = c.ins[i];
    // copy_'s destination is overwritten: linear in its source only, into a destination that is not
    // partial yet. One that is (a gradient DDP's reducer overwrites with its all-reduced bucket, a
    // second gradient copied into the same flat bucket) is finished first and overwritten whole.
    if (name == "aten::copy" && i == 0 && o.write) {
      if (o.place.is_p()) return replicated(c, r);
      continue;
    }
    if (o.write && c.outs.empty() && !o.place.is_p()) {
      // An in-place write into a value that is not itself partial (R += P): needs P finished.
      return replicated(c, r);
    }
    ++tensors;
    if (o.place.is_p()) {
      if (o.place.reduce != Reduce::kSum) return replicated(c, r);
      // Partials of two batches are accumulated by different loops: their sum needs both finished.
      if (first_partial >= 0 && c.ins[first_partial].place.batch != o.place.batch) return replicated(c, r);
      ++partial;
      if (first_partial < 0) first_partial = static_cast<int64_t>(i);
    }
  }
  bool ok = false;
  if (name == "aten::add" || name == "aten::sub") {
    ok = partial == tensors; // P + P; P + R is not partial
  } else if (name == "aten::mul") {
    ok = partial == 1;
  } else if (name == "aten::div") {
    ok = partial == 1 && first_partial == 0; // the numerator only
  } else if (name == "aten::neg" || name == "aten::_to_copy" || name == "aten::clone" || name == "aten::copy") {
    ok = partial == 1;
  }
  if (!ok) return replicated(c, r);
  for (size_t i = 0; i < c.ins.size(); ++i) {
    r.ins[i] = c.ins[i].place.is_p() || c.ins[i].write ? OperandMode::partial() : OperandMode::whole();
  }
  for (auto& o : r.outs) o = Place::P(Reduce::kSum);
  return true;
}

bool pointwise(const RuleCall& c, RuleResult& r) {
  auto out = output_sizes(c);
  if (!out) return fail(r, "no output");
  if (nothing_batched(c)) return any_partial(c) ? linear(c, r) : replicated(c, r);
  auto p = broadcast(c, r, *out, c.wanted(0));
  if (!p) return false;
  for (size_t i = 0; i < c.outs.size(); ++i) {
    if (!c.outs[i].sizes.equals(*out)) return fail(r, "outputs of different shapes");
    r.outs[i] = *p;
  }
  return true;
}

// isin(elements, test_elements): elementwise in `elements` (generation's stopping check: which
// sampled tokens are end-of-sequence tokens), `test_elements` read whole.
bool isin(const RuleCall& c, RuleResult& r) {
  if (nothing_batched(c)) return replicated(c, r);
  const int64_t e = c.operand_index(0), t = c.operand_index(1);
  if (t >= 0 && c.ins[t].place.is_s()) return fail(r, "the values tested against carry the batch");
  if (e < 0 || c.outs.empty()) return fail(r, "no batched elements");
  std::vector<int64_t> which{e};
  auto p = broadcast(c, r, c.outs[0].sizes, c.wanted(0), which);
  if (!p) return false;
  if (t >= 0) r.ins[t] = OperandMode::whole();
  r.outs[0] = *p;
  return true;
}

const bool registered = [] {
  register_placement_rules("pointwise", {"aten::isin.Tensor_Tensor", "aten::isin.Tensor_Scalar"}, &isin);
  register_pointwise_default(&pointwise, /*outer_aware=*/true);
  register_placement_rules("pointwise",
                           {"aten::copy_", "aten::_to_copy", "aten::fill_", "aten::zero_", "aten::masked_fill_",
                            "aten::masked_fill", "aten::where", "aten::clone", "aten::_copy_from",
                            "aten::lift_fresh_copy", "aten::alias_copy", "aten::detach_copy", "aten::positive",
                            "aten::resolve_conj", "aten::resolve_neg", "aten::_conj_physical", "aten::conj_physical",
                            "aten::conj_physical_", "aten::log_sigmoid_forward", "aten::log_sigmoid_backward"},
                           &pointwise, /*outer_aware=*/true);
  // Elementwise activations and activation gradients that ATen does not tag pointwise (a leaky-ReLU
  // GAN's backward ran whole through leaky_relu_backward: issue 31), or did not before torch 2.13
  // (2.11: leaky_relu and the in-place celu_, elu_, hardsigmoid_, hardtanh_, selu_; the GAN's
  // forward ran whole there and did not fit).
  register_placement_rules("pointwise",
                           {"aten::leaky_relu", "aten::leaky_relu_", "aten::celu_", "aten::elu_",
                            "aten::hardsigmoid_", "aten::hardtanh_", "aten::selu_", "aten::leaky_relu_backward",
                            "aten::hardtanh_backward", "aten::elu_backward",
                            "aten::softplus_backward", "aten::hardswish", "aten::hardswish_",
                            "aten::hardswish_backward", "aten::mish_backward", "aten::hardsigmoid_backward",
                            "aten::softshrink_backward", "aten::hardshrink_backward",
                            "aten::rrelu_with_noise_backward"},
                           &pointwise, /*outer_aware=*/true);
  return true;
}();

} // namespace
} // namespace lazymem::rules
