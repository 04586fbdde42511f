// record: shape, dtype and alias inference by running the op on meta mirrors. Mirrors share one
// meta StorageImpl per lazymem storage, so overlap checks and in-place/aliasing rules behave as on
// a real device, and a returned alias can be traced back to the lazymem storage it views. Results
// are cached by the call key: a repeated op with the same metadata skips the meta run.
#pragma once

#include <memory>
#include <vector>

#include "record/call.h"

namespace lazymem {

struct OutSpec {
  enum Kind : uint8_t {
    kNone,  // undefined tensor / None
    kNew,   // fresh buffer
    kView,  // view of the storage of call.tensors[src]
    kSelf,  // returns call.tensors[src] itself (in-place / out=)
    kValue, // a non-tensor value, returned as is
  };
  Kind kind = kNone;
  int32_t src = -1;
  TensorMeta meta;
  size_t nbytes = 0; // kNew: storage size
  c10::IValue value;
};

struct RetSpec {
  bool is_list = false;
  bool optional = false;
  std::vector<OutSpec> items;
};

// Metadata change of a written lazymem argument (out= resize): new geometry and storage size.
struct Mutation {
  int32_t tensor = -1; // index into call.tensors
  TensorMeta meta;
  size_t storage_nbytes = 0;
};

struct MetaResult {
  std::vector<RetSpec> rets;
  std::vector<Mutation> mutations;
  size_t new_outs = 0; // items of kind kNew (a node's defs)
  // Unique per result ever made (never reused): nodes recorded from a cached result share it, and
  // equal ids mean equal call keys — the op, its arguments and operand geometry (Node::sig).
  uint64_t id = 0;
};

// Returns the (possibly cached) meta result, or nullptr when the op has no usable meta kernel
// (the caller then runs it eagerly). User errors (bad shapes, dtypes) propagate as eager raises them.
std::shared_ptr<const MetaResult> infer_meta(Call& call);

void clear_meta_cache();
size_t meta_cache_size();

// A tensor with t's metadata (dtype, sizes, strides, offset, requires_grad) on the backing device
// and no memory behind it: what a kernel-choice function (SDPA's, batch norm's) reads, never data.
// Undefined for an undefined t.
at::Tensor metadata_twin(const at::Tensor& t);

} // namespace lazymem
