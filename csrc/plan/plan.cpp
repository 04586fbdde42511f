// plan: the Plan value — batch ids, each whole stage's releases, and the text form explain() prints.
#include "plan/plan.h"

#include <algorithm>
#include <atomic>
#include <sstream>

#include "core/config.h"
#include "ops/op_rules.h"

namespace lazymem {

uint64_t new_batch_id() {
  static std::atomic<uint64_t> next{0};
  return next.fetch_add(1, std::memory_order_relaxed) + 1;
}

void Stage::set_released(const std::vector<std::pair<size_t, LazyBuffer*>>& after) {
  std::vector<uint32_t> end(nodes.size() + 1, 0); // counts, then each node's begin
  for (const auto& a : after) ++end[a.first + 1];
  for (size_t p = 0; p < nodes.size(); ++p) {
    end[p + 1] += end[p];
    nodes[p].release_begin = nodes[p].release_end = end[p];
  }
  released.assign(after.size(), nullptr);
  for (const auto& a : after) released[nodes[a.first].release_end++] = a.second;
}

namespace {

const char* bind_name(Bind b) {
  switch (b) {
    case Bind::kWhole:
      return "whole";
    case Bind::kLocal:
      return "rows";
    case Bind::kNarrow:
      return "rows of full";
    case Bind::kPartial:
      return "partial";
    case Bind::kDiscard:
      return "dropped";
  }
  return "?";
}

std::string node_line(const PlannedNode& pn) {
  std::ostringstream os;
  const Node& n = *pn.node;
  os << "#" << n.seq << " " << pn.op.operator_name().name;
  if (!pn.op.operator_name().overload_name.empty()) os << "." << pn.op.operator_name().overload_name;
  os << "(";
  for (size_t i = 0; i < n.uses.size(); ++i) {
    os << (i ? ", " : "") << "b" << n.uses[i].ref.buf->id << (n.uses[i].write ? "!" : "");
    if (!pn.uses.empty() && pn.uses[i].bind != Bind::kWhole) os << ":" << bind_name(pn.uses[i].bind);
  }
  os << ")";
  if (!n.defs.empty()) {
    os << " -> ";
    for (size_t j = 0; j < n.defs.size(); ++j) {
      os << (j ? ", " : "") << "b" << n.defs[j].ref.buf->id;
      if (!pn.defs.empty() && pn.defs[j].bind != Bind::kWhole) os << ":" << bind_name(pn.defs[j].bind);
    }
  }
  if (pn.recompute) os << " [recomputed]";
  if (pn.rng_stream) os << " [random: eager's draws, generated whole once, rows read per chunk]";
  if (pn.rng_block) os << " [random, rows keyed in blocks of " << pn.rng_block << "]";
  if (!pn.rewrites.empty()) os << " [" << pn.rewrites.size() << " args per chunk]";
  if (pn.op != n.op) os << " [runs as " << pn.op.operator_name().name << "]";
  return os.str();
}

} // namespace

std::string Plan::to_string(bool nodes) const {
  std::ostringstream os;
  os << (split ? "split" : "unsplit") << " plan: " << executed_nodes << " nodes run, " << eliminated
     << " eliminated";
  if (!retained.empty()) os << ", " << retained.size() << " kept pending";
  os << "; predicted peak " << format_bytes(predicted_peak);
  if (budget >= 0) os << " of a " << format_bytes(budget) << " budget";
  if (reused) os << " (reused: the program has the structure of an earlier one)";
  os << "\n";
  for (const std::string& n : notes) os << "  " << n << "\n";
  if (!facts.empty()) {
    int64_t bytes = 0;
    for (const BatchFact& f : facts) bytes += static_cast<int64_t>(f.buf->nbytes.load());
    os << "  " << facts.size() << (facts.size() == 1 ? " value keeps its" : " values keep their") << " batch for later plans ("
       << format_bytes(bytes) << "), read chunk by chunk\n";
  }
  for (size_t i = 0; i < stages.size(); ++i) {
    const Stage& st = stages[i];
    if (!st.loop) {
      os << "  stage " << i << ": " << st.nodes.size() << " nodes run once\n";
    } else {
      os << "  stage " << i << ": pass over " << st.batch << " rows";
      if (st.batch_id != 0) os << " of batch " << st.batch_id;
      os << " in " << st.chunks() << " chunks of " << st.chunk
         << ", " << st.nodes.size() << " nodes\n";
      // Chunk-local values: every one with `nodes`, else the largest and a total.
      std::vector<const Slot*> local, partial;
      int64_t per_chunk = 0;
      for (const Slot& sl : st.slots) {
        if (sl.store == Store::kLocal) {
          local.push_back(&sl);
          per_chunk += sl.layout.bytes(st.chunk);
        } else {
          if (sl.acc >= 0) partial.push_back(&sl); // (partials never finished stay chunk-local)
        }
      }
      std::sort(local.begin(), local.end(), [&](const Slot* a, const Slot* b) {
        return a->layout.bytes(st.chunk) > b->layout.bytes(st.chunk);
      });
      const size_t show = nodes ? local.size() : std::min<size_t>(local.size(), 3);
      if (!local.empty()) {
        os << "    " << local.size() << " batch-sharded values chunk-local, " << format_bytes(per_chunk)
           << " per chunk if all were live; largest:";
        for (size_t k = 0; k < show; ++k) {
          os << (k ? "," : "") << " b" << local[k]->buf->id << " " << format_bytes(local[k]->layout.bytes(st.chunk));
        }
        os << "\n";
      }
      int64_t acc_bytes = 0;
      for (const Slot* sl : partial) acc_bytes += sl->bytes;
      if (!partial.empty()) {
        os << "    " << partial.size() << " partials accumulated (" << format_bytes(acc_bytes) << ")";
        os << (nodes ? ":" : "") << "\n";
      }
      for (const Slot* sl : partial) {
        const Accumulator& a = st.accs[sl->acc];
        const bool finished = a.finalize != Finalize::kNone;
        if (!nodes && !finished) continue; // plain sums are listed at debug level 2
        os << "      b" << sl->buf->id << " P(" << reduce_name(a.reduce) << ") " << format_bytes(sl->bytes);
        if (a.finalize == Finalize::kDivConst) os << ", then divided by " << a.divisor;
        if (a.finalize == Finalize::kDivOutput) os << ", then divided by b" << a.divide_by->id;
        os << "\n";
      }
      for (const FullStore& f : st.stores) {
        os << "    b" << f.buf->id << " batch-sharded, assembled whole in " << (f.host ? "host memory" : "device memory")
           << ": " << format_bytes(static_cast<int64_t>(f.buf->nbytes.load())) << "\n";
      }
      if (!st.recomputed.empty()) {
        size_t again = 0;
        for (const PlannedNode& pn : st.nodes) again += pn.recompute;
        os << "    recomputed chunk by chunk from an earlier pass (" << again << (again == 1 ? " node" : " nodes")
           << " run again), not stored:";
        for (const LazyBuffer* b : st.recomputed) os << " b" << b->id << " " << format_bytes(static_cast<int64_t>(b->nbytes.load()));
        os << "\n";
      }
    }
    if (nodes) {
      for (const PlannedNode& pn : st.nodes) os << "      " << node_line(pn) << "\n";
    } else {
      // torch.distributed collectives (dist/collectives.cpp): where each runs, once, in record order,
      // and the bytes of the tensors it writes (not its ordering token).
      for (const PlannedNode& pn : st.nodes) {
        if (!op_rules(pn.op).collective) continue;
        const std::optional<int> token = pn.op.schema().argumentIndexWithName("token");
        int64_t bytes = 0;
        for (const Use& u : pn.node->uses) {
          if (u.write && u.arg != token.value_or(-1)) bytes += u.ref.meta.numel() * c10::elementSize(u.ref.meta.dtype);
        }
        const std::string& name = pn.op.operator_name().name; // lazymem::c10d_<collective>_
        os << "    collective: " << name.substr(14, name.size() - 15) << " (op #" << pn.node->seq
           << " of the recorded program, " << format_bytes(bytes) << "), once" << (st.loop ? " per chunk" : "") << "\n";
      }
    }
  }
  return os.str();
}

} // namespace lazymem
