// execute: the binder between replay and buffers' real storage. Replay asks it for the real view of
// each operand and hands it each result; the binder answers from the Plan's bindings: whole
// buffers (LazyBuffer::real) in whole stages; in loop stages, per chunk, chunk-local storages
// (localized views), full storages narrowed to the chunk's rows (resident values, results assembled
// on the device or in host memory, host snapshots of uploads) and partials that are accumulated.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/SmallVector.h>

#include <memory>
#include <utility>
#include <vector>

#include "execute/transfer.h"
#include "plan/plan.h"

namespace lazymem {

class Binder {
 public:
  explicit Binder(const Stage& stage);

  // Loop stages: the chunk of batch rows [start, start + rows) begins; every chunk-local storage is
  // empty.
  void begin_chunk(int64_t start, int64_t rows);
  // Loop stages: `pn` runs next. Its rows in this chunk (PlannedNode::rows) are what chunk_start() and
  // chunk_rows() say, and what rewritten arguments, host constants and random draws follow. False
  // when the chunk holds none of them: the node does not run in this chunk.
  bool begin_node(const PlannedNode& pn);
  int64_t chunk_start() const {
    return node_start_;
  }
  int64_t chunk_rows() const {
    return node_rows_;
  }

  // The real view for node->uses[i] (allocating storage for a buffer first touched here). A value
  // held in host memory is copied into a device temporary (its chunk's rows, or whole), once per
  // node run; one the node writes is copied back when it is done (execute/transfer.h).
  at::Tensor use(const PlannedNode& pn, size_t i);
  // The view of node->uses[i] in its home (host memory for a value held there): what the undo log
  // saves and restores.
  at::Tensor home(const PlannedNode& pn, size_t i);
  // The host constant `c` narrowed to the chunk's rows.
  c10::IValue constant(const PlannedNode& pn, const ConstNarrow& c) const;
  // Binds the kernel's result for node->defs[i]: adopted as the buffer's (or slot's) storage when its
  // geometry matches, otherwise copied into it. `taken` lists storages already adopted by this node.
  void def(const PlannedNode& pn, size_t i, const at::Tensor& result,
           c10::SmallVector<const c10::StorageImpl*, 8>& taken);
  // The expected view (recorded, localized or narrowed) of node->defs[i] in the current chunk.
  TensorMeta def_meta(const PlannedNode& pn, size_t i) const;
  // The view of node->defs[i]'s value once bound (allocating its storage if it has none yet).
  at::Tensor bound_def(const PlannedNode& pn, size_t i);
  bool in_loop() const {
    return stage_.loop;
  }
  // The rows the running node has in all (the batch's, or its map's).
  int64_t batch() const {
    return node_total_;
  }
  // The rows this chunk binds of a value shaped as the operand bound by `bd` (a use's or def's
  // binding of the running node): `full` narrowed along the batch dim. `full` itself in whole
  // stages and for operands bound whole. (A random node's stream: execute/streams.cpp.)
  at::Tensor rows_along(const Bound* bd, const at::Tensor& full) const;
  // Device bytes of the copies of host-held values made since the last call (lazymem's own
  // transients, not the kernel's workspace: the executor learns workspace without them).
  int64_t take_copied_bytes() {
    return std::exchange(copied_bytes_, 0);
  }
  // Device bytes of the storage allocated for the running node's operands (a buffer it writes first,
  // or one grown), counted before allocating: kept values the memory model counts, not the kernel's
  // workspace, even when their allocation was the one refused.
  int64_t operand_storage_bytes() const {
    return operand_storage_bytes_;
  }
  // A node run begins: no device copy of an earlier run (one that failed before done()) is reused.
  void begin_run() {
    copies_.clear();
    copied_bytes_ = 0;
    operand_storage_bytes_ = 0;
  }
  // After the node ran: device copies of host-held values it wrote go back to host memory; in whole
  // stages, buffers it wrote now hold its versions.
  void done(const PlannedNode& pn);

  // Loop stages: starts copying to the device the rows [start, start + rows) of the host-held values
  // `pn` reads (every node's when null) that are copied ahead (copied_ahead): the next chunk's, once
  // `pn` has read this chunk's. use() takes the copy when the node runs for those rows; one for other
  // rows (a chunk run again smaller) is dropped there. A copy that cannot be allocated is not started
  // (the node copies when it runs).
  void copy_ahead(const PlannedNode* pn, int64_t start, int64_t rows);

  // Loop stages: adds the slot's partial into its accumulator (the first chunk's partial becomes it).
  void accumulate(int32_t slot);
  // Loop stages: drops a chunk-local storage.
  void free_slot(int32_t slot) {
    local_[slot] = c10::Storage();
  }
  // Loop stages, after `pn` ran in the chunk (outside the node's measured window, as its slots are
  // freed): drops the kept rows (KeptRows) whose last reader it is.
  void after_node(const PlannedNode& pn);
  void end_chunk();

 private:
  at::Tensor slot_view(int32_t slot, const TensorMeta& meta, bool partial);
  c10::Storage& slot_storage(int32_t slot);
  int64_t slot_bytes(int32_t slot) const; // what slot_storage allocates for this chunk

  // The rows [first, first + count) of a view with `map` in this chunk.
  std::pair<int64_t, int64_t> rows_of(const RowMap& map) const {
    const auto [first, last] = map.local(c0_, c1_);
    return {first, last - first};
  }

  // The device copy of a host-held view for the running node (use i, or def i as ~i): of its
  // contents when `fill`; copied back at done() when `back`.
  at::Tensor device_copy(int64_t key, const at::Tensor& home, bool back, bool fill);
  struct Copy {
    int64_t key;
    at::Tensor home, device;
    bool back;
  };
  c10::SmallVector<Copy, 2> copies_; // of the running node
  // The copy started ahead for node->uses[i] in the chunk whose rows of it are [first, first + count),
  // taken by use() (into copies_) when it matches.
  at::Tensor take_ahead(const PlannedNode& pn, size_t i, const at::Tensor& home);
  struct Ahead {
    const PlannedNode* pn;
    size_t use;
    int64_t first, count;
    std::unique_ptr<PendingCopy> copy;
  };
  // Rows the chunk writes into a host-held value and reads again (plan.h KeptRows): the kernel's
  // result (`device`, for the rows `home` of the value in host memory) from the writer through the
  // last reader, which read views of it (kept_view) instead of copying the rows back in. For a shared
  // read, the first reader's device copy of its rows `home`.
  struct Kept {
    KeptRows rows;
    at::Tensor device, home;
  };
  std::vector<Kept> kept_;
  bool kept_known_ = false;
  size_t node_index(const PlannedNode& pn) const; // in stage_.nodes (SIZE_MAX: not one of them)
  void keep(const PlannedNode& pn, size_t i, const at::Tensor& home, const at::Tensor& r,
            const c10::SmallVector<const c10::StorageImpl*, 8>& taken);
  at::Tensor kept_view(const PlannedNode& pn, size_t i, const at::Tensor& home) const;
  // A shared read's first reader (use i of `pn`) copied `home` to `d`: kept for the later readers.
  void keep_read(const PlannedNode& pn, size_t i, const at::Tensor& home, const at::Tensor& d);
  std::vector<std::pair<const PlannedNode*, size_t>> aheadable_; // uses copied ahead in this loop
  std::vector<Ahead> ahead_;
  int64_t copied_bytes_ = 0;
  int64_t operand_storage_bytes_ = 0;

  const Stage& stage_;
  c10::SmallVector<c10::Storage, 16> local_;
  std::vector<char> acc_started_; // per accumulator: a chunk's partial became it in this loop
  int64_t c0_ = 0, c1_ = 0; // the chunk's batch rows
  int64_t node_start_ = 0, node_rows_ = 0, node_total_ = 0;
};

// A view over `storage` (on the backing device, or on the host when `host`) with `meta`'s geometry.
at::Tensor storage_view(const c10::Storage& storage, const TensorMeta& meta, bool host = false);

} // namespace lazymem
