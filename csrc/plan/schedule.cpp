// plan: dead-code elimination and buffer liveness for one segment.
#include "plan/schedule.h"

#include <sstream>
#include <unordered_map>
#include <unordered_set>

namespace lazymem {
namespace {

// Needed versions per buffer: small sets, usually one or two entries.
class NeedSet {
 public:
  void add(const LazyBuffer* b, uint32_t v) {
    if (v == 0) return; // version 0 is the uninitialized allocation: nothing computes it
    auto& vs = need_[b];
    for (uint32_t x : vs) {
      if (x == v) return;
    }
    vs.push_back(v);
  }
  bool has(const LazyBuffer* b, uint32_t v) const {
    auto it = need_.find(b);
    if (it == need_.end()) return false;
    for (uint32_t x : it->second) {
      if (x == v) return true;
    }
    return false;
  }

 private:
  std::unordered_map<const LazyBuffer*, c10::SmallVector<uint32_t, 2>> need_;
};

} // namespace

Schedule plan_segment(const std::vector<const Node*>& nodes,
                      const std::function<bool(const LazyBuffer&)>& live_out) {
  Schedule s;
  const int32_t n = static_cast<int32_t>(nodes.size());

  // The last version each buffer reaches inside the segment.
  std::unordered_map<const LazyBuffer*, uint32_t> last_version;
  for (const Node* node : nodes) {
    for (const auto& d : node->defs) last_version[d.ref.buf.get()] = d.ref.version;
    for (const auto& u : node->uses) {
      if (u.write) {
        auto& v = last_version[u.ref.buf.get()];
        v = std::max(v, u.write_version);
      }
    }
  }
  NeedSet need;
  std::unordered_set<const LazyBuffer*> kept;
  for (const auto& [buf, v] : last_version) {
    if (live_out(*buf)) {
      need.add(buf, v);
      kept.insert(buf);
    }
  }

  // Backward pass: a node runs if it produces a needed version (or must run for its effect).
  std::vector<char> runs(n, 0);
  for (int32_t i = n - 1; i >= 0; --i) {
    const Node* node = nodes[i];
    bool needed = node->random || node->effectful;
    for (const auto& d : node->defs) needed = needed || need.has(d.ref.buf.get(), d.ref.version);
    for (const auto& u : node->uses) needed = needed || (u.write && need.has(u.ref.buf.get(), u.write_version));
    if (!needed) continue;
    runs[i] = 1;
    for (const auto& u : node->uses) {
      // A read needs the version it reads; a partial write needs the rest of the buffer's old value.
      bool full_overwrite = u.write && u.write_only && u.ref.meta.covers(u.ref.buf->nbytes.load());
      if (!full_overwrite) need.add(u.ref.buf.get(), u.ref.version);
    }
  }

  // Forward pass: the run list and each buffer's last use among executed nodes.
  std::unordered_map<LazyBuffer*, int32_t> last_use;
  std::unordered_set<LazyBuffer*> mentioned;
  for (int32_t i = 0; i < n; ++i) {
    const Node* node = nodes[i];
    for (const auto& d : node->defs) mentioned.insert(d.ref.buf.get());
    for (const auto& u : node->uses) mentioned.insert(u.ref.buf.get());
    if (!runs[i]) {
      ++s.eliminated;
      continue;
    }
    int32_t pos = static_cast<int32_t>(s.run.size());
    s.run.push_back(i);
    for (const auto& d : node->defs) last_use[d.ref.buf.get()] = pos;
    for (const auto& u : node->uses) last_use[u.ref.buf.get()] = pos;
  }
  s.release.resize(s.run.size());
  for (const auto& [buf, pos] : last_use) {
    if (!kept.count(buf) && !live_out(*buf)) s.release[pos].push_back(buf);
  }
  for (LazyBuffer* buf : mentioned) {
    if (!last_use.count(buf) && !live_out(*buf)) s.release_unused.push_back(buf);
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
