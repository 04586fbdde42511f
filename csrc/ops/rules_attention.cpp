// ops: scaled-dot-product attention (batch_split_theory.md §4 row 26) and the fused inference paths
// of nn.MultiheadAttention and nn.TransformerEncoderLayer. Query, key and value carry
// the batch at dim 0, the mask is broadcast against (B, heads, L, S) — per sample when it has the
// batch, whole otherwise; outputs and the saved log-sum-exp keep the batch. Without dropout the
// op draws nothing even though it is tagged random.
#include <algorithm>

#include "ops/rule_util.h"

namespace lazymem::rules {
namespace {

bool dropout_free(const RuleCall& c, int arg) {
  return c.args[arg].isDouble() && c.args[arg].toDouble() == 0.0;
}

// How a mask meets the batch: broadcast against (B, heads, L, S) (SDPA), or per sample at dim 0 (a
// key-padding or merged mask of the fused module paths) when it carries the batch, shared otherwise.
enum class MaskKind { kBroadcast4, kDim0 };

// Binds q/k/v-like operands (dim 0 the batch) and the mask.
// `rng_rets`: outputs that are the kernel's random-number state (read only with dropout, which these
// rules refuse): the same for every chunk.
bool attention_common(const RuleCall& c, RuleResult& r, std::initializer_list<int> batched, int mask_arg,
                      MaskKind kind = MaskKind::kBroadcast4, bool per_sample_mask = false,
                      std::initializer_list<int> rng_rets = {}) {
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
  if (m >= 0 && kind == MaskKind::kBroadcast4 && !align(c, r, static_cast<size_t>(m), 4, 0, rows, p->at(0))) {
    return false;
  }
  if (m >= 0 && kind == MaskKind::kDim0 && per_sample_mask) {
    // Positional rows even when the mask is replicated (an expanded causal mask): the kernel checks
    // its dim 0 against the chunk's.
    if ((c.ins[m].place.is_s() && c.ins[m].place != *p) || c.ins[m].dim() == 0 || c.ins[m].sizes[0] != rows * p->unit) {
      return fail(r, "the mask carries the batch elsewhere");
    }
    r.ins[m] = OperandMode::rows(0, p->unit);
  }
  for (size_t i = 0; i < c.ins.size(); ++i) {
    if (r.ins[i].mode == Mode::kWhole && c.ins[i].place.is_s()) return fail(r, "an operand carries the batch elsewhere");
  }
  for (size_t j = 0; j < c.outs.size(); ++j) {
    if (c.outs[j].dim() == 1 && c.outs[j].sizes[0] == 0) continue; // an empty placeholder (no weights)
    if (c.outs[j].dim() == 0 || std::find(rng_rets.begin(), rng_rets.end(), c.outs[j].ret) != rng_rets.end()) {
      // The fused kernels' dropout seed and offset (unread without dropout): every chunk's alike.
      r.outs[j] = Place::P(Reduce::kNone);
      continue;
    }
    if (c.outs[j].dim() == 0 || c.outs[j].sizes[0] != rows) return fail(r, "an output without the batch");
    r.outs[j] = p->at(0);
  }
  return true;
}

// The fused paths' mask_type: 0 a (L, S) mask shared by every sample; 1 a (B, S) key-padding mask,
// 2 or none a (B, heads, L, S) mask: per sample.
bool per_sample_mask(const RuleCall& c, int mask_type_arg) {
  const c10::IValue& t = c.args[mask_type_arg];
  return !(t.isInt() && t.toInt() == 0);
}

// _transformer_encoder_layer_fwd(src, embed_dim, num_heads, qkv_weight, ..., mask, mask_type): the
// fused inference path of nn.TransformerEncoderLayer (batch_first, so src is (B, L, E)); every
// sample is independent.
bool encoder_layer(const RuleCall& c, RuleResult& r) {
  if (nothing_batched(c)) return replicated(c, r);
  return attention_common(c, r, {0}, 18, MaskKind::kDim0, per_sample_mask(c, 19));
}

// _native_multi_head_attention(query, key, value, embed_dim, num_head, qkv_weight, qkv_bias,
//   proj_weight, proj_bias, mask, need_weights, average_attn_weights, mask_type) -> (out, weights):
// nn.MultiheadAttention's fused inference path (batch_first); the weights are per sample or empty.
bool native_mha(const RuleCall& c, RuleResult& r) {
  if (nothing_batched(c)) return replicated(c, r);
  return attention_common(c, r, {0, 1, 2}, 9, MaskKind::kDim0, per_sample_mask(c, 12));
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

// _scaled_dot_product_efficient_attention(query, key, value, attn_bias, compute_log_sumexp, dropout_p,
//   is_causal, scale) -> (output, log_sumexp, philox_seed, philox_offset): CUDA's memory-efficient
//   kernel, (B, heads, L, E) operands; the log-sum-exp keeps the batch at dim 0.
bool efficient(const RuleCall& c, RuleResult& r) {
  if (!dropout_free(c, 5)) return fail(r, "attention dropout inside the fused kernel");
  r.no_draws = true;
  if (nothing_batched(c)) return replicated(c, r);
  return attention_common(c, r, {0, 1, 2}, 3);
}

// ..._backward(grad_out, query, key, value, attn_bias, out, logsumexp, philox_seed, philox_offset,
//   dropout_p, grad_input_mask, is_causal, scale) -> (grad_query, grad_key, grad_value, grad_bias)
bool efficient_backward(const RuleCall& c, RuleResult& r) {
  if (!dropout_free(c, 9)) return fail(r, "attention dropout inside the fused kernel");
  r.no_draws = true;
  if (c.outs.size() > 3 && c.outs[3].dim() > 0 && c10::multiply_integers(c.outs[3].sizes) > 0) {
    return fail(r, "the attention mask's gradient (a sum over the batch)");
  }
  if (nothing_batched(c)) return replicated(c, r);
  return attention_common(c, r, {0, 1, 2, 3, 5, 6}, 4);
}

// _scaled_dot_product_flash_attention(query, key, value, dropout_p, is_causal, return_debug_mask, scale)
//   -> (output, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, rng_state, unused, debug_attn_mask):
//   CUDA's flash kernel, (B, heads, L, E) operands; the cumulative lengths are undefined and the debug
//   mask empty without return_debug_mask; max_q/max_k are the sequence lengths, every chunk's.
bool flash(const RuleCall& c, RuleResult& r) {
  if (!dropout_free(c, 3)) return fail(r, "attention dropout inside the fused kernel");
  if (c.args[5].isBool() && c.args[5].toBool()) return fail(r, "the flash kernel's debug attention mask");
  r.no_draws = true;
  if (nothing_batched(c)) return replicated(c, r);
  return attention_common(c, r, {0, 1, 2}, /*mask_arg=*/-1, MaskKind::kBroadcast4, false, {6, 7});
}

// ..._backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k,
//   dropout_p, is_causal, philox_seed, philox_offset, scale) -> (grad_query, grad_key, grad_value)
bool flash_backward(const RuleCall& c, RuleResult& r) {
  if (!dropout_free(c, 10)) return fail(r, "attention dropout inside the fused kernel");
  r.no_draws = true;
  if (nothing_batched(c)) return replicated(c, r);
  const int64_t cq = c.operand_index(6), ck = c.operand_index(7);
  if (cq >= 0 || ck >= 0) return fail(r, "variable-length flash attention (cumulative sequence lengths)");
  return attention_common(c, r, {0, 1, 2, 3, 4, 5}, /*mask_arg=*/-1);
}

const bool registered = [] {
  register_placement_rules("attention", {"aten::_scaled_dot_product_flash_attention"}, &flash);
  register_placement_rules("attention", {"aten::_scaled_dot_product_flash_attention_backward"}, &flash_backward);
  register_placement_rules("attention", {"aten::_scaled_dot_product_flash_attention_for_cpu"}, &flash_cpu);
  register_placement_rules("attention", {"aten::_scaled_dot_product_flash_attention_for_cpu_backward"},
                           &flash_cpu_backward);
  register_placement_rules("attention", {"aten::_scaled_dot_product_efficient_attention"}, &efficient);
  register_placement_rules("attention", {"aten::_scaled_dot_product_efficient_attention_backward"},
                           &efficient_backward);
  register_placement_rules("attention", {"aten::_transformer_encoder_layer_fwd"}, &encoder_layer);
  register_placement_rules("attention", {"aten::_native_multi_head_attention"}, &native_mha);
  return true;
}();

} // namespace
} // namespace lazymem::rules
