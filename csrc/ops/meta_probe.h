// ops: meta probes. Runs an op on meta tensors of given geometry (no data, no device) and reports
// its outputs' shapes and dtypes, or that it refused them. The planner probes every node it will run
// on a chunk's shapes: an op whose shape arguments carry the batch in a way its rule did not rewrite
// disagrees with the localized outputs, and runs whole instead of giving a wrong answer. Results are
// cached by the call's geometry and arguments.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/ivalue.h>
#include <ATen/core/stack.h>
#include <c10/util/SmallVector.h>

namespace lazymem {

struct ProbeTensor {
  int32_t arg = -1;
  int32_t elem = -1;
  c10::SmallVector<int64_t, 5> sizes;
  c10::SmallVector<int64_t, 5> strides;
  int64_t offset = 0;
  c10::ScalarType dtype = c10::ScalarType::Undefined;
  int32_t storage = -1;       // operands with the same storage id alias one meta storage
  int64_t storage_bytes = 0;
};

struct ProbeOutput {
  struct Item {
    int32_t ret = -1;
    int32_t elem = -1;                 // position in a list return, or -1
    std::vector<int64_t> sizes;
    c10::ScalarType dtype = c10::ScalarType::Undefined; // Undefined: an undefined tensor / None
  };
  std::vector<Item> items;
  const Item* find(int32_t ret, int32_t elem) const {
    for (const Item& i : items) {
      if (i.ret == ret && i.elem == elem) return &i;
    }
    return nullptr;
  }
};

// The dtype the backing device's kernel gives result `ret` of `op` where its meta kernel gives
// another (nullopt: meta is right). torch 2.11's meta _scaled_dot_product_flash_attention_for_cpu
// gives its logsumexp float32 for double inputs; the CPU kernel (and 2.13's meta) the inputs' opmath
// type. `input` is the op's first tensor argument's dtype.
std::optional<c10::ScalarType> backing_result_dtype(const c10::OperatorHandle& op, size_t ret,
                                                     c10::ScalarType input);

// `args`: the boxed arguments with tensor slots to be filled from `tensors` (their other values are
// used as given). nullopt when the meta kernel raises or does not exist.
// The meta kernels a probe runs before the Meta key's: record/ installs eager's C++ ones where Python
// ones shadow them, and lazymem's own for Python-only ops (record/cpp_meta.h, record/native_meta.h),
// so that a probe runs what meta inference runs. True when it ran the op.
using MetaFirst = bool (*)(const c10::OperatorHandle& op, torch::jit::Stack& stack);
void set_meta_first(MetaFirst f);

std::optional<ProbeOutput> meta_probe(const c10::OperatorHandle& op, const std::vector<c10::IValue>& args,
                                      const std::vector<ProbeTensor>& tensors);

} // namespace lazymem
