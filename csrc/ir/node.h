// ir: the recorded program's vocabulary. A Node is one ATen op call with its boxed arguments; every
// lazymem tensor argument is replaced by a TensorRef (buffer + view metadata + version read), and
// every functional output names a fresh buffer. Nodes hold buffers, never tensors, so a tensor the
// user drops makes its buffer dead even while nodes still mention it.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/ivalue.h>
#include <c10/core/GeneratorImpl.h>
#include <c10/core/TensorImpl.h>
#include <c10/util/SmallVector.h>

#include "core/rng_form.h"
#include "ir/buffer.h"

namespace lazymem {

// View metadata of a tensor over its buffer.
struct TensorMeta {
  c10::SmallVector<int64_t, 5> sizes;
  c10::SmallVector<int64_t, 5> strides;
  int64_t offset = 0;
  c10::ScalarType dtype = c10::ScalarType::Undefined;
  bool conj = false;
  bool neg = false;

  static TensorMeta of(const c10::TensorImpl& t);
  // A dense row-major view from offset 0 (strides as an empty tensor of these sizes gets).
  static TensorMeta contiguous(c10::IntArrayRef sizes, c10::ScalarType dtype);
  int64_t numel() const;
  // Bytes from the start of the storage needed to hold every element of the view.
  size_t extent_bytes() const;
  // True if the view is dense, non-overlapping and covers exactly `nbytes` from offset 0.
  bool covers(size_t nbytes) const;
  // Dense and row-major, whatever the strides of dims of one element (any offset).
  bool row_major() const;
  // Writes sizes/strides/offset/conj/neg onto `t` (dtype must already match).
  void apply_to(c10::TensorImpl& t) const;
  std::string to_string() const;
};

// (The buffer, version and write fields come before the meta: the plan fingerprint reads them for
// every reference, cold, and finds them in one cache line.)
struct TensorRef {
  BufferPtr buf;
  uint32_t version = 0; // the buffer version this reference reads (assigned at append)
  TensorMeta meta;

  TensorRef() = default;
  TensorRef(BufferPtr b, TensorMeta m, uint32_t v) : buf(std::move(b)), version(v), meta(std::move(m)) {}
};

// A lazymem tensor argument: stack position `arg` (and list position `elem`, or -1).
struct Use {
  int32_t arg = -1;
  int32_t elem = -1;
  bool write = false;          // the op writes through this argument (in-place / out=)
  bool write_only = false;     // ...and does not read its previous contents (out=, fill_, copy_ dst)
  uint32_t write_version = 0;  // version produced by the write (assigned at append)
  TensorRef ref;
  size_t covered_nbytes = 0;   // buffer size the view densely covers from offset 0 (0 if it does not)

  // A write that replaces the buffer's whole value (earlier versions are not needed by it).
  bool full_overwrite() const {
    return write && write_only && covered_nbytes != 0 && covered_nbytes == ref.buf->nbytes.load(std::memory_order_relaxed);
  }
};

// A functional output: return position `ret` (and list position `elem`, or -1), a fresh buffer.
struct Def {
  int32_t ret = -1;
  int32_t elem = -1;
  TensorRef ref;
};

struct Node {
  explicit Node(c10::OperatorHandle o) : op(std::move(o)) {}

  uint64_t seq = 0;             // program order; assigned at append (increasing, with holes once
                                // nodes kept pending by a materialization are put back)
  // The cached meta result the node was recorded from (MetaResult::id), standing for everything
  // about it but its buffers, their versions, grad mode and row-keyed state: two nodes with the
  // same sig have the same op, arguments (floats where they matter), operand and result geometry,
  // uses and defs (plan/reuse.cpp fingerprints them by it). 0: none, or changed since recording.
  uint64_t sig = 0;
  c10::OperatorHandle op;       // the op replayed on the backing device
  std::vector<c10::IValue> args;// boxed arguments; lazymem tensor slots hold None until replay
  std::vector<Use> uses;
  std::vector<Def> defs;
  c10::SmallVector<int32_t, 1> device_args; // Device arguments rewritten to the backing device
  int32_t generator_arg = -1;   // Generator? argument position, if the schema has one
  c10::intrusive_ptr<c10::GeneratorImpl> generator; // lazymem generator of a random node
  bool random = false;          // consumes a generator: never eliminated, replayed in order
  bool effectful = false;       // no outputs but a side effect (asserts): never eliminated
  bool grad_mode = false;       // GradMode at record time: a few kernels read it (replay restores it)
  bool upload = false;          // copy_ of a host tensor (its snapshot in args[1]) into a lazymem buffer
  // A split plan kept it pending once already (its result survived, not needed, recomputed later):
  // a value still unread at the next plan is stored instead, so a chain of syncs that each leave it
  // unread (generation's KV cache, read by every later token) recomputes it at most once.
  bool kept = false;
  // Op rules the plan fingerprint reads (ir/tape.h), set by the recorder: floating-point arguments
  // cannot change placements (pointwise and _foreach_ ops), and the argument that is per-call state.
  bool floats_shape_free = false;
  int32_t state_arg = -1;
  // How it draws and how its draws are reproduced chunk by chunk (random nodes; set by the recorder).
  RngForm rng_form = RngForm::kNone;
  // Its draws were taken from its generator (it ran on it, its stream was generated, or its row-keyed
  // seed drawn): once, in program order (execute/streams.cpp).
  bool drawn = false;
  // Eager's draws for its whole value (core/rng_form.h), generated once, in program order, when it
  // first runs split or a later random node draws first; every chunk, recomputation, retry and later
  // plan reads them. In host memory (`host`) or on the device.
  struct Stream {
    at::Tensor values;
    bool host = true;
  };
  std::shared_ptr<const Stream> stream;
  // Row-keyed random draws (a form that is not eager's on the backing device, split): block b of `block` batch rows
  // draws from a generator seeded with mix(seed, b), so the same rows get the same numbers however
  // the batch is chunked, and a node kept pending draws them again when it runs later, split or not.
  struct RowKeyed {
    uint64_t seed = 0;
    uint32_t block = 1;
    int64_t rows = 0;                              // the batch
    std::vector<std::pair<int8_t, int64_t>> uses;  // per use: (batch dim, unit), dim -1 if none
    std::vector<std::pair<int8_t, int64_t>> defs;  // per def
    std::vector<std::array<int64_t, 4>> consts;    // host constants: (arg, elem, dim, unit)
  };
  std::shared_ptr<const RowKeyed> row_keyed;
  uint64_t row_seed = 0; // the row-keyed seed, once drawn (drawn)
  std::string site;             // where it was recorded (debug mode), for error messages

  const char* name() const {
    return op.operator_name().name.c_str();
  }
  std::string describe() const; // "aten::add.Tensor (op #12)" plus the recording site if known
  std::string to_string() const;
};

using NodePtr = std::unique_ptr<Node>;

// Node shells. A node the pipeline's worker ran is emptied and its storage kept, with its vectors'
// capacity, for the recording thread's next record, and the buffers it named go back to the recording
// thread to be dropped there. glibc frees a block into the arena of the thread that allocated it,
// under that arena's lock: the worker freeing what the recording thread made (nodes, buffers) held
// that lock against every allocation of the recording thread, whose futex wake-ups were then an
// eighth of its time. (A thread's own nodes are freed as usual: fresh allocations lie in program order,
// which later walks over a segment read faster than shells scattered in memory.)
NodePtr new_node(const c10::OperatorHandle& op);
// Empties the nodes and keeps their shells (up to a bound; the rest are freed). Null entries are
// skipped. The nodes' buffer references are moved to `released`: everything else they held is
// released now, as their destruction would.
void recycle_nodes(std::vector<NodePtr>& nodes, std::vector<BufferPtr>& released);

} // namespace lazymem
