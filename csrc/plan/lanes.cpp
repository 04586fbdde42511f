// plan: lane chains and their groups (see lanes.h).
#include "plan/lanes.h"

#include <algorithm>
#include <array>
#include <sstream>
#include <unordered_map>

namespace lazymem {
namespace {

constexpr size_t kMinLanes = 2;
constexpr size_t kMinRuns = 2;

// The buffers a node touches, and whether it writes each.
template <class F>
void each_buffer(const ProgramIndex& ix, size_t node, const Node& n, F&& f) {
  for (size_t k = 0; k < n.defs.size(); ++k) f(ix.def(node, k), true);
  for (size_t k = 0; k < n.uses.size(); ++k) f(ix.use(node, k), n.uses[k].write);
}

// Builds chains greedily from `start`: runs of one op over disjoint lanes, consecutive runs of the
// same length, nodes of no lane in between allowed when they touch no lane's buffer.
class Finder {
 public:
  Finder(const std::vector<const Node*>& nodes, const Schedule& s) : nodes_(nodes), s_(s) {}

  std::vector<LaneChain> find() {
    std::vector<LaneChain> out;
    size_t p = 0;
    while (p < s_.run.size()) {
      LaneChain c;
      if (chain_at(p, c)) {
        p = c.last;
        out.push_back(std::move(c));
      } else {
        ++p;
      }
    }
    return out;
  }

 private:
  const Node& node(size_t pos) const {
    return *nodes_[s_.run[pos]];
  }
  bool movable(const Node& n) const {
    return !n.random && !n.effectful && !n.upload;
  }
  // The length of the run of one op starting at `p` (1 if none).
  size_t run_length(size_t p) const {
    const Node& a = node(p);
    if (!movable(a)) return 1;
    size_t q = p + 1;
    while (q < s_.run.size() && node(q).op == a.op && movable(node(q))) ++q;
    return q - p;
  }

  bool chain_at(size_t p, LaneChain& c) {
    const size_t lanes = run_length(p);
    if (lanes < kMinLanes) return false;
    owner_.clear();
    written_.clear();
    c = LaneChain{};
    c.first = p;
    c.lanes = lanes;
    c.nodes.assign(lanes, {});
    size_t q = p;
    size_t runs = 0;
    std::vector<size_t> others;
    while (q < s_.run.size()) {
      const size_t len = run_length(q);
      if (len == lanes && fits_run(q, lanes)) {
        for (size_t k = 0; k < lanes; ++k) {
          take(q + k, static_cast<int32_t>(k));
          c.nodes[k].push_back(q + k);
        }
        ++runs;
        q += lanes;
        c.last = q;
        c.others.insert(c.others.end(), others.begin(), others.end());
        others.clear();
        continue;
      }
      // A node of no lane: allowed in between if it touches no lane's buffer and writes nothing a
      // lane reads (it then runs before the chain).
      if (runs == 0 || !movable(node(q)) || !independent(q)) break;
      others.push_back(q);
      ++q;
    }
    c.runs = runs;
    // (A node of no lane moves before the chain: when it ran, no lane had touched what it touches,
    // and what it writes no lane had read, so every lane's node that follows it still does.)
    return runs >= kMinRuns;
  }

  // Position k of the run at `q` touches only lane k's buffers (or buffers every lane only reads).
  bool fits_run(size_t q, size_t lanes) const {
    std::unordered_map<int32_t, int32_t> seen; // this run's buffers -> lane
    for (size_t k = 0; k < lanes; ++k) {
      bool ok = true;
      each_buffer(s_.index, s_.run[q + k], node(q + k), [&](int32_t b, bool w) {
        auto it = owner_.find(b);
        if (it != owner_.end() && it->second != static_cast<int32_t>(k) && (it->second >= 0 || w)) ok = false;
        if (it != owner_.end() && it->second < 0 && w) ok = false; // a shared read-only value written
        auto [s, inserted] = seen.emplace(b, static_cast<int32_t>(k));
        if (!inserted && s->second != static_cast<int32_t>(k) && (w || written_.count(b))) ok = false;
        if (!inserted && s->second != static_cast<int32_t>(k)) s->second = -1; // read by several lanes
      });
      if (!ok) return false;
    }
    // Buffers several positions of this run read must not be written by any lane.
    for (const auto& [b, k] : seen) {
      if (k < 0 && written_.count(b)) return false;
    }
    return true;
  }

  void take(size_t q, int32_t lane) {
    each_buffer(s_.index, s_.run[q], node(q), [&](int32_t b, bool w) {
      auto it = owner_.find(b);
      if (it == owner_.end()) {
        owner_.emplace(b, lane);
      } else if (it->second != lane) {
        it->second = -1; // read by several lanes: shared, read-only
      }
      if (w) written_.insert({b, lane});
    });
  }

  bool independent(size_t q) const {
    bool ok = true;
    each_buffer(s_.index, s_.run[q], node(q), [&](int32_t b, bool w) {
      auto it = owner_.find(b);
      if (it != owner_.end() && (it->second >= 0 || w)) ok = false;
    });
    return ok;
  }

  const std::vector<const Node*>& nodes_;
  const Schedule& s_;
  std::unordered_map<int32_t, int32_t> owner_;   // buffer -> lane (-1: read by several, never written)
  std::unordered_map<int32_t, int32_t> written_; // buffers a lane writes
};

} // namespace

std::vector<LaneChain> find_lane_chains(const std::vector<const Node*>& nodes, const Schedule& s) {
  return Finder(nodes, s).find();
}

void run_lanes_in_groups(Schedule& s, const std::vector<const Node*>& nodes, const std::vector<LaneChain>& chains,
                         size_t groups) {
  if (chains.empty() || groups <= 1) return;
  std::vector<int32_t> run;
  run.reserve(s.run.size());
  size_t p = 0;
  for (const LaneChain& c : chains) {
    for (; p < c.first; ++p) run.push_back(s.run[p]);
    for (size_t o : c.others) run.push_back(s.run[o]);
    const size_t g = std::min(groups, c.lanes);
    for (size_t group = 0; group < g; ++group) {
      const size_t lo = c.lanes * group / g, hi = c.lanes * (group + 1) / g;
      for (size_t r = 0; r < c.runs; ++r) {
        for (size_t k = lo; k < hi; ++k) run.push_back(s.run[c.nodes[k][r]]);
      }
    }
    p = c.last;
  }
  for (; p < s.run.size(); ++p) run.push_back(s.run[p]);
  s.run = std::move(run);
  // Releases after each buffer's last use in the new order.
  const size_t nb = s.index.size();
  std::vector<int32_t> last_use(nb, -1);
  for (size_t q = 0; q < s.run.size(); ++q) {
    const int32_t i = s.run[q];
    each_buffer(s.index, static_cast<size_t>(i), *nodes[i], [&](int32_t b, bool) { last_use[b] = static_cast<int32_t>(q); });
  }
  s.release.assign(s.run.size(), {});
  for (size_t b = 0; b < nb; ++b) {
    if (!s.live[b] && last_use[b] >= 0) s.release[last_use[b]].push_back(s.index.buffers[b]);
  }
}

std::string describe_lane_groups(const std::vector<LaneChain>& chains, size_t groups) {
  // Chains alike (an optimizer's per-tensor ops, one chain per parameter group) said once, counted.
  std::vector<std::pair<std::array<size_t, 3>, size_t>> kinds; // (runs, lanes, groups), how many
  for (const LaneChain& c : chains) {
    const std::array<size_t, 3> k{c.runs, c.lanes, std::min(groups, c.lanes)};
    auto it = std::find_if(kinds.begin(), kinds.end(), [&](const auto& e) { return e.first == k; });
    if (it == kinds.end()) {
      kinds.emplace_back(k, 1);
    } else {
      ++it->second;
    }
  }
  std::ostringstream os;
  for (size_t i = 0; i < kinds.size(); ++i) {
    const auto& [k, n] = kinds[i];
    os << (i ? "; " : "") << (n == 1 ? std::string("a chain") : std::to_string(n) + " chains") << " of " << k[0]
       << " per-tensor ops over " << k[1] << " tensors " << (n == 1 ? "runs" : "each run") << " in " << k[2]
       << " groups of tensors";
  }
  return os.str();
}

} // namespace lazymem
