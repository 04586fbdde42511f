// plan: the split planner's builder (private to plan/split.cpp and plan/split_emit.cpp). Over the
// placements and stages of plan/analysis.h it decides what runs now and what stays pending, where
// each batch-sharded value lives (chunk-local, full storage on the device or in host memory, or
// recomputed chunk by chunk in each loop that reads it) — split.cpp — and emits the Plan: every
// operand bound, partials and their accumulators, stores, releases — split_emit.cpp.
#pragma once

#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "plan/analysis.h"
#include "plan/memory.h"
#include "plan/planner.h"
#include "plan/schedule.h"

namespace lazymem {

inline uint64_t vkey(int32_t buf, uint32_t version) {
  return (static_cast<uint64_t>(static_cast<uint32_t>(buf)) << 32) | version;
}

class SplitBuilder {
 public:
  SplitBuilder(const PlanInput& in, const Schedule& s, Plan& plan,
               const std::unordered_map<const Node*, std::string>& forced,
               const std::unordered_set<const Node*>& finished)
      : in_(in), s_(s), plan_(plan) {
    a_.forced_barriers = forced;
    a_.finished_reads = finished;
  }

  // Fills the plan; false (with notes in the plan) when it cannot be split or no chunk size fits.
  bool build();
  // Nodes that cannot run split (plan/probe.h, and in-place writes to stored time-major rows): they
  // run whole in the next attempt.
  std::unordered_map<const Node*, std::string> unsafe();
  // After build() failed: nodes that should read their partial operands finished (the next attempt
  // may then split); empty when another attempt would fail the same way.
  const std::vector<const Node*>& crossing() const {
    return a_.crossing;
  }
  std::vector<NodePtr> take_owned() {
    return std::move(a_.owned);
  }

 private:
  // ---- analysis (split.cpp) ----
  bool refuse();
  // Producers of every (buffer, version) among the running nodes, and each buffer's final version.
  void index_producers();
  int32_t producer(int32_t buf, uint32_t version) const {
    auto it = producer_.find(vkey(buf, version));
    return it == producer_.end() ? -1 : it->second;
  }
  // Which batch-sharded values that survive the plan stay pending (recomputed when needed) rather
  // than stored, and which nodes run now.
  void decide_pending();
  // Dead-code elimination for what runs now.
  void dce(const std::vector<char>& kept, const std::vector<uint64_t>& pins);
  bool is_upload(int32_t i) const {
    return a_.nodes[i].node->upload;
  }
  // Full storage for batch-sharded values that must exist whole: results, values that survive the
  // plan and are not kept pending, values read or written whole (other_), and values that cross
  // stages (cross_) unless they are recomputed where they are read (uploads always are: each loop
  // that reads a leaf's rows uploads them again).
  void decide_storage();
  void update_full();

  // ---- recomputation of values crossing stages (split.cpp) ----
  // A buffer whose storage is only needed because loops after the one computing it read its rows.
  bool recompute_candidate(int32_t b) const {
    return cross_[b] && !other_[b] && !recompute_[b] && !refused_[b];
  }
  bool local(int32_t b) const {
    return a_.bufs[b].place.is_s() && !full_[b];
  }
  // Whether a node running before stage `s` ends writes a version of `b` after `version`.
  bool overwritten(int32_t b, uint32_t version, int32_t s) const;
  // Whether the nodes computing `version` of `b` can run again for a chunk's rows in loop stage `s`,
  // collecting them in `cone`: each is a loop node of an earlier stage that has no effect (random
  // ones draw keyed by row: the same numbers again), writes nothing but chunk-local values (its
  // whole or partial results are dropped when it runs again) and reads either chunk-local values
  // (computed again in turn) or values still unchanged when `s` runs (weights, finished reductions,
  // stored rows).
  static constexpr size_t kMaxCone = 128;
  bool walk(int32_t b, uint32_t version, int32_t s, std::unordered_set<int32_t>& cone) const;
  // Every recomputed value can be computed again in each loop that reads it.
  bool recomputations_valid() const;
  bool try_recompute(int32_t b);
  // choose_chunks: the largest store on the device does not fit.
  Relief relieve(const FullStore& f);
  // kPriced: with the loops sized, whether holding the recomputed values in host memory instead is
  // cheaper (measured node times against modeled copies; a note says which and why). True: the
  // plan is to be emitted again with them held there.
  bool price_recompute();
  void reset_emission();

  // ---- emission (split_emit.cpp) ----
  struct LoopState {
    std::unordered_map<int32_t, int32_t> slot;   // buffer -> slot
    std::unordered_map<int32_t, size_t> last;    // slot -> index of its last access in the body
    std::unordered_map<int32_t, uint32_t> held;  // chunk-local buffer -> the version its slot holds
    std::unordered_map<int32_t, uint32_t> written; // full buffers written here -> last version
    size_t si = 0;                               // the loop's index among the plan's stages
  };
  void emit();
  void emit_whole(const std::vector<int32_t>& nodes);
  void emit_loop(int32_t s, const std::vector<int32_t>& nodes);
  // Appends node i to the loop body (`copy`: run again for a recomputation or a re-upload).
  void add(Stage& st, LoopState& ls, int32_t i, bool copy);
  // Chunk-local values an earlier loop computed (a leaf's upload, a value recomputed instead of
  // stored): the nodes computing them run again for the chunk's rows, inputs first. `target` is the
  // value a node of this loop reads; false (and `target` blamed) if a version it needs was
  // overwritten in this loop already.
  bool ensure(Stage& st, LoopState& ls, int32_t b, uint32_t version, int32_t target);
  // Partials: accumulate after their last partial write; free every slot after its last access.
  void emit_partials(Stage& st, LoopState& ls);
  // Releases after each value's last access, and dead values nothing here touches.
  void emit_releases();
  // Batch facts of the batch-sharded values that survive the plan with real data.
  void emit_facts();
  int32_t slot_of(Stage& st, LoopState& ls, int32_t b, Store store);
  // Binding of node i's use k (or, with `def`, its def k) in a loop.
  Bound bind(Stage& st, LoopState& ls, int32_t i, size_t k, bool def);
  // G rows per random-number block (see split_emit.cpp).
  uint32_t rng_block(const NodeInfo& ni) const;
  void set_random_draws(const NodeInfo& ni, PlannedNode& pn) const;
  PlannedNode planned_loop_node(Stage& st, LoopState& ls, int32_t i, size_t body_index, bool copy);

  const PlanInput& in_;
  const Schedule& s_;
  Plan& plan_;
  Analysis a_;
  int32_t stages_ = 0;
  std::unordered_map<uint64_t, int32_t> producer_;
  std::vector<uint32_t> final_, exec_final_;
  std::vector<char> exec_, retain_, kept_, pinned_, full_, host_;
  // Buffers whose full storage is needed for other reasons than crossing stages (other_), that
  // cross stages (cross_), recomputed where they are read instead (recompute_), that cannot be
  // (refused_); each buffer's writes as (stage, version); recomputations an emission found
  // impossible.
  std::vector<char> other_, cross_, recompute_, refused_;
  std::vector<std::vector<std::pair<int32_t, uint32_t>>> writes_;
  std::vector<int32_t> blamed_;
  bool priced_ = false;      // price_recompute() has decided
  std::string price_note_;   // and why
  bool prefer_host_ = false; // it chose host memory: relieve() recomputes nothing
  // Where chunks cost per node (PlanInput::chunk_node_ns): the largest value stored whole on the
  // device is tried in host memory once, kept there if the chunks it saves outweigh its copies by a
  // fifth of the time they cost (plan/memory.h chunk_overhead_seconds), else put back.
  bool try_host_store(bool fits = true); // true: emit the plan again (a trial starts or is undone)
  enum class HostTrial : uint8_t { kNone, kTrying, kDone } host_trial_ = HostTrial::kNone;
  std::vector<char> host_before_trial_;
  double trial_before_ = 0, trial_copies_ = 0;
  std::string trial_name_;
  std::string host_note_;     // why a store is in host memory when it was tried there
  std::vector<char> saved_recompute_, saved_refused_, saved_host_; // the decisions before it did
  bool copying_ = false; // planned_loop_node binds a node run again (recompute)
  std::vector<uint64_t> pins_;
  std::unordered_set<const Node*> unnarrowable_;
  // During emission: the last access of every buffer with storage, as (stage, node) in the
  // flattened plan, and which buffers hold real data by then.
  std::unordered_map<int32_t, std::pair<size_t, size_t>> last_;
  std::vector<char> real_;
};

} // namespace lazymem
