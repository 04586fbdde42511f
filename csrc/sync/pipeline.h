// sync: the pipeline's worker (issue 30 item 1). Once a materialization has run unsplit, what is
// recorded next is handed to a worker thread in batches, each planned and run as an auto-flush would
// (sync.cpp's run_segment, with SyncRequest::background), while recording goes on. Used by sync.cpp
// only.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <iterator>
#include <mutex>
#include <optional>
#include <thread>
#include <utility>
#include <vector>

#include <c10/core/impl/VirtualGuardImpl.h>

#include "core/config.h"
#include "core/runtime.h"
#include "execute/graphs.h"
#include "execute/memory.h"
#include "ir/program.h"
#include "sync/pipeline_trace.h"
#include "sync/sync.h"

namespace lazymem {

// Whether this thread is materializing (sync.cpp): a record made during a flush hands nothing off.
bool in_flush_on_this_thread();

// Device bytes lazymem holds: its values and, on a CUDA-like device, its kernels' workspaces.
inline int64_t device_bytes_held() {
  // (What CUDA graphs hold beyond values is theirs: on a CUDA device it is outside lazymem_device_bytes.)
  return backing_device().is_cpu() ? device_counter().allocated() - cuda_graph_unheld_bytes() : lazymem_device_bytes();
}

// Pipelined execution (issue 30 item 1): once a materialization has shown that the program runs
// unsplit with room to spare, what is recorded next is handed, a batch of nodes at a time, to a
// worker thread that plans and runs it while the recording thread goes on recording. Each batch is a
// flush like the auto-flush's (its plan frees what nothing pending or held reads; every kernel is
// eager's, in program order), so results are the ones a synchronous flush gives. A materialization
// that splits or runs out of memory disarms it; the next one that fits unsplit arms it again.
//
// How near the budget a batch may come: a batch runs eagerly, and what it leaves allocated can no
// longer be split, so a step that grew (a longer sequence) could run its forward on the worker and
// leave its backward no room. A batch that repeats the last step that ran within the budget (its
// plan reused, or its nodes those of that step at the same point: the same ops on the same shapes)
// may come as near the budget as that step's peak (its worker's batches and its read together), plus
// 1/32 of the budget; any other (a shape not seen at this point of a step) stays within half the
// budget. Under a memory cap the recording thread holds the caching allocator's cap for the worker's
// batches (cap_allocator), as a synchronous run would.
class Pipeline {
 public:
  static Pipeline& get() {
    static Pipeline* p = new Pipeline(); // never destroyed: its thread may outlive static destructors
    return *p;
  }

  // After a materialization on a recording thread: whether the next steps may be pipelined, and the
  // step's peak (how near the budget a batch that repeats the step may come: see above; 0 none).
  void rearm(bool fits, int64_t peak, int64_t budget, int64_t whole) {
    armed_peak_.store(fits ? peak : 0, std::memory_order_relaxed);
    // (Whether batches may come over half the budget, so the allocator is to be capped for them.)
    cap_wanted_.store(fits && budget >= 0 && batch_limit(budget, whole, true) > budget / 2, std::memory_order_relaxed);
    armed_.store(fits && enabled(), std::memory_order_relaxed);
  }
  // The largest predicted peak of a batch the worker runs (`budget`: the plan's target, -1 none;
  // `whole`: what an unsplit plan may hold). Never past the budget in force now: the arming step may
  // have run under a larger one (torch_lazymem.set_memory_budget since).
  int64_t batch_limit(int64_t budget, int64_t whole, bool repeats) const {
    if (budget < 0) return INT64_MAX;
    const int64_t allowed = std::max(budget, whole), armed = armed_peak_.load(std::memory_order_relaxed);
    if (!repeats || armed <= 0 || armed > allowed) return budget / 2;
    return std::max(budget / 2, std::min(allowed, armed + budget / 32));
  }
  bool armed() const {
    return armed_.load(std::memory_order_relaxed);
  }
  void disarm() {
    armed_.store(false, std::memory_order_relaxed);
  }

  // The worker's nodes' buffers whose last reference was theirs (ir/node.h recycle_nodes): the
  // recording thread made them and drops them, at its next record or materialization.
  void hand_back(std::vector<BufferPtr>&& bufs) {
    if (bufs.empty()) return;
    std::lock_guard<std::mutex> lk(released_mu_);
    if (released_.empty()) {
      released_.swap(bufs);
    } else {
      released_.insert(released_.end(), std::make_move_iterator(bufs.begin()), std::make_move_iterator(bufs.end()));
    }
    has_released_.store(true, std::memory_order_release);
  }
  void drop_released() {
    if (!has_released_.load(std::memory_order_acquire)) return;
    std::vector<BufferPtr> gone;
    {
      std::lock_guard<std::mutex> lk(released_mu_);
      gone.swap(released_);
      has_released_.store(false, std::memory_order_relaxed);
    }
  }

  // After each record: hands what is pending to the worker once a batch has accumulated.
  void maybe_hand_off() {
    if (has_released_.load(std::memory_order_relaxed) && !in_flush_on_this_thread()) drop_released();
    if (!armed_.load(std::memory_order_relaxed) || in_flush_on_this_thread()) return;
    const c10::Device dev = backing_device();
    if (!enabled(dev)) return;
    Program& p = Program::get();
    // The first batches after a read are small, so the device starts early in the step (under eager
    // it starts at the first op): 8, 16, 32 ... nodes, up to the batch size, counted from the read,
    // so a step's batches are the same every step.
    const size_t batch = std::min(batch_size(dev), kFirstBatch << std::min<size_t>(handed_count_.load(std::memory_order_relaxed), 20));
    if (p.pending_count() < batch) return;
    if (handed_.load(std::memory_order_relaxed)) { // the worker has a batch: no lock per record
      note_due(p, batch);
      return;
    }
    Due gone; // (a late batch's noted live-out set, released outside the lock)
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (busy_ || upto_) {
        note_due_locked(p, batch);
        return;
      }
      // Not while another thread materializes: the live-out stamp below would overwrite the one of
      // the segment it has taken and not yet planned (Segment::epoch: one stamp per buffer), so its
      // plan would free values still held (a recording thread's chain, read back as "no data"), and
      // the memory held now is that run's. Its read ends the step; the next record hands off.
      // (Only tried: a flush takes mu_ under the flush lock, take_error.)
      std::unique_lock<std::mutex> flush = try_lock_flush();
      if (!flush.owns_lock()) return;
      handed_.store(true, std::memory_order_relaxed);
      handed_since_read_.store(true, std::memory_order_relaxed);
      handed_count_.fetch_add(1, std::memory_order_relaxed);
      // The batch runs on the stream the recording thread has current, as it would unpipelined.
      stream_.reset();
      if (!dev.is_cpu()) stream_ = c10::impl::VirtualGuardImpl(dev.type()).getStream(dev);
      // Batches of a fixed size from the last materialization on: the same batches step after step,
      // so their plans are the plan cache's.
      upto_ = p.seq_at(batch - 1);
      // A batch handed after its last op (the worker was busy then) keeps the live-out set it had
      // at that op as well: values the user dropped since are still its outputs, as in a step where
      // it was handed on time, so its fingerprint and plan are that step's (they were planned anew:
      // on the CPU, one steady step in three).
      live_ = p.snapshot_live(upto_, flush, due_.upto == upto_ ? &due_.live : nullptr);
      if (due_.upto == upto_) stats().pipeline_handed_late.fetch_add(1, std::memory_order_relaxed);
      gone = std::exchange(due_, Due{});
      due_noted_.store(false, std::memory_order_relaxed);
      live_.resident = device_bytes_held(); // (the worker is idle: none of it is a run's)
      live_.offset = handed_nodes_.fetch_add(batch, std::memory_order_relaxed);
      stats().pipeline_handed.fetch_add(1, std::memory_order_relaxed);
      pipeline_trace(PipeEvent::kHanded, batch);
      if (!worker_.joinable()) worker_ = std::thread([this] { loop(); });
    }
    hold_cap();
    cv_.notify_one();
  }

  // The caching allocator's cap for the worker's batches, where they may come over half the budget:
  // set from the recording thread (a Python call; the worker would wait for the GIL each batch) and
  // held until the recording thread's next synchronous run. No lock is held across the call.
  void hold_cap() {
    if (!cap_wanted_.load(std::memory_order_relaxed)) return;
    const int64_t budget = memory_budget();
    const int64_t target = plan_target(budget);
    if (budget < 0 || batch_limit(target, whole_plan_target(budget), true) <= target / 2) return;
    int expected = kCapNone;
    if (!cap_state_.compare_exchange_strong(expected, kCapChanging)) return;
    cap_restore_ = cap_allocator(budget);
    cap_state_.store(kCapHeld);
  }
  void release_cap() {
    int expected = kCapHeld;
    if (!cap_state_.compare_exchange_strong(expected, kCapChanging)) return;
    restore_allocator(std::exchange(cap_restore_, 0.0));
    cap_state_.store(kCapNone);
  }

  // Tests (sync.h pipeline_hold): while held, the worker stays busy after running its batch.
  void hold(bool held) {
    {
      std::lock_guard<std::mutex> lk(mu_);
      held_ = held;
    }
    cv_.notify_all();
  }

  // Waits until the worker is idle (the process exits; tests).
  void drain() {
    {
      std::unique_lock<std::mutex> lk(mu_);
      idle_.wait(lk, [&] { return !busy_ && !upto_; });
    }
    drop_released();
  }

  // An error a background flush met (a kernel's, or a lazymem error), raised by the next flush that
  // needs everything (synchronize, generator state); a read raises its own values' errors.
  std::exception_ptr take_error() {
    std::lock_guard<std::mutex> lk(mu_);
    return std::exchange(error_, nullptr);
  }

  static bool enabled(c10::Device dev = backing_device()) {
    const int on = config().pipeline.load(std::memory_order_relaxed);
    return (on > 0 || (on < 0 && !dev.is_cpu())) &&
           config().force_chunks.load(std::memory_order_relaxed) <= 0;
  }

  // Nodes per batch. On an accelerator a batch costs the recording thread nothing (the worker only
  // launches its kernels), and small ones start the device early in a step; on the CPU backing the
  // worker competes with recording for cores, and each batch is a flush with its own plan.
  static size_t batch_size(c10::Device dev) {
    const uint64_t set = config().pipeline_batch.load(std::memory_order_relaxed);
    if (set > 0) return set;
    return dev.is_cpu() ? kBatchCpu : kBatchAccelerator;
  }

  // Whether the worker was handed a batch since the recording thread's last materialization: a read
  // then runs everything pending even when the worker holds the value's writer (materialize).
  bool handed_since_read() const {
    return handed_since_read_.load(std::memory_order_relaxed);
  }
  void read_ran() {
    Due gone; // (its nodes ran: the buffers it held go, outside the lock)
    {
      std::lock_guard<std::mutex> lk(mu_);
      gone = std::exchange(due_, Due{});
      due_noted_.store(false, std::memory_order_relaxed);
    }
    handed_since_read_.store(false, std::memory_order_relaxed);
    handed_count_.store(0, std::memory_order_relaxed);
    handed_nodes_.store(0, std::memory_order_relaxed);
  }

  // The step's node signatures (Node::sig), in program order, and its peaks: each batch the worker
  // ran, then the read that ends the step. A step that fit is what later batches are compared against
  // (repeats). Returns the step's peaks so far: at its end, those of the whole step, the worker's
  // batches included (the read alone may run only the step's tail, far below its peak).
  struct Peaks {
    int64_t planned = 0;  // the larger of the measured and predicted peaks (how near the budget)
    int64_t measured = 0; // stats()["peak_bytes"]
  };
  Peaks note_step(const Segment& seg, bool ends_step, bool fits, Peaks peaks) {
    std::lock_guard<std::mutex> lk(sigs_mu_);
    for (const auto& n : seg.nodes) {
      if (n) step_sigs_.push_back(n->sig); // (nodes put back pending are not the step's yet)
    }
    step_peaks_.planned = std::max(step_peaks_.planned, peaks.planned);
    step_peaks_.measured = std::max(step_peaks_.measured, peaks.measured);
    const Peaks step = step_peaks_;
    if (!ends_step) return step;
    if (fits) {
      armed_sigs_.swap(step_sigs_);
    }
    step_sigs_.clear();
    step_peaks_ = Peaks{};
    return step;
  }
  // Whether a batch handed `offset` nodes after the read has the nodes of the armed step there.
  bool repeats(const Segment& seg, uint64_t offset) {
    std::lock_guard<std::mutex> lk(sigs_mu_);
    if (offset + seg.nodes.size() > armed_sigs_.size()) return false;
    for (size_t i = 0; i < seg.nodes.size(); ++i) {
      const uint64_t sig = seg.nodes[i]->sig;
      if (sig == 0 || sig != armed_sigs_[offset + i]) return false;
    }
    return true;
  }

 private:
  // At a batch's last op, when the worker is still busy: what its live-out set is now, for the
  // hand-off (once per batch).
  void note_due(Program& p, size_t batch) {
    if (due_noted_.load(std::memory_order_relaxed)) return;
    std::lock_guard<std::mutex> lk(mu_);
    note_due_locked(p, batch);
  }
  void note_due_locked(Program& p, size_t batch) {
    if (due_noted_.exchange(true, std::memory_order_relaxed)) return;
    pipeline_trace(PipeEvent::kDue, batch);
    due_.upto = p.seq_at(batch - 1);
    due_.live = p.live_now(due_.upto);
  }

  void loop() {
    std::unique_lock<std::mutex> lk(mu_);
    for (;;) {
      cv_.wait(lk, [&] { return upto_ != 0; });
      const uint64_t upto = upto_;
      const Program::LiveSnapshot live = live_;
      const std::optional<c10::Stream> stream = stream_;
      busy_ = true;
      lk.unlock();
      pipeline_trace(PipeEvent::kWorkerStart);
      std::exception_ptr err;
      const auto t0 = std::chrono::steady_clock::now();
      try {
        std::optional<c10::Stream> before;
        if (stream) before = c10::impl::VirtualGuardImpl(stream->device_type()).exchangeStream(*stream);
        struct Restore {
          const std::optional<c10::Stream>& s;
          ~Restore() {
            if (s) c10::impl::VirtualGuardImpl(s->device_type()).exchangeStream(*s);
          }
        } restore{before};
        sync(SyncRequest{{}, upto, /*keep_pending=*/true, /*background=*/true, /*read=*/false, &live});
      } catch (const c10::OutOfMemoryError&) {
        disarm(); // what did not run is pending again: the next materialization plans it
      } catch (...) {
        err = std::current_exception();
        disarm();
      }
      pipeline_trace(PipeEvent::kWorkerEnd);
      stats().pipeline_worker_ns.fetch_add(
          std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count(),
          std::memory_order_relaxed);
      lk.lock();
      cv_.wait(lk, [&] { return !held_; }); // (tests: still busy after its run)
      if (err && !error_) error_ = err;
      busy_ = false;
      upto_ = 0;
      handed_.store(false, std::memory_order_relaxed);
      idle_.notify_all();
    }
  }

  std::atomic<bool> armed_{false};
  std::atomic<int64_t> armed_peak_{0}; // the arming materialization's peak (0: none)
  std::atomic<bool> cap_wanted_{false};
  static constexpr int kCapNone = 0, kCapChanging = 1, kCapHeld = 2;
  std::atomic<int> cap_state_{kCapNone};
  double cap_restore_ = 0.0; // written only by the thread that moved cap_state_ to kCapChanging
  // (On an H200, of batches of 64, 128 and 256 ops, 64 was the fastest or tied on GPT-2 steps of 238
  // and 654 ops: tools/gpu_check.py check 10.)
  static constexpr size_t kBatchCpu = 1024, kBatchAccelerator = 64, kFirstBatch = 8;
  std::atomic<size_t> handed_count_{0}; // batches handed since the recording thread's last materialization
  std::atomic<uint64_t> handed_nodes_{0}; // their nodes
  std::mutex sigs_mu_;
  std::vector<uint64_t> armed_sigs_, step_sigs_; // (sigs_mu_) see note_step
  Peaks step_peaks_;                             // (sigs_mu_) the step's largest peaks so far
  std::atomic<bool> handed_{false}; // from a hand-off until the worker has run it (read unlocked)
  std::atomic<bool> handed_since_read_{false};
  std::mutex mu_;
  std::condition_variable cv_, idle_;
  uint64_t upto_ = 0;
  Program::LiveSnapshot live_; // the batch's live-out set at the hand-off
  struct Due {
    uint64_t upto = 0;           // the batch's last node
    std::vector<BufferPtr> live; // its live-out set at that node's record
  };
  Due due_;                           // (mu_) the batch the worker was too busy to take at its last op
  std::atomic<bool> due_noted_{false}; // due_ is this batch's: set once per batch
  std::optional<c10::Stream> stream_; // the recording thread's current stream at the hand-off
  bool busy_ = false;
  bool held_ = false; // (tests) hold: busy until let go
  std::exception_ptr error_;
  std::thread worker_;
  std::mutex released_mu_;
  std::vector<BufferPtr> released_; // (released_mu_) see hand_back
  std::atomic<bool> has_released_{false};
};

} // namespace lazymem
