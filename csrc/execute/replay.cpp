// execute: node replay.
#include "execute/replay.h"

#include <optional>

#include <ATen/Context.h>
#include <ATen/ops/empty.h>
#include <c10/core/GradMode.h>

#include "core/boxed.h"
#include "core/check.h"
#include "core/config.h"
#include "core/runtime.h"
#include "device/generator.h"
#include "execute/real.h"
#include "execute/streams.h"
#include "execute/transfer.h"

namespace lazymem {
namespace {

c10::IValue copy_if_list(const c10::IValue& v) {
  return v.isList() ? c10::IValue(v.toList().copy()) : v;
}

void place(torch::jit::Stack& stack, int32_t arg, int32_t elem, c10::IValue v) {
  c10::IValue& slot = stack[arg];
  if (elem < 0) {
    slot = std::move(v);
  } else {
    slot.toList().set(elem, std::move(v));
  }
}

const c10::IValue& ret_value(const torch::jit::Stack& stack, const Def& d, c10::IValue& scratch) {
  const c10::IValue& r = stack[d.ret];
  if (d.elem < 0) return r;
  scratch = r.toList().get(d.elem);
  return scratch;
}

int64_t rewritten(const ArgRewrite& rw, const Binder& binder) {
  switch (rw.kind) {
    case ArgRewrite::kRows:
      return rw.base + rw.scale * binder.chunk_rows();
    case ArgRewrite::kStart:
      return rw.base + rw.scale * binder.chunk_start();
    case ArgRewrite::kEnd:
      return rw.base + rw.scale * (binder.chunk_start() + binder.chunk_rows());
    case ArgRewrite::kConst:
      break;
  }
  return rw.base;
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

} // namespace

void redispatch_with(const c10::OperatorHandle& op, torch::jit::Stack& stack, c10::ArrayRef<int32_t> device_args,
                     int32_t generator_arg, const at::Generator& g, bool grad_mode) {
  for (int32_t d : device_args) {
    if (!stack[d].isNone()) stack[d] = c10::IValue(backing_device());
  }
  c10::AutoGradMode grad(grad_mode);
  const c10::DispatchKeySet ks(backing_key());
  if (generator_arg >= 0) {
    stack[generator_arg] = c10::IValue(g);
    redispatch_boxed(op, ks, &stack);
  } else {
    DefaultGeneratorLoan loan(g);
    redispatch_boxed(op, ks, &stack);
  }
}

void redispatch_on_backing(const c10::OperatorHandle& op, torch::jit::Stack& stack, size_t first,
                           c10::ArrayRef<int32_t> device_args, int32_t generator_arg, LazyGenerator* gen,
                           bool grad_mode) {
  for (int32_t d : device_args) {
    if (!stack[first + d].isNone()) stack[first + d] = c10::IValue(backing_device());
  }
  c10::AutoGradMode grad(grad_mode);
  const c10::DispatchKeySet ks(backing_key());
  if (!gen) {
    redispatch_boxed(op, ks, &stack);
    return;
  }
  at::Generator ours = gen->backing();
  if (generator_arg >= 0) {
    stack[first + generator_arg] = c10::IValue(ours);
    redispatch_boxed(op, ks, &stack);
  } else {
    DefaultGeneratorLoan loan(ours);
    redispatch_boxed(op, ks, &stack);
  }
}

namespace {

uint64_t mix(uint64_t seed, int64_t block) {
  uint64_t x = seed + 0x9e3779b97f4a7c15ull * static_cast<uint64_t>(block + 1);
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

at::Tensor rows_of(const at::Tensor& v, std::pair<int8_t, int64_t> at, int64_t first, int64_t count) {
  return v.narrow(at.first, first * at.second, count * at.second);
}

// The node's row-keyed state, made the first time it runs split: its seed is one draw from its
// generator; the batch dims of its operands are the plan's.
const Node::RowKeyed& row_keyed(const PlannedNode& pn, const Binder& binder) {
  Node& n = *pn.node;
  if (!n.row_keyed) {
    auto rk = std::make_shared<Node::RowKeyed>();
    if (!n.drawn) {
      DrawOrder::before(n);
      n.row_seed = row_keyed_seed(n);
      n.drawn = true;
    }
    rk->seed = n.row_seed;
    rk->block = pn.rng_block;
    rk->rows = binder.batch();
    auto dim_of = [](const Bound& b) {
      return b.bind == Bind::kLocal || b.bind == Bind::kNarrow ? std::make_pair(b.dim, b.unit)
                                                                : std::make_pair(int8_t{-1}, int64_t{1});
    };
    for (const Bound& b : pn.uses) rk->uses.push_back(dim_of(b));
    for (const Bound& b : pn.defs) rk->defs.push_back(dim_of(b));
    for (const ConstNarrow& c : pn.consts) {
      LAZYMEM_INTERNAL_ASSERT(c.outer == 1, "a gathered host constant of a random node: ", n.describe());
      rk->consts.push_back({c.arg, c.elem, c.dim, c.unit});
    }
    n.row_keyed = rk;
  }
  return *n.row_keyed;
}

// A random node keyed by batch rows: one kernel call per block of rows, each with a generator
// seeded by (node seed, block). A block the chunk cuts through (ragged chunks) is drawn whole into
// a temporary and its chunk's rows copied: only for fills, whose only batched operand is the one
// they write (the planner uses one-row blocks for ops that read batched inputs).
void replay_row_keyed(const PlannedNode& pn, Binder& binder, torch::jit::Stack& stack) {
  Node& n = *pn.node;
  const Node::RowKeyed& rk = row_keyed(pn, binder);
  stats().random_row_keyed.fetch_add(1, std::memory_order_relaxed);
  const bool loop = binder.in_loop();
  const int64_t s0 = loop ? binder.chunk_start() : 0;
  const int64_t rows = loop ? binder.chunk_rows() : rk.rows;
  std::vector<at::Tensor> uv(n.uses.size()), dv(n.defs.size());
  for (size_t k = 0; k < n.uses.size(); ++k) {
    uv[k] = binder.use(pn, k);
    if (boundary_checked()) check_on_device(uv[k], n, "operand", k);
  }
  for (size_t j = 0; j < n.defs.size(); ++j) dv[j] = binder.bound_def(pn, j);
  const int64_t G = rk.block;
  for (int64_t b = s0 / G; b * G < s0 + rows; ++b) {
    const int64_t lo = std::max(b * G, s0), hi = std::min((b + 1) * G, s0 + rows);
    const int64_t block_end = std::min((b + 1) * G, rk.rows);
    const bool cut = lo != b * G || hi != block_end;
    const int64_t first = cut ? b * G : lo, count = cut ? block_end - b * G : hi - lo;
    stack.clear();
    for (const auto& a : n.args) stack.push_back(copy_if_list(a));
    for (const auto& c : rk.consts) {
      const c10::IValue& v = c[1] < 0 ? n.args[c[0]] : n.args[c[0]].toList().get(c[1]);
      place(stack, static_cast<int32_t>(c[0]), static_cast<int32_t>(c[1]),
            c10::IValue(v.toTensor().narrow(c[2], first * c[3], count * c[3])));
    }
    for (const ArgRewrite& rw : pn.rewrites) place(stack, rw.arg, rw.elem, c10::IValue(rewritten(rw, binder)));
    std::vector<std::pair<size_t, at::Tensor>> temps; // written operands drawn into a whole block
    for (size_t k = 0; k < n.uses.size(); ++k) {
      at::Tensor v = uv[k];
      if (rk.uses[k].first >= 0) {
        v = rows_of(v, rk.uses[k], lo - s0, hi - lo);
        // A kernel draws its numbers in the order of the memory it fills: a block is drawn into a
        // dense batch-major temporary whenever the chunk's storage is not one (a block the chunk cuts,
        // a time-major value's rows), so every row gets the same numbers whatever the chunking.
        if (cut || (n.uses[k].write && !v.is_contiguous())) {
          LAZYMEM_INTERNAL_ASSERT(n.uses[k].write, n.describe(), ": a chunk cuts a random block of an input");
          std::vector<int64_t> sizes(v.sizes().begin(), v.sizes().end());
          sizes[rk.uses[k].first] = count * rk.uses[k].second;
          at::Tensor t = at::empty(sizes, v.options());
          temps.emplace_back(k, t);
          v = t;
        }
      }
      place(stack, n.uses[k].arg, n.uses[k].elem, c10::IValue(std::move(v)));
    }
    at::Generator g = make_backing_generator(mix(rk.seed, b));
    redispatch_with(pn.op, stack, n.device_args, n.generator_arg, g, n.grad_mode);
    c10::IValue scratch;
    for (size_t j = 0; j < n.defs.size(); ++j) {
      if (!dv[j].defined()) continue;
      at::Tensor r = ret_value(stack, n.defs[j], scratch).toTensor();
      if (rk.defs[j].first < 0) {
        dv[j].copy_(r);
        continue;
      }
      if (cut) r = rows_of(r, rk.defs[j], lo - first, hi - lo);
      rows_of(dv[j], rk.defs[j], lo - s0, hi - lo).copy_(r);
    }
    for (auto& [k, t] : temps) {
      rows_of(uv[k], rk.uses[k], lo - s0, hi - lo).copy_(rows_of(t, rk.uses[k], lo - first, hi - lo));
    }
  }
  for (size_t i = 0; i < n.defs.size(); ++i) {
    if (i < pn.post_div.size() && pn.post_div[i] != 0 && dv[i].defined()) dv[i].div_(pn.post_div[i]);
  }
  binder.done(pn);
  stack.clear();
}

} // namespace

namespace {
thread_local bool t_reached_kernel = false;
} // namespace

bool replay_reached_kernel() {
  return t_reached_kernel;
}

void replay(const PlannedNode& pn, Binder& binder, torch::jit::Stack& stack) {
  Node& n = *pn.node;
  t_reached_kernel = false;
  std::optional<at::Generator> reseeded; // a row-keyed seed drawn while the node was pending
  if (n.random) {
    t_reached_kernel = true; // (the stream and row-keyed paths bind as they run: taken as reached)
    if (n.stream || pn.rng_stream) {
      stack.clear();
      replay_from_stream(pn, binder);
      return;
    }
    if (pn.rng_block > 0 || n.row_keyed) {
      replay_row_keyed(pn, binder, stack);
      return;
    }
    if (n.drawn && rng_form_draws(n.rng_form)) {
      // Its draws were taken in program order while it was pending (a row-keyed form off the CPU):
      // it draws from them, not again from the generator's stream.
      reseeded = make_backing_generator(n.row_seed);
    } else if (rng_form_draws(n.rng_form)) {
      DrawOrder::before(n);
    }
  }
  stack.clear();
  for (const auto& a : n.args) stack.push_back(copy_if_list(a));
  for (const ConstNarrow& c : pn.consts) place(stack, c.arg, c.elem, binder.constant(pn, c));
  for (const ArgRewrite& rw : pn.rewrites) place(stack, rw.arg, rw.elem, c10::IValue(rewritten(rw, binder)));
  c10::SmallVector<const c10::StorageImpl*, 8> taken;
  const bool check = boundary_checked();
  for (size_t i = 0; i < n.uses.size(); ++i) {
    const Use& u = n.uses[i];
    // An upload is the copy from host memory itself: into its destination's home, wherever that is.
    const bool upload_dst = n.upload && u.write;
    at::Tensor v = upload_dst ? binder.home(pn, i) : binder.use(pn, i);
    if (upload_dst && u.ref.buf->real_on_host) await_copies_out(v.storage().unsafeGetStorageImpl()); // (written on the host)
    if (check && !upload_dst) check_on_device(v, n, "operand", i);
    taken.push_back(v.storage().unsafeGetStorageImpl());
    place(stack, u.arg, u.elem, c10::IValue(std::move(v)));
  }
  if (n.upload && n.uses.size() == 1 && !n.uses[0].ref.buf->real_on_host) {
    // Host to device: counted (the snapshot's bytes this chunk copies).
    const c10::IValue& src = stack.at(1);
    if (src.isTensor()) count_transfer(static_cast<int64_t>(src.toTensor().numel() * src.toTensor().element_size()), true);
  }
  t_reached_kernel = true;
  if (reseeded) {
    redispatch_with(pn.op, stack, n.device_args, n.generator_arg, *reseeded, n.grad_mode);
  } else {
    redispatch_on_backing(pn.op, stack, 0, n.device_args, n.generator_arg,
                          static_cast<LazyGenerator*>(n.generator.get()), n.grad_mode);
  }
  if (n.random) n.drawn = true;
  c10::IValue scratch;
  for (size_t i = 0; i < n.defs.size(); ++i) {
    const Def& d = n.defs[i];
    const c10::IValue& r = ret_value(stack, d, scratch);
    try {
      binder.def(pn, i, r.toTensor(), taken);
    } catch (const c10::OutOfMemoryError&) {
      throw; // retryable: the node goes back to the program
    } catch (const std::exception& e) {
      d.ref.buf->poison = annotate_node_error(e, "lazymem: " + n.describe() + ": ");
    }
    if (i < pn.post_div.size() && pn.post_div[i] != 0) binder.bound_def(pn, i).div_(pn.post_div[i]);
  }
  if (pn.post_div_written != 0) {
    for (size_t k = 0; k < n.uses.size(); ++k) {
      if (n.uses[k].write) binder.use(pn, k).div_(pn.post_div_written);
    }
  }
  binder.done(pn);
  stack.clear(); // drop the real views and results now: buffers are released right after their last use
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

} // namespace lazymem
