// record: one intercepted op call, analysed. The tensor arguments are classified (lazymem,
// CPU scalar, constant host tensor), mixed devices are rejected the way eager rejects CPU/CUDA
// mixes, and every shape-relevant property is folded into a key for the meta-inference cache.
#pragma once

#include <memory>
#include <vector>

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <c10/util/SmallVector.h>

#include "ir/node.h"
#include "ops/op_rules.h"

namespace lazymem {

struct TensorArg {
  enum Kind : uint8_t { kLazy, kCpuScalar, kConstant };
  int32_t arg = -1;
  int32_t elem = -1;
  const at::Tensor* tensor = nullptr; // borrowed from the call's stack, alive for the whole record_call
  const at::Tensor& t() const { return *tensor; }
  Kind kind = kLazy;
  uint8_t write = 0;  // OpRules::writes of its argument
  int32_t alias = -1; // kLazy: index of the first lazy tensor argument on the same storage
};

struct CallKey {
  c10::SmallVector<int64_t, 48> words;
  size_t hash = 0;
  bool operator==(const CallKey& o) const {
    return hash == o.hash && words.size() == o.words.size() &&
        std::equal(words.begin(), words.end(), o.words.begin());
  }
};
struct CallKeyHash {
  size_t operator()(const CallKey& k) const {
    return k.hash;
  }
};

struct Call {
  Call(const c10::OperatorHandle& o, const OpRules& r, torch::jit::Stack* s, bool b = false)
      : op(o), rules(r), stack(s), num_args(o.schema().arguments().size()), borrowed(b) {}
  const c10::OperatorHandle& op;
  const OpRules& rules;
  torch::jit::Stack* stack;
  size_t num_args;
  bool borrowed; // the stack's tensors are borrowed (record_call): never dropped, never copied for nothing
  c10::SmallVector<TensorArg, 6> tensors;
  CallKey key;
  bool cacheable = true;
  bool has_mask_index = false;  // a bool/byte tensor inside a Tensor?[] argument

  const c10::IValue& arg(size_t i) const {
    return (*stack)[stack->size() - num_args + i];
  }
  c10::IValue& arg(size_t i) {
    return (*stack)[stack->size() - num_args + i];
  }
};

// Classifies the arguments and builds the cache key. Non-lazymem tensors are accepted as constants
// when `allow_constants` (the source of a host-to-lazymem copy) or inside a Tensor?[] index list;
// otherwise they raise eager's "Expected all tensors to be on the same device" error.
void analyze_call(Call& call, bool allow_constants);

} // namespace lazymem
