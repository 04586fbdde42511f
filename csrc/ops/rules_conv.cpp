// ops: convolution, pooling, upsampling, padding and other per-sample image ops: the batch is dim 0
// of their inputs and outputs, samples never mix (batch_split_theory.md §4 rows 6, 27). Weight and
// bias gradients of convolution_backward sum over the batch: partial P(+). Backward ops that carry
// the input's sizes get the batch entry rewritten per chunk. (Pooling and upsampling also accept
// unbatched (C, H, W) inputs, whose dim 0 is channels: those are independent too.)
#include "ops/rule_util.h"

#include <string>
#include <unordered_map>

namespace lazymem::rules {
namespace {

struct Spec {
  std::vector<int> batched;     // arguments whose dim 0 is the batch
  std::vector<char> outs;       // per output: 'S' batch dim 0, 'P' partial sum, 'R'
  int sizes_arg = -1;           // an int[] argument holding the input's sizes (batch at [0])
  int min_rank = 1;             // batched operands need at least this rank
};

const std::unordered_map<std::string, Spec>& specs() {
  static const std::unordered_map<std::string, Spec> m = {
      {"aten::convolution", {{0}, {'S'}, -1, 3}},
      {"aten::convolution_backward", {{0, 1}, {'S', 'P', 'P'}, -1, 3}},
      {"aten::max_pool2d_with_indices", {{0}, {'S', 'S'}}},
      {"aten::max_pool2d_with_indices_backward", {{0, 1, 7}, {'S'}}},
      {"aten::max_pool3d_with_indices", {{0}, {'S', 'S'}}},
      {"aten::max_pool3d_with_indices_backward", {{0, 1, 7}, {'S'}}},
      {"aten::avg_pool2d", {{0}, {'S'}}},
      {"aten::avg_pool2d_backward", {{0, 1}, {'S'}}},
      {"aten::avg_pool3d", {{0}, {'S'}}},
      {"aten::avg_pool3d_backward", {{0, 1}, {'S'}}},
      {"aten::_adaptive_avg_pool2d", {{0}, {'S'}}},
      {"aten::_adaptive_avg_pool2d_backward", {{0, 1}, {'S'}}},
      {"aten::_adaptive_avg_pool3d", {{0}, {'S'}}},
      {"aten::_adaptive_avg_pool3d_backward", {{0, 1}, {'S'}}},
      {"aten::adaptive_max_pool2d", {{0}, {'S', 'S'}}},
      {"aten::adaptive_max_pool2d_backward", {{0, 1, 2}, {'S'}}},
      {"aten::adaptive_max_pool3d", {{0}, {'S', 'S'}}},
      {"aten::adaptive_max_pool3d_backward", {{0, 1, 2}, {'S'}}},
      {"aten::max_unpool2d", {{0, 1}, {'S'}}},
      {"aten::upsample_nearest1d", {{0}, {'S'}}},
      {"aten::upsample_nearest2d", {{0}, {'S'}}},
      {"aten::upsample_nearest3d", {{0}, {'S'}}},
      {"aten::_upsample_nearest_exact1d", {{0}, {'S'}}},
      {"aten::_upsample_nearest_exact2d", {{0}, {'S'}}},
      {"aten::_upsample_nearest_exact3d", {{0}, {'S'}}},
      {"aten::upsample_linear1d", {{0}, {'S'}}},
      {"aten::upsample_bilinear2d", {{0}, {'S'}}},
      {"aten::_upsample_bilinear2d_aa", {{0}, {'S'}}},
      {"aten::upsample_bicubic2d", {{0}, {'S'}}},
      {"aten::_upsample_bicubic2d_aa", {{0}, {'S'}}},
      {"aten::upsample_trilinear3d", {{0}, {'S'}}},
      {"aten::upsample_nearest1d_backward", {{0}, {'S'}, 2}},
      {"aten::upsample_nearest2d_backward", {{0}, {'S'}, 2}},
      {"aten::upsample_nearest3d_backward", {{0}, {'S'}, 2}},
      {"aten::_upsample_nearest_exact1d_backward", {{0}, {'S'}, 2}},
      {"aten::_upsample_nearest_exact2d_backward", {{0}, {'S'}, 2}},
      {"aten::_upsample_nearest_exact3d_backward", {{0}, {'S'}, 2}},
      {"aten::upsample_linear1d_backward", {{0}, {'S'}, 2}},
      {"aten::upsample_bilinear2d_backward", {{0}, {'S'}, 2}},
      {"aten::_upsample_bilinear2d_aa_backward", {{0}, {'S'}, 2}},
      {"aten::upsample_bicubic2d_backward", {{0}, {'S'}, 2}},
      {"aten::_upsample_bicubic2d_aa_backward", {{0}, {'S'}, 2}},
      {"aten::upsample_trilinear3d_backward", {{0}, {'S'}, 2}},
      {"aten::reflection_pad1d", {{0}, {'S'}}},
      {"aten::reflection_pad2d", {{0}, {'S'}}},
      {"aten::reflection_pad3d", {{0}, {'S'}}},
      {"aten::reflection_pad1d_backward", {{0, 1}, {'S'}}},
      {"aten::reflection_pad2d_backward", {{0, 1}, {'S'}}},
      {"aten::reflection_pad3d_backward", {{0, 1}, {'S'}}},
      {"aten::replication_pad1d", {{0}, {'S'}}},
      {"aten::replication_pad2d", {{0}, {'S'}}},
      {"aten::replication_pad3d", {{0}, {'S'}}},
      {"aten::replication_pad1d_backward", {{0, 1}, {'S'}}},
      {"aten::replication_pad2d_backward", {{0, 1}, {'S'}}},
      {"aten::replication_pad3d_backward", {{0, 1}, {'S'}}},
      {"aten::grid_sampler_2d", {{0, 1}, {'S'}, -1, 4}},
      {"aten::grid_sampler_2d_backward", {{0, 1, 2}, {'S', 'S'}, -1, 4}},
      {"aten::channel_shuffle", {{0}, {'S'}, -1, 3}},
      {"aten::native_channel_shuffle", {{0}, {'S'}, -1, 3}},
  };
  return m;
}

bool per_sample(const RuleCall& c, RuleResult& r) {
  const auto& n = c.op.operator_name();
  auto it = specs().find(n.name);
  if (it == specs().end()) return fail(r, "no per-sample spec");
  const Spec& s = it->second;
  if (nothing_batched(c)) return replicated(c, r);
  int64_t unit = -1, rows = -1;
  Place place; // the batch's (dim 0)
  for (auto& m : r.ins) m = OperandMode::whole();
  for (int arg : s.batched) {
    int64_t i = c.operand_index(arg);
    if (i < 0) continue;
    const Operand& o = c.ins[i];
    if (o.dim() < s.min_rank) return fail(r, "an unbatched input");
    if (o.place.is_s() && o.place.dim != 0) return fail(r, "the batch is not dim 0");
    if (o.place.is_s()) {
      if (unit >= 0 && o.place != place) return fail(r, "inputs carry the batch differently");
      unit = o.place.unit;
      rows = o.sizes[0];
      place = o.place;
    }
  }
  if (unit < 0) {
    const Place* want = c.wanted(0);
    if (!want || want->dim != 0) return replicated(c, r);
    unit = want->unit;
    rows = c.outs[0].sizes[0];
    place = *want;
  }
  for (int arg : s.batched) {
    int64_t i = c.operand_index(arg);
    if (i < 0) continue;
    if (c.ins[i].sizes[0] != rows) return fail(r, "inputs disagree on the batch size");
    r.ins[i] = OperandMode::rows(0, place);
  }
  for (size_t i = 0; i < c.ins.size(); ++i) {
    if (r.ins[i].mode == Mode::kWhole && c.ins[i].place.is_s()) return fail(r, "a weight carries the batch");
  }
  for (size_t j = 0; j < c.outs.size(); ++j) {
    // Outputs a mask turned off are not defs: index the spec by the def's return position.
    const size_t ret = static_cast<size_t>(c.outs[j].ret);
    if (ret >= s.outs.size()) continue;
    if (s.outs[ret] == 'S') {
      if (c.outs[j].sizes.empty() || c.outs[j].sizes[0] != rows) return fail(r, "an output without the batch");
      r.outs[j] = place.at(0);
    } else if (s.outs[ret] == 'P') {
      r.outs[j] = Place::P(Reduce::kSum);
    }
  }
  if (s.sizes_arg >= 0) r.rewrites.push_back(ArgRewrite{s.sizes_arg, 0, ArgRewrite::kRows, 0, unit});
  return true;
}

// constant_pad_nd pads the trailing len(pad)/2 dims; any dim before them may carry the batch.
bool constant_pad(const RuleCall& c, RuleResult& r) {
  if (nothing_batched(c)) return replicated(c, r);
  auto p = broadcast(c, r, c.ins[0].sizes, c.wanted(0), std::vector<int64_t>{0});
  if (!p) return false;
  const int64_t padded = static_cast<int64_t>(int_list(c.args[1]).size()) / 2;
  if (p->is_s() && p->dim >= c.ins[0].dim() - padded) return fail(r, "pads along the batch");
  for (auto& o : r.outs) o = *p;
  return true;
}

const bool registered = [] {
  std::vector<const char*> names;
  for (const auto& [name, spec] : specs()) names.push_back(name.c_str());
  for (const char* n : names) register_placement_rules("conv", {n}, &per_sample);
  register_placement_rules("conv", {"aten::constant_pad_nd"}, &constant_pad);
  return true;
}();

} // namespace
} // namespace lazymem::rules
