// plan: stages — whole stages (even numbers: nodes run once) and chunk loops (odd numbers: passes
// over the batch) — by dependence (batch_split_theory.md §5.3). A value produced in a loop is
// usable row by row in that loop; whole (finished partials, gathered batch-sharded values) only
// from the next stage on. Readers of a version run no later than the writer of the next one, and a
// loop that writes rows of a buffer runs after any loop that reads it whole. Stages are as late as
// dependence allows (ALAP): a forward runs in the same loop as the backward that reads its
// activations, while cheap values a later loop needs finished (the targets' total weight) run in
// an earlier pass.
#include "plan/analysis.h"

#include <algorithm>
#include <unordered_map>

namespace lazymem {
namespace {

struct Edge {
  int32_t from;
  int32_t to;
  int32_t gap;     // stage(to) >= stage(from) + gap
  bool partial;    // a partial read: the same loop
};

uint64_t key(int32_t buf, uint32_t version) {
  return (static_cast<uint64_t>(static_cast<uint32_t>(buf)) << 32) | version;
}

std::vector<Edge> edges(const Analysis& a) {
  std::unordered_map<uint64_t, int32_t> producer;
  std::unordered_map<uint64_t, std::vector<std::pair<int32_t, bool>>> readers; // (node, reads whole)
  std::vector<Edge> out;
  for (int32_t v : a.order) {
    const NodeInfo& ni = a.nodes[v];
    const Node& n = *ni.node;
    for (size_t k = 0; k < n.uses.size(); ++k) {
      const Use& u = n.uses[k];
      const uint64_t kv = key(ni.use_buf[k], u.ref.version);
      const Mode m = ni.rr.ins[k].mode;
      if (!u.full_overwrite()) {
        auto it = producer.find(kv);
        if (it != producer.end()) {
          const NodeInfo& p = a.nodes[it->second];
          // A partial value read as anything but a partial needs it finished: the next stage.
          const bool finished = m != Mode::kPartial && a.reads_partial(ni, k);
          int32_t gap = 0;
          if (p.loop && ni.loop) {
            gap = m == Mode::kWhole || finished ? 2 : 0;
          } else if (p.loop != ni.loop) {
            gap = 1;
          }
          out.push_back(Edge{it->second, v, gap, m == Mode::kPartial});
        }
        readers[kv].emplace_back(v, m == Mode::kWhole);
      }
      if (u.write) {
        // Readers of the version this write replaces run no later; one that reads it whole in a loop
        // runs in an earlier stage than a loop that writes its rows.
        for (auto [r, whole] : readers[kv]) {
          if (r != v) out.push_back(Edge{r, v, whole && a.nodes[r].loop && ni.loop ? 1 : 0, false});
        }
        auto prev = producer.find(kv);
        if (prev != producer.end() && prev->second != v) out.push_back(Edge{prev->second, v, 0, false});
        producer[key(ni.use_buf[k], u.write_version)] = v;
      }
    }
    for (size_t j = 0; j < n.defs.size(); ++j) {
      if (ni.discard[j]) continue;
      producer[key(ni.def_buf[j], n.defs[j].ref.version)] = v;
    }
    // A partial finished by dividing by another partial (NLL's total weight): that one is finished
    // by the same loop's end at the latest.
    for (size_t j = 0; j < ni.rr.finalize.size(); ++j) {
      const Finalize& f = ni.rr.finalize[j];
      if (f.kind != Finalize::kDivOutput) continue;
      auto it = producer.find(key(ni.def_buf[f.output], n.defs[f.output].ref.version));
      if (it != producer.end() && it->second != v) out.push_back(Edge{it->second, v, 0, false});
    }
  }
  // Random nodes draw from their generator in program order (DESIGN.md §7 RNG). One whose draws can
  // be taken ahead of it (a stream, a row-keyed seed: execute/streams.cpp) has them taken when a
  // later one draws first; one that can only draw by running (its draws depend on its inputs'
  // values) is a fence: every node drawing after it from the same generator runs no earlier.
  std::unordered_map<const c10::GeneratorImpl*, int32_t> fence;
  for (int32_t v : a.order) {
    const NodeInfo& ni = a.nodes[v];
    const Node& n = *ni.node;
    if (!n.random || n.drawn || !rng_form_draws(n.rng_form) || ni.rr.no_draws) continue;
    auto it = fence.find(n.generator.get());
    if (it != fence.end()) out.push_back(Edge{it->second, v, 0, false});
    if (!rng_form_streams(n.rng_form)) fence[n.generator.get()] = v;
  }
  return out;
}

// Stages cycle through kinds: 0 whole, then one loop kind per batch (stage_kind in analysis.h).
// The first stage at or after `s` (at or before) of kind `k`.
int32_t kind_up(int32_t s, int32_t k, int32_t kinds) {
  const int32_t d = ((k - s % kinds) % kinds + kinds) % kinds;
  return s + d;
}

int32_t kind_down(int32_t s, int32_t k, int32_t kinds) {
  const int32_t d = (((s % kinds) - k) % kinds + kinds) % kinds;
  return s - d;
}

} // namespace

int32_t stage_kinds(const Analysis& a) {
  return static_cast<int32_t>(a.loop_batches.size()) + 1;
}

int32_t stage_batch(const Analysis& a, int32_t stage) {
  const int32_t k = stage % stage_kinds(a);
  return k == 0 ? -1 : a.loop_batches[k - 1];
}

int32_t assign_stages(Analysis& a) {
  // The batches loops run over, in order of first appearance: each a stage kind.
  a.loop_batches.clear();
  std::unordered_map<int32_t, int32_t> kind_of;
  for (int32_t v : a.order) {
    const NodeInfo& ni = a.nodes[v];
    if (!ni.loop) continue;
    const int32_t c = a.find(std::max(ni.batch, 0));
    if (kind_of.emplace(c, static_cast<int32_t>(a.loop_batches.size()) + 1).second) a.loop_batches.push_back(c);
  }
  const int32_t kinds = stage_kinds(a);
  auto kind = [&](int32_t v) {
    const NodeInfo& ni = a.nodes[v];
    return ni.loop ? kind_of.at(a.find(std::max(ni.batch, 0))) : 0;
  };
  auto parity_up = [&](int32_t s, int32_t v) { return kind_up(s, kind(v), kinds); };
  auto parity_down = [&](int32_t s, int32_t v) { return kind_down(s, kind(v), kinds); };
  std::vector<Edge> es = edges(a);
  std::unordered_map<int32_t, std::vector<const Edge*>> in, out;
  for (const Edge& e : es) {
    in[e.to].push_back(&e);
    out[e.from].push_back(&e);
  }
  // An edge with a gap needs `to` in a later stage than `from` (a finished value, a whole read of a
  // loop's rows); without one, the same stage will do.
  std::unordered_map<int32_t, int32_t> asap;
  int32_t last = 0;
  for (int32_t v : a.order) {
    int32_t s = 0;
    for (const Edge* e : in[v]) s = std::max(s, asap[e->from] + (e->gap > 0 ? 1 : 0));
    s = parity_up(s, v);
    asap[v] = s;
    last = std::max(last, s);
  }
  std::unordered_map<int32_t, int32_t> alap;
  for (auto it = a.order.rbegin(); it != a.order.rend(); ++it) {
    const int32_t v = *it;
    int32_t s = parity_down(last, v);
    for (const Edge* e : out[v]) s = std::min(s, alap[e->to] - (e->gap > 0 ? 1 : 0));
    alap[v] = std::max(parity_down(s, v), asap[v]);
  }
  auto partial_ok = [&](const std::unordered_map<int32_t, int32_t>& st) {
    for (const Edge& e : es) {
      if (e.partial && st.at(e.from) != st.at(e.to)) return false;
    }
    return true;
  };
  const std::unordered_map<int32_t, int32_t>* chosen = &alap;
  if (!partial_ok(alap)) chosen = &asap;
  if (!partial_ok(*chosen)) {
    // The readers that dependence pushes past their partial's loop: read it finished instead.
    a.crossing.clear();
    for (const Edge& e : es) {
      if (e.partial && chosen->at(e.from) != chosen->at(e.to)) a.crossing.push_back(a.nodes[e.to].node);
    }
    a.notes.push_back("a partial value would have to cross a pass over the batch");
    return -1;
  }
  for (int32_t v : a.order) a.nodes[v].stage = chosen->at(v);
  return last + 1;
}

} // namespace lazymem
