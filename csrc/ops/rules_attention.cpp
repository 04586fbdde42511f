// ops: scaled-dot-product attention (batch_split_theory.md §4 row 26). Query, key and value carry
// the batch at dim 0, the mask is broadcast against (B, heads, L, S) — per sample when it has the
// batch, whole otherwise; outputs and the saved log-sum-exp keep the batch. Without dropout the
// op draws nothing even though it is tagged random.
#include "ops/rule_util.h"

namespace lazymem::rules {
namespace {

bool dropout_free(const RuleCall& c, int arg) {
  return c.args[arg].isDouble() && c.args[arg].toDouble() == 0.0;
}

// Binds q/k/v-like operands (dim 0 the batch) and the broadcast mask against a rank-4 attention.
bool attention_common(const RuleCall& c, RuleResult& r, std::initializer_list<int> batched, int mask_arg) {
  std::optional<Place> p;
  int64_t rows = -1;
  for (int arg : batched) {
    const Operand* o = c.operand(arg);
    if (!o || !o->place.is_s()) continue;
    if (o->place.dim != 0 || (p && *p != o->place)) return fail(r, "the batch is not dim 0 of query, key and value");
    p = o->place;
    rows = o->sizes[0];
  }
  if (!p) {
    const int64_t m = c.operand_index(mask_arg);
    if (m < 0 || !c.ins[m].place.is_s()) return replicated(c, r);
    return fail(r, "only the mask carries the batch");
  }
  for (auto& m : r.ins) m = OperandMode::whole();
  for (int arg : batched) {
    int64_t i = c.operand_index(arg);
    if (i < 0) continue;
    if (c.ins[i].dim() < 3 || c.ins[i].sizes[0] != rows) return fail(r, "operands disagree on the batch");
    r.ins[i] = OperandMode::rows(0, p->unit);
  }
  const int64_t m = c.operand_index(mask_arg);
  if (m >= 0 && !align(c, r, static_cast<size_t>(m), 4, 0, rows, p->unit)) return false;
  for (size_t i = 0; i < c.ins.size(); ++i) {
    if (r.ins[i].mode == Mode::kWhole && c.ins[i].place.is_s()) return fail(r, "an operand carries the batch elsewhere");
  }
  for (size_t j = 0; j < c.outs.size(); ++j) {
    if (c.outs[j].dim() == 0 || c.outs[j].sizes[0] != rows) return fail(r, "an output without the batch");
    r.outs[j] = Place::S(0, p->unit);
  }
  return true;
}

// _scaled_dot_product_flash_attention_for_cpu(query, key, value, dropout_p, is_causal, attn_mask,
//   scale) -> (output, logsumexp)
bool flash_cpu(const RuleCall& c, RuleResult& r) {
  if (!dropout_free(c, 3)) return fail(r, "attention dropout inside the fused kernel");
  r.no_draws = true;
  if (nothing_batched(c)) return replicated(c, r);
  return attention_common(c, r, {0, 1, 2}, 5);
}

// ..._backward(grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, attn_mask, scale)
bool flash_cpu_backward(const RuleCall& c, RuleResult& r) {
  if (!dropout_free(c, 6)) return fail(r, "attention dropout inside the fused kernel");
  r.no_draws = true;
  if (nothing_batched(c)) return replicated(c, r);
  return attention_common(c, r, {0, 1, 2, 3, 4, 5}, 8);
}

const bool registered = [] {
  register_placement_rules("attention", {"aten::_scaled_dot_product_flash_attention_for_cpu"}, &flash_cpu);
  register_placement_rules("attention", {"aten::_scaled_dot_product_flash_attention_for_cpu_backward"},
                           &flash_cpu_backward);
  return true;
}();

} // namespace
} // namespace lazymem::rules
