// ir: LazyBuffer, the unit of storage in the recorded program. One per phantom StorageImpl; the
// phantom DataPtr's context holds a reference. Views of a tensor share its buffer. Every write
// (functional output, in-place op, write through a view) makes a new *version* (SSA over versions).
#pragma once

#include <atomic>
#include <cstdint>
#include <exception>

#include <c10/core/Storage.h>
#include <c10/core/TensorImpl.h>
#include <c10/util/intrusive_ptr.h>

namespace lazymem {

struct LazyBuffer : c10::intrusive_ptr_target {
  explicit LazyBuffer(size_t nbytes);
  ~LazyBuffer() override;
  LazyBuffer(const LazyBuffer&) = delete;
  LazyBuffer& operator=(const LazyBuffer&) = delete;

  // The fields the planner reads for every buffer of a program (plan/fingerprint.cpp), cold after
  // the step's kernels ran, come first: they fill the object's first two cache lines.

  // Logical size of the phantom storage; grows with resize_ (never shrinks).
  std::atomic<size_t> nbytes;
  // Planner scratch: valid while one plan is built, under the flush mutex.
  uint64_t plan_stamp = 0;
  int64_t plan_bytes = 0;
  uint64_t live_epoch = 0;       // (Program's mutex) epoch of the last detached segment whose live-out set holds it
  uint32_t version = 0;          // (Program's mutex) latest recorded version; 0 = allocated, never written
  uint32_t upload_version = 0;   // (Program's mutex) the version a host upload wrote (0: none)...
  // (Program's mutex) Batch provenance (DESIGN.md §7): a buffer whose value came from the host (an
  // upload) is a data leaf, its dim 0 the batch, unless it holds module state, comes from a tensor
  // that requires grad, or the user said otherwise (torch_lazymem.mark_batch).
  enum class BatchHint : uint8_t { kAuto, kNever, kMarked };
  BatchHint batch_hint = BatchHint::kAuto;

  // --- written only by the thread holding the flush mutex ---
  bool real_on_host = false;     // real is in host memory (a split result larger than the budget)
  uint32_t real_version = 0;
  c10::Storage real;             // data on the backing device (or host), holding version real_version
  // The kernel output whose storage `real` adopted, in its def's layout: reads of that layout take it
  // instead of a new TensorImpl per read (execute/bind.cpp). Never handed to a kernel that writes it
  // (an in-place op may change its sizes); reset whenever `real` changes (set_real).
  c10::intrusive_ptr<c10::TensorImpl> real_impl;
  std::exception_ptr poison;     // set when the node that should have written it failed
  uint64_t exec_epoch = 0;       // the execution that last wrote its real data (see ExecOutcome)

  // --- guarded by Program's mutex ---
  int64_t upload_rows = 0;       // ...the upload's dim-0 size and that dim's byte stride
  int64_t upload_stride_bytes = 0;
  int64_t mark_rows = 0;         // kMarked: the batch size and the byte stride of the marked dim
  int64_t mark_stride_bytes = 0;
  // Batch fact (DESIGN.md §7): version `fact_version` of the value holds a batch of `fact_rows` rows
  // laid out [outer][rows][fact_row_bytes], batch `fact_batch` (a global id: values stored with one
  // id pair row by row). Valid while the real data is that version. Set by an upload (a hint: dim
  // 0, `fact_hint`) and by plans for the batch-sharded values they store, so that a later plan reads
  // them chunk by chunk. (Program's mutex at record time, the flush mutex after a plan.)
  uint32_t fact_version = 0;
  bool fact_hint = false;
  uint64_t fact_batch = 0;
  int64_t fact_rows = 0;
  int64_t fact_row_bytes = 0;
  uint64_t last_writer_seq = 0;  // seq of the latest node that writes this buffer (maybe executed)
  uint32_t pending_writes = 0;   // pending nodes that write it (defs and in-place writes)
  uint32_t tape_number = 0;      // its number in the Program's tape (ir/tape.h) while tape_stamp is the tape's
  uint64_t tape_stamp = 0;
  uint64_t sweep_stamp = 0;      // Program::collect_dead's scratch

  const uint64_t id;
  // Cleared by the phantom DataPtr deleter when no tensor or storage refers to the buffer any more.
  // Once false it never becomes true again: nothing can name the buffer to read it.
  std::atomic<bool> storage_alive{true};
  // True while the buffer holds data of its own (real storage, or a pending upload's host snapshot):
  // its death while a pending node still names it is worth a sweep (Program::collect_dead).
  std::atomic<bool> holds_data{false};
  // execute/fuse.cpp's scratch while it finds a stage's chains (flush mutex): while fuse_stamp is the
  // chain's, the chain's node at stage position fuse_pos holds this buffer's value. (Last: the
  // fields above keep their cache lines.)
  uint32_t fuse_pos = 0;
  uint64_t fuse_stamp = 0;

  bool has_real() const {
    return static_cast<bool>(real);
  }
  void set_real(c10::Storage s, bool on_host = false);
  void drop_real();
};

using BufferPtr = c10::intrusive_ptr<LazyBuffer>;

// The phantom deleter counts buffers that die holding data while something else (a pending node)
// still refers to them; Program::collect_dead() sweeps when the count moved since its last sweep.
void note_dead_pinned();
uint64_t dead_pinned_count();

// Number of buffers currently holding real data (for safe backing-device changes).
int64_t buffers_with_real_data();
// Bytes of real storage held by buffers (resident memory; the CUDA path reports this).
int64_t resident_bytes();
// Total LazyBuffers alive (leak checks in tests).
int64_t buffers_alive();

} // namespace lazymem
