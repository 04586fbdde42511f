// plan: the split plan's notes (explain()): the batches and passes, every source and the dim chosen,
// barriers and why, what stays pending, what is held in host memory or recomputed.
#include <algorithm>
#include <sstream>

#include "core/config.h"
#include "plan/analysis.h"

namespace lazymem {

void note_split(Plan& plan, const Analysis& a) {
  std::ostringstream os;
  int64_t loops = 0, chunks = 0;
  std::vector<std::pair<int32_t, int64_t>> batches; // (batch, rows) in order of first loop
  for (const Stage& st : plan.stages) {
    if (!st.loop || st.tensor_rows) continue;
    ++loops;
    chunks = std::max<int64_t>(chunks, st.chunks());
    bool seen = false;
    for (const auto& b : batches) seen = seen || b.first == st.batch_id;
    if (!seen) batches.emplace_back(st.batch_id, st.batch);
  }
  if (batches.size() <= 1) {
    os << "split along a batch of " << (batches.empty() ? a.batch : batches[0].second) << " rows: ";
  } else {
    os << "split along " << batches.size() << " batches (";
    for (size_t k = 0; k < batches.size(); ++k) {
      os << (k ? ", " : "") << "batch " << batches[k].first << ": " << batches[k].second << " rows";
    }
    os << "), each in its own loops: ";
  }
  os << loops << (loops == 1 ? " pass" : " passes") << ", up to " << chunks << " chunks";
  plan.notes.insert(plan.notes.begin(), os.str());
  plan.notes.insert(plan.notes.begin() + 1, a.source_notes.begin(), a.source_notes.end());
  for (int32_t i : a.order) {
    const NodeInfo& ni = a.nodes[i];
    if (!ni.barrier) continue;
    plan.notes.push_back("barrier: " + ni.node->describe() + " runs whole: " + (ni.rr.why ? ni.rr.why : "no rule"));
  }
  if (!plan.retained.empty()) {
    plan.notes.push_back(std::to_string(plan.retained.size()) +
                         " nodes stay pending: batch-sharded values that survive are recomputed chunk by chunk "
                         "when needed, not stored");
  }
  for (const Stage& st : plan.stages) {
    for (const FullStore& f : st.stores) {
      if (f.host) plan.notes.push_back("b" + std::to_string(f.buf->id) + " (" + format_bytes(f.buf->nbytes.load()) +
                                       ") is assembled in host memory: it does not fit the device budget");
    }
  }
  std::vector<const LazyBuffer*> recomputed;
  int64_t recomputed_bytes = 0;
  size_t again = 0;
  for (const Stage& st : plan.stages) {
    for (const PlannedNode& pn : st.nodes) again += pn.recompute;
    for (const LazyBuffer* b : st.recomputed) {
      if (std::find(recomputed.begin(), recomputed.end(), b) != recomputed.end()) continue;
      recomputed.push_back(b);
      recomputed_bytes += static_cast<int64_t>(b->nbytes.load());
    }
  }
  if (!recomputed.empty()) {
    plan.notes.push_back(std::to_string(recomputed.size()) + " values crossing passes (" + format_bytes(recomputed_bytes) +
                         ") are recomputed chunk by chunk in the passes that read them (" + std::to_string(again) +
                         " node runs) instead of stored");
  }
  // Random nodes in loops: eager's draws from streams generated whole, or keyed by rows.
  std::vector<const Node*> streamed, keyed;
  int64_t stream_bytes = 0;
  for (const Stage& st : plan.stages) {
    for (const PlannedNode& pn : st.nodes) {
      if (pn.rng_stream && std::find(streamed.begin(), streamed.end(), pn.node) == streamed.end()) {
        streamed.push_back(pn.node);
        stream_bytes += pn.rng_stream_bytes;
      }
      if (pn.rng_block && std::find(keyed.begin(), keyed.end(), pn.node) == keyed.end()) keyed.push_back(pn.node);
    }
  }
  if (!streamed.empty()) {
    plan.notes.push_back("random ops in loops drawing eager's numbers: " + std::to_string(streamed.size()) +
                         " (each one's draws generated whole once, in program order, in host memory: " +
                         format_bytes(stream_bytes) + "; every chunk reads its rows)");
  }
  if (!keyed.empty()) {
    plan.notes.push_back("random ops in loops drawing numbers keyed by batch row: " + std::to_string(keyed.size()) +
                         " (the same in any chunking, not eager's: their kernel on this backing device is not "
                         "reproduced from a stream)");
  }
  plan.barriers = a.barriers;
  plan.batch = a.batch;
}

} // namespace lazymem
