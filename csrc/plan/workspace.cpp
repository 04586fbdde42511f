// plan: the learned workspace table.
#include "plan/workspace.h"

#include <algorithm>
#include <cstdlib>
#include <c10/util/hash.h>

namespace lazymem {
namespace {

struct Hasher {
  uint64_t h = 1469598103934665603ull;
  void add(uint64_t x) {
    h = c10::hash_combine(h, x);
  }
  // A view's geometry; the batch dim's size (which changes with the chunk) is left out.
  void meta(const TensorMeta& m, int64_t batch_dim) {
    add(static_cast<uint64_t>(m.dtype) * 131 + m.sizes.size());
    for (size_t k = 0; k < m.sizes.size(); ++k) {
      add(static_cast<int64_t>(k) == batch_dim ? ~0ull : static_cast<uint64_t>(m.sizes[k]));
      add(static_cast<uint64_t>(m.strides[k]));
    }
  }
  void value(const c10::IValue& v) {
    if (v.isInt()) {
      add(static_cast<uint64_t>(v.toInt()));
    } else if (v.isDouble()) {
      // A floating-point scalar's value is left out: no kernel's transient memory depends on it (the
      // outputs' geometry is hashed apart), and an optimizer's step size, a scheduler's learning
      // rate or a bias correction changes every step. With it, every step learned a "new" key, the
      // workspace generation moved and no step's plan was ever reused.
      add(0x9e3779b97f4a7c15ull); // (a tag no small integer matches)
    } else if (v.isBool()) {
      add(v.toBool() ? 3 : 5);
    } else if (v.isIntList()) {
      for (int64_t x : v.toIntList()) add(static_cast<uint64_t>(x));
    } else if (v.isNone()) {
      add(7);
    } else if (v.isTensor()) {
      const at::Tensor& t = v.toTensor();
      if (t.defined()) {
        for (int64_t x : t.sizes()) add(static_cast<uint64_t>(x));
      }
    }
  }
};

} // namespace

Workspace& Workspace::get() {
  static Workspace* w = new Workspace();
  return *w;
}

bool Workspace::known_op(const c10::FunctionSchema* op) const {
  std::lock_guard<std::mutex> lock(mu_);
  return ops_.count(op) > 0;
}

bool Workspace::observe(uint64_t key, const c10::FunctionSchema* op, int64_t rows, int64_t bytes, Kind kind) {
  std::lock_guard<std::mutex> lock(mu_);
  ops_.insert(op);
  Seen& s = seen_[key];
  const bool bound = kind == kBound;
  int completed = 0;
  for (int i = 0; i < s.n; ++i) completed += s.kind[i] != kBound;
  for (int i = 0; i < s.n; ++i) {
    if (s.rows[i] != rows) continue;
    if (kind == kMeasured && s.kind[i] == kEstimate) { // a measurement replaces an estimate
      if (bytes == s.bytes[i]) {
        s.kind[i] = kMeasured;
        return false;
      }
      s.bytes[i] = bytes;
      s.kind[i] = kMeasured;
      generation_.fetch_add(1, std::memory_order_relaxed);
      return true;
    }
    // A completed run where only a bound was known anchors the line even if it needed less.
    const bool anchors = !bound && s.kind[i] == kBound;
    if (bytes <= s.bytes[i] && !anchors) return false;
    s.bytes[i] = std::max(bytes, s.bytes[i]);
    if (s.kind[i] == kBound) s.kind[i] = kind;
    generation_.fetch_add(1, std::memory_order_relaxed);
    return true;
  }
  // Below the line, an observation teaches nothing, except one of the first two completed runs.
  const Affine a = line(s);
  if (s.n > 0 && bytes <= a.alpha + a.beta * rows && (bound || completed >= 2)) return false;
  int at = s.n;
  if (s.n == kPoints) {
    // Full: the new point replaces the one nearest to it in rows (the least information lost).
    at = 0;
    for (int i = 1; i < s.n; ++i) {
      if (std::abs(s.rows[i] - rows) < std::abs(s.rows[at] - rows)) at = i;
    }
  } else {
    ++s.n;
  }
  s.rows[at] = rows;
  s.bytes[at] = bytes;
  s.kind[at] = kind;
  generation_.fetch_add(1, std::memory_order_relaxed);
  return true;
}

Workspace::Affine Workspace::line(const Seen& s) {
  auto ceil_div = [](int64_t a, int64_t b) { return a <= 0 ? int64_t{0} : (a + b - 1) / b; };
  if (s.n == 0) return {};
  // The anchor: the completed run of fewest rows once two runs completed, else the origin (one
  // run, or only bounds: a workspace that scales with the rows).
  int anchor = -1, completed = 0;
  for (int i = 0; i < s.n; ++i) {
    if (s.kind[i] == kBound) continue;
    ++completed;
    if (anchor < 0 || s.rows[i] < s.rows[anchor]) anchor = i;
  }
  if (completed == 1 && s.rows[anchor] > 0) anchor = -1;
  const int64_t r0 = anchor < 0 ? 0 : s.rows[anchor], b0 = anchor < 0 ? 0 : s.bytes[anchor];
  int64_t beta = 0;
  for (int i = 0; i < s.n; ++i) {
    if (s.rows[i] > r0) beta = std::max(beta, ceil_div(s.bytes[i] - b0, s.rows[i] - r0));
  }
  int64_t alpha = 0;
  for (int i = 0; i < s.n; ++i) alpha = std::max(alpha, s.bytes[i] - beta * s.rows[i]);
  return {alpha, beta};
}

Workspace::Affine Workspace::predict(uint64_t key) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = seen_.find(key);
  return it == seen_.end() ? Affine{} : line(it->second);
}

bool Workspace::knows(uint64_t key) const {
  std::lock_guard<std::mutex> lock(mu_);
  return seen_.count(key) > 0;
}

void Workspace::clear() {
  std::lock_guard<std::mutex> lock(mu_);
  seen_.clear();
  ops_.clear();
  generation_.fetch_add(1, std::memory_order_relaxed);
}

size_t Workspace::size() const {
  std::lock_guard<std::mutex> lock(mu_);
  return seen_.size();
}

uint64_t workspace_key(const PlannedNode& pn) {
  const Node& n = *pn.node;
  Hasher h;
  h.add(reinterpret_cast<uintptr_t>(&pn.op.schema()));
  for (size_t i = 0; i < n.uses.size(); ++i) {
    int64_t bd = i < pn.uses.size() && pn.uses[i].bind != Bind::kWhole ? pn.uses[i].dim : -1;
    h.meta(n.uses[i].ref.meta, bd);
  }
  for (size_t i = 0; i < n.defs.size(); ++i) {
    int64_t bd = i < pn.defs.size() && pn.defs[i].bind != Bind::kWhole ? pn.defs[i].dim : -1;
    h.meta(n.defs[i].ref.meta, bd);
  }
  for (const c10::IValue& v : n.args) h.value(v);
  h.add(pn.rewrites.size());
  return h.h;
}

} // namespace lazymem
