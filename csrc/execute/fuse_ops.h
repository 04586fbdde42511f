// execute: the ops fuse.h runs as one loop, and what a node of them reads and writes (fuse.cpp's
// analysis of a planned node; internal to execute/fuse*).
#pragma once

#include <cstdint>

#include <c10/core/ScalarType.h>

#include "ir/node.h"
#include "plan/plan.h"

namespace lazymem::fuse {

// Each a correctly rounded IEEE operation, or exact, evaluated as eager's CPU kernel evaluates it.
enum class Op : uint8_t {
  kAdd, kSub, kMul, kDiv, kMaximum, kMinimum, // binary
  kThresholdBackward,                         // (self, grad): self <= p ? 0 : grad
  kNeg, kRecip, kAbs, kSquare, kCube, kInvSquare, // unary
  kClampMin, kClampMax, kClamp                // unary with bounds p (and q)
};

// A host number an op reads: converted to the op's dtype when it runs, as ATen converts a CPU scalar
// operand (static_cast from its own type, so an int64 is not rounded twice through a double).
struct Number {
  bool is_int = false;
  int64_t i = 0;
  double d = 0;
  template <typename T>
  T as() const {
    return is_int ? static_cast<T>(i) : static_cast<T>(d);
  }
};

// One operand of a fusible node: a host number, or a tensor the node reads (one of its uses).
struct Operand {
  enum Kind : uint8_t { kNone, kNumber, kTensor } kind = kNone;
  uint32_t use = 0;
  Number number;
};

// A node as the analysis found it: fusible (ok), its op, operands and numbers.
struct Fusible {
  bool ok = false;
  Op op = Op::kAdd;
  Operand a, b;   // b: kNone for unary ops
  Number p, q;    // bounds (clamp), the threshold (threshold_backward)
  int32_t out = -1; // an out= or in-place form: the use it writes (else its def is the result)
  bool inplace = false;
  c10::ScalarType dtype = c10::ScalarType::Undefined;
  int64_t numel = 0;
};

// The node's op on dense float or double operands of its result's size, read and written as fuse.h
// says; not ok otherwise.
Fusible analyze(const PlannedNode& pn);

// Whether two views of a buffer are one view (offset, sizes and strides: conservative, a reshape of
// the same elements is another view).
inline bool same_view(const TensorMeta& a, const TensorMeta& b) {
  return a.offset == b.offset && a.sizes == b.sizes && a.strides == b.strides;
}

// A fusible node's result: its def, or the use its out= or in-place form writes.
inline const TensorRef& result_of(const Node& n, int32_t out) {
  return out < 0 ? n.defs[0].ref : n.uses[static_cast<size_t>(out)].ref;
}

} // namespace lazymem::fuse
