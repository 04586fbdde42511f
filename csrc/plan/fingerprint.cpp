// plan: the fingerprint of a planner input (see plan/reuse.h): everything the planner reads, in a
// canonical order — per node the id of its cached meta result (or all of it), its buffers
// numbered by first appearance and versions relative to each buffer's first reference (the nodes'
// tape, ir/tape.h: the Program's, written as they were recorded, or one built here); per buffer the
// facts the plan depends on; the buffers the sync point reads; the budget policy, memory held,
// chunking and recompute settings and the workspace model's generation.
#include "plan/reuse.h"

#include <algorithm>
#include <cstring>
#include <c10/util/hash.h>

#include "core/check.h"
#include "core/config.h"
#include "plan/workspace.h"

namespace lazymem {
namespace {

struct KeyWriter {
  std::vector<uint64_t>& k;
  size_t n = 0; // words written (k is kept larger)
  size_t cap = 0;
  uint64_t* p = nullptr;

  // Writes from the start of `key`, which keeps its size (its room) unless it must grow.
  explicit KeyWriter(std::vector<uint64_t>& key, size_t expect) : k(key) {
    p = k.data();
    cap = k.size();
    reserve(std::max<size_t>(expect, 64));
  }
  __attribute__((noinline)) void grow(size_t need) {
    k.resize(std::max(need, 2 * k.size()));
    p = k.data();
    cap = k.size();
  }
  // Room for `more` words written with raw().
  void reserve(size_t more) {
    if (__builtin_expect(n + more > cap, 0)) grow(n + more);
  }
  void raw(uint64_t v) {
    p[n++] = v;
  }
  void put(uint64_t v) {
    if (__builtin_expect(n == cap, 0)) grow(n + 1);
    p[n++] = v;
  }
  void put_i(int64_t v) {
    put(static_cast<uint64_t>(v));
  }
  void copy(const uint64_t* src, size_t count) {
    if (!count) return; // (src may be null: an empty vector's data())
    reserve(count);
    std::memcpy(p + n, src, count * sizeof(uint64_t));
    n += count;
  }
};

std::atomic<uint64_t> g_stamps{uint64_t{1} << 60}; // apart from the memory model's stamps

bool same_tape(const Tape& a, const Tape& b) {
  return a.nodes == b.nodes && a.describable == b.describable && a.words == b.words && a.buffers == b.buffers &&
         a.base == b.base;
}

} // namespace

void fingerprint(const PlanInput& in, Fingerprint& fp) {
  fp.words = 0;
  fp.hash = 0;
  fp.budget = -1;
  fp.whole_budget = -1;
  fp.cacheable = false;
  // The Program's tape when it describes exactly these nodes; else one built now (cold reads).
  thread_local Tape built;
  const Tape* tape = in.tape;
  const bool kept = tape != nullptr && tape->valid && tape->nodes == in.nodes.size();
  if (!kept || config().check_tape.load(std::memory_order_relaxed)) {
    built.reset(Tape::Scratch::kPlanner);
    for (const Node* n : in.nodes) built.add(*n);
    LAZYMEM_INTERNAL_ASSERT(!kept || same_tape(*tape, built), "the program's tape differs from its ", in.nodes.size(),
                            " nodes");
  }
  if (kept) {
    stats().fingerprints_from_tape.fetch_add(1, std::memory_order_relaxed);
  } else {
    tape = &built;
  }
  KeyWriter w(fp.key, tape->words.size() + tape->buffers.size() * 4 + 64);
  w.copy(tape->words.data(), tape->words.size()); // the nodes
  // Per buffer, in the tape's numbering, the facts the plan depends on. The buffers are numbered in
  // the planner's scratch for the needed ones below.
  const uint64_t stamp = g_stamps.fetch_add(1, std::memory_order_relaxed) + 1;
  const std::vector<LazyBuffer*>& bufs = tape->buffers;
  fp.buffers.assign(bufs.begin(), bufs.end());
  fp.base.assign(tape->base.begin(), tape->base.end());
  const size_t nb = bufs.size();
  thread_local std::vector<uint64_t> ids; // batch ids of facts, by first appearance
  ids.clear();
  for (size_t c = 0; c < std::min<size_t>(nb, 8); ++c) __builtin_prefetch(&bufs[c]->nbytes);
  for (size_t c = 0; c < nb; ++c) {
    LazyBuffer* b = bufs[c];
    if (c + 8 < nb) {
      __builtin_prefetch(&bufs[c + 8]->nbytes);
      __builtin_prefetch(&bufs[c + 8]->real);
    }
    if (c + 3 < nb && bufs[c + 3]->has_real()) __builtin_prefetch(bufs[c + 3]->real.unsafeGetStorageImpl());
    if (b->poison) return;
    b->plan_stamp = stamp;
    b->plan_bytes = static_cast<int64_t>(c);
    w.reserve(7);
    w.raw(b->nbytes.load(std::memory_order_relaxed));
    w.raw(uint64_t{b->has_real()} | (uint64_t{b->real_on_host} << 1) | (static_cast<uint64_t>(b->batch_hint) << 2) |
          (uint64_t{in.live_out(*b)} << 4));
    if (b->has_real()) {
      w.raw(b->real.nbytes());
      w.raw(static_cast<uint64_t>(static_cast<int64_t>(b->real_version) - static_cast<int64_t>(fp.base[c])));
    }
    // A batch fact still valid (plan/solve.cpp): its layout, whether a hint, and its batch id
    // numbered by first appearance (the ids themselves differ from step to step).
    if (b->fact_version != 0 && b->has_real() && b->real_version == b->fact_version) {
      uint64_t id = 0;
      if (b->fact_batch != 0) {
        auto at = std::find(ids.begin(), ids.end(), b->fact_batch);
        id = static_cast<uint64_t>(at - ids.begin()) + 1;
        if (at == ids.end()) ids.push_back(b->fact_batch);
      }
      w.put_i(b->fact_rows);
      w.put_i(b->fact_row_bytes);
      w.put((id << 1) | uint64_t{b->fact_hint});
    }
    if (b->batch_hint == LazyBuffer::BatchHint::kMarked) {
      w.put_i(b->mark_rows);
      w.put_i(b->mark_stride_bytes);
    }
  }
  // The buffers the sync point reads, by number.
  thread_local std::vector<uint64_t> needed;
  needed.clear();
  for (LazyBuffer* b : in.needed) {
    if (b->plan_stamp != stamp) return; // needed but not in the program: not cached
    needed.push_back(static_cast<uint64_t>(b->plan_bytes));
  }
  std::sort(needed.begin(), needed.end());
  needed.erase(std::unique(needed.begin(), needed.end()), needed.end());
  w.put(needed.size());
  w.copy(needed.data(), needed.size());
  // The budget is not in the key (free memory moves a little between steps): a stored plan is
  // reused while its predicted peak fits and the budget has not grown much (see reuse_plan).
  fp.budget = in.budget;
  fp.whole_budget = in.whole_budget;
  w.put(uint64_t{in.budget < 0});
  fp.resident = in.resident;
  w.put_i(in.force_chunks);
  w.put_i(in.chunk_node_ns);
  w.put(uint64_t{in.keep_pending} | (uint64_t{config().debug.load(std::memory_order_relaxed) >= 3} << 1) |
        (static_cast<uint64_t>(in.recompute) << 2));
  w.put(Workspace::get().generation());
  fp.words = w.n;
  fp.cacheable = tape->describable;
  // The hash only picks the candidate entry (keys are compared whole): a sample of the key.
  uint64_t h = fp.words;
  const size_t step = std::max<size_t>(1, fp.words / 64);
  for (size_t i = 0; i < fp.words; i += step) h = c10::hash_combine(h, fp.key[i]);
  fp.hash = h;
}

} // namespace lazymem
