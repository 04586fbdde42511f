// plan: dead-code elimination and buffer liveness for one segment.
#include "plan/schedule.h"

#include <sstream>
#include <unordered_map>
#include <algorithm>

namespace lazymem {
namespace {

// Needed versions of one buffer: a small set, usually one or two entries.
struct Needs {
  c10::SmallVector<uint32_t, 2> versions;
  void add(uint32_t v) {
    if (v == 0) return; // version 0 is the uninitialized allocation: nothing computes it
    if (std::find(versions.begin(), versions.end(), v) == versions.end()) versions.push_back(v);
  }
  bool has(uint32_t v) const {
    return std::find(versions.begin(), versions.end(), v) != versions.end();
  }
};

} // namespace

ProgramIndex ProgramIndex::build(const std::vector<const Node*>& nodes) {
  ProgramIndex ix;
  const size_t n = nodes.size();
  std::unordered_map<const LazyBuffer*, int32_t> index;
  index.reserve(n * 2);
  ix.buffers.reserve(n * 2);
  auto of = [&](LazyBuffer* b) {
    auto [it, inserted] = index.emplace(b, static_cast<int32_t>(ix.buffers.size()));
    if (inserted) ix.buffers.push_back(b);
    return it->second;
  };
  ix.def_start.resize(n + 1);
  ix.use_start.resize(n + 1);
  for (size_t i = 0; i < n; ++i) {
    ix.def_start[i] = static_cast<int32_t>(ix.def_ix.size());
    ix.use_start[i] = static_cast<int32_t>(ix.use_ix.size());
    for (const auto& d : nodes[i]->defs) ix.def_ix.push_back(of(d.ref.buf.get()));
    for (const auto& u : nodes[i]->uses) ix.use_ix.push_back(of(u.ref.buf.get()));
  }
  ix.def_start[n] = static_cast<int32_t>(ix.def_ix.size());
  ix.use_start[n] = static_cast<int32_t>(ix.use_ix.size());
  return ix;
}

Schedule plan_segment(const std::vector<const Node*>& nodes,
                      const std::function<bool(const LazyBuffer&)>& live_out) {
  Schedule s;
  const int32_t n = static_cast<int32_t>(nodes.size());

  // Number every buffer once; remember each ref's index (defs first, then uses, per node).
  s.index = ProgramIndex::build(nodes);
  const ProgramIndex& index = s.index;
  const std::vector<int32_t>& def_ix = index.def_ix;
  const std::vector<int32_t>& use_ix = index.use_ix;
  const std::vector<int32_t>& def_start = index.def_start;
  const std::vector<int32_t>& use_start = index.use_start;
  const size_t nb = index.size();

  // The last version each buffer reaches inside the segment; live buffers need it.
  std::vector<uint32_t> last_version(nb, 0);
  for (int32_t i = 0; i < n; ++i) {
    const Node* node = nodes[i];
    for (size_t k = 0; k < node->defs.size(); ++k) {
      last_version[def_ix[def_start[i] + k]] = node->defs[k].ref.version;
    }
    for (size_t k = 0; k < node->uses.size(); ++k) {
      const Use& u = node->uses[k];
      uint32_t& v = last_version[use_ix[use_start[i] + k]];
      if (u.write) v = std::max(v, u.write_version);
    }
  }
  s.live.assign(nb, 0);
  std::vector<char>& live = s.live;
  std::vector<Needs> need(nb);
  for (size_t b = 0; b < nb; ++b) {
    live[b] = live_out(*index.buffers[b]) ? 1 : 0;
    if (live[b]) need[b].add(last_version[b]);
  }

  // Backward pass: a node runs if it produces a needed version (or must run for its effect).
  std::vector<char> runs(n, 0);
  for (int32_t i = n - 1; i >= 0; --i) {
    const Node* node = nodes[i];
    bool needed = node->random || node->effectful;
    for (size_t k = 0; k < node->defs.size() && !needed; ++k) {
      needed = need[def_ix[def_start[i] + k]].has(node->defs[k].ref.version);
    }
    for (size_t k = 0; k < node->uses.size() && !needed; ++k) {
      const Use& u = node->uses[k];
      needed = u.write && need[use_ix[use_start[i] + k]].has(u.write_version);
    }
    if (!needed) continue;
    runs[i] = 1;
    for (size_t k = 0; k < node->uses.size(); ++k) {
      const Use& u = node->uses[k];
      // A read needs the version it reads; a partial write needs the rest of the buffer's old value.
      if (!u.full_overwrite()) need[use_ix[use_start[i] + k]].add(u.ref.version);
    }
  }

  // Forward pass: the run list and each buffer's last use among executed nodes.
  std::vector<int32_t> last_use(nb, -1);
  for (int32_t i = 0; i < n; ++i) {
    if (!runs[i]) {
      ++s.eliminated;
      continue;
    }
    int32_t pos = static_cast<int32_t>(s.run.size());
    s.run.push_back(i);
    for (int32_t k = def_start[i]; k < def_start[i + 1]; ++k) last_use[def_ix[k]] = pos;
    for (int32_t k = use_start[i]; k < use_start[i + 1]; ++k) last_use[use_ix[k]] = pos;
  }
  s.release.resize(s.run.size());
  for (size_t b = 0; b < nb; ++b) {
    if (live[b]) continue;
    if (last_use[b] >= 0) {
      s.release[last_use[b]].push_back(index.buffers[b]);
    } else {
      s.release_unused.push_back(index.buffers[b]);
    }
  }
  return s;
}

std::string Schedule::to_string(const std::vector<const Node*>& nodes) const {
  std::ostringstream os;
  os << "Schedule: " << run.size() << " nodes run, " << eliminated << " eliminated\n";
  for (size_t p = 0; p < run.size(); ++p) {
    os << "  " << nodes[run[p]]->to_string();
    if (!release[p].empty()) {
      os << "  ; free";
      for (const LazyBuffer* b : release[p]) os << " b" << b->id;
    }
    os << "\n";
  }
  return os.str();
}

} // namespace lazymem
