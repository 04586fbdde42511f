// plan: measured node and copy times.
#include "plan/timing.h"

#include <algorithm>
#include <atomic>
#include <mutex>
#include <unordered_map>

#include "core/config.h"
#include "plan/plan.h"
#include "plan/workspace.h"

namespace lazymem {
namespace {

struct Times {
  std::mutex mu;
  std::unordered_map<uint64_t, double> ns_per_row; // the latest runs weigh most (halved each run)
};

Times& times() {
  static Times* t = new Times();
  return *t;
}

std::atomic<double> g_copy_s_per_byte{0.0}; // 0: nothing measured

} // namespace

uint64_t node_time_key(const PlannedNode& pn) {
  if (pn.time_key == 0) pn.time_key = workspace_key(pn) | 1; // (0: not computed yet)
  return pn.time_key;
}

void observe_node_time(uint64_t key, int64_t rows, int64_t ns) {
  const double v = static_cast<double>(ns) / static_cast<double>(std::max<int64_t>(rows, 1));
  Times& t = times();
  std::lock_guard<std::mutex> lock(t.mu);
  auto [it, fresh] = t.ns_per_row.try_emplace(key, v); // (no node allocated when the key is known)
  if (!fresh) it->second = 0.5 * (it->second + v);
}

std::optional<double> node_ns_per_row(uint64_t key) {
  Times& t = times();
  std::lock_guard<std::mutex> lock(t.mu);
  auto it = t.ns_per_row.find(key);
  if (it == t.ns_per_row.end()) return std::nullopt;
  return it->second;
}

void clear_node_times() {
  Times& t = times();
  std::lock_guard<std::mutex> lock(t.mu);
  t.ns_per_row.clear();
}

void observe_copy(int64_t bytes, double seconds) {
  // Small copies measure their overheads, not the link: at 25 GB/s a MiB takes 42 us, about what a
  // copy's fixed costs (a launch, a wait, a first touch of the pages) come to.
  if (bytes < kLearnedCopyBytes) return;
  const double v = seconds / static_cast<double>(bytes);
  double old = g_copy_s_per_byte.load(std::memory_order_relaxed);
  g_copy_s_per_byte.store(old > 0 ? 0.5 * (old + v) : v, std::memory_order_relaxed);
}

void clear_copy_times() {
  g_copy_s_per_byte.store(0.0, std::memory_order_relaxed);
}

double predicted_copy_seconds(int64_t bytes) {
  const double link = config().link_bandwidth.load(std::memory_order_relaxed);
  double per_byte = link > 0 ? 1.0 / link : 1.0 / 25e9;
  per_byte = std::max(per_byte, g_copy_s_per_byte.load(std::memory_order_relaxed));
  return per_byte * static_cast<double>(bytes);
}

} // namespace lazymem
