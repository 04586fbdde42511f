// execute: runs a Plan on the backing device. Whole stages replay their nodes once on whole buffers;
// loop stages allocate the full storages they assemble, then replay their nodes chunk by chunk
// through the binder, accumulate partials after their last write in each chunk, and finish the
// accumulators when the loop ends. Each buffer is released right after its last use.
//
// Failure semantics. Out of memory inside a chunk: its rows run again in smaller chunks when that
// is safe (see Walker::run_chunk), the smaller size kept for the rest of the loop. Otherwise
// execution stops; the outcome says where, so that sync/ puts every node that has not completed
// back in the program (a loop that fails restarts as a whole: its storages and accumulators are
// dropped), and nothing is lost. Any other error: the failing node's
// outputs (and everything computed from them) are poisoned, the rest runs, and the first error is
// reported; later reads of a poisoned value raise the same error.
#pragma once

#include <cstdint>
#include <exception>
#include <string>
#include <utility>
#include <vector>

#include "plan/plan.h"

namespace lazymem {

struct ExecOutcome {
  size_t executed = 0;               // node runs (a node in a loop runs once per chunk)
  std::exception_ptr first_error;    // the first failure other than out of memory
  std::exception_ptr oom;            // set when execution stopped for lack of memory
  std::string oom_site;              // the node whose allocation failed
  size_t stage = 0;                  // with oom: the stage that did not complete...
  size_t node = 0;                   // ...and, for a whole stage, its first node that did not run
  bool oom_learned = false;          // with oom: the failing node's workspace was more than known
  size_t chunk_retries = 0;          // chunks that ran out of memory and ran again in smaller chunks
  std::vector<std::pair<size_t, int64_t>> smaller_chunks; // (stage, chunk) loops that finished smaller
  // With oom: every completed node only wrote buffers this execution created (stamped `epoch`) and
  // drew no random numbers from a generator's stream, so dropping those buffers and running the
  // whole program again is the same as never having run it.
  bool restartable = true;
  // With oom in a loop: values the loop had updated in place for some of the batch's rows (a
  // read-modify-write through a narrowed view, which cannot run twice on the same rows). Neither
  // running the loop again nor resuming it is exact: the caller loses them (reads raise) rather
  // than compute a wrong answer.
  std::vector<LazyBuffer*> torn;
  // With torn: by one node of a whole stage (which may have updated part of them before running out
  // of memory inside its kernel; Walker::save_updated), not a loop's rows.
  bool torn_in_node = false;
  uint64_t epoch = 0;
  int64_t peak = 0;                  // device bytes at the peak
  const Node* peak_node = nullptr;   // the node running when it happened (nullptr: between nodes)
};

// A whole stage's walk, as a StageRunner drives it (execute/graphs.h: CUDA graphs).
class StageWalk {
 public:
  virtual ~StageWalk() = default;
  virtual const Stage& stage() const = 0;
  // Runs node p as execute() runs it, then releases what dies after it. False: out of memory.
  // `measure`: its time and workspace feed the models (not in a capture's dry run, which launches
  // nothing, nor in an emulated replay, which copies every result).
  virtual bool run_plain(size_t p, bool measure = true) = 0;
  // Node p's effects on the buffers without running its kernel (a graph ran it): `results` (one per
  // def, then one per use; undefined: none) become the storage of those buffers that have none, then
  // versions, epochs and releases as run_plain.
  virtual void bookkeep(size_t p, c10::ArrayRef<c10::Storage> results) = 0;
  virtual ExecOutcome& outcome() = 0;
};

class StageRunner {
 public:
  virtual ~StageRunner() = default;
  // At node p of a whole stage: runs nodes [p, q) itself and returns q, or returns p (the walk runs
  // p plainly).
  virtual size_t run_from(size_t p, StageWalk& walk) = 0;
  // After the run: device bytes its graphs' pools held beyond lazymem's values (counted in the peak).
  virtual int64_t pool_bytes() const = 0;
};

// Runs `plan`. The caller holds the flush lock. `random_nodes`: the random nodes of the plan's
// segment that draw, in program order (the plan's and those it leaves pending): each draws in that
// order (execute/streams.h). `runner`: runs parts of a whole stage itself (graph replay).
ExecOutcome execute(const Plan& plan, c10::ArrayRef<Node*> random_nodes = {}, StageRunner* runner = nullptr);

} // namespace lazymem
