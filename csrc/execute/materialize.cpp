// execute: flush orchestration.
#include "execute/materialize.h"

#include <mutex>

#include "core/check.h"
#include "core/config.h"
#include "core/runtime.h"
#include "execute/executor.h"
#include "ir/program.h"

namespace lazymem {
namespace {

std::mutex g_flush_mu;
thread_local bool t_in_flush = false;

struct InFlush {
  InFlush() {
    t_in_flush = true;
  }
  ~InFlush() {
    t_in_flush = false;
  }
};

const bool g_hooks_installed = [] {
  flush_hooks().flush_until = [](uint64_t seq) { flush_until_seq(seq); };
  return true;
}();

} // namespace

void flush_until_seq(uint64_t upto) {
  if (upto == 0) return;
  LAZYMEM_CHECK(!t_in_flush, "a lazymem value was needed while lazymem was already materializing on "
                "this thread (for example from a kernel or a hook run during replay); this is not supported");
  std::lock_guard<std::mutex> lock(g_flush_mu);
  InFlush guard;
  Segment seg = Program::get().take_prefix(upto);
  if (seg.nodes.empty()) return;
  execute_segment(seg);
}

std::unique_lock<std::mutex> lock_flush() {
  LAZYMEM_CHECK(!t_in_flush, "a lazymem value was read while lazymem was materializing on this thread");
  return std::unique_lock<std::mutex>(g_flush_mu);
}

void materialize(const std::vector<LazyBuffer*>& bufs) {
  uint64_t upto = 0;
  for (LazyBuffer* b : bufs) upto = std::max(upto, Program::get().pending_writer(*b));
  flush_until_seq(upto);
  std::lock_guard<std::mutex> lock(g_flush_mu);
  for (LazyBuffer* b : bufs) {
    if (b->poison) std::rethrow_exception(b->poison);
  }
}

void maybe_auto_flush() {
  const Config& c = config();
  uint64_t max_nodes = c.flush_threshold_nodes.load(std::memory_order_relaxed);
  uint64_t max_bytes = c.flush_threshold_bytes.load(std::memory_order_relaxed);
  if (!max_nodes && !max_bytes) return;
  if (t_in_flush) return;
  Program& p = Program::get();
  bool over = (max_nodes && p.pending_count() >= max_nodes) || (max_bytes && p.pending_def_bytes() >= max_bytes);
  if (!over) return;
  stats().auto_flushes.fetch_add(1, std::memory_order_relaxed);
  flush_until_seq(p.last_seq());
}

} // namespace lazymem
