// plan: meta probes of chunk shapes (see probe.h).
#include "plan/probe.h"

#include <algorithm>

#include "ops/meta_probe.h"
#include "plan/localize.h"

namespace lazymem {

std::string probe_chunk(const Stage& st, const PlannedNode& pn, int64_t rows,
                        const std::function<int32_t(const LazyBuffer*)>& storage_of) {
  const Node& n = *pn.node;
  std::vector<ProbeTensor> ts;
  auto add = [&](int32_t arg, int32_t elem, const TensorMeta& m, int32_t storage, int64_t bytes) {
    ProbeTensor t;
    t.arg = arg;
    t.elem = elem;
    t.sizes = m.sizes;
    t.strides = m.strides;
    t.offset = m.offset;
    t.dtype = m.dtype;
    t.storage = storage;
    t.storage_bytes = std::max<int64_t>(bytes, static_cast<int64_t>(m.extent_bytes()));
    ts.push_back(std::move(t));
  };
  int32_t next = -1; // storages of their own (host constants, gathered copies)
  for (size_t k = 0; k < n.uses.size(); ++k) {
    const Use& u = n.uses[k];
    const Bound& bd = pn.uses[k];
    const int32_t id = storage_of(u.ref.buf.get());
    switch (bd.bind) {
      case Bind::kLocal: {
        const RowLayout& l = st.slots[bd.slot].layout;
        add(u.arg, u.elem, localize(u.ref.meta, l, rows), id, l.bytes(rows));
        break;
      }
      case Bind::kNarrow:
        if (bd.outer != 1) { // a gathered copy
          const TensorMeta g = gathered_rows(u.ref.meta, bd.dim, bd.unit, bd.outer, rows);
          add(u.arg, u.elem, g, next--, static_cast<int64_t>(g.extent_bytes()));
          break;
        }
        add(u.arg, u.elem, narrow_rows(u.ref.meta, bd.dim, bd.unit, 0, rows), id,
            static_cast<int64_t>(u.ref.buf->nbytes.load()));
        break;
      default:
        add(u.arg, u.elem, u.ref.meta, id, static_cast<int64_t>(u.ref.buf->nbytes.load()));
    }
  }
  std::vector<c10::IValue> args = n.args;
  for (auto& v : args) {
    if (v.isList()) v = c10::IValue(v.toList().copy());
  }
  for (size_t i = 0; i < args.size(); ++i) {
    auto host = [&](const c10::IValue& v, int32_t elem) {
      if (!v.isTensor() || !v.toTensor().defined() || v.toTensor().device().type() == c10::DeviceType::PrivateUse1) return;
      at::Tensor t = v.toTensor();
      for (const ConstNarrow& c : pn.consts) {
        if (c.arg == static_cast<int32_t>(i) && c.elem == elem) t = t.narrow(c.dim, 0, rows * c.unit);
      }
      TensorMeta m = TensorMeta::of(*t.unsafeGetTensorImpl());
      add(static_cast<int32_t>(i), elem, m, next--, static_cast<int64_t>(t.storage().nbytes()));
    };
    if (args[i].isList()) {
      auto l = args[i].toList();
      for (size_t e = 0; e < l.size(); ++e) host(l.get(e), static_cast<int32_t>(e));
    } else {
      host(args[i], -1);
    }
  }
  for (const ArgRewrite& rw : pn.rewrites) {
    int64_t v = rw.kind == ArgRewrite::kRows ? rw.base + rw.scale * rows
        : rw.kind == ArgRewrite::kEnd        ? rw.base + rw.scale * rows
                                             : rw.base;
    if (rw.elem < 0) {
      args[rw.arg] = c10::IValue(v);
    } else {
      args[rw.arg].toList().set(rw.elem, c10::IValue(v));
    }
  }
  auto out = meta_probe(pn.op, args, ts);
  if (!out) return "its meta kernel refuses a chunk's shapes";
  for (size_t j = 0; j < n.defs.size(); ++j) {
    const Def& d = n.defs[j];
    const Bound& bd = pn.defs[j];
    if (bd.bind == Bind::kDiscard) continue;
    TensorMeta want = d.ref.meta;
    if (bd.bind == Bind::kLocal) want = localize(d.ref.meta, st.slots[bd.slot].layout, rows);
    if (bd.bind == Bind::kNarrow) {
      want = bd.outer != 1 ? gathered_rows(d.ref.meta, bd.dim, bd.unit, bd.outer, rows)
                           : narrow_rows(d.ref.meta, bd.dim, bd.unit, 0, rows);
    }
    const ProbeOutput::Item* got = out->find(d.ret, d.elem);
    if (!got || got->dtype != want.dtype || !c10::IntArrayRef(got->sizes).equals(want.sizes)) {
      if (pn.placeholder_outputs && got && (got->sizes.empty() || want.numel() == 0)) continue;
      return "on a chunk's shapes its meta kernel gives other outputs than its rule says";
    }
  }
  return "";
}

std::unordered_map<const Node*, std::string> probe_plan(const Plan& plan,
                                                       const std::function<int32_t(const LazyBuffer*)>& storage_of) {
  std::unordered_map<const Node*, std::string> bad;
  for (const Stage& st : plan.stages) {
    if (!st.loop) continue;
    std::vector<int64_t> sizes{st.chunk};
    const int64_t last = st.batch - (st.chunks() - 1) * st.chunk;
    if (last != st.chunk) sizes.push_back(last);
    for (const PlannedNode& pn : st.nodes) {
      for (int64_t rows : sizes) {
        std::string why = probe_chunk(st, pn, rows, storage_of);
        if (!why.empty()) {
          bad.emplace(pn.node, why);
          break;
        }
      }
    }
  }
  return bad;
}

} // namespace lazymem
