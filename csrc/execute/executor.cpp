// execute: the plan walker.
#include "execute/executor.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <optional>

#include <ATen/core/stack.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/DeviceGuard.h>

#include "core/check.h"
#include "core/config.h"
#include "core/runtime.h"
#include "execute/bind.h"
#include "execute/memory.h"
#include "execute/real.h"
#include "execute/replay.h"
#include "execute/streams.h"
#include "execute/transfer.h"
#include "execute/undo.h"
#include "plan/timing.h"
#include "plan/workspace.h"

namespace lazymem {
namespace {

std::exception_ptr input_poison(const Node& n) {
  for (const Use& u : n.uses) {
    if (u.ref.buf->poison && !u.full_overwrite()) return u.ref.buf->poison;
  }
  return nullptr;
}

void poison_outputs(const Node& n, const std::exception_ptr& p) {
  for (const Def& d : n.defs) d.ref.buf->poison = p;
  for (const Use& u : n.uses) {
    if (u.write) u.ref.buf->poison = p;
  }
}

std::string failure_prefix(const Node& n) {
  return "lazymem: " + n.describe() + " failed while materializing: ";
}

std::atomic<uint64_t> g_epochs{0};

class Walker final : public StageWalk {
 public:
  Walker(const Plan& plan, DevicePeakWindow* device_peak, StageRunner* runner)
      : plan_(plan), device_peak_(device_peak), runner_(runner) {
    out_.epoch = g_epochs.fetch_add(1, std::memory_order_relaxed) + 1;
    for (const Stage& st : plan.stages) total_chunks_ += st.loop ? st.chunks() : 0;
  }

  ~Walker() {
    if (progress_shown_ && flush_hooks().progress) flush_hooks().progress(chunks_done_, total_chunks_, true);
  }

  ExecOutcome run() {
    for (LazyBuffer* b : plan_.release_unused) b->drop_real();
    for (size_t s = 0; s < plan_.stages.size(); ++s) {
      const Stage& st = plan_.stages[s];
      bool ok = st.loop ? run_loop(st, s) : run_whole(st, s);
      if (!ok) {
        out_.stage = s;
        break;
      }
    }
    record_facts();
    return out_;
  }

 private:
  // Runs one node, poisoning its outputs on failure. Returns false on out of memory.
  bool run_node(const PlannedNode& pn, Binder& binder, int64_t rows, bool measure = true) {
    const bool counting = counting_ && measure;
    const Node& n = *pn.node;
    if (std::exception_ptr poison = input_poison(n)) {
      poison_outputs(n, poison);
      pn.node->drawn = true; // (a node whose input failed draws nothing: the program has failed)
      return true;
    }
    if (out_.restartable) check_restartable(pn);
    try {
      if (counting) {
        device_counter().reset_node_peak();
        node_start_ = device_counter().allocated();
      }
      binder.begin_run();
      const auto t0 = std::chrono::steady_clock::now();
      replay(pn, binder, stack_);
      if (measure) {
        observe_node_time(node_time_key(pn), std::max<int64_t>(rows, 1),
                          std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count());
      }
      ++out_.executed;
      if (device_peak_) device_peak_->sample();
      stamp_writes(n);
      if (counting) {
        learn(pn, rows, binder.take_copied_bytes());
        if (config().debug >= 3) {
          std::fprintf(stderr, "[lazymem]   %s rows %lld: measured %lld, predicted %lld\n", n.name(),
                       static_cast<long long>(rows), static_cast<long long>(device_counter().node_peak()),
                       static_cast<long long>(pn.predicted));
        }
        if (device_counter().node_peak() > node_peak_) {
          node_peak_ = device_counter().node_peak();
          out_.peak_node = &n;
        }
      }
    } catch (const c10::OutOfMemoryError&) {
      stack_.clear();
      out_.oom = std::current_exception();
      out_.oom_site = n.describe();
      if (counting) out_.oom_learned = learn_from_failure(pn, binder, rows, binder.take_copied_bytes());
      return false;
    } catch (const std::exception& e) {
      stack_.clear();
      auto ep = annotate_node_error(e, failure_prefix(n));
      poison_outputs(n, ep);
      if (!out_.first_error) out_.first_error = ep;
    }
    return true;
  }

  // The node's transient bytes beyond what it left allocated (its outputs): its workspace.
  // (Not the device copies of host-held values the binder made for it: `copies` bytes, counted by
  // the memory model on their own.)
  void learn(const PlannedNode& pn, int64_t rows, int64_t copies) {
    int64_t ws = device_counter().node_peak() - device_counter().node_allocated() - copies;
    if (ws > 0 && Workspace::get().observe(workspace_key(pn), &pn.op.schema(), rows, ws)) note_learned(pn, rows, ws, "");
  }

  static void note_learned(const PlannedNode& pn, int64_t rows, int64_t ws, const char* how) {
    if (config().debug < 2) return;
    std::fprintf(stderr, "[lazymem] workspace of %s at %lld rows: %s%s\n", pn.node->describe().c_str(),
                 static_cast<long long>(rows), format_bytes(ws).c_str(), how);
  }

  // Whether running `pn` keeps the execution restartable (ExecOutcome::restartable).
  void check_restartable(const PlannedNode& pn) {
    const Node& n = *pn.node;
    auto older = [&](const LazyBuffer& b) { return b.has_real() && b.exec_epoch != out_.epoch; };
    bool ok = !n.effectful && !draws_from_generator(pn);
    for (const Def& d : n.defs) ok = ok && !older(*d.ref.buf);
    for (const Use& u : n.uses) ok = ok && !(u.write && older(*u.ref.buf));
    out_.restartable = ok;
  }

  void stamp_writes(const Node& n) {
    for (const Def& d : n.defs) d.ref.buf->exec_epoch = out_.epoch;
    for (const Use& u : n.uses) {
      if (u.write) u.ref.buf->exec_epoch = out_.epoch;
    }
  }

  // After a refused allocation: the node tried to hold its outputs plus at least this much beyond
  // them (the kernel's transients are freed by now). Learned as a lower bound of its workspace, so a
  // new plan of the same program accounts for it. True if that is more than was known. As in
  // learn(), outputs the node does not keep (a chunk's result copied into full storage, or dropped)
  // are part of the workspace: the memory model counts them there. The storage of the operands it
  // writes first (copy_ into a fresh buffer) is not, whether or not its allocation was the one refused:
  // learned as workspace, that value's bytes were counted twice by every later plan of an op of the
  // same shapes (program_fuzz seeds 810858 then 811152: a copy_ refused its destination by an injected
  // failure, and the next program could not fit its 90 KiB "workspace" at any chunk size).
  bool learn_from_failure(const PlannedNode& pn, const Binder& binder, int64_t rows, int64_t copies) {
    int64_t outputs = 0;
    for (size_t i = 0; i < pn.node->defs.size(); ++i) {
      if (pn.defs.empty() || (pn.defs[i].bind != Bind::kDiscard && pn.defs[i].bind != Bind::kNarrow)) {
        outputs += static_cast<int64_t>(binder.def_meta(pn, i).extent_bytes());
      }
    }
    const int64_t ws = device_counter().node_peak() - node_start_ - outputs - copies - binder.operand_storage_bytes();
    if (ws <= 0 || !Workspace::get().observe(workspace_key(pn), &pn.op.schema(), rows, ws, Workspace::kBound)) return false;
    note_learned(pn, rows, ws, " at least (the allocation past it was refused)");
    return true;
  }

  bool run_whole(const Stage& st, size_t s) {
    Binder binder(st);
    stage_ = &st;
    binder_ = &binder;
    for (size_t p = 0; p < st.nodes.size();) {
      const size_t next = runner_ ? runner_->run_from(p, *this) : p;
      if (next > p) {
        p = next;
        continue;
      }
      if (!run_plain(p, true)) {
        out_.node = p;
        return false;
      }
      ++p;
    }
    binder_ = nullptr;
    return true;
  }

 public:
  const Stage& stage() const override {
    return *stage_;
  }

  bool run_plain(size_t p, bool measure) override {
    const PlannedNode& pn = stage_->nodes[p];
    const size_t mark = saved_.size();
    std::vector<LazyBuffer*> unsaved;
    if (!save_updated(pn, unsaved)) { // (out of memory saving: the node did not run)
      saved_.resize(mark);
      return false;
    }
    if (!run_node(pn, *binder_, 0, measure)) {
      restore_rows(mark); // what its kernel may have updated before it failed, as it was
      if (!unsaved.empty() && replay_reached_kernel()) {
        out_.torn = std::move(unsaved);
        out_.torn_in_node = true;
      }
      return false;
    }
    saved_.resize(mark);
    for (LazyBuffer* b : stage_->released_after(pn)) release(b);
    return true;
  }

  void bookkeep(size_t p, c10::ArrayRef<c10::Storage> results) override {
    const PlannedNode& pn = stage_->nodes[p];
    Node& n = *pn.node;
    // (Before its results are stored, as run_node checks before the kernel: a def holding storage
    // this execution did not stamp yet would read as older.)
    if (out_.restartable) check_restartable(pn);
    for (size_t i = 0; i < results.size(); ++i) {
      if (!results[i]) continue;
      LazyBuffer& b = i < n.defs.size() ? *n.defs[i].ref.buf : *n.uses[i - n.defs.size()].ref.buf;
      if (!b.has_real()) b.set_real(results[i]);
    }
    binder_->done(pn);
    stamp_writes(n);
    ++out_.executed;
    for (LazyBuffer* b : stage_->released_after(pn)) release(b);
  }

  ExecOutcome& outcome() override {
    return out_;
  }

 private:

  // The plan's batch facts, on the buffers that hold the versions they describe (a plan that stopped
  // early did not write some of them).
  void record_facts() {
    for (const BatchFact& f : plan_.facts) {
      LazyBuffer& b = *f.buf;
      if (!b.has_real() || b.real_version != f.version || b.poison) continue;
      b.fact_version = f.version;
      b.fact_hint = false;
      b.fact_batch = f.batch;
      b.fact_rows = f.layout.rows;
      b.fact_row_bytes = f.layout.row_bytes;
    }
  }

  // Frees a buffer after its last use; one this execution did not write cannot be brought back.
  void release(LazyBuffer* b) {
    if (b->has_real() && b->exec_epoch != out_.epoch) out_.restartable = false;
    b->drop_real();
  }

  bool run_loop(const Stage& st, size_t index) {
    for (const FullStore& f : st.stores) {
      if (f.buf->has_real()) continue;
      size_t n = f.buf->nbytes.load();
      try {
        f.buf->set_real(f.host ? allocate_host(n) : allocate_real(n), f.host);
        f.buf->exec_epoch = out_.epoch;
      } catch (const c10::OutOfMemoryError&) {
        out_.oom = std::current_exception();
        out_.oom_site = "the storage assembling b" + std::to_string(f.buf->id) + " (" + format_bytes(n) + ")";
        abandon_loop(st);
        return false;
      }
    }
    Binder binder(st);
    int64_t chunk = st.chunk;
    std::vector<char> none(st.slots.size(), 0);
    updated_in_place_.clear();
    saved_.clear();
    binder.copy_ahead(nullptr, 0, std::min(chunk, st.batch)); // the first chunk's host-held rows
    for (int64_t start = 0; start < st.batch;) {
      const int64_t rows = std::min(chunk, st.batch - start);
      if (!run_chunk(st, binder, start, rows, none, chunk)) {
        restore_rows(0); // every stored value the loop updated in place is as it was: it can run again
        abandon_loop(st);
        out_.torn = updated_in_place_;
        return false;
      }
      start += rows;
    }
    saved_.clear();
    if (chunk < st.chunk) out_.smaller_chunks.emplace_back(index, chunk);
    for (const Accumulator& a : st.accs) {
      LazyBuffer& b = *a.buf;
      b.exec_epoch = out_.epoch;
      if (b.poison || !b.has_real()) continue;
      try {
        if (a.finalize == Finalize::kDivConst) {
          real_view(b, a.meta).div_(a.divisor);
        } else if (a.finalize == Finalize::kDivOutput) {
          LazyBuffer& d = *a.divide_by;
          real_view(b, a.meta).div_(real_view(d, TensorMeta{{}, {}, 0, a.meta.dtype}));
        }
      } catch (const std::exception& e) {
        b.poison = annotate_node_error(e, "lazymem: finishing a split reduction failed: ");
      }
      b.real_version = a.version;
    }
    for (const auto& [b, version] : st.written) b->real_version = version;
    for (LazyBuffer* b : st.release_after) release(b);
    return true;
  }

  // Runs rows [start, start + rows) of a loop as one chunk, accumulating partials except the slots in
  // `skip` (already holding these rows' contribution). Out of memory inside it: the rows of stored
  // values it updated in place are put back from the undo log (save_rows); when re-running these
  // rows then changes nothing but what they compute (no random draws from a generator's stream, no
  // effect), they run again in chunks half the size, skipping the partials already accumulated for
  // them, and `chunk` stays that small for the rest of the loop. Random ops draw by row, so the
  // retried rows get the same numbers. False if it cannot recover.
  bool run_chunk(const Stage& st, Binder& binder, int64_t start, int64_t rows, const std::vector<char>& skip,
                 int64_t& chunk) {
    std::vector<char> done = skip;
    bool redoable = true;
    const size_t mark = saved_.size();
    binder.begin_chunk(start, rows);
    bool ok = true;
    for (const PlannedNode& pn : st.nodes) {
      if (!binder.begin_node(pn)) { // none of its rows in this chunk (a slice of the batch elsewhere)
        for (int32_t slot : pn.free_slots) binder.free_slot(slot);
        binder.after_node(pn);
        continue;
      }
      // An in-place update of a stored value's rows: the rows are saved first (undoable), unless the
      // node also draws from a generator's stream or has an effect, which no saved rows undo.
      const bool redo = redoable_node(pn);
      const bool undoable = !redo && !pn.node->effectful && !draws_from_generator(pn);
      if (undoable && !save_rows(st, pn, binder)) {
        ok = false;
        break;
      }
      if (!run_node(pn, binder, binder.chunk_rows())) {
        ok = false;
        break;
      }
      if (start + rows < st.batch) binder.copy_ahead(&pn, start + rows, std::min(chunk, st.batch - start - rows));
      if (!redo && !undoable) {
        redoable = false;
        note_updated_in_place(st, pn);
      }
      for (int32_t slot : pn.accumulate) {
        if (done[slot] || st.slots[slot].buf->poison) continue;
        try {
          binder.accumulate(slot);
        } catch (const c10::OutOfMemoryError&) {
          out_.oom = std::current_exception();
          out_.oom_site = "accumulating the partial of b" + std::to_string(st.slots[slot].buf->id);
          ok = false;
          break;
        }
        done[slot] = 1;
      }
      if (!ok) break;
      for (int32_t slot : pn.free_slots) binder.free_slot(slot);
      binder.after_node(pn);
    }
    binder.end_chunk();
    if (ok) report_progress();
    if (config().debug >= 3 && ok) {
      std::fprintf(stderr, "[lazymem]   chunk at row %lld done: %lld bytes allocated, %lld held by buffers\n",
                   static_cast<long long>(start), static_cast<long long>(device_counter().allocated()),
                   static_cast<long long>(resident_bytes()));
    }
    if (ok) return true;
    restore_rows(mark); // this chunk's rows of stored values, as they were before it
    if (rows <= 1 || !redoable) return false;
    const int64_t smaller = (rows + 1) / 2;
    chunk = std::min(chunk, smaller);
    ++out_.chunk_retries;
    if (config().debug) {
      std::fprintf(stderr, "[lazymem] out of memory at %s in the chunk of %lld rows at row %lld: running its rows "
                   "again in chunks of %lld\n", out_.oom_site.c_str(), static_cast<long long>(rows),
                   static_cast<long long>(start), static_cast<long long>(smaller));
    }
    out_.oom = nullptr;
    out_.oom_site.clear();
    out_.oom_learned = false;
    for (int64_t s = start; s < start + rows; s += smaller) {
      if (!run_chunk(st, binder, s, std::min(smaller, start + rows - s), done, chunk)) return false;
    }
    return true;
  }

  // After each chunk: once the run is expected to take longer than progress_after_seconds, reports
  // chunks done (at most ten times a second).
  void report_progress() {
    ++chunks_done_;
    if (!flush_hooks().progress) return;
    const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - started_).count();
    if (!progress_shown_) {
      const double expected = elapsed / static_cast<double>(chunks_done_) * static_cast<double>(total_chunks_);
      if (expected < config().progress_after_seconds.load(std::memory_order_relaxed)) return;
      progress_shown_ = true;
    } else if (elapsed - last_report_ < 0.1 && chunks_done_ < total_chunks_) {
      return;
    }
    last_report_ = elapsed;
    flush_hooks().progress(std::min(chunks_done_, total_chunks_), std::max(total_chunks_, chunks_done_), false);
  }

  // The values `pn` (not redoable, rows not saved) updated in place: some of their rows are updated.
  void note_updated_in_place(const Stage& st, const PlannedNode& pn) {
    for (size_t k : stored_rows_updated(st, pn)) {
      LazyBuffer* b = pn.node->uses[k].ref.buf.get();
      if (std::find(updated_in_place_.begin(), updated_in_place_.end(), b) != updated_in_place_.end()) continue;
      if (config().debug >= 2) {
        std::fprintf(stderr, "[lazymem] %s updates b%llu in place, rows at a time\n", pn.node->describe().c_str(),
                     static_cast<unsigned long long>(b->id));
      }
      updated_in_place_.push_back(b);
    }
  }

  // Saves the rows `pn` is about to update in place (stored_rows_updated) in host memory: the loop's
  // undo log. False (out of memory recorded) if a host copy cannot be made.
  bool save_rows(const Stage& st, const PlannedNode& pn, Binder& binder) {
    for (size_t k : stored_rows_updated(st, pn)) {
      if (!save_view(binder.home(pn, k), /*beside=*/false, pn, k, "the rows of ")) return false;
    }
    return true;
  }

  // Puts `view`'s contents in the undo log: in host memory (counted there), or `beside` it on the
  // device. False, out of memory recorded, when the copy cannot be made.
  bool save_view(const at::Tensor& view, bool beside, const PlannedNode& pn, size_t k, const char* what) {
    await_copies_out(view.storage().unsafeGetStorageImpl()); // (rows of a host-held value: as they are)
    try {
      if (beside) {
        saved_.push_back(SavedRows{view, view.clone()});
      } else {
        CountingScope host(&host_counter()); // host memory, not the device's
        saved_.push_back(SavedRows{view, view.to(at::kCPU, /*non_blocking=*/false, /*copy=*/true)});
      }
    } catch (const c10::OutOfMemoryError&) {
      out_.oom = std::current_exception();
      out_.oom_site = std::string("saving ") + what + "b" + std::to_string(pn.node->uses[k].ref.buf->id) +
          " before " + pn.node->describe() + " updates it in place";
      return false;
    }
    return true;
  }

  // A node of a whole stage that updates an earlier value in place and allocates as it runs can run
  // out of memory inside its kernel after the update: run again from there, it would update the value
  // twice (BatchNorm's running statistics were). Up to kUndoBytes of such values (undo.h,
  // node_updates_to_save) are saved first and put back if it fails: in host memory on the CPU
  // backing, beside them on a GPU (a copy to the host would wait for the device at every BatchNorm
  // and could not be captured in a CUDA graph). Larger ones go to `unsaved`: lost if it fails.
  static constexpr int64_t kUndoBytes = int64_t{1} << 20;
  bool save_updated(const PlannedNode& pn, std::vector<LazyBuffer*>& unsaved) {
    for (size_t k : node_updates_to_save(pn, kUndoBytes, unsaved)) {
      if (!save_view(binder_->home(pn, k), /*beside=*/!counting_, pn, k, "")) return false;
    }
    return true;
  }

  // Puts back the rows saved since `from`, newest first.
  void restore_rows(size_t from) {
    if (saved_.size() > from) await_copies_out(); // (a copy out landing later would undo the restore)
    for (size_t i = saved_.size(); i-- > from;) saved_[i].view.copy_(saved_[i].rows);
    saved_.resize(from);
  }

  // A loop that ran out of memory restarts as a whole: what it assembled or accumulated goes.
  void abandon_loop(const Stage& st) {
    for (const Accumulator& a : st.accs) a.buf->drop_real();
    for (const FullStore& f : st.stores) f.buf->drop_real();
  }

  const Plan& plan_;
  DevicePeakWindow* device_peak_; // a CUDA-like backing device's (else the counting allocator's)
  StageRunner* runner_;
  const Stage* stage_ = nullptr; // the whole stage running, and its binder
  Binder* binder_ = nullptr;
  ExecOutcome out_;
  torch::jit::Stack stack_;
  const bool counting_ = backing_device().is_cpu(); // the counting allocator sees every byte
  int64_t node_peak_ = 0;
  int64_t node_start_ = 0; // device bytes allocated when the running node started
  std::vector<LazyBuffer*> updated_in_place_; // by the running loop, rows not saved (note_updated_in_place)
  struct SavedRows {
    at::Tensor view; // the rows, in the stored value
    at::Tensor rows; // their contents before the update, in host memory (a node's undo on a GPU: beside them)
  };
  std::vector<SavedRows> saved_; // the undo log: the running loop's (save_rows), a node's (save_updated)
  const std::chrono::steady_clock::time_point started_ = std::chrono::steady_clock::now();
  int64_t total_chunks_ = 0;
  int64_t chunks_done_ = 0;
  bool progress_shown_ = false;
  double last_report_ = 0;
};

} // namespace

ExecOutcome execute(const Plan& plan, c10::ArrayRef<Node*> random_nodes, StageRunner* runner) {
  device_counter().reset_window_peak();
  device_counter().start_injection();
  ReplayScope scope;
  DrawOrder draws(random_nodes);
  std::optional<c10::DeviceGuard> device_guard;
  if (!backing_device().is_cpu()) device_guard.emplace(backing_device());
  std::optional<DevicePeakWindow> device_peak;
  if (!backing_device().is_cpu()) device_peak.emplace(backing_device());
  // On the CPU backing the counting allocator holds the run to the plan's budget (memory.h).
  ScopedBudgetLimit limit(backing_device().is_cpu() ? plan.budget : -1);
  // Sampled after each node only where the plan comes over half its budget: reading the allocator's
  // statistics takes its lock and copies them, a cost per kernel that eager does not pay. Elsewhere
  // the peak is the process's where the run raised it, else the larger of the start and the end.
  const bool each_node = plan.budget >= 0 && plan.predicted_peak > plan.budget / 2 && device_peak &&
      !device_peak->traced();
  const int64_t resident = device_peak ? lazymem_device_bytes() : 0;
  // Results copied out to host memory are there before anything outside the run reads them.
  struct AwaitCopiesOut {
    ~AwaitCopiesOut() {
      try {
        await_copies_out();
      } catch (...) { // NOLINT(bugprone-empty-catch): unwinding already (a device failing)
      }
    }
  } await_on_error;
  ExecOutcome out = Walker(plan, each_node ? &*device_peak : nullptr, runner).run();
  await_copies_out();
  if (!out.oom) draws.finish();
  device_counter().stop_injection();
  if (device_peak) device_peak->sample();
  out.peak = device_peak ? device_peak->peak() : device_counter().window_peak();
  // Graphs ran in their pools, which the allocator's trace does not see.
  if (runner && runner->pool_bytes() > 0) out.peak = std::max(out.peak, resident + runner->pool_bytes());
  return out;
}

} // namespace lazymem
