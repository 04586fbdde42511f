// ops: what the recorder needs to know about an op beyond its schema, computed once per op.
// Tags and schema give most of it; the small tables in op_rules.cpp give the rest (ops that must
// run eagerly, in-place ops that overwrite without reading, ops that are no-ops on lazymem).
// The batch-splitting placement rules will join this registry, one file per op family.
#pragma once

#include <cstdint>
#include <vector>

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/ivalue.h>

#include "core/rng_form.h"

namespace lazymem {

struct OpRules {
  // Output shape or result depends on data (nonzero, unique, item): flush and run for real.
  bool eager = false;
  // Eager only when an index in a Tensor?[] argument is a bool/byte mask (boolean indexing).
  bool eager_if_mask_index = false;
  // Nothing to do on lazymem (record_stream): returns without recording.
  bool noop = false;
  // Consumes a random generator.
  bool random = false;
  // In-place op whose written argument's previous contents are not read (fill_, copy_, normal_).
  bool overwrites_self = false;
  // TensorIterator-based (pointwise tag, copy_, fill_): eager checks written arguments for internal
  // overlap and partial overlap with inputs, which Python meta kernels do not; the recorder does.
  bool iterator_overlap_checks = false;
  // Has a CompositeExplicitAutogradNonFunctional kernel: a structured op whose C++ meta function is
  // the one eager runs (same checks, same messages), while the Meta key may hold a Python meta kernel.
  bool structured = false;
  // Floating-point arguments cannot change the output metadata (pointwise ops, _foreach_ ops): the
  // meta cache keys them by type only, so AdamW's per-step scalars do not miss every step.
  bool float_values_shape_free = false;
  // add, sub, mul, div (Tensor overloads, in place or not): TensorIterator on the CPU converts a
  // wrapped Python number to the tensor's float dtype on every call (Tensor.to, an allocation and a
  // copy); the recorder hands the kernel the number already converted (recorder.cpp).
  bool casts_wrapped_number = false;
  // Some outputs are placeholders whose shape differs between meta inference and the CPU kernel
  // (native_batch_norm's saved statistics in eval mode): tolerated, values left uninitialized.
  bool placeholder_outputs = false;
  // No tensor returns and no mutable arguments: kept for its side effect (asserts).
  bool effect_only = false;
  // A torch.distributed collective (lazymem::c10d_*, dist/collectives.cpp): effectful although it
  // writes its tensors; every rank runs it once, whole, in program order.
  bool collective = false;
  int32_t generator_arg = -1;
  // An int argument naming per-call state rather than structure (the ragged sink's collector
  // token): left out of meta-cache keys and plan fingerprints.
  int32_t state_arg = -1;
  std::vector<int32_t> device_args;
  // For each argument: 0 = not written, 1 = written (in-place), 2 = written out= argument.
  std::vector<uint8_t> writes;
  bool any_write = false;
  bool has_tensor_list_return = false;
};

// Rules for `op`; cached, thread-safe.
const OpRules& op_rules(const c10::OperatorHandle& op);

// How a call of a random op (`args` boxed as recorded: tensor slots None) draws, and how its draws
// are reproduced when it runs chunk by chunk (core/rng_form.h; ops/rules_rng.cpp). kNone for ops
// that are not random.
RngForm random_form(const c10::OperatorHandle& op, const std::vector<c10::IValue>& args);

} // namespace lazymem
