// ops: shared rule helpers.
#include "ops/rule_util.h"

namespace lazymem::rules {

bool nothing_batched(const RuleCall& c) {
  for (const Operand& o : c.ins) {
    if (o.place.is_s()) return false;
  }
  for (size_t i = 0; i < c.outs.size(); ++i) {
    if (c.wanted(i)) return false;
  }
  return true;
}

bool any_partial(const RuleCall& c) {
  for (const Operand& o : c.ins) {
    if (o.place.is_p()) return true;
  }
  return false;
}

bool align(const RuleCall& c, RuleResult& r, size_t i, int64_t out_ndim, int64_t out_dim, int64_t out_size,
           const Place& p) {
  const Operand& o = c.ins[i];
  const int64_t ad = out_dim - (out_ndim - o.dim());
  if (ad < 0 || (o.sizes[ad] == 1 && out_size != 1)) {
    if (o.place.is_s()) return fail(r, "a batch-sharded operand is broadcast along the batch");
    r.ins[i] = OperandMode::whole();
    return true;
  }
  if (o.sizes[ad] != out_size) return fail(r, "an operand's size along the batch differs from the output's");
  if (o.place.is_s() && o.place != p.at(ad)) return fail(r, "operands carry the batch along different dims");
  r.ins[i] = OperandMode::rows(ad, p);
  return true;
}

std::optional<Place> broadcast(const RuleCall& c, RuleResult& r, c10::IntArrayRef out, const Place* want,
                               c10::ArrayRef<int64_t> which) {
  const int64_t on = static_cast<int64_t>(out.size());
  std::vector<int64_t> all;
  if (which.empty()) {
    for (size_t i = 0; i < c.ins.size(); ++i) all.push_back(static_cast<int64_t>(i));
    which = all;
  }
  std::optional<Place> found; // the output's placement
  for (int64_t i : which) {
    const Operand& o = c.ins[i];
    if (!o.place.is_s()) continue;
    const int64_t d = o.place.dim + (on - o.dim());
    if (d < 0 || d >= on || o.sizes[o.place.dim] != out[d]) {
      fail(r, "a batch-sharded operand is broadcast along the batch");
      return std::nullopt;
    }
    if (found && *found != o.place.at(d)) {
      fail(r, "operands carry the batch along different dims of the output");
      return std::nullopt;
    }
    found = o.place.at(d);
  }
  if (!found && want && want->is_s()) found = *want;
  if (!found) {
    for (int64_t i : which) r.ins[i] = OperandMode::whole();
    return Place::R();
  }
  for (int64_t i : which) {
    if (!align(c, r, static_cast<size_t>(i), on, found->dim, out[found->dim], *found)) return std::nullopt;
  }
  return found;
}

std::optional<Place> bind_batch(const RuleCall& c, RuleResult& r, std::initializer_list<int> args, int64_t limit,
                                bool demand) {
  std::optional<Place> found;
  int64_t rows = -1;
  for (auto& m : r.ins) m = OperandMode::whole();
  for (int arg : args) {
    const Operand* o = c.operand(arg);
    if (!o || !o->place.is_s()) continue;
    if (found && *found != o->place) {
      fail(r, "operands carry the batch along different dims");
      return std::nullopt;
    }
    found = o->place;
    rows = o->sizes[o->place.dim];
  }
  if (!found && demand) {
    const Place* want = c.wanted(0);
    if (want && want->is_s() && want->dim < c.outs[0].dim()) {
      found = *want;
      rows = c.outs[0].sizes[want->dim];
    }
  }
  if (!found) return Place::R();
  if (found->dim >= limit) {
    fail(r, limit == 1 ? "the batch is not the leading dim" : "the batch is among the dims the op works across");
    return std::nullopt;
  }
  for (int arg : args) {
    const int64_t i = c.operand_index(arg);
    if (i < 0) continue;
    const Operand& o = c.ins[i];
    if (o.dim() <= found->dim || o.sizes[found->dim] != rows) {
      fail(r, "an operand without the batch's rows");
      return std::nullopt;
    }
    r.ins[i] = OperandMode::rows(found->dim, *found);
  }
  for (size_t i = 0; i < c.ins.size(); ++i) {
    if (r.ins[i].mode == Mode::kWhole && c.ins[i].place.is_s()) {
      fail(r, "a weight carries the batch");
      return std::nullopt;
    }
  }
  return found;
}

std::vector<int64_t> int_list(const c10::IValue& v) {
  if (v.isNone()) return {};
  if (v.isInt()) return {v.toInt()};
  if (v.isIntList()) {
    auto l = v.toIntList();
    return std::vector<int64_t>(l.begin(), l.end());
  }
  return {};
}

int64_t written(const RuleCall& c) {
  for (size_t i = 0; i < c.ins.size(); ++i) {
    if (c.ins[i].write) return static_cast<int64_t>(i);
  }
  return -1;
}

std::optional<c10::IntArrayRef> output_sizes(const RuleCall& c) {
  if (!c.outs.empty()) return c.outs[0].sizes;
  int64_t w = written(c);
  if (w >= 0) return c.ins[w].sizes;
  return std::nullopt;
}

} // namespace lazymem::rules
