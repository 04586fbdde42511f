// execute: workspace probes (see ws_probe.h).
#include "execute/ws_probe.h"

#include <chrono>
#include <mutex>
#include <string>
#include <tuple>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include <cstdio>
#include <cstring>

#include <ATen/core/Tensor.h>
#include <ATen/core/stack.h>

#include "core/config.h"
#include "core/runtime.h"
#include "execute/memory.h"
#include "execute/real.h"
#include "execute/replay.h"
#include "plan/probe.h"
#include "plan/timing.h"
#include "plan/workspace.h"

namespace lazymem {
namespace {

// Op families whose kernels allocate beyond their outputs. Only these: a kernel run on a geometry it
// was not recorded with must be one whose shape checks are known to hold it (and the meta kernel is
// asked first).
bool in_families(const c10::FunctionSchema& s) {
  static const char* const kFamilies[] = {
      "aten::_transformer_encoder_layer_fwd", "aten::_native_multi_head_attention", "aten::_scaled_dot_product",
      "aten::_flash_attention", "aten::_efficient_attention", "aten::lstm", "aten::gru", "aten::rnn_",
      "aten::_fused_adam", "aten::_fused_sgd", "aten::_fused_adagrad", "aten::convolution", "aten::_convolution",
      "aten::mkldnn_convolution", "aten::_slow_conv2d", "aten::slow_conv", "aten::_cdist", "aten::embedding_dense_backward",
      "aten::_embedding_bag", "aten::_ctc_loss"};
  const std::string& name = s.name();
  for (const char* f : kFamilies) {
    if (name.rfind(f, 0) == 0) return true;
  }
  return false;
}

bool allocates_inside(const c10::FunctionSchema& s) {
  static std::mutex mu;
  static std::unordered_map<const c10::FunctionSchema*, bool> families;
  std::lock_guard<std::mutex> lock(mu);
  auto it = families.find(&s);
  if (it == families.end()) it = families.emplace(&s, in_families(s)).first;
  return it->second;
}

// Keys a probe could not run (the kernel refused zeros, or its geometry): not probed again.
std::mutex g_refused_mu;
std::unordered_set<uint64_t> g_refused;

MemoryCounter& probe_counter() {
  static MemoryCounter* c = new MemoryCounter("lazymem's workspace probes");
  return *c;
}

// Runs `op` on zeros of `call`'s geometry on the backing device; the bytes its kernel held beyond
// its outputs, or -1 when it refused (a probe teaches nothing then; the real run still learns).
// With `ns`, the kernel's wall time too.
int64_t measure(const PlannedNode& pn, const ChunkCall& call, int64_t* ns = nullptr) {
  const Node& n = *pn.node;
  if (!meta_accepts(pn, call)) return -1; // the geometry is refused: never run the kernel on it
  try {
    ReplayScope scope;
    CountingScope counting(&probe_counter(), /*workers=*/true);
    torch::jit::Stack stack;
    for (const auto& a : call.args) stack.push_back(a.isList() ? c10::IValue(a.toList().copy()) : a);
    std::unordered_map<int32_t, c10::Storage> storages;
    for (const ProbeTensor& t : call.tensors) {
      c10::Storage& st = storages[t.storage];
      if (!st) {
        st = allocate_real(static_cast<size_t>(t.storage_bytes));
        if (t.storage_bytes > 0) std::memset(st.mutable_data(), 0, static_cast<size_t>(t.storage_bytes));
      }
      auto impl = c10::make_intrusive<c10::TensorImpl>(c10::Storage(st), c10::DispatchKeySet(backing_key()),
                                                       caffe2::TypeMeta::fromScalarType(t.dtype));
      impl->set_sizes_and_strides(t.sizes, t.strides, t.offset);
      at::Tensor v(std::move(impl));
      if (t.elem < 0) {
        stack[t.arg] = std::move(v);
      } else {
        stack[t.arg].toList().set(t.elem, c10::IValue(std::move(v)));
      }
    }
    probe_counter().reset_node_peak();
    const auto start = std::chrono::steady_clock::now();
    redispatch_on_backing(pn.op, stack, 0, n.device_args, n.generator_arg, nullptr, n.grad_mode);
    if (ns) {
      *ns = std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start).count();
    }
    return probe_counter().node_peak() - probe_counter().allocated();
  } catch (const std::exception&) {
    return -1;
  }
}

} // namespace

bool probe_workspace(const Plan& plan) {
  // Measured by the counting allocator (the CPU backing device); a reused plan's keys were probed
  // when it was made.
  if (!backing_device().is_cpu() || plan.reused || !config().workspace_probes.load(std::memory_order_relaxed)) return false;
  // The probes' operands are device memory beside what the program holds: within the plan's budget
  // too (a budget no allocator enforces was exceeded here, outside any plan's run). A probe that
  // does not fit is refused; the real run learns the workspace.
  ScopedBudgetLimit limit(plan.budget);
  Workspace& ws = Workspace::get();
  bool learned = false;
  std::unordered_map<const LazyBuffer*, int32_t> ids;
  auto storage_of = [&](const LazyBuffer* b) { return ids.emplace(b, static_cast<int32_t>(ids.size())).first->second; };
  for (const Stage& st : plan.stages) {
    for (const PlannedNode& pn : st.nodes) {
      const Node& n = *pn.node;
      if (n.random || n.effectful || n.defs.empty() || !allocates_inside(pn.op.schema())) continue;
      const uint64_t key = workspace_key(pn);
      if (ws.knows(key)) continue;
      {
        std::lock_guard<std::mutex> lock(g_refused_mu);
        if (g_refused.count(key)) continue;
      }
      int64_t at[3] = {-1, -1, -1};
      if (st.loop) {
        for (int64_t r : {1, 2}) {
          if (r > st.batch) break;
          ChunkCall call = chunk_call(st, pn, 0, r, storage_of);
          if (call.rows == 0) break;
          at[r] = measure(pn, call);
        }
        for (int64_t r : {1, 2}) {
          if (at[r] >= 0 && ws.observe(key, &pn.op.schema(), r, at[r])) learned = true;
        }
      } else {
        // A whole node: its rows along dim 0 of its first output; operands of that extent narrowed.
        const int64_t N = n.defs[0].ref.meta.sizes.empty() ? 0 : n.defs[0].ref.meta.sizes[0];
        if (N < 3) continue;
        for (int64_t r : {1, 2}) {
          ChunkCall call = whole_call_narrowed(pn, N, r, storage_of);
          at[r] = measure(pn, call);
        }
        if (at[1] < 0 || at[2] < 0) {
          std::lock_guard<std::mutex> lock(g_refused_mu);
          g_refused.insert(key);
          continue;
        }
        const int64_t estimate = std::max(at[1], at[2]) + std::max<int64_t>(0, at[2] - at[1]) * (N - 2);
        if (estimate > 0 && ws.observe(key, &pn.op.schema(), 0, estimate, Workspace::kEstimate)) learned = true;
      }
      if (at[1] < 0 || at[2] < 0) {
        std::lock_guard<std::mutex> lock(g_refused_mu);
        g_refused.insert(key);
      }
      if (at[1] >= 0 && config().debug >= 2) {
        std::fprintf(stderr, "[lazymem] workspace probe of %s: %lld bytes at 1 row, %lld at 2\n", n.describe().c_str(),
                     static_cast<long long>(at[1]), static_cast<long long>(at[2]));
      }
    }
  }
  return learned;
}

bool probe_node_times(const Plan& plan) {
  if (!backing_device().is_cpu() || plan.reused || !plan.unpriced ||
      !config().workspace_probes.load(std::memory_order_relaxed)) {
    return false;
  }
  // The nodes the pricing reads: run again in a later loop, of no time measured yet.
  std::vector<std::tuple<const Stage*, const PlannedNode*, uint64_t>> todo;
  std::unordered_set<uint64_t> keys;
  for (const Stage& st : plan.stages) {
    if (!st.loop || st.chunk <= 0) continue;
    for (const PlannedNode& pn : st.nodes) {
      if (!pn.recompute) continue;
      const uint64_t key = node_time_key(pn);
      if (node_ns_per_row(key) || !keys.insert(key).second) continue;
      // (Zeros would not draw or act as the node does: the plan stays unpriced. An in-place node
      // writes zeros of its own.)
      if (pn.node->random || pn.node->effectful) return false;
      todo.emplace_back(&st, &pn, key);
    }
  }
  if (todo.empty()) return false;
  // Operands beside what the program holds, within the plan's budget (as the workspace probes).
  ScopedBudgetLimit limit(plan.budget);
  std::unordered_map<const LazyBuffer*, int32_t> ids;
  auto storage_of = [&](const LazyBuffer* b) { return ids.emplace(b, static_cast<int32_t>(ids.size())).first->second; };
  std::vector<std::tuple<uint64_t, int64_t, int64_t>> learned; // key, rows, ns
  for (auto [st, pn, key] : todo) {
    ChunkCall call = chunk_call(*st, *pn, 0, std::min(st->chunk, st->batch), storage_of);
    if (call.rows == 0) return false;
    int64_t best = -1;
    for (int run = 0; run < 2; ++run) {
      int64_t ns = 0;
      if (measure(*pn, call, &ns) < 0) { // refused: the first real run measures it
        if (config().debug >= 2) {
          std::fprintf(stderr, "[lazymem] time probe of %s refused: the plan recomputes unpriced\n",
                       pn->node->describe().c_str());
        }
        return false;
      }
      best = best < 0 ? ns : std::min(best, ns);
    }
    learned.emplace_back(key, call.rows, best);
  }
  for (auto [key, rows, ns] : learned) observe_node_time(key, rows, ns);
  if (config().debug >= 2) {
    std::fprintf(stderr, "[lazymem] time probes: %zu recomputed nodes timed on one chunk each\n", learned.size());
  }
  return true;
}

} // namespace lazymem
