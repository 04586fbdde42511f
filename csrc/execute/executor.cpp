// execute: the plan walker.
#include "execute/executor.h"

#include <cstdio>
#include <optional>

#include <ATen/core/stack.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/DeviceGuard.h>

#include "core/check.h"
#include "core/config.h"
#include "core/runtime.h"
#include "execute/bind.h"
#include "execute/real.h"
#include "execute/replay.h"
#include "plan/workspace.h"

namespace lazymem {
namespace {

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

c10::Storage allocate_host(size_t nbytes) {
  // Host memory is not the device's: allocated outside any counting scope.
  CountingScope none(nullptr);
  return c10::Storage(c10::Storage::use_byte_size_t(), nbytes, c10::GetCPUAllocator(), /*resizable=*/false);
}

class Walker {
 public:
  explicit Walker(const Plan& plan) : plan_(plan) {}

  ExecOutcome run() {
    for (LazyBuffer* b : plan_.release_unused) b->drop_real();
    for (size_t s = 0; s < plan_.stages.size(); ++s) {
      const Stage& st = plan_.stages[s];
      bool ok = st.loop ? run_loop(st) : run_whole(st, s);
      if (!ok) {
        out_.stage = s;
        return out_;
      }
    }
    return out_;
  }

 private:
  // Runs one node, poisoning its outputs on failure. Returns false on out of memory.
  bool run_node(const PlannedNode& pn, Binder& binder, int64_t rows) {
    const Node& n = *pn.node;
    if (std::exception_ptr poison = input_poison(n)) {
      poison_outputs(n, poison);
      return true;
    }
    try {
      if (counting_) device_counter().reset_node_peak();
      replay(pn, binder, stack_);
      ++out_.executed;
      if (counting_) {
        learn(pn, rows);
        if (config().debug >= 3) {
          std::fprintf(stderr, "[lazymem]   %s rows %lld: measured %lld, predicted %lld\n", n.name(),
                       static_cast<long long>(rows), static_cast<long long>(device_counter().node_peak()),
                       static_cast<long long>(pn.predicted));
        }
        if (device_counter().node_peak() > node_peak_) {
          node_peak_ = device_counter().node_peak();
          out_.peak_node = &n;
        }
      }
    } catch (const c10::OutOfMemoryError&) {
      stack_.clear();
      out_.oom = std::current_exception();
      out_.oom_site = n.describe();
      return false;
    } catch (const std::exception& e) {
      stack_.clear();
      auto ep = annotate_node_error(e, failure_prefix(n));
      poison_outputs(n, ep);
      if (!out_.first_error) out_.first_error = ep;
    }
    return true;
  }

  // The node's transient bytes beyond what it left allocated (its outputs): its workspace.
  void learn(const PlannedNode& pn, int64_t rows) {
    int64_t ws = device_counter().node_peak() - device_counter().allocated();
    if (ws > 0) Workspace::get().observe(workspace_key(pn), &pn.op.schema(), rows, ws);
  }

  bool run_whole(const Stage& st, size_t s) {
    Binder binder(st);
    for (size_t p = 0; p < st.nodes.size(); ++p) {
      const PlannedNode& pn = st.nodes[p];
      if (!run_node(pn, binder, 0)) {
        out_.node = p;
        return false;
      }
      for (LazyBuffer* b : pn.release) b->drop_real();
    }
    return true;
  }

  bool run_loop(const Stage& st) {
    for (const FullStore& f : st.stores) {
      if (f.buf->has_real()) continue;
      size_t n = f.buf->nbytes.load();
      try {
        f.buf->set_real(f.host ? allocate_host(n) : allocate_real(n), f.host);
      } catch (const c10::OutOfMemoryError&) {
        out_.oom = std::current_exception();
        out_.oom_site = "the storage assembling b" + std::to_string(f.buf->id) + " (" + format_bytes(n) + ")";
        abandon_loop(st);
        return false;
      }
    }
    Binder binder(st);
    for (int64_t start = 0; start < st.batch; start += st.chunk) {
      const int64_t rows = std::min(st.chunk, st.batch - start);
      binder.begin_chunk(start, rows);
      for (const PlannedNode& pn : st.nodes) {
        if (!run_node(pn, binder, rows)) {
          binder.end_chunk();
          abandon_loop(st);
          return false;
        }
        for (int32_t slot : pn.accumulate) {
          if (!st.slots[slot].buf->poison) binder.accumulate(slot);
        }
        for (int32_t slot : pn.free_slots) binder.free_slot(slot);
      }
      binder.end_chunk();
      if (config().debug >= 3) {
        std::fprintf(stderr, "[lazymem]   chunk at row %lld done: %lld bytes allocated, %lld held by buffers\n",
                     static_cast<long long>(start), static_cast<long long>(device_counter().allocated()),
                     static_cast<long long>(resident_bytes()));
      }
    }
    for (const Accumulator& a : st.accs) {
      LazyBuffer& b = *a.buf;
      if (b.poison || !b.has_real()) continue;
      try {
        if (a.finalize == Finalize::kDivConst) {
          real_view(b, a.meta).div_(a.divisor);
        } else if (a.finalize == Finalize::kDivOutput) {
          LazyBuffer& d = *a.divide_by;
          real_view(b, a.meta).div_(real_view(d, TensorMeta{{}, {}, 0, a.meta.dtype}));
        }
      } catch (const std::exception& e) {
        b.poison = annotate_node_error(e, "lazymem: finishing a split reduction failed: ");
      }
      b.real_version = a.version;
    }
    for (const auto& [b, version] : st.written) b->real_version = version;
    for (LazyBuffer* b : st.release_after) b->drop_real();
    return true;
  }

  // A loop that ran out of memory restarts as a whole: what it assembled or accumulated goes.
  void abandon_loop(const Stage& st) {
    for (const Accumulator& a : st.accs) a.buf->drop_real();
    for (const FullStore& f : st.stores) f.buf->drop_real();
  }

  const Plan& plan_;
  ExecOutcome out_;
  torch::jit::Stack stack_;
  const bool counting_ = backing_device().is_cpu(); // the counting allocator sees every byte
  int64_t node_peak_ = 0;
};

} // namespace

ExecOutcome execute(const Plan& plan) {
  device_counter().reset_window_peak();
  ReplayScope scope;
  std::optional<c10::DeviceGuard> device_guard;
  if (!backing_device().is_cpu()) device_guard.emplace(backing_device());
  ExecOutcome out = Walker(plan).run();
  out.peak = backing_device().is_cpu() ? device_counter().window_peak() : resident_bytes();
  return out;
}

} // namespace lazymem
