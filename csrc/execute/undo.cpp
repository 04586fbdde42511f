// execute: what running a node again would change twice.
#include "execute/undo.h"

#include "core/rng_form.h"

namespace lazymem {

bool draws_from_generator(const PlannedNode& pn) {
  const Node& n = *pn.node;
  return n.random && rng_form_draws(n.rng_form) && !n.drawn && !pn.rng_stream && pn.rng_block == 0 && !n.stream &&
      !n.row_keyed;
}

bool idempotent_in_place(const c10::FunctionSchema& s) {
  static const char* const kOps[] = {"aten::masked_fill_", "aten::fill_", "aten::zero_", "aten::relu_",
                                     "aten::clamp_", "aten::clamp_min_", "aten::clamp_max_", "aten::hardtanh_",
                                     "aten::abs_", "aten::floor_", "aten::ceil_", "aten::round_", "aten::trunc_",
                                     "aten::sign_"};
  if (s.overload_name() == "Tensor") return false; // a tensor argument might alias what is updated
  for (const char* op : kOps) {
    if (s.name() == op) return true;
  }
  return false;
}

bool reads_what_it_writes(const Node& n, size_t k) {
  const Use& u = n.uses[k];
  if (!u.write) return false;
  if (!u.write_only) return true;
  for (size_t j = 0; j < n.uses.size(); ++j) {
    if (j != k && n.uses[j].ref.buf == u.ref.buf && !n.uses[j].write_only) return true;
  }
  return false;
}

bool redoable_node(const PlannedNode& pn) {
  const Node& n = *pn.node;
  if (n.effectful || draws_from_generator(pn)) return false;
  if (idempotent_in_place(pn.op.schema())) return true;
  for (size_t k = 0; k < n.uses.size() && k < pn.uses.size(); ++k) {
    if (reads_what_it_writes(n, k) && pn.uses[k].bind == Bind::kNarrow) return false;
  }
  return true;
}

std::vector<size_t> stored_rows_updated(const Stage& st, const PlannedNode& pn) {
  const Node& n = *pn.node;
  std::vector<size_t> out;
  for (size_t k = 0; k < n.uses.size() && k < pn.uses.size(); ++k) {
    const Use& u = n.uses[k];
    if (!reads_what_it_writes(n, k) || pn.uses[k].bind != Bind::kNarrow) continue;
    const LazyBuffer* b = u.ref.buf.get();
    bool own = false;
    for (const FullStore& f : st.stores) own = own || f.buf == b;
    for (const Accumulator& a : st.accs) own = own || a.buf == b;
    if (!own) out.push_back(k);
  }
  return out;
}

std::vector<size_t> node_updates_to_save(const PlannedNode& pn, int64_t max_bytes, std::vector<LazyBuffer*>& unsaved) {
  // (Every plain node of every run asks: the cheap tests first, most nodes update nothing in place.)
  const Node& n = *pn.node;
  std::vector<size_t> updated;
  int64_t bytes = 0;
  bool list = false;
  for (size_t k = 0; k < n.uses.size(); ++k) {
    const Use& u = n.uses[k];
    if (!u.write) continue;
    list = list || u.elem >= 0;
    if (!reads_what_it_writes(n, k) || !u.ref.buf->has_real() || u.ref.buf->real_on_host) continue;
    updated.push_back(k);
    bytes += static_cast<int64_t>(u.ref.meta.extent_bytes());
  }
  if (updated.empty() || (n.defs.empty() && !list)) return {}; // (none allocates after updating)
  if (n.effectful || draws_from_generator(pn) || idempotent_in_place(pn.op.schema())) return {};
  if (bytes <= max_bytes) return updated;
  for (size_t k : updated) unsaved.push_back(n.uses[k].ref.buf.get());
  return {};
}

} // namespace lazymem
