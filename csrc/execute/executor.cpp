// execute: node replay, output adoption, poisoning and out-of-memory recovery.
#include "execute/executor.h"

#include <chrono>
#include <cstdio>

#include <ATen/Context.h>
#include <ATen/core/stack.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/GradMode.h>

#include "core/check.h"
#include "core/config.h"
#include "core/runtime.h"
#include "device/generator.h"
#include "execute/real.h"
#include "ops/op_rules.h"
#include "plan/schedule.h"

namespace lazymem {
namespace {

c10::IValue copy_if_list(const c10::IValue& v) {
  return v.isList() ? c10::IValue(v.toList().copy()) : v;
}

void place(torch::jit::Stack& stack, const Use& u, at::Tensor t) {
  c10::IValue& slot = stack[u.arg];
  if (u.elem < 0) {
    slot = std::move(t);
  } else {
    slot.toList().set(u.elem, c10::IValue(std::move(t)));
  }
}

const c10::IValue& ret_value(const torch::jit::Stack& stack, const Def& d, c10::IValue& scratch) {
  const c10::IValue& r = stack[d.ret];
  if (d.elem < 0) return r;
  scratch = r.toList().get(d.elem);
  return scratch;
}

// Ops without a Generator argument draw from the backing device's default generator: lend it this
// node's generator state for the duration of the kernel.
class DefaultGeneratorLoan {
 public:
  explicit DefaultGeneratorLoan(at::Generator ours)
      : ours_(std::move(ours)), def_(at::globalContext().defaultGenerator(backing_device())) {
    std::scoped_lock lock(def_.mutex(), ours_.mutex());
    saved_ = def_.clone();
    def_.set_state(ours_.get_state());
  }
  ~DefaultGeneratorLoan() {
    try {
      std::scoped_lock lock(def_.mutex(), ours_.mutex());
      ours_.set_state(def_.get_state());
      def_.set_state(saved_.get_state());
    } catch (...) {
      // A failure to restore generator state cannot be reported from a destructor; the stream
      // continues from wherever the kernel left the default generator.
    }
  }

 private:
  at::Generator ours_;
  at::Generator def_;
  at::Generator saved_;
};

using Taken = c10::SmallVector<const c10::StorageImpl*, 8>;

void adopt_or_copy(const Def& d, const at::Tensor& r, Taken& taken, bool placeholder) {
  LazyBuffer& b = *d.ref.buf;
  const TensorMeta& m = d.ref.meta;
  LAZYMEM_INTERNAL_ASSERT(r.defined(), "kernel returned an undefined tensor where meta inference promised ",
                          m.to_string());
  const c10::StorageImpl* rs = r.has_storage() ? r.storage().unsafeGetStorageImpl() : nullptr;
  // Only plain dense results are adopted: a ZeroTensor (efficientzerotensor) has a sized storage with
  // no memory behind it, and other functionality keys (conj/neg bits, Python) change what the bytes mean.
  bool plain = rs && (rs->data_ptr().get() != nullptr || rs->nbytes() == 0) &&
      !r.key_set().has_any(c10::DispatchKeySet({c10::DispatchKey::ZeroTensor, c10::DispatchKey::Python}));
  bool adopt = plain && !b.has_real() && r.device() == backing_device() && r.scalar_type() == m.dtype &&
      r.sizes().equals(m.sizes) && r.strides().equals(m.strides) && r.storage_offset() == m.offset &&
      r.is_conj() == m.conj && r.is_neg() == m.neg && rs->nbytes() >= b.nbytes.load() &&
      std::find(taken.begin(), taken.end(), rs) == taken.end();
  if (adopt) {
    b.set_real(r.storage());
    taken.push_back(rs);
    return;
  }
  if (!r.sizes().equals(m.sizes)) {
    // The kernel disagrees with meta inference on this output's shape. Known placeholders
    // (native_batch_norm's saved statistics in eval mode, empty on the CPU, sized in meta) keep the
    // meta shape with uninitialized values, as placeholders are never read; anything else fails
    // for this output alone (reads of it raise; the node's other outputs are fine).
    LAZYMEM_CHECK(placeholder && (r.numel() == 0 || m.numel() == 0), "meta inference and the ", backing_device(),
                  " kernel disagree on the shape of output ", d.ret, ": ", m.to_string(), " vs ", r.sizes(),
                  "; this output cannot be used on lazymem (please report the op)");
    ensure_real(b, m.extent_bytes());
    return;
  }
  // Meta and real strides can differ for ops without structured kernels: the recorded metadata is
  // authoritative, so the values are copied into the layout every lazymem view expects.
  stats().outputs_copied.fetch_add(1, std::memory_order_relaxed);
  if (config().debug) {
    std::fprintf(stderr, "[lazymem] output %d copied: recorded %s, kernel returned strides %s offset %lld\n", d.ret,
                 m.to_string().c_str(), c10::str(r.strides()).c_str(), static_cast<long long>(r.storage_offset()));
  }
  ensure_real(b, m.extent_bytes());
  real_view(b, m).copy_(r);
}

// `stack` is the caller's, reused from node to node (it keeps its capacity).
void run_node(Node& n, torch::jit::Stack& stack) {
  stack.clear();
  for (const auto& a : n.args) stack.push_back(copy_if_list(a));
  Taken taken;
  for (const Use& u : n.uses) {
    LazyBuffer& b = *u.ref.buf;
    if (!u.full_overwrite()) {
      LAZYMEM_INTERNAL_ASSERT(b.has_real() ? b.real_version == u.ref.version : u.ref.version == 0,
                              n.describe(), " reads b", b.id, " version ", u.ref.version,
                              " but the executor holds version ", b.real_version,
                              b.has_real() ? "" : " (no data)");
    }
    ensure_real(b, u.ref.meta.extent_bytes());
    taken.push_back(b.real.unsafeGetStorageImpl());
    place(stack, u, real_view(u.ref));
  }
  redispatch_on_backing(n.op, stack, 0, n.device_args, n.generator_arg,
                        static_cast<LazyGenerator*>(n.generator.get()), n.grad_mode);
  c10::IValue scratch;
  const bool placeholder = op_rules(n.op).placeholder_outputs;
  for (const Def& d : n.defs) {
    const c10::IValue& r = ret_value(stack, d, scratch);
    try {
      adopt_or_copy(d, r.toTensor(), taken, placeholder);
    } catch (const c10::OutOfMemoryError&) {
      throw; // retryable: the node goes back to the program
    } catch (const std::exception& e) {
      d.ref.buf->poison = annotate_node_error(e, "lazymem: " + n.describe() + ": ");
    }
    d.ref.buf->real_version = d.ref.version;
  }
  for (const Use& u : n.uses) {
    if (!u.write) continue;
    u.ref.buf->real_version = u.write_version;
    if (u.full_overwrite()) u.ref.buf->poison = nullptr;
  }
  stack.clear(); // drop the real views and results now: buffers are released right after their last use
}

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

} // namespace

void redispatch_on_backing(const c10::OperatorHandle& op, torch::jit::Stack& stack, size_t first,
                           c10::ArrayRef<int32_t> device_args, int32_t generator_arg, LazyGenerator* gen,
                           bool grad_mode) {
  for (int32_t d : device_args) {
    if (!stack[first + d].isNone()) stack[first + d] = c10::IValue(backing_device());
  }
  c10::AutoGradMode grad(grad_mode);
  const c10::DispatchKeySet ks(backing_key());
  if (!gen) {
    op.redispatchBoxed(ks, &stack);
    return;
  }
  at::Generator ours = gen->backing();
  if (generator_arg >= 0) {
    stack[first + generator_arg] = c10::IValue(ours);
    op.redispatchBoxed(ks, &stack);
  } else {
    DefaultGeneratorLoan loan(ours);
    op.redispatchBoxed(ks, &stack);
  }
}

std::exception_ptr annotate_node_error(const std::exception& e, const std::string& prefix) {
  const c10::SourceLocation loc{__func__, __FILE__, static_cast<uint32_t>(__LINE__)};
#define LAZYMEM_REWRAP(T)                                            \
  if (auto* x = dynamic_cast<const T*>(&e)) {                        \
    return std::make_exception_ptr(T(loc, prefix + x->msg()));       \
  }
  LAZYMEM_REWRAP(c10::OutOfMemoryError)
  LAZYMEM_REWRAP(c10::IndexError)
  LAZYMEM_REWRAP(c10::ValueError)
  LAZYMEM_REWRAP(c10::TypeError)
  LAZYMEM_REWRAP(c10::NotImplementedError)
  LAZYMEM_REWRAP(c10::LinAlgError)
  LAZYMEM_REWRAP(c10::Error)
#undef LAZYMEM_REWRAP
  return std::make_exception_ptr(std::runtime_error(prefix + e.what()));
}

void execute_segment(Segment& seg) {
  std::vector<const Node*> nodes;
  nodes.reserve(seg.nodes.size());
  for (const auto& n : seg.nodes) nodes.push_back(n.get());
  auto live_out = [&](const LazyBuffer& b) { return seg.is_live_out(b); };
  Schedule s = plan_segment(nodes, live_out);
  if (config().debug >= 2) std::fprintf(stderr, "[lazymem] %s", s.to_string(nodes).c_str());

  auto t0 = std::chrono::steady_clock::now();
  // Dead values no executed node touches (e.g. inputs of eliminated nodes) go before anything runs.
  for (LazyBuffer* b : s.release_unused) b->drop_real();
  device_counter().reset_window_peak();
  ReplayScope scope;
  std::optional<c10::DeviceGuard> device_guard;
  if (!backing_device().is_cpu()) device_guard.emplace(backing_device());
  std::exception_ptr first_error;
  size_t executed = 0;
  auto finish = [&] {
    auto& st = stats();
    if (executed) st.materializations.fetch_add(1, std::memory_order_relaxed);
    st.nodes_executed.fetch_add(executed, std::memory_order_relaxed);
    st.nodes_eliminated.fetch_add(s.eliminated, std::memory_order_relaxed);
    int64_t peak = backing_device().is_cpu() ? device_counter().window_peak() : resident_bytes();
    st.peak_bytes.store(peak, std::memory_order_relaxed);
    if (config().debug) {
      double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
      std::fprintf(stderr, "[lazymem] materialized: %zu nodes run, %zu eliminated, peak %s, %.2f ms\n",
                   executed, s.eliminated, format_bytes(peak).c_str(), ms);
    }
  };

  torch::jit::Stack stack;
  for (size_t p = 0; p < s.run.size(); ++p) {
    Node& n = *seg.nodes[s.run[p]];
    if (std::exception_ptr poison = input_poison(n)) {
      poison_outputs(n, poison);
    } else {
      try {
        run_node(n, stack);
        ++executed;
      } catch (const c10::OutOfMemoryError& e) {
        std::vector<NodePtr> rest;
        for (size_t q = p; q < s.run.size(); ++q) rest.push_back(std::move(seg.nodes[s.run[q]]));
        size_t remaining = rest.size();
        std::string prefix = "lazymem: out of memory while materializing " + n.describe() + ". Nothing was lost: " +
            std::to_string(remaining) +
            " recorded ops are still pending and run when memory is available (free tensors or raise the "
            "capacity, then read the value again). ";
        Program::get().restore_prefix(std::move(rest));
        finish();
        std::rethrow_exception(annotate_node_error(e, prefix));
      } catch (const std::exception& e) {
        auto ep = annotate_node_error(e, failure_prefix(n));
        poison_outputs(n, ep);
        if (!first_error) first_error = ep;
      }
    }
    for (LazyBuffer* b : s.release[p]) b->drop_real();
    seg.nodes[s.run[p]].reset(); // drop the node now: its CPU snapshots and buffer references go too
  }
  finish();
  if (first_error) std::rethrow_exception(first_error);
}

} // namespace lazymem
