// ops: losses with a `reduction` argument (batch_split_theory.md §3.3, §4 rows 15-16). Per-element
// (reduction none) a loss keeps the batch. A sum over the batch is partial P(+). A mean is never an
// average of chunk averages: its kernels divide by their own numel, so a split mean runs as a sum —
// the forward finished by 1/N with N global, the backward's rows divided by N — and NLL's mean
// (cross entropy), whose denominator is the total weight of the targets that are not ignored, runs
// its backward with the global total weight, computed first by a cheap pass over the targets only.
#include "ops/rule_util.h"

#include <string>
#include <unordered_map>

namespace lazymem::rules {
namespace {

constexpr int64_t kNone = 0, kMean = 1, kSum = 2;

int64_t numel(c10::IntArrayRef sizes) {
  int64_t n = 1;
  for (int64_t s : sizes) n *= s;
  return n;
}

// The batch among `args` at dim 0 (inputs (N, C, ...) and targets (N, ...)); class weights and
// total weights must not carry it.
std::optional<Place> leading_batch(const RuleCall& c, RuleResult& r, std::initializer_list<int> args) {
  return bind_batch(c, r, args, /*limit=*/1, /*demand=*/false);
}

// nll_loss_forward / nll_loss2d_forward(self, target, weight, reduction, ignore_index)
//   -> (output, total_weight)
bool nll_forward(const RuleCall& c, RuleResult& r) {
  if (nothing_batched(c)) return replicated(c, r);
  if (c.ins[0].dim() < 2) return fail(r, "an unbatched input");
  auto p = leading_batch(c, r, {0, 1});
  if (!p) return false;
  if (!p->is_s()) return replicated(c, r);
  const int64_t reduction = c.int_arg(3);
  r.outs[1] = Place::P(Reduce::kSum);
  if (reduction == kNone) {
    r.outs[0] = *p;
  } else {
    r.outs[0] = Place::P(Reduce::kSum);
    if (reduction == kMean) {
      // Chunks sum their losses; the total weight comes from a pass over the targets first, and
      // the sum is divided by it once the loop ends.
      r.rewrites.push_back(ArgRewrite{3, -1, ArgRewrite::kConst, kSum, 0});
      r.finalize[0] = Finalize{Finalize::kDivOutput, 1.0, 1};
      r.needs_total_weight = true;
    }
  }
  return true;
}

// nll_loss_backward / nll_loss2d_backward(grad_output, self, target, weight, reduction, ignore_index,
//   total_weight) -> grad_input. With the global total weight the kernel's per-row formula is exact.
bool nll_backward(const RuleCall& c, RuleResult& r) {
  if (nothing_batched(c)) return replicated(c, r);
  const bool per_row = c.int_arg(4) == kNone;
  auto p = per_row ? leading_batch(c, r, {0, 1, 2}) : leading_batch(c, r, {1, 2});
  if (!p) return false;
  if (!p->is_s()) return replicated(c, r);
  r.outs[0] = *p;
  return true;
}

struct Elementwise {
  int reduction_arg;
  bool backward; // arg 0 is grad_output
};

const std::unordered_map<std::string, Elementwise>& elementwise() {
  static const std::unordered_map<std::string, Elementwise> m = {
      {"aten::mse_loss", {2, false}},
      {"aten::l1_loss", {2, false}},
      {"aten::smooth_l1_loss", {2, false}},
      {"aten::huber_loss", {2, false}},
      {"aten::soft_margin_loss", {2, false}},
      {"aten::binary_cross_entropy", {3, false}},
      {"aten::binary_cross_entropy_with_logits", {4, false}},
      {"aten::mse_loss_backward", {3, true}},
      {"aten::smooth_l1_loss_backward", {3, true}},
      {"aten::huber_loss_backward", {3, true}},
      {"aten::soft_margin_loss_backward", {3, true}},
      {"aten::binary_cross_entropy_backward", {4, true}},
  };
  return m;
}

// Losses of an input and a same-shaped target (and broadcast weights): reduction none is pointwise,
// sum is partial, mean is a sum divided by the global number of elements.
bool elementwise_loss(const RuleCall& c, RuleResult& r) {
  auto it = elementwise().find(c.op.operator_name().name);
  if (it == elementwise().end()) return fail(r, "no loss spec");
  const Elementwise& s = it->second;
  if (nothing_batched(c)) return replicated(c, r);
  const int64_t reduction = c.int_arg(s.reduction_arg);
  // out= forms (the composites call the backward's .grad_input): the written grad is the output.
  const int64_t out = c.outs.empty() ? written(c) : -1;
  if (c.outs.empty() && (!s.backward || out < 0)) return fail(r, "an out= loss");
  const int64_t self = c.operand_index(s.backward ? 1 : 0);
  if (self < 0) return fail(r, "no input");
  std::vector<int64_t> aligned;
  for (size_t i = 0; i < c.ins.size(); ++i) {
    if (s.backward && c.ins[i].arg == 0 && reduction != kNone) continue; // a scalar grad_output
    aligned.push_back(static_cast<int64_t>(i));                          // (the out= grad included)
  }
  auto p = broadcast(c, r, c.ins[self].sizes, nullptr, aligned);
  if (!p) return false;
  if (!p->is_s()) return replicated(c, r);
  if (s.backward && reduction != kNone) {
    int64_t g = c.operand_index(0);
    if (g >= 0) {
      if (c.ins[g].place.is_s()) return fail(r, "a reduced loss's gradient carries the batch");
      r.ins[g] = OperandMode::whole();
    }
  }
  const double n = static_cast<double>(numel(c.ins[self].sizes));
  if (s.backward) {
    if (!c.outs.empty()) r.outs[0] = *p;
    if (reduction == kMean) {
      r.rewrites.push_back(ArgRewrite{s.reduction_arg, -1, ArgRewrite::kConst, kSum, 0});
      if (c.outs.empty()) {
        r.post_div_written = n;
      } else {
        r.post_div[0] = n;
      }
    }
    return true;
  }
  if (reduction == kNone) {
    r.outs[0] = *p;
    return true;
  }
  r.outs[0] = Place::P(Reduce::kSum);
  if (reduction == kMean) {
    r.rewrites.push_back(ArgRewrite{s.reduction_arg, -1, ArgRewrite::kConst, kSum, 0});
    r.finalize[0] = Finalize{Finalize::kDivConst, n, -1};
  }
  return true;
}

const bool registered = [] {
  // Per-row losses: a batch flattened with outer blocks (two views of a batch concatenated) is fine.
  register_placement_rules("loss", {"aten::nll_loss_forward", "aten::nll_loss2d_forward"}, &nll_forward, true);
  register_placement_rules("loss", {"aten::nll_loss_backward", "aten::nll_loss2d_backward"}, &nll_backward, true);
  for (const auto& [name, spec] : elementwise()) {
    register_placement_rules("loss", {name.c_str()}, &elementwise_loss, /*outer_aware=*/true);
  }
  return true;
}();

} // namespace
} // namespace lazymem::rules
