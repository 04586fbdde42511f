// ir: the pending program, a program-ordered list of nodes shared by every recording thread.
// append() assigns each node its seq and the buffer versions it reads and writes; a sync point
// detaches a prefix (take_prefix) for the planner and executor. Only the prefix's nodes leave the
// program, so nodes recorded meanwhile by other threads stay pending in order.
#pragma once

#include <atomic>
#include <deque>
#include <mutex>
#include <string>
#include <vector>

#include "ir/node.h"
#include "ir/tape.h"

namespace lazymem {

struct Segment {
  std::vector<NodePtr> nodes;
  // Buffers whose values must survive the segment, decided at the cut (under the program lock):
  // read by a node that stayed pending, or still named by a tensor. The snapshot matters: a node
  // recorded after the cut may read a buffer whose last tensor dies before the segment is planned,
  // but that buffer was necessarily alive at the cut (storages never come back to life).
  // The set is kept as an epoch stamp on each buffer (no allocation): take_prefix stamps the live
  // buffers with a fresh epoch under the program lock. Valid while the segment is being executed.
  uint64_t epoch = 0;
  // The nodes' tape when the Program kept it whole for them (the segment is everything pending
  // and nothing was put back since the tape started); not `valid` otherwise.
  Tape tape;
  // Its live-out set is a snapshot's (take_prefix), stamped when the pipeline handed it over.
  bool live_snapshot = false;
  bool is_live_out(const LazyBuffer& b) const {
    return b.live_epoch == epoch;
  }
};

class Program {
 public:
  static Program& get();
  Program();

  // Appends a node: assigns seq, the versions its uses read, the versions its writes create and
  // version 1 of every def. Returns the seq. Thread-safe.
  uint64_t append(NodePtr node);
  // Records a write done outside the program (eager path, already applied to real data) and
  // returns the new version. The caller must have flushed every pending reader and writer.
  uint32_t note_external_write(LazyBuffer& b);

  // Sets `b`'s batch provenance (torch_lazymem.mark_batch; module state on upload).
  void set_batch_hint(LazyBuffer& b, LazyBuffer::BatchHint hint, int64_t rows = 0, int64_t stride_bytes = 0,
                      bool only_if_auto = false);
  // Seq of the pending node that last writes `b`, or 0 when no pending node writes it.
  uint64_t pending_writer(const LazyBuffer& b);
  uint64_t last_seq();
  // Seq of the n-th pending node (from 0), or of the last one when fewer are pending (0: none).
  uint64_t seq_at(size_t n);
  // Lock-free reads (atomics written under the lock): the auto-flush check runs after every record.
  size_t pending_count() const {
    return pending_size_.load(std::memory_order_relaxed);
  }
  // Bytes of fresh buffers the pending program defines (auto-flush threshold).
  uint64_t pending_def_bytes() const {
    return pending_bytes_.load(std::memory_order_relaxed);
  }

  // Drops pending nodes nobody can read (every buffer they write lost its last tensor and nothing
  // that stays reads it), freeing the data they pinned, when a buffer holding data died since the
  // last sweep (cheap otherwise). Run at each sync and by memory queries. Returns the nodes dropped.
  size_t collect_dead();

  // The live-out set of the pending nodes with seq <= upto, stamped now: every buffer of theirs that a
  // tensor holds or a later pending node reads. What no tensor holds now, nothing can read later, so
  // a take_prefix(upto) with no other take in between may use this set instead of one stamped when it
  // runs. The pipeline stamps it at the hand-off, on the recording thread, so a batch's live-out set
  // does not depend on how far recording got before the worker took it: the same every step, and so
  // are the batch's fingerprint and plan.
  struct LiveSnapshot {
    uint64_t upto = 0, epoch = 0, takes = 0;
    int64_t resident = 0; // device bytes lazymem held then (set by the caller)
    uint64_t offset = 0;  // nodes handed before it since the last read (the pipeline's)
  };
  // `flush`: the flush lock, held (no segment is between its take and the end of its planning, whose
  // live-out set is the same per-buffer stamp).
  // `also`: buffers to stamp as well (the pipeline's batch handed after its last op: its live-out set
  // as it was at that op, live_now, so its plan is the one a batch handed on time gets).
  LiveSnapshot snapshot_live(uint64_t upto, const std::unique_lock<std::mutex>& flush,
                             const std::vector<BufferPtr>* also = nullptr);
  // The buffers the live-out stamp of the pending nodes with seq <= upto would mark now.
  std::vector<BufferPtr> live_now(uint64_t upto);
  // Detaches pending nodes with seq <= upto (all of them if upto is past the end), with the live-out
  // set of `live` when it is still valid (see snapshot_live).
  Segment take_prefix(uint64_t upto, const LiveSnapshot* live = nullptr);
  // Puts back nodes of a detached prefix that the plan leaves pending (kept for later, or not run
  // after an out-of-memory error), in front of everything recorded since. Any subset of the
  // detached prefix, in program order.
  void restore_prefix(std::vector<NodePtr> nodes);
  // Hands back a segment's tape once it is planned: the next one is written into its room.
  void recycle_tape(Tape&& tape);

  // Checks the program's invariants (increasing seqs, versions consistent); throws if violated.
  void verify();
  std::string to_string(size_t max_nodes = 200);

 private:
  std::mutex mu_;
  std::deque<NodePtr> pending_;
  // The tape of every pending node (ir/tape.h), written as they are appended; renumbered from the
  // first pending node when nodes are put back or a prefix leaves some behind.
  Tape tape_;
  Tape spare_tape_;
  void retape();
  void collect_dead_locked(std::vector<NodePtr>& dead);
  uint64_t swept_at_ = 0;
  uint64_t takes_ = 0; // take_prefix calls
  // Stamps the live-out set of the pending nodes with seq <= upto with a fresh epoch (returned).
  uint64_t stamp_live_locked(uint64_t upto);
  template <class Mark>
  void visit_live_locked(uint64_t upto, Mark&& mark);
  uint64_t next_seq_ = 1;
  std::atomic<uint64_t> pending_bytes_{0};
  std::atomic<size_t> pending_size_{0};
};

} // namespace lazymem
