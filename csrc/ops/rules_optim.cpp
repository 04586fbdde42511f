// ops: optimizer updates (batch_split_theory.md §4 row 29): the _foreach_* and fused optimizer ops
// act on parameters, gradients and optimizer state, all replicated. Gradients that are partial in a
// loop are finished first, so an update runs once, after the loop, on the same values eager sees.
// A batch-sharded operand here would mean a per-sample update: it runs whole.
#include "ops/rule_util.h"

namespace lazymem::rules {
namespace {

bool replicated_only(const RuleCall& c, RuleResult& r) {
  if (!nothing_batched(c)) return fail(r, "an optimizer update of batch-sharded values");
  return replicated(c, r);
}

const bool registered = [] {
  register_placement_rules("optim",
                           {"aten::_foreach_*", "aten::_fused_adam", "aten::_fused_adam_", "aten::_fused_adamw",
                            "aten::_fused_adamw_", "aten::_fused_sgd", "aten::_fused_sgd_", "aten::_fused_adagrad",
                            "aten::_fused_adagrad_", "aten::_amp_foreach_non_finite_check_and_unscale_",
                            "aten::_amp_update_scale_"},
                           &replicated_only);
  return true;
}();

} // namespace
} // namespace lazymem::rules
