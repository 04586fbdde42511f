// plan: meta probes of chunk shapes (see probe.h).
#include "plan/probe.h"

#include <algorithm>

#include "ops/meta_probe.h"
#include "plan/localize.h"

namespace lazymem {

namespace {

void add_tensor(std::vector<ProbeTensor>& ts, int32_t arg, int32_t elem, const TensorMeta& m, int32_t storage,
                int64_t bytes) {
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
}

std::vector<c10::IValue> copied_args(const Node& n) {
  std::vector<c10::IValue> args = n.args;
  for (auto& v : args) {
    if (v.isList()) v = c10::IValue(v.toList().copy());
  }
  return args;
}

} // namespace

ChunkCall whole_call_narrowed(const PlannedNode& pn, int64_t extent, int64_t rows,
                              const std::function<int32_t(const LazyBuffer*)>& storage_of) {
  const Node& n = *pn.node;
  ChunkCall call;
  call.rows = rows;
  int32_t next = -1;
  for (const Use& u : n.uses) {
    TensorMeta m = u.ref.meta;
    if (!m.sizes.empty() && m.sizes[0] == extent) {
      m.sizes[0] = rows;
      add_tensor(call.tensors, u.arg, u.elem, m, next--, static_cast<int64_t>(m.extent_bytes()));
    } else {
      add_tensor(call.tensors, u.arg, u.elem, m, storage_of(u.ref.buf.get()), static_cast<int64_t>(u.ref.buf->nbytes.load()));
    }
  }
  call.args = copied_args(n);
  return call;
}

ChunkCall chunk_call(const Stage& st, const PlannedNode& pn, int64_t c0, int64_t c1,
                     const std::function<int32_t(const LazyBuffer*)>& storage_of) {
  const Node& n = *pn.node;
  const auto [node_first, node_last] = pn.rows.local(c0, c1);
  const int64_t rows = node_last - node_first;
  ChunkCall call;
  call.rows = rows;
  call.first = node_first;
  if (rows == 0 && pn.row_node) return call; // it does not run in this chunk
  auto narrowed = [&](const TensorMeta& m, const Bound& bd) {
    const auto [first, last] = bd.map.local(c0, c1);
    return narrow_rows(m, bd.dim, bd.unit, first, last - first);
  };
  std::vector<ProbeTensor>& ts = call.tensors;
  auto add = [&](int32_t arg, int32_t elem, const TensorMeta& m, int32_t storage, int64_t bytes) {
    add_tensor(ts, arg, elem, m, storage, bytes);
  };
  int32_t next = -1; // storages of their own (host constants, gathered copies)
  for (size_t k = 0; k < n.uses.size(); ++k) {
    const Use& u = n.uses[k];
    const Bound& bd = pn.uses[k];
    const int32_t id = storage_of(u.ref.buf.get());
    switch (bd.bind) {
      case Bind::kLocal: {
        const RowLayout& l = st.slots[bd.slot].layout;
        const auto [first, last] = local_rows(l, c0, c1);
        add(u.arg, u.elem, localize(u.ref.meta, l, c0, c1), id, l.bytes(last - first));
        break;
      }
      case Bind::kNarrow:
        if (bd.outer != 1) { // a gathered copy of the buffer's rows in the chunk
          const auto [first, last] = bd.map.local(c0, c1);
          const TensorMeta g = gathered_rows(u.ref.meta, bd.dim, bd.unit, bd.outer, last - first);
          add(u.arg, u.elem, g, next--, static_cast<int64_t>(g.extent_bytes()));
          break;
        }
        add(u.arg, u.elem, narrowed(u.ref.meta, bd), id, static_cast<int64_t>(u.ref.buf->nbytes.load()));
        break;
      default:
        add(u.arg, u.elem, u.ref.meta, id, static_cast<int64_t>(u.ref.buf->nbytes.load()));
    }
  }
  call.args = copied_args(n);
  std::vector<c10::IValue>& args = call.args;
  for (size_t i = 0; i < args.size(); ++i) {
    auto host = [&](const c10::IValue& v, int32_t elem) {
      if (!v.isTensor() || !v.toTensor().defined() || v.toTensor().device().type() == c10::DeviceType::PrivateUse1) return;
      at::Tensor t = v.toTensor();
      int64_t outer = 1;
      int8_t dim = -1;
      int64_t unit = 1;
      for (const ConstNarrow& c : pn.consts) {
        if (c.arg != static_cast<int32_t>(i) || c.elem != elem) continue;
        if (c.outer > 1) {
          outer = c.outer, dim = c.dim, unit = c.unit;
        } else {
          t = t.narrow(c.dim, node_first * c.unit, rows * c.unit);
        }
      }
      TensorMeta m = TensorMeta::of(*t.unsafeGetTensorImpl());
      if (outer > 1) { // the gathered copy replay makes: its own contiguous storage
        m = gathered_rows(m, dim, unit, outer, rows);
        add(static_cast<int32_t>(i), elem, m, next--, static_cast<int64_t>(m.extent_bytes()));
        return;
      }
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
        : rw.kind == ArgRewrite::kStart      ? rw.base + rw.scale * node_first
        : rw.kind == ArgRewrite::kEnd        ? rw.base + rw.scale * node_last
                                             : rw.base;
    if (rw.elem < 0) {
      args[rw.arg] = c10::IValue(v);
    } else {
      args[rw.arg].toList().set(rw.elem, c10::IValue(v));
    }
  }
  return call;
}

bool meta_accepts(const PlannedNode& pn, const ChunkCall& call) {
  return meta_probe(pn.op, call.args, call.tensors).has_value();
}

std::string probe_chunk(const Stage& st, const PlannedNode& pn, int64_t c0, int64_t c1,
                        const std::function<int32_t(const LazyBuffer*)>& storage_of) {
  const Node& n = *pn.node;
  const ChunkCall call = chunk_call(st, pn, c0, c1, storage_of);
  if (call.rows == 0 && pn.row_node) return ""; // it does not run in this chunk
  auto narrowed = [&](const TensorMeta& m, const Bound& bd) {
    const auto [first, last] = bd.map.local(c0, c1);
    return narrow_rows(m, bd.dim, bd.unit, first, last - first);
  };
  auto out = meta_probe(pn.op, call.args, call.tensors);
  if (!out) return "its meta kernel refuses a chunk's shapes";
  for (size_t j = 0; j < n.defs.size(); ++j) {
    const Def& d = n.defs[j];
    const Bound& bd = pn.defs[j];
    if (bd.bind == Bind::kDiscard) continue;
    TensorMeta want = d.ref.meta;
    if (bd.bind == Bind::kLocal) want = localize(d.ref.meta, st.slots[bd.slot].layout, c0, c1);
    if (bd.bind == Bind::kNarrow) {
      const auto [first, last] = bd.map.local(c0, c1);
      want = bd.outer != 1 ? gathered_rows(d.ref.meta, bd.dim, bd.unit, bd.outer, last - first) : narrowed(d.ref.meta, bd);
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
    if (!st.loop || st.chunk <= 0) continue;
    auto chunk_at = [&](int64_t row) { // the chunk holding batch row `row`
      const int64_t c0 = row / st.chunk * st.chunk;
      return std::make_pair(c0, std::min(c0 + st.chunk, st.batch));
    };
    for (const PlannedNode& pn : st.nodes) {
      std::vector<std::pair<int64_t, int64_t>> chunks{chunk_at(0), chunk_at(st.batch - 1)};
      if (!pn.rows.identity()) {
        chunks.push_back(chunk_at(pn.rows.off));
        chunks.push_back(chunk_at(pn.rows.off + pn.rows.step * (pn.rows.n - 1)));
      }
      std::sort(chunks.begin(), chunks.end());
      chunks.erase(std::unique(chunks.begin(), chunks.end()), chunks.end());
      for (auto [c0, c1] : chunks) {
        std::string why = probe_chunk(st, pn, c0, c1, storage_of);
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
