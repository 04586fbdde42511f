// ops: random ops. A random op splits along the batch only when eager's draws can be reproduced in
// any chunking (DESIGN.md §7 RNG): its form (core/rng_form.h) names eager's kernel as a draw that
// depends on the geometry alone, generated whole once in program order, followed by element-wise
// ops each chunk applies to its rows. Fills are pointwise in their operands; multinomial draws each
// row of its probabilities apart. Ops whose draws depend on their inputs' values (rejection samplers,
// rrelu in training, multinomial with replacement) have no such form: they run whole, which draws
// exactly eager's numbers. Ops tagged random that draw nothing in a given call (scaled-dot-product
// attention without dropout) say so in their own family.
#include "ops/op_rules.h"
#include "ops/rule_util.h"

#include <limits>
#include <string>
#include <vector>

#include <ATen/core/enum_tag.h>

namespace lazymem {
namespace {

bool is(const std::string& name, const char* n) {
  return name == n;
}

// A double argument by schema name (dropout_p, p), or NaN when absent or not a double.
double double_arg(const c10::FunctionSchema& s, const std::vector<c10::IValue>& args, const char* name) {
  for (size_t i = 0; i < s.arguments().size() && i < args.size(); ++i) {
    if (s.arguments()[i].name() == name && args[i].isDouble()) return args[i].toDouble();
  }
  return std::numeric_limits<double>::quiet_NaN();
}

} // namespace

RngForm random_form(const c10::OperatorHandle& op, const std::vector<c10::IValue>& args) {
  if (!op.hasTag(at::Tag::nondeterministic_seeded)) return RngForm::kNone;
  const c10::FunctionSchema& s = op.schema();
  const std::string& name = s.name();
  const std::string& overload = s.overload_name();
  if (is(name, "aten::uniform_") || is(name, "aten::normal_") || is(name, "aten::random_") ||
      is(name, "aten::exponential_") || is(name, "aten::geometric_") || is(name, "aten::log_normal_") ||
      is(name, "aten::cauchy_") || (is(name, "aten::bernoulli_") && overload == "float") ||
      (is(name, "aten::bernoulli") && overload == "p") ||
      (is(name, "aten::randperm") && (overload == "generator_out" || overload == "out"))) {
    return RngForm::kFill;
  }
  if ((is(name, "aten::bernoulli_") && overload == "Tensor") || (is(name, "aten::bernoulli") && overload.empty())) {
    return RngForm::kBernoulliP;
  }
  if (is(name, "aten::normal")) {
    if (overload == "Tensor_float") return RngForm::kNormalTF;
    if (overload == "float_Tensor") return RngForm::kNormalFT;
    if (overload == "Tensor_Tensor") return RngForm::kNormalTT;
    return RngForm::kWhole;
  }
  if (is(name, "aten::native_dropout")) {
    // native_dropout(input, p, train): draws a mask unless train is False.
    return args.size() > 2 && args[2].isBool() && !args[2].toBool() ? RngForm::kNoDraws : RngForm::kDropout;
  }
  if (is(name, "aten::multinomial") && overload.empty()) {
    // multinomial(self, num_samples, replacement): without replacement, or one sample, eager draws
    // exponential_(1) over the probabilities' geometry and takes argmax / topk of p / q; with
    // replacement it draws a uniform per sample from the row's cumulative sum.
    const bool replacement = args.size() > 2 && args[2].isBool() && args[2].toBool();
    const bool one = args.size() > 1 && args[1].isInt() && args[1].toInt() == 1;
    return !replacement || one ? RngForm::kMultinomial : RngForm::kWhole;
  }
  if (is(name, "aten::rrelu_with_noise") || is(name, "aten::rrelu_with_noise_")) {
    // (self, noise, lower, upper, training, generator): draws for the negative elements in training.
    return args.size() > 4 && args[4].isBool() && args[4].toBool() ? RngForm::kWhole : RngForm::kNoDraws;
  }
  // Attention and other fused kernels with a dropout probability: none drawn when it is 0.
  const double p = double_arg(s, args, "dropout_p");
  if (p == 0.0) return RngForm::kNoDraws;
  return RngForm::kWhole;
}

namespace rules {
namespace {

// Whether a call may split: not when its draws depend on its inputs' values (r.why says so).
bool splits(const RuleCall& c, RuleResult& r) {
  const RngForm f = random_form(c.op, c.args);
  if (f == RngForm::kNoDraws) r.no_draws = true;
  if (f == RngForm::kWhole) {
    return fail(r, "its draws depend on its inputs' values (a rejection sampler, rrelu in training, multinomial "
                   "with replacement): it runs whole, drawing eager's numbers");
  }
  return true;
}

bool pointwise_random(const RuleCall& c, RuleResult& r) {
  auto out = output_sizes(c);
  if (!out) return fail(r, "no output");
  if (nothing_batched(c)) return replicated(c, r);
  if (!splits(c, r)) return false;
  auto p = broadcast(c, r, *out, c.wanted(0));
  if (!p) return false;
  for (size_t i = 0; i < c.outs.size(); ++i) {
    if (!c.outs[i].sizes.equals(*out)) return fail(r, "outputs of different shapes");
    r.outs[i] = *p;
  }
  return true;
}

// multinomial(self, num_samples, replacement): self (B, C) -> (B, n), rows drawn independently.
bool multinomial(const RuleCall& c, RuleResult& r) {
  if (nothing_batched(c)) return replicated(c, r);
  if (!splits(c, r)) return false;
  const Operand& self = c.ins[0];
  if (!self.place.is_s() || self.place.dim != 0 || self.dim() != 2) return fail(r, "draws across the batch");
  r.ins[0] = OperandMode::rows(0, self.place.unit);
  r.outs[0] = self.place;
  return true;
}

// rrelu_with_noise(self, noise!, lower, upper, training, generator) runs whole: in training its draws
// depend on which elements are negative; in eval mode it neither reads nor writes `noise`, an empty
// tensor nothing wrote, but its kernel still requires it to have the input's shape.
bool rrelu(const RuleCall& c, RuleResult& r) {
  if (nothing_batched(c)) return replicated(c, r);
  if (!splits(c, r)) return false;
  return fail(r, "rrelu in eval mode takes an unwritten noise tensor of the input's shape: it runs whole");
}

const bool registered = [] {
  register_placement_rules("rng",
                           {"aten::bernoulli_", "aten::bernoulli.p", "aten::bernoulli", "aten::normal_",
                            "aten::normal.Tensor_float", "aten::normal.float_Tensor", "aten::normal.Tensor_Tensor",
                            "aten::uniform_", "aten::random_", "aten::exponential_", "aten::geometric_",
                            "aten::log_normal_", "aten::cauchy_", "aten::poisson", "aten::binomial",
                            "aten::native_dropout", "aten::_standard_gamma", "aten::_sample_dirichlet"},
                           &pointwise_random);
  register_placement_rules("rng", {"aten::rrelu_with_noise", "aten::rrelu_with_noise_"}, &rrelu);
  register_placement_rules("rng", {"aten::multinomial"}, &multinomial);
  return true;
}();

} // namespace
} // namespace rules
} // namespace lazymem
