// ops: random ops. Elementwise random fills and samplers are pointwise in their operands (a batched
// fill is one per chunk: the planner draws batch-sharded random values keyed by row blocks, so the
// same rows get the same numbers whatever the chunking — DESIGN.md §7 RNG); multinomial draws each
// row of its probabilities independently. Ops tagged random that draw nothing in a given call
// (scaled-dot-product attention without dropout) say so in their own family.
#include "ops/rule_util.h"

namespace lazymem::rules {
namespace {

bool pointwise_random(const RuleCall& c, RuleResult& r) {
  auto out = output_sizes(c);
  if (!out) return fail(r, "no output");
  if (nothing_batched(c)) return replicated(c, r);
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
  const Operand& self = c.ins[0];
  if (!self.place.is_s() || self.place.dim != 0 || self.dim() != 2) return fail(r, "draws across the batch");
  r.ins[0] = OperandMode::rows(0, self.place.unit);
  r.outs[0] = self.place;
  return true;
}

const bool registered = [] {
  register_placement_rules("rng",
                           {"aten::bernoulli_", "aten::bernoulli.p", "aten::bernoulli", "aten::normal_",
                            "aten::normal.Tensor_float", "aten::normal.float_Tensor", "aten::normal.Tensor_Tensor",
                            "aten::uniform_", "aten::random_", "aten::exponential_", "aten::geometric_",
                            "aten::log_normal_", "aten::cauchy_", "aten::poisson", "aten::binomial",
                            "aten::native_dropout", "aten::_standard_gamma", "aten::_sample_dirichlet",
                            "aten::rrelu_with_noise", "aten::rrelu_with_noise_"},
                           &pointwise_random);
  register_placement_rules("rng", {"aten::multinomial"}, &multinomial);
  return true;
}();

} // namespace
} // namespace lazymem::rules
