// ops: embedding and index ops (batch_split_theory.md §3.8, §4 rows 7, 17). Batched indices into a
// replicated table give batched rows (embedding, index_select, gather, take, advanced indexing); the
// embedding's weight gradient scatters batched rows into the table: a sum over the batch, P(+)
// (unless scaled by index frequencies over the whole batch). Indexing a batched tensor along a dim
// that is not the batch keeps it; moving rows across the batch does not split.
#include "ops/rule_util.h"

#include <algorithm>

namespace lazymem::rules {
namespace {

// embedding(weight, indices, padding_idx, scale_grad_by_freq, sparse): out = indices.shape + [D].
bool embedding(const RuleCall& c, RuleResult& r) {
  if (nothing_batched(c)) return replicated(c, r);
  int64_t w = c.operand_index(0), ix = c.operand_index(1);
  if (w < 0 || ix < 0 || c.ins[w].place.is_s()) return fail(r, "the embedding table carries the batch");
  const Operand& idx = c.ins[ix];
  Place p = idx.place;
  if (!p.is_s()) {
    const Place* want = c.wanted(0);
    if (!want || !want->is_s() || want->dim >= idx.dim()) return replicated(c, r);
    p = *want;
  }
  r.ins[w] = OperandMode::whole();
  r.ins[ix] = OperandMode::rows(p.dim, p.unit);
  r.outs[0] = p;
  return true;
}

// embedding_dense_backward(grad_output, indices, num_weights, padding_idx, scale_grad_by_freq):
// grad_output = indices.shape + [D]; the table's gradient sums rows over the batch.
bool embedding_backward(const RuleCall& c, RuleResult& r) {
  if (nothing_batched(c)) return replicated(c, r);
  if (c.args[4].isBool() && c.args[4].toBool()) {
    return fail(r, "scale_grad_by_freq divides by index counts over the whole batch");
  }
  int64_t g = c.operand_index(0), ix = c.operand_index(1);
  if (g < 0 || ix < 0) return fail(r, "missing operands");
  // Replicated indices (a constant expanded to the batch) follow the gradient's rows.
  const Operand& grad = c.ins[g];
  const Place* seed = grad.place.is_s() && grad.place.dim < c.ins[ix].dim() ? &grad.place : nullptr;
  auto p = broadcast(c, r, c.ins[ix].sizes, seed, std::vector<int64_t>{ix});
  if (!p || !p->is_s()) return p ? replicated(c, r) : false;
  if (c.ins[g].place.is_s() && c.ins[g].place != *p) return fail(r, "gradient and indices disagree on the batch");
  if (c.ins[g].sizes[p->dim] != c.ins[ix].sizes[p->dim]) return fail(r, "gradient and indices disagree");
  r.ins[g] = OperandMode::rows(p->dim, p->unit);
  r.outs[0] = Place::P(Reduce::kSum);
  return true;
}

// index_select(self, dim, index): out.shape[dim] = index.numel().
bool index_select(const RuleCall& c, RuleResult& r) {
  if (nothing_batched(c)) return replicated(c, r);
  int64_t s = c.operand_index(0), ix = c.operand_index(2);
  const int64_t dim = wrap_dim(c.int_arg(1), c.ins[s].dim());
  for (auto& m : r.ins) m = OperandMode::whole();
  if (ix >= 0 && c.ins[ix].place.is_s()) {
    // Batched indices into self along `dim`: self is read whole (a gather along the batch when self
    // carries it there: stored by an earlier pass); the output follows the indices' rows.
    if (c.ins[s].place.is_s() && c.ins[s].place.dim != dim) {
      return fail(r, "indexes a tensor batched along another dim with batched indices");
    }
    r.ins[ix] = OperandMode::rows(0, c.ins[ix].place.unit);
    r.outs[0] = c.ins[ix].place.at(dim);
    return true;
  }
  const Operand& self = c.ins[s];
  if (!self.place.is_s()) {
    // Replicated indices (a constant buffer expanded to the batch: BERT's token types) whose
    // output is wanted batch-sharded along `dim`: each chunk selects with its rows of the indices.
    const Place* want = c.wanted(0);
    if (ix < 0 || !want || !want->is_s() || want->dim != dim || c.ins[ix].dim() != 1) return replicated(c, r);
    r.ins[ix] = OperandMode::rows(0, *want);
    r.outs[0] = *want;
    return true;
  }
  if (self.place.dim == dim) return fail(r, "selects rows along the batch");
  r.ins[s] = OperandMode::rows(self.place.dim, self.place.unit);
  r.outs[0] = self.place;
  return true;
}

// gather(self, dim, index, sparse_grad): out.shape = index.shape; out[..i..] reads self at the same
// position along every dim but `dim`.
bool gather(const RuleCall& c, RuleResult& r) {
  if (nothing_batched(c)) return replicated(c, r);
  int64_t s = c.operand_index(0), ix = c.operand_index(2);
  const Operand& self = c.ins[s];
  const Operand& idx = c.ins[ix];
  const int64_t dim = wrap_dim(c.int_arg(1), self.dim());
  Place p = idx.place.is_s() ? idx.place : self.place;
  if (!p.is_s()) return replicated(c, r);
  if (idx.place.is_s() && self.place.is_s() && idx.place != self.place) return fail(r, "operands disagree");
  for (auto& m : r.ins) m = OperandMode::whole();
  if (p.dim == dim) {
    // Batched indices along `dim`: each output row reads anywhere in self, which is read whole (a
    // gather along the batch when self carries it there: stored by an earlier pass).
    if (!idx.place.is_s()) return fail(r, "gathers along the batch with indices that do not carry it");
    if (self.place.is_s() && self.place.dim != dim) return fail(r, "operands carry the batch along different dims");
    r.ins[ix] = OperandMode::rows(p.dim, p.unit);
    r.outs[0] = p;
    return true;
  }
  // Row i of the output reads row i of self and of the index (self may have more rows than the
  // index; a batched self needs an index with every one of its rows).
  if (self.place.is_s() && idx.sizes[p.dim] != self.sizes[p.dim]) {
    return fail(r, "index and self disagree on the batch's rows");
  }
  r.ins[s] = OperandMode::rows(p.dim, p.unit);
  r.ins[ix] = OperandMode::rows(p.dim, p.unit);
  r.outs[0] = p;
  return true;
}

// scatter / scatter_add / scatter_reduce (self, dim, index, src|value, ...): out = self with rows
// updated along `dim`; splits when the batch is another dim, where self, index and src are
// aligned row by row.
bool scatter(const RuleCall& c, RuleResult& r) {
  if (nothing_batched(c)) return replicated(c, r);
  int64_t s = c.operand_index(0), ix = c.operand_index(2);
  if (s < 0 || ix < 0) return fail(r, "missing operands");
  const int64_t dim = wrap_dim(c.int_arg(1), c.ins[s].dim());
  std::optional<Place> p;
  for (const Operand& o : c.ins) {
    if (!o.place.is_s()) continue;
    if (p && *p != o.place) return fail(r, "operands disagree on the batch");
    p = o.place;
  }
  if (!p) {
    const Place* want = c.wanted(0);
    if (!want) return replicated(c, r);
    p = *want;
  }
  if (p->dim == dim) return fail(r, "scatters along the batch");
  const int64_t rows = c.ins[s].sizes[p->dim];
  for (size_t i = 0; i < c.ins.size(); ++i) {
    const Operand& o = c.ins[i];
    if (o.dim() != c.ins[s].dim() || o.sizes[p->dim] != rows) return fail(r, "operands disagree on the batch's rows");
    r.ins[i] = OperandMode::rows(p->dim, p->unit);
  }
  for (auto& o : r.outs) o = *p;
  return true;
}

// take(self, index): out.shape = index.shape, reading self flattened.
bool take(const RuleCall& c, RuleResult& r) {
  if (nothing_batched(c)) return replicated(c, r);
  int64_t s = c.operand_index(0), ix = c.operand_index(1);
  if (c.ins[s].place.is_s() || !c.ins[ix].place.is_s()) return fail(r, "takes from a batched tensor");
  r.ins[s] = OperandMode::whole();
  r.ins[ix] = OperandMode::rows(c.ins[ix].place.dim, c.ins[ix].place.unit);
  r.outs[0] = c.ins[ix].place;
  return true;
}

// Advanced indexing self[indices]: index tensors broadcast together; their result dims replace the
// indexed dims (in place when those are adjacent, in front otherwise).
struct Indexing {
  std::vector<int64_t> indexed;     // self dims with an index tensor
  std::vector<int64_t> idx_ops;     // operand positions of the index tensors
  int64_t result_rank = 0;          // rank of the indices' broadcast
  bool adjacent = true;
};

Indexing indexing(const RuleCall& c, int32_t list_arg) {
  Indexing ix;
  for (size_t i = 0; i < c.ins.size(); ++i) {
    const Operand& o = c.ins[i];
    if (o.arg != list_arg || o.elem < 0) continue;
    ix.indexed.push_back(o.elem);
    ix.idx_ops.push_back(static_cast<int64_t>(i));
    ix.result_rank = std::max(ix.result_rank, o.dim());
  }
  for (size_t k = 1; k < ix.indexed.size(); ++k) {
    if (ix.indexed[k] != ix.indexed[k - 1] + 1) ix.adjacent = false;
  }
  return ix;
}

// The output dim of self's non-indexed dim `d`.
int64_t output_dim_of(const Indexing& ix, int64_t d) {
  if (ix.adjacent) {
    if (d < ix.indexed.front()) return d;
    return d - static_cast<int64_t>(ix.indexed.size()) + ix.result_rank;
  }
  int64_t before = 0;
  for (int64_t k = 0; k < d; ++k) {
    if (std::find(ix.indexed.begin(), ix.indexed.end(), k) == ix.indexed.end()) ++before;
  }
  return ix.result_rank + before;
}

// index.Tensor(self, indices) and index_put(self, indices, values, accumulate): the batch either in a
// dim of self that is not indexed (replicated index tensors), or in the index tensors over a
// replicated self (reads only).
bool advanced_index(const RuleCall& c, RuleResult& r) {
  if (nothing_batched(c)) return replicated(c, r);
  const bool put = c.op.operator_name().name != "aten::index";
  Indexing ix = indexing(c, 1);
  if (ix.idx_ops.empty()) return fail(r, "no index tensors");
  int64_t s = c.operand_index(0);
  const Operand& self = c.ins[s];
  for (auto& m : r.ins) m = OperandMode::whole();
  bool batched_indices = false;
  for (int64_t i : ix.idx_ops) batched_indices = batched_indices || c.ins[i].place.is_s();
  const bool along = self.place.is_s() &&
      std::find(ix.indexed.begin(), ix.indexed.end(), self.place.dim) != ix.indexed.end();
  // A gather along the batch with batched indices (mixup's x[perm]): any output row may read any
  // row of self, so self is read whole — stored by an earlier pass — and the output follows the
  // indices' rows (below).
  if (along && batched_indices && !put) {
  } else if (self.place.is_s()) {
    const int64_t d = self.place.dim;
    if (along) return fail(r, "indexes along the batch");
    for (int64_t i : ix.idx_ops) {
      if (c.ins[i].place.is_s()) return fail(r, "indexes a batched tensor with batched indices");
    }
    r.ins[s] = OperandMode::rows(d, self.place.unit);
    const int64_t od = output_dim_of(ix, d);
    if (put) {
      // values broadcast against the indexing result self[indices]
      int64_t v = c.operand_index(2);
      int64_t result_rank = self.dim() - static_cast<int64_t>(ix.indexed.size()) + ix.result_rank;
      if (v >= 0 && !align(c, r, static_cast<size_t>(v), result_rank, od, self.sizes[d], self.place.at(od))) return false;
      for (auto& o : r.outs) o = self.place;
    } else {
      for (auto& o : r.outs) o = self.place.at(od);
    }
    return true;
  }
  if (put) return fail(r, "puts batched values at batched indices");
  // Batched index tensors into a replicated self.
  std::optional<Place> p;
  for (int64_t i : ix.idx_ops) {
    const Operand& o = c.ins[i];
    if (!o.place.is_s()) continue;
    int64_t rd = o.place.dim + (ix.result_rank - o.dim());
    Place q = o.place.at(rd);
    if (p && *p != q) return fail(r, "index tensors disagree on the batch");
    p = q;
  }
  if (!p) return replicated(c, r);
  int64_t rows = -1;
  for (int64_t i : ix.idx_ops) {
    if (c.ins[i].place.is_s()) rows = c.ins[i].sizes[c.ins[i].place.dim];
  }
  for (int64_t i : ix.idx_ops) {
    if (!align(c, r, static_cast<size_t>(i), ix.result_rank, p->dim, rows, *p)) return false;
  }
  const int64_t first = ix.adjacent ? ix.indexed.front() : 0;
  for (auto& o : r.outs) o = p->at(first + p->dim);
  return true;
}

// lazymem::ragged_sink(a, b?, kind, token, start, rows) -> count (execute/ragged.h): nonzero,
// masked_select or boolean-mask indexing run on each chunk's rows, the pieces concatenated in row
// order — equal to the whole result only when the batch is the leading dim of every operand (rows
// of a chunk are then a contiguous run of the row-major order). Chunk k gets start = s_k * unit and
// rows = n_k * unit (positions along dim 0); the counts sum.
bool ragged_sink(const RuleCall& c, RuleResult& r) {
  const Place* p = nullptr;
  for (const Operand& o : c.ins) {
    if (o.place.is_s()) p = &o.place;
  }
  if (!p) return replicated(c, r);
  for (const Operand& o : c.ins) {
    if (!o.place.is_s() || o.place.dim != 0 || o.place.outer != 1 || o.place.unit != p->unit) {
      return fail(r, "a data-dependent op whose operands do not all carry the batch as their leading dim");
    }
  }
  for (auto& m : r.ins) m = OperandMode::rows(0, *p);
  r.outs[0] = Place::P(Reduce::kSum);
  r.rewrites.push_back(ArgRewrite{4, -1, ArgRewrite::kStart, 0, p->unit});
  r.rewrites.push_back(ArgRewrite{5, -1, ArgRewrite::kRows, 0, p->unit});
  return true;
}

const bool registered = [] {
  register_placement_rules("embedding", {"aten::embedding"}, &embedding);
  register_placement_rules("embedding", {"aten::embedding_dense_backward"}, &embedding_backward);
  register_placement_rules("index", {"aten::index_select"}, &index_select);
  register_placement_rules("index", {"aten::gather"}, &gather);
  register_placement_rules("index",
                           {"aten::scatter", "aten::scatter_", "aten::scatter_add", "aten::scatter_add_",
                            "aten::scatter_reduce", "aten::scatter_reduce_"},
                           &scatter);
  register_placement_rules("index", {"aten::take"}, &take);
  register_placement_rules("index",
                           {"aten::index.Tensor", "aten::index_put", "aten::index_put_", "aten::_index_put_impl_",
                            "aten::_unsafe_index", "aten::_unsafe_index_put"},
                           &advanced_index);
  register_placement_rules("index", {"lazymem::ragged_sink"}, &ragged_sink);
  return true;
}();

} // namespace
} // namespace lazymem::rules
