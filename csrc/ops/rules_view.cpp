// ops: ops that move data between shapes and carry shapes as arguments — the backward of select and
// slice (a zero tensor of the input's sizes with the gradient in one slice), slice/select scatter,
// narrow copies, repeat, cat and stack (batch_split_theory.md §4 rows 8-10, 22-24). (Views proper
// make no node: their geometry is localized by the planner.) Along dims that are not the batch they
// keep it, with the batch's entry of a sizes argument rewritten to the chunk's rows; a slice of rows
// along the batch runs whole (a view of some rows is read gathered), a concatenation of batches
// along it keeps them as blocks.
#include "ops/rule_util.h"

namespace lazymem::rules {
namespace {

// select_backward(grad_output, input_sizes, dim, index): grad lacks `dim`.
bool select_backward(const RuleCall& c, RuleResult& r) {
  if (nothing_batched(c)) return replicated(c, r);
  const Operand& g = c.ins[0];
  if (!g.place.is_s()) return fail(r, "only the output would carry the batch");
  const int64_t rank = static_cast<int64_t>(int_list(c.args[1]).size());
  const int64_t dim = wrap_dim(c.int_arg(2), rank);
  const int64_t od = g.place.dim < dim ? g.place.dim : g.place.dim + 1;
  r.ins[0] = OperandMode::rows(g.place.dim, g.place.unit);
  r.outs[0] = g.place.at(od);
  r.rewrites.push_back(ArgRewrite{1, static_cast<int32_t>(od), ArgRewrite::kRows, 0, g.place.unit});
  return true;
}

// slice_backward(grad_output, input_sizes, dim, start, end, step) and
// unfold_backward(grad_in, input_sizes, dim, size, step): same rank as the input.
bool sized_backward(const RuleCall& c, RuleResult& r) {
  if (nothing_batched(c)) return replicated(c, r);
  const Operand& g = c.ins[0];
  if (!g.place.is_s()) return fail(r, "only the output would carry the batch");
  const int64_t rank = static_cast<int64_t>(int_list(c.args[1]).size());
  const int64_t dim = wrap_dim(c.int_arg(2), rank);
  if (g.place.dim == dim || g.place.dim >= rank) return fail(r, "slices along the batch");
  r.ins[0] = OperandMode::rows(g.place.dim, g.place.unit);
  r.outs[0] = g.place;
  r.rewrites.push_back(ArgRewrite{1, g.place.dim, ArgRewrite::kRows, 0, g.place.unit});
  return true;
}

// slice_scatter(self, src, dim, start, end, step), select_scatter(self, src, dim, index),
// narrow_copy(self, dim, start, length): the batch must not be `dim`.
bool scatter_into_slice(const RuleCall& c, RuleResult& r) {
  if (nothing_batched(c)) return replicated(c, r);
  const std::string& name = c.op.operator_name().name;
  const bool narrow = name == "aten::narrow_copy";
  const int64_t self = c.operand_index(0);
  const int64_t dim = wrap_dim(c.int_arg(narrow ? 1 : 2), c.ins[self].dim());
  const bool select = name == "aten::select_scatter";
  std::optional<Place> p;
  for (size_t i = 0; i < c.ins.size(); ++i) {
    const Operand& o = c.ins[i];
    if (!o.place.is_s()) continue;
    int64_t d = o.place.dim;
    if (select && o.arg == 1 && d >= dim) ++d; // src lacks `dim`
    Place q = o.place.at(d);
    if (p && *p != q) return fail(r, "operands disagree on the batch");
    p = q;
  }
  if (!p) return replicated(c, r);
  if (p->dim == dim) return fail(r, "slices along the batch");
  for (size_t i = 0; i < c.ins.size(); ++i) {
    int64_t d = p->dim;
    if (select && c.ins[i].arg == 1 && d > dim) --d;
    if (c.ins[i].dim() <= d || c.ins[i].sizes[d] != c.ins[self].sizes[p->dim]) return fail(r, "operands disagree on rows");
    r.ins[i] = OperandMode::rows(d, p->unit);
  }
  for (auto& o : r.outs) o = *p;
  return true;
}

// repeat(self, repeats): leading new dims, then each dim tiled; a dim tiled once keeps the batch.
bool repeat(const RuleCall& c, RuleResult& r) {
  if (nothing_batched(c)) return replicated(c, r);
  const Operand& self = c.ins[0];
  if (!self.place.is_s()) return fail(r, "only the output would carry the batch");
  std::vector<int64_t> reps = int_list(c.args[1]);
  const int64_t od = self.place.dim + static_cast<int64_t>(reps.size()) - self.dim();
  if (od < 0 || reps[od] != 1) return fail(r, "tiles along the batch");
  r.ins[0] = OperandMode::rows(self.place.dim, self.place.unit);
  r.outs[0] = self.place.at(od);
  return true;
}

// cat(tensors, dim) / stack(tensors, dim): every tensor keeps the batch along the same dim. Joined
// along another dim, the output keeps it there. cat along the batch's own dim of tensors that all
// carry it: either each holds every batch row (`outer` blocks of them, alike per row), giving a dim
// of blocks whose `outer` is their sum and each chunk's output the cat of the inputs' chunks (two
// views of a batch concatenated, as contrastive losses do); or each holds a slice of the batch
// (a row map) and the slices tile a range in order (towers over x[:h] and x[h:] concatenated), giving
// that range: each chunk's output is the cat of the inputs' rows in the chunk, in order. (Legacy
// empty 1-D tensors, which cat skips, stay whole.)
bool join(const RuleCall& c, RuleResult& r) {
  if (nothing_batched(c)) return replicated(c, r);
  const bool stack = c.op.operator_name().name == "aten::stack";
  int64_t rank = -1;
  for (const Operand& o : c.ins) {
    if (o.arg == 0 && !(o.dim() == 1 && o.sizes[0] == 0)) rank = o.dim();
  }
  const int64_t dim = wrap_dim(c.int_arg(1), stack ? rank + 1 : rank);
  std::optional<Place> p;
  int64_t outer = 0;
  bool mapped = false;
  for (const Operand& o : c.ins) {
    if (!o.place.is_s()) continue;
    if (o.arg != 0) return fail(r, "an out= join");
    mapped = mapped || !o.place.map.identity();
    if (p && p->at(0) != o.place.at(0) &&
        !(p->dim == dim && o.place.dim == dim && p->unit == o.place.unit && p->batch == o.place.batch)) {
      return fail(r, "inputs carry the batch along different dims");
    }
    if (!p) p = o.place;
    outer += o.place.outer;
  }
  if (!p) return replicated(c, r);
  const bool along = !stack && p->dim == dim;
  const int64_t od = stack && p->dim >= dim ? p->dim + 1 : p->dim;
  if (along && mapped) {
    // Slices of the batch in order: each piece's rows follow the previous piece's.
    RowMap m;
    bool first = true;
    for (size_t i = 0; i < c.ins.size(); ++i) {
      const Operand& o = c.ins[i];
      if (o.dim() == 1 && o.sizes[0] == 0) {
        r.ins[i] = OperandMode::whole();
        continue;
      }
      if (!o.place.is_s() || o.place.outer != 1 || o.place.unit != p->unit || o.dim() != rank) {
        return fail(r, "joins slices of the batch with a tensor that is not one");
      }
      const RowMap& q = o.place.map.identity() ? RowMap{0, 1, c.batch} : o.place.map;
      if (first) {
        m = q;
        first = false;
      } else if (q.off != m.off + m.step * m.n || (q.step != m.step && q.n > 1 && m.n > 1)) {
        return fail(r, "joins slices of the batch out of order");
      } else {
        if (m.n == 1) m.step = q.step;
        m.n += q.n;
      }
      r.ins[i] = OperandMode::rows(dim, o.place);
    }
    Place out = p->at(od);
    out.map = m.off == 0 && m.step == 1 && m.n == c.batch ? RowMap{} : m;
    for (auto& o : r.outs) o = out;
    return true;
  }
  int64_t rows = -1;
  for (const Operand& o : c.ins) {
    if (o.place.is_s()) rows = o.sizes[o.place.dim] / o.place.outer;
  }
  for (size_t i = 0; i < c.ins.size(); ++i) {
    const Operand& o = c.ins[i];
    if (o.dim() == 1 && o.sizes[0] == 0 && !stack) {
      r.ins[i] = OperandMode::whole();
      continue;
    }
    if (along && !o.place.is_s()) return fail(r, "joins along the batch with a tensor that does not carry it");
    const int64_t blocks = along ? o.place.outer : p->outer;
    if (o.dim() != rank || o.sizes[p->dim] != rows * blocks) return fail(r, "inputs disagree on the batch's rows");
    r.ins[i] = OperandMode::rows(p->dim, p->unit, blocks);
  }
  Place out = p->at(od);
  out.outer = along ? outer : p->outer;
  for (auto& o : r.outs) o = out;
  return true;
}

// arange.start_out(start, end, step, out): a batch-sharded arange (one that only feeds batched
// rows) is the chunk's slice of it: start + step * rows. Integral values only (floating-point
// starts would round differently from the whole arange).
bool arange(const RuleCall& c, RuleResult& r) {
  const Operand& out = c.ins[0];
  if (!out.place.is_s()) return replicated(c, r);
  if (out.place.dim != 0 || out.place.unit != 1) return fail(r, "a flattened arange");
  const c10::IValue& start = c.args[0];
  const c10::IValue& step = c.args[2];
  auto integral = [](const c10::IValue& v) {
    return v.isInt() || (v.isScalar() && v.toScalar().isIntegral(false));
  };
  if (!integral(start) || !integral(step) || !c10::isIntegralType(out.dtype, false)) {
    return fail(r, "a floating-point arange");
  }
  const int64_t a = start.isInt() ? start.toInt() : start.toScalar().toLong();
  const int64_t s = step.isInt() ? step.toInt() : step.toScalar().toLong();
  r.ins[0] = OperandMode::rows(0, 1);
  r.rewrites.push_back(ArgRewrite{0, -1, ArgRewrite::kStart, a, s});
  r.rewrites.push_back(ArgRewrite{1, -1, ArgRewrite::kEnd, a, s});
  return true;
}

const bool registered = [] {
  register_placement_rules("view", {"aten::select_backward"}, &select_backward);
  register_placement_rules("view", {"aten::slice_backward", "aten::unfold_backward"}, &sized_backward);
  register_placement_rules("view", {"aten::slice_scatter", "aten::select_scatter", "aten::narrow_copy"},
                           &scatter_into_slice);
  register_placement_rules("view", {"aten::repeat"}, &repeat);
  register_placement_rules("view", {"aten::cat", "aten::stack"}, &join, /*outer_aware=*/true);
  register_placement_rules("factory", {"aten::arange.start_out"}, &arange);
  return true;
}();

} // namespace
} // namespace lazymem::rules
