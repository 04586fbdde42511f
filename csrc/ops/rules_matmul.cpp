// ops: the matmul family as einsum (batch_split_theory.md §4 row 5, DTensor's einsum strategy).
// Each operand's dims are labelled; the batch is one label. A label kept in the output keeps the
// output batch-sharded along it (every operand that has it is used row by row, the others whole);
// a contracted label makes the output partial, P(+): weight gradients `g^T x`, where each chunk's
// product is one term of the sum over the batch. An added input (addmm's bias) is broadcast against
// the output; with a partial output it would be added once per chunk, so only beta = 0 splits.
// When operands carry the batch in different roles (a similarity matrix `z @ z.T`, its gradient
// `g @ z`), the output keeps the role of the first operand whose role the output has, and operands
// with another role are used whole: the planner stores them in an earlier pass (a gather).
#include "ops/rule_util.h"

#include <cstring>
#include <string>
#include <unordered_map>

namespace lazymem::rules {
namespace {

struct Spec {
  std::vector<std::pair<int, const char*>> operands; // argument index, its labels
  const char* out;                                   // the output's labels
  int bias = -1;                                     // argument broadcast against the output
  int beta = -1;                                     // argument holding beta (bias scale)
};

const std::unordered_map<std::string, Spec>& specs() {
  static const std::unordered_map<std::string, Spec> m = {
      {"aten::mm", {{{0, "mk"}, {1, "kn"}}, "mn"}},
      {"aten::bmm", {{{0, "bmk"}, {1, "bkn"}}, "bmn"}},
      {"aten::addmm", {{{1, "mk"}, {2, "kn"}}, "mn", 0, 3}},
      {"aten::baddbmm", {{{1, "bmk"}, {2, "bkn"}}, "bmn", 0, 3}},
      {"aten::addbmm", {{{1, "bmk"}, {2, "bkn"}}, "mn", 0, 3}},
      {"aten::mv", {{{0, "mk"}, {1, "k"}}, "m"}},
      {"aten::addmv", {{{1, "mk"}, {2, "k"}}, "m", 0, 3}},
      {"aten::dot", {{{0, "k"}, {1, "k"}}, ""}},
      {"aten::vdot", {{{0, "k"}, {1, "k"}}, ""}},
      {"aten::outer", {{{0, "m"}, {1, "n"}}, "mn"}},
      {"aten::ger", {{{0, "m"}, {1, "n"}}, "mn"}},
      {"aten::addr", {{{1, "m"}, {2, "n"}}, "mn", 0, 3}},
  };
  return m;
}

const Spec* spec_of(const c10::OperatorHandle& op) {
  const auto& n = op.operator_name();
  std::string base = n.name;
  if (!base.empty() && base.back() == '_') base.pop_back(); // addmm_ -> addmm
  auto it = specs().find(base);
  return it == specs().end() ? nullptr : &it->second;
}

bool matmul(const RuleCall& c, RuleResult& r) {
  const Spec* s = spec_of(c.op);
  if (!s) return fail(r, "no matmul spec");
  if (nothing_batched(c)) return replicated(c, r);
  // The batch's label, from the sharded operands (or the demanded output dim).
  // `sh`: how the batch is sharded along its label (unit, outer), whichever dim that is.
  // Operands carrying the batch in different roles (`z @ z.T`: rows of one, columns of the other)
  // keep the first role that the output has; the others are used whole, gathered from an earlier pass.
  char label = 0;
  Place sh;
  bool roles = false;
  for (const auto& [arg, labels] : s->operands) {
    const Operand* o = c.operand(arg);
    if (!o || !o->place.is_s()) continue;
    if (o->dim() != static_cast<int64_t>(std::strlen(labels))) return fail(r, "unexpected operand rank");
    const char l = labels[o->place.dim];
    if (label && l != label) {
      roles = true;
      if (std::strchr(s->out, label)) continue;
      if (!std::strchr(s->out, l)) return fail(r, "operands carry the batch in different contracted roles");
    } else if (label && sh != o->place.at(0)) {
      return fail(r, "operands carry the batch in the same role with different layouts");
    }
    label = l;
    sh = o->place.at(0);
  }
  if (roles && s->bias >= 0) return fail(r, "operands carry the batch in different roles beside an added input");
  const int64_t bias = s->bias >= 0 ? c.operand_index(s->bias) : -1;
  if (!label && bias >= 0 && c.ins[bias].place.is_s()) {
    // Only the added input carries the batch: it follows the output's dims.
    int64_t od = c.ins[bias].place.dim + (static_cast<int64_t>(std::strlen(s->out)) - c.ins[bias].dim());
    if (od < 0) return fail(r, "the added input is broadcast along the batch");
    label = s->out[od];
    sh = c.ins[bias].place.at(0);
  }
  if (!label) {
    const Place* want = c.wanted(0);
    if (!want || !want->is_s() || want->dim >= static_cast<int64_t>(std::strlen(s->out))) return replicated(c, r);
    label = s->out[want->dim];
    sh = want->at(0);
  }
  for (auto& m : r.ins) m = OperandMode::whole();
  for (const auto& [arg, labels] : s->operands) {
    int64_t i = c.operand_index(arg);
    if (i < 0) continue;
    const char* at = std::strchr(labels, label);
    if (at && (!c.ins[i].place.is_s() || c.ins[i].place.dim == at - labels)) {
      r.ins[i] = OperandMode::rows(at - labels, sh);
    } else if (c.ins[i].place.is_s() && !roles) {
      return fail(r, "a batch-sharded operand lacks the batch's role");
    }
  }
  const char* out_at = std::strchr(s->out, label);
  const int64_t out_ndim = static_cast<int64_t>(std::strlen(s->out));
  if (out_at) {
    const int64_t od = out_at - s->out;
    const int64_t w = written(c);
    const int64_t out_size = c.outs.empty() ? (w >= 0 ? c.ins[w].sizes[od] : 0) : c.outs[0].sizes[od];
    // The added input and an out= output follow the output's dims.
    for (int64_t i : {bias, w}) {
      if (i >= 0 && !align(c, r, static_cast<size_t>(i), out_ndim, od, out_size, sh.at(od))) return false;
    }
    for (auto& o : r.outs) o = sh.at(od);
    return true;
  }
  // Contracted: each chunk's product is one term of the sum over the batch.
  if (bias >= 0) {
    const c10::IValue& beta = c.args[s->beta];
    if (!(beta.isScalar() && beta.toScalar().toDouble() == 0.0)) {
      return fail(r, "contracts the batch with an added input (it would be added once per chunk)");
    }
  }
  for (int64_t i = 0; i < static_cast<int64_t>(c.ins.size()); ++i) {
    if (c.ins[i].write) return fail(r, "contracts the batch into an existing output");
  }
  for (auto& o : r.outs) o = Place::P(Reduce::kSum);
  return true;
}

const bool registered = [] {
  register_placement_rules("matmul",
                           {"aten::mm", "aten::bmm", "aten::addmm", "aten::addmm_", "aten::baddbmm", "aten::baddbmm_",
                            "aten::addbmm", "aten::addbmm_", "aten::mv", "aten::addmv", "aten::addmv_", "aten::dot",
                            "aten::vdot", "aten::outer", "aten::ger", "aten::addr", "aten::addr_"},
                           &matmul, /*outer_aware=*/true);
  return true;
}();

} // namespace
} // namespace lazymem::rules
