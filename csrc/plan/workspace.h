// plan: kernel workspace learned from the counting allocator. A node's workspace is the transient
// memory its kernel (and lazymem's own copies around it) needs beyond its outputs: the executor
// measures it on every run that has any, and the memory model adds it to the node's live bytes the
// next time the same op runs on the same shapes. Keys name the op, every operand's geometry with the
// batch dim marked, and the scalar arguments; per key, the observations at different chunk sizes
// give workspace = alpha + beta * rows, a line above every observation. A run that completed measured
// the workspace at its rows; a run refused an allocation learned only a lower bound there (what it
// had plus what it asked for, which stops short of the rest of the kernel). The line goes through
// the completed run of fewest rows (the origin until two runs completed: a workspace that scales
// with the rows) with the least slope that covers every other observation, so a bound learned at a
// large chunk never becomes a constant that no chunk size escapes.
#pragma once

#include <atomic>
#include <cstdint>
#include <mutex>
#include <unordered_map>
#include <unordered_set>

#include "plan/plan.h"

namespace lazymem {

class Workspace {
 public:
  static Workspace& get();

  // Whether any run of `op` ever needed workspace (a fast check before computing keys).
  bool known_op(const c10::FunctionSchema* op) const;
  // What an observation is: a run that completed (measured), a refused allocation (at least that
  // many bytes), or a probe's estimate (execute/ws_probe.h), which the first measurement at the same
  // rows replaces.
  enum Kind : uint8_t { kMeasured, kBound, kEstimate };
  // Records `bytes` of workspace at `rows`; true if that changed what is predicted.
  bool observe(uint64_t key, const c10::FunctionSchema* op, int64_t rows, int64_t bytes, Kind kind = kMeasured);
  // Whether anything was observed for `key`.
  bool knows(uint64_t key) const;
  // Distinct chunk sizes remembered per key.
  static constexpr int kPoints = 8;
  struct Affine {
    int64_t alpha = 0;
    int64_t beta = 0;
  };
  Affine predict(uint64_t key) const;
  void clear();
  size_t size() const;
  // Changes whenever a prediction may change (something was learned, or forgotten): plans made
  // before are not reused after (plan/reuse.h).
  uint64_t generation() const {
    return generation_.load(std::memory_order_relaxed);
  }

 private:
  // Distinct row counts observed (the most a chunk size of each was seen to need). The first two
  // completed runs are kept whatever they are (the line's first estimate); after that only an
  // observation above the prediction is kept, so a key run at many chunk sizes (the same layer in
  // passes of different chunk sizes, a recomputed node) stops changing the model once the model
  // covers them all.
  struct Seen {
    int n = 0;
    int64_t rows[kPoints] = {};
    int64_t bytes[kPoints] = {};
    Kind kind[kPoints] = {};
  };
  static Affine line(const Seen& s);
  mutable std::mutex mu_;
  std::unordered_map<uint64_t, Seen> seen_;
  std::unordered_set<const c10::FunctionSchema*> ops_;
  std::atomic<uint64_t> generation_{0};
};

// The workspace key of `pn` as planned (batch dims of bound operands marked, so a key holds across
// chunk sizes), and the rows it runs on in its stage (0 in whole stages).
uint64_t workspace_key(const PlannedNode& pn);

} // namespace lazymem
