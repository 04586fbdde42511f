// ops: reductions, scans, sorts and softmax. Over dims that do not carry the batch they keep it
// (its dim renumbered when the reduced dims before it drop out); over the batch, sum is partial
// P(+), amax/amin P(max)/P(min), logsumexp P(logsumexp) merged by logaddexp, p-norms P(norm)
// merged as (a^p + b^p)^(1/p), and mean is a sum finished by 1/N with N the global count — never an
// average of per-chunk averages (batch_split_theory.md §0.3, §4 rows 3-4). Softmax, log-softmax and
// their backward, variance and standard deviation over the batch need every row at once: the rule
// asks the planner to expand them into passes (plan/synth.cpp): a pass computing an exactly merged
// statistic (log-sum-exp, Chan's moments, a sum), then the rows per chunk. Arg-reductions, scans,
// sorts, medians and products over the batch run whole. Reductions of a partial input are partial
// again when they are linear (sum, mean).
#include "ops/rule_util.h"

#include <algorithm>
#include <string>
#include <unordered_map>

namespace lazymem::rules {
namespace {

struct Spec {
  enum Dims : uint8_t {
    kList,  // int[]? (None or empty: every dim)
    kInt,   // int
    kOpt,   // int? (None: every dim, flattened)
    kAll,   // every dim
  };
  Dims dims = kList;
  int8_t dim_arg = 1;
  int8_t keepdim_arg = -1; // -1: the output keeps the input's rank (scans, sorts, softmax);
                           // -2: reduced dims always drop (no keepdim argument); -3: always kept
  Reduce over_batch = Reduce::kNone;
  const char* mean_as = nullptr; // mean: the sum overload it becomes over the batch
  int8_t operands = 1;           // leading operands with the input's shape (softmax backward: 2)
  bool expand = false;           // over the batch: expanded into passes by the planner
  int8_t ord_arg = -1;           // p-norms: the argument holding p (None: 2)
};

const std::unordered_map<std::string, Spec>& specs() {
  static const std::unordered_map<std::string, Spec> m = {
      {"aten::sum.dim_IntList", {Spec::kList, 1, 2, Reduce::kSum}},
      {"aten::sum", {Spec::kAll, -1, -2, Reduce::kSum}},
      {"aten::nansum", {Spec::kList, 1, 2, Reduce::kSum}},
      {"aten::mean.dim", {Spec::kList, 1, 2, Reduce::kSum, "aten::sum.dim_IntList"}},
      {"aten::mean", {Spec::kAll, -1, -2, Reduce::kSum, "aten::sum"}},
      {"aten::amax", {Spec::kList, 1, 2, Reduce::kMax}},
      {"aten::amin", {Spec::kList, 1, 2, Reduce::kMin}},
      {"aten::count_nonzero.dim_IntList", {Spec::kList, 1, -2, Reduce::kSum}},
      {"aten::prod.dim_int", {Spec::kInt, 1, 2}},
      {"aten::logsumexp", {Spec::kList, 1, 2, Reduce::kLogSumExp}},
      {"aten::var.correction", {Spec::kList, 1, 3, Reduce::kNone, nullptr, 1, true}},
      {"aten::std.correction", {Spec::kList, 1, 3, Reduce::kNone, nullptr, 1, true}},
      {"aten::var_mean.correction", {Spec::kList, 1, 3, Reduce::kNone, nullptr, 1, true}},
      {"aten::std_mean.correction", {Spec::kList, 1, 3, Reduce::kNone, nullptr, 1, true}},
      {"aten::linalg_vector_norm", {Spec::kList, 2, 3, Reduce::kNorm, nullptr, 1, false, 1}},
      {"aten::norm.ScalarOpt_dim", {Spec::kList, 2, 3, Reduce::kNorm, nullptr, 1, false, 1}},
      {"aten::norm.ScalarOpt_dim_dtype", {Spec::kList, 2, 3, Reduce::kNorm, nullptr, 1, false, 1}},
      // all / any over the batch: a partial logical and / or, kept as min / max of booleans.
      {"aten::any.dim", {Spec::kInt, 1, 2, Reduce::kMax}},
      {"aten::all.dim", {Spec::kInt, 1, 2, Reduce::kMin}},
      {"aten::any.dims", {Spec::kList, 1, 2, Reduce::kMax}},
      {"aten::all.dims", {Spec::kList, 1, 2, Reduce::kMin}},
      {"aten::any", {Spec::kAll, -1, -2, Reduce::kMax}},
      {"aten::max", {Spec::kAll, -1, -2, Reduce::kMax}},
      {"aten::min", {Spec::kAll, -1, -2, Reduce::kMin}},
      {"aten::all", {Spec::kAll, -1, -2, Reduce::kMin}},
      {"aten::argmax", {Spec::kOpt, 1, 2}},
      {"aten::argmin", {Spec::kOpt, 1, 2}},
      {"aten::max.dim", {Spec::kInt, 1, 2}},
      {"aten::min.dim", {Spec::kInt, 1, 2}},
      {"aten::kthvalue", {Spec::kInt, 2, 3}},
      {"aten::median.dim", {Spec::kInt, 1, 2}},
      {"aten::nanmedian.dim", {Spec::kInt, 1, 2}},
      {"aten::mode", {Spec::kInt, 1, 2}},
      {"aten::cumsum", {Spec::kInt, 1}},
      {"aten::cumprod", {Spec::kInt, 1}},
      {"aten::logcumsumexp", {Spec::kInt, 1}},
      {"aten::cummax", {Spec::kInt, 1}},
      {"aten::cummin", {Spec::kInt, 1}},
      {"aten::sort", {Spec::kInt, 1}},
      {"aten::sort.stable", {Spec::kInt, 2}},
      {"aten::topk", {Spec::kInt, 2}},
      {"aten::_softmax", {Spec::kInt, 1, -1, Reduce::kNone, nullptr, 1, true}},
      {"aten::_log_softmax", {Spec::kInt, 1, -1, Reduce::kNone, nullptr, 1, true}},
      {"aten::_softmax_backward_data", {Spec::kInt, 2, -1, Reduce::kNone, nullptr, 2, true}},
      {"aten::_log_softmax_backward_data", {Spec::kInt, 2, -1, Reduce::kNone, nullptr, 2, true}},
      // (lazymem::softmax_backward_reduce: the sum a split softmax backward needs, keepdim)
      {"lazymem::softmax_backward_reduce", {Spec::kInt, 2, -3, Reduce::kSum, nullptr, 2}},
      {"aten::flip", {Spec::kList, 1}},
  };
  return m;
}

const Spec* spec_of(const c10::OperatorHandle& op) {
  const auto& n = op.operator_name();
  const auto& m = specs();
  auto it = m.find(n.name + (n.overload_name.empty() ? "" : "." + n.overload_name));
  return it == m.end() ? nullptr : &it->second;
}

// The reduced (or operated-on) dims, wrapped; `all` when every dim is.
std::vector<int64_t> reduced_dims(const RuleCall& c, const Spec& s, int64_t ndim, bool& all) {
  all = false;
  std::vector<int64_t> dims;
  if (s.dims == Spec::kAll) {
    all = true;
  } else {
    const c10::IValue& v = c.args[s.dim_arg];
    if (v.isNone() || (s.dims == Spec::kList && int_list(v).empty() && s.keepdim_arg != -1)) {
      all = true;
    } else {
      dims = int_list(v);
    }
  }
  if (all) {
    for (int64_t d = 0; d < ndim; ++d) dims.push_back(d);
  }
  for (auto& d : dims) d = wrap_dim(d, ndim);
  return dims;
}

bool reduction(const RuleCall& c, RuleResult& r) {
  const Spec* s = spec_of(c.op);
  if (!s) return fail(r, "no reduction spec");
  const Operand& self = c.ins[0];
  const int64_t ndim = self.dim();
  if (nothing_batched(c)) {
    // sum and mean are linear: the reduction of a partial is partial.
    if (self.place.is_p() && self.place.reduce == Reduce::kSum && s->over_batch == Reduce::kSum) {
      r.ins[0] = OperandMode::partial();
      for (auto& o : r.outs) o = Place::P(Reduce::kSum);
      return true;
    }
    return replicated(c, r);
  }
  // The operands that share the input's shape (softmax backward's grad and output).
  std::vector<int64_t> same;
  for (int64_t i = 0; i < s->operands && i < static_cast<int64_t>(c.ins.size()); ++i) same.push_back(i);
  const Place* want = c.wanted(0);
  // Demand (an output wanted batch-sharded) is met only by reductions that keep the input's rank.
  auto in = broadcast(c, r, self.sizes, s->keepdim_arg == -1 ? want : nullptr, same);
  if (!in) return false;
  if (!in->is_s()) return replicated(c, r);
  bool all = false;
  std::vector<int64_t> dims = reduced_dims(c, *s, ndim, all);
  const int64_t d = in->dim;
  const bool over_batch = std::find(dims.begin(), dims.end(), d) != dims.end();
  if (over_batch) {
    if (s->expand) {
      r.expand = true;
      return fail(r, "reduces over the batch: needs every row at once (expanded into passes)");
    }
    if (s->keepdim_arg == -1 || s->over_batch == Reduce::kNone) {
      return fail(r, "reduces over the batch: needs every row at once");
    }
    for (auto& o : r.outs) o = Place::P(s->over_batch);
    if (s->ord_arg >= 0) {
      const c10::IValue& p = c.args[s->ord_arg];
      const double ord = p.isNone() ? 2.0 : p.toScalar().toDouble();
      for (auto& f : r.finalize) f = Finalize{Finalize::kNorm, ord, -1};
    }
    if (s->mean_as) {
      double n = 1;
      for (int64_t k : dims) n *= static_cast<double>(self.sizes[k]);
      r.replace_op = s->mean_as;
      r.finalize[0] = Finalize{Finalize::kDivConst, n, -1};
    }
    return true;
  }
  int64_t out_dim = d;
  if (s->keepdim_arg != -1) {
    const bool keepdim = s->keepdim_arg == -3 ||
        (s->keepdim_arg >= 0 && c.args[s->keepdim_arg].isBool() && c.args[s->keepdim_arg].toBool());
    if (!keepdim) out_dim -= std::count_if(dims.begin(), dims.end(), [&](int64_t k) { return k < d; });
  }
  for (auto& o : r.outs) o = in->at(out_dim);
  return true;
}

// lazymem::moments(x, dims, dtype) -> [2, *x's sizes with dims kept as 1]: over the batch, each
// chunk's (biased variance, mean), merged by Chan's update with the global counts.
bool moments(const RuleCall& c, RuleResult& r) {
  if (nothing_batched(c)) return replicated(c, r);
  auto in = broadcast(c, r, c.ins[0].sizes, nullptr);
  if (!in) return false;
  if (!in->is_s()) return replicated(c, r);
  const std::vector<int64_t> dims = int_list(c.args[1]);
  int64_t count = 1;
  bool over_batch = false;
  for (int64_t k : dims) {
    const int64_t d = wrap_dim(k, c.ins[0].dim());
    over_batch = over_batch || d == in->dim;
    count *= c.ins[0].sizes[d];
  }
  if (!over_batch || c.batch == 0) return fail(r, "moments that do not reduce over the batch");
  r.outs[0] = Place::P(Reduce::kMoments);
  r.finalize[0].kind = Finalize::kMoments;
  const int64_t rows = in->map.identity() ? c.batch : in->map.n; // the rows it holds (a slice: fewer)
  if (rows == 0) return fail(r, "moments over no rows of the batch");
  r.finalize[0].per_row = count / rows;
  return true;
}

// Ops a split expansion runs once, on finished statistics (lazymem::moments_finish).
bool once(const RuleCall& c, RuleResult& r) {
  if (nothing_batched(c)) return replicated(c, r);
  return fail(r, "a finished statistic carries the batch");
}

// lazymem::softmax_from_lse(x, lse, log) and softmax_backward_apply(grad, out, sum, log): the rows
// of the batch-shaped operands with the statistic broadcast.
bool rows_with_statistic(const RuleCall& c, RuleResult& r) {
  if (nothing_batched(c)) return replicated(c, r);
  auto p = broadcast(c, r, c.ins[0].sizes, c.wanted(0));
  if (!p) return false;
  for (auto& o : r.outs) o = *p;
  return true;
}

// tril/triu act on the last two dims: any other dim may carry the batch.
bool triangle(const RuleCall& c, RuleResult& r) {
  if (nothing_batched(c)) return replicated(c, r);
  auto out = output_sizes(c);
  auto p = broadcast(c, r, *out, c.wanted(0));
  if (!p) return false;
  if (p->is_s() && p->dim >= static_cast<int64_t>(out->size()) - 2) return fail(r, "the batch is in a matrix dim");
  for (auto& o : r.outs) o = *p;
  return true;
}

// roll along dims that do not carry the batch (no dims: the flattened tensor rolls, batch included).
bool roll(const RuleCall& c, RuleResult& r) {
  if (nothing_batched(c)) return replicated(c, r);
  auto p = broadcast(c, r, c.ins[0].sizes, c.wanted(0), std::vector<int64_t>{0});
  if (!p) return false;
  std::vector<int64_t> dims = int_list(c.args[2]);
  if (dims.empty()) return fail(r, "rolls the flattened tensor");
  for (int64_t k : dims) {
    if (wrap_dim(k, c.ins[0].dim()) == p->dim) return fail(r, "rolls along the batch");
  }
  for (auto& o : r.outs) o = *p;
  return true;
}

const bool registered = [] {
  register_placement_rules(
      "reduction",
      {"aten::sum.dim_IntList", "aten::sum", "aten::nansum", "aten::mean.dim", "aten::mean", "aten::amax",
       "aten::amin", "aten::count_nonzero.dim_IntList", "aten::prod.dim_int", "aten::logsumexp",
       "aten::var.correction", "aten::std.correction", "aten::var_mean.correction", "aten::std_mean.correction",
       "aten::linalg_vector_norm", "aten::norm.ScalarOpt_dim", "aten::norm.ScalarOpt_dim_dtype", "aten::any.dim",
       "aten::all.dim", "aten::any.dims", "aten::all.dims", "aten::any", "aten::all", "aten::argmax", "aten::argmin", "aten::max.dim",
       "aten::min.dim", "aten::kthvalue", "aten::median.dim", "aten::nanmedian.dim", "aten::mode", "aten::cumsum",
       "aten::cumprod", "aten::logcumsumexp", "aten::cummax", "aten::cummin", "aten::sort", "aten::sort.stable",
       "aten::topk", "aten::flip", "aten::max.", "aten::min."},
      &reduction, /*outer_aware=*/true);
  register_placement_rules("softmax",
                           {"aten::_softmax", "aten::_log_softmax", "aten::_softmax_backward_data",
                            "aten::_log_softmax_backward_data"},
                           &reduction, /*outer_aware=*/true);
  register_placement_rules("softmax", {"lazymem::softmax_backward_reduce"}, &reduction, /*outer_aware=*/true);
  register_placement_rules("softmax", {"lazymem::softmax_from_lse", "lazymem::softmax_backward_apply"},
                           &rows_with_statistic, /*outer_aware=*/true);
  register_placement_rules("reduction", {"lazymem::moments"}, &moments, /*outer_aware=*/true);
  register_placement_rules("reduction", {"lazymem::moments_finish"}, &once);
  register_placement_rules("pointwise", {"aten::tril", "aten::triu", "aten::tril_", "aten::triu_"}, &triangle);
  register_placement_rules("pointwise", {"aten::roll"}, &roll);
  return true;
}();

} // namespace
} // namespace lazymem::rules
