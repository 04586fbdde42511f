// plan: measured compute time per node, for the planner's choices that trade compute for copies
// (recomputing a value crossing passes against holding it in host memory). The executor times each
// node run; the planner reads the time per batch row of the same op on the same shapes and
// bindings (workspace_key), so a plan made once a step has run prices its choices with measured
// times. Bytes per second of copies across the host/device boundary come from the modeled link
// and the copies measured so far (execute/transfer.h).
#pragma once

#include <cstdint>
#include <optional>

namespace lazymem {

struct PlannedNode;

// The key a planned node's times are kept under (its workspace_key: op, shapes, bindings, args),
// computed once per planned node.
uint64_t node_time_key(const PlannedNode& pn);
// A run of the node keyed `key` took `ns` for `rows` batch rows (1 for a whole node).
void observe_node_time(uint64_t key, int64_t rows, int64_t ns);
// Nanoseconds per batch row of the node keyed `key` (nullopt: never run).
std::optional<double> node_ns_per_row(uint64_t key);
// Drops what was measured (tests).
void clear_node_times();

// Seconds a copy of `bytes` across the boundary is expected to take each way: the modeled link's
// time, or (off the simulated device, or faster than it) the copies measured so far; 25 GB/s when
// nothing is known.
double predicted_copy_seconds(int64_t bytes);
// A copy of `bytes` took `seconds` (memcpy and link together); learned from copies of at least
// kLearnedCopyBytes.
void observe_copy(int64_t bytes, double seconds);
constexpr int64_t kLearnedCopyBytes = int64_t{1} << 20;
// Forgets the copies measured (tests).
void clear_copy_times();

} // namespace lazymem
