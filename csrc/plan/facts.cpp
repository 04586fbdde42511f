// plan: batch facts of an unsplit plan. A program that fits runs whole, but what it leaves behind
// may be read by a later plan that does not fit: BERT's mask check syncs mid-forward and runs the
// embeddings whole; the rest of the step must still split along the batch they carry. So when a
// plan that runs whole has sources, the batch is solved for (plan/solve.cpp) as if it were to
// split, and each surviving value it writes that the solution makes batch-sharded gets a batch fact
// (LazyBuffer), which the next plan takes as a source read chunk by chunk. Only new plans pay for
// this: a reused plan carries its facts.
#include "plan/analysis.h"
#include "plan/schedule.h"

namespace lazymem {

void note_unsplit_facts(const std::vector<Node*>& nodes, const Schedule& s, const std::vector<LazyBuffer*>& needed,
                        Plan& plan) {
  // Nothing survives that a node here writes: nothing to tell.
  bool writes_live = false;
  for (int32_t i : s.run) {
    const Node& n = *nodes[i];
    if (n.upload) continue;
    for (size_t k = 0; k < n.defs.size() && !writes_live; ++k) writes_live = s.live[s.index.def(i, k)];
  }
  if (!writes_live) return;
  std::vector<LazyBuffer*> live;
  for (size_t b = 0; b < s.index.size(); ++b) {
    if (s.live[b]) live.push_back(s.index.buffers[b]);
  }
  Analysis a;
  if (!place_batch(a, nodes, s.run, live, needed)) return;
  std::vector<uint32_t> last(a.bufs.size(), 0);
  for (int32_t i : a.order) {
    const NodeInfo& ni = a.nodes[i];
    for (size_t j = 0; j < ni.node->defs.size(); ++j) last[ni.def_buf[j]] = ni.node->defs[j].ref.version;
    for (size_t k = 0; k < ni.node->uses.size(); ++k) {
      if (ni.node->uses[k].write) last[ni.use_buf[k]] = ni.node->uses[k].write_version;
    }
  }
  // Values that survive the plan, and the plan's own intermediates: an execution that stops part
  // way (out of memory, planned again from there) leaves those it stored for the rest, which must
  // still split by them (the executor records a fact only on a buffer holding its version).
  for (size_t b = 0; b < a.program_bufs; ++b) {
    const BufInfo& bi = a.bufs[b];
    if (!bi.place.is_s() || (last[b] == 0 && !(bi.live && bi.seed))) continue;
    const uint32_t version = last[b] > 0 ? last[b] : bi.buf->real_version;
    if (version == 0) continue;
    BatchClass& c = a.batches[a.find(bi.place.batch)];
    if (c.id == 0) c.id = new_batch_id();
    plan.facts.push_back(BatchFact{bi.buf, version, bi.layout, c.id});
  }
}

} // namespace lazymem
