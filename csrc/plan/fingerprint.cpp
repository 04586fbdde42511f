// plan: the fingerprint of a planner input (see plan/reuse.h): everything the planner reads, in a
// canonical order — per node the id of its cached meta result (or every word of it), its buffers
// numbered by first appearance and versions relative to each buffer's first reference (the nodes'
// tape, ir/tape.h: the Program's, written as they were recorded, or one built here); per buffer the
// facts the plan depends on; the buffers the sync point reads; the budget policy, memory held,
// chunking and recompute settings and the workspace model's generation.
#include "plan/reuse.h"

#include <algorithm>
#include <cstring>
#include <functional>

#include "core/check.h"
#include "core/config.h"
#include "ops/op_rules.h"
#include "plan/workspace.h"

namespace lazymem {
namespace {

struct KeyWriter {
  std::vector<uint64_t>& k;
  bool ok = true;
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
    reserve(count);
    std::memcpy(p + n, src, count * sizeof(uint64_t));
    n += count;
  }
  void put_d(double d) {
    uint64_t bits;
    std::memcpy(&bits, &d, sizeof(bits));
    put(bits);
  }

  void meta(const TensorMeta& m) {
    put(m.sizes.size() | (static_cast<uint64_t>(m.dtype) << 8) | (uint64_t{m.conj} << 16) | (uint64_t{m.neg} << 17));
    for (int64_t s : m.sizes) put_i(s);
    for (int64_t s : m.strides) put_i(s);
    put_i(m.offset);
  }
  void host_tensor(const at::Tensor& t) {
    if (!t.defined()) {
      put(1);
      return;
    }
    put(2 | (static_cast<uint64_t>(t.scalar_type()) << 8) | (static_cast<uint64_t>(t.device().type()) << 16) |
        (static_cast<uint64_t>(t.dim()) << 32));
    for (int64_t s : t.sizes()) put_i(s);
    for (int64_t s : t.strides()) put_i(s);
    put_i(t.storage_offset());
  }
  // An argument; floating-point values only when they can change placements (`floats`).
  void value(const c10::IValue& v, bool floats) {
    if (v.isNone()) {
      put(10);
    } else if (v.isInt()) {
      put(11);
      put_i(v.toInt());
    } else if (v.isBool()) {
      put(12 + v.toBool());
    } else if (v.isDouble()) {
      put(14);
      if (floats) put_d(v.toDouble());
    } else if (v.isSymInt()) {
      auto i = v.toSymInt().maybe_as_int();
      if (!i) {
        ok = false;
        return;
      }
      put(11);
      put_i(*i);
    } else if (v.isSymFloat()) {
      put(14);
      if (floats) put_d(v.toSymFloat().guard_float(__FILE__, __LINE__));
    } else if (v.isComplexDouble()) {
      put(15);
      if (floats) {
        put_d(v.toComplexDouble().real());
        put_d(v.toComplexDouble().imag());
      }
    } else if (v.isString()) {
      put(16);
      put(std::hash<std::string>{}(v.toStringRef()));
    } else if (v.isDevice()) {
      put(17 | (static_cast<uint64_t>(v.toDevice().type()) << 8) |
          (static_cast<uint64_t>(static_cast<uint8_t>(v.toDevice().index())) << 16));
    } else if (v.isTensor()) {
      host_tensor(v.toTensor());
    } else if (v.isGenerator()) {
      put(18);
    } else if (v.isList()) {
      c10::ArrayRef<c10::IValue> l = v.toListRef();
      put(19 | (static_cast<uint64_t>(l.size()) << 8));
      for (size_t i = 0; i < l.size() && ok; ++i) value(l[i], floats);
    } else if (v.isTuple()) {
      const auto& e = v.toTupleRef().elements();
      put(20 | (static_cast<uint64_t>(e.size()) << 8));
      for (const auto& x : e) value(x, floats);
    } else {
      ok = false; // an argument the fingerprint cannot describe: not cached
    }
  }
};

uint64_t mix(uint64_t h, uint64_t v) {
  h ^= v + 0x9e3779b97f4a7c15ULL + (h << 6) + (h >> 2);
  return h;
}

std::atomic<uint64_t> g_stamps{uint64_t{1} << 60}; // apart from the memory model's stamps

// The words of an open node (ir/tape.h) around its references' numbers and versions, which `refs`
// holds as the tape wrote them. Returns the tape words consumed.
size_t write_open(KeyWriter& w, const Node& n, const uint64_t* refs) {
  w.put(reinterpret_cast<uintptr_t>(&n.op.schema()));
  w.put(uint64_t{n.upload} | (uint64_t{n.random} << 1) | (uint64_t{n.effectful} << 2) |
        (uint64_t{n.grad_mode} << 3) | (uint64_t{n.row_keyed != nullptr} << 4) |
        (static_cast<uint64_t>(n.uses.size()) << 8) | (static_cast<uint64_t>(n.defs.size()) << 24) |
        (static_cast<uint64_t>(n.args.size()) << 40));
  if (n.row_keyed) w.put(n.row_keyed->block);
  // Floating-point arguments of pointwise and _foreach_ ops (AdamW's per-step scalars) cannot
  // change placements; elsewhere (batch norm's momentum, a norm's order) they are part of the key.
  bool floats = true;
  for (const c10::IValue& a : n.args) {
    if (a.isDouble()) {
      floats = !op_rules(n.op).float_values_shape_free;
      break;
    }
  }
  const int32_t state_arg = op_rules(n.op).state_arg;
  for (size_t i = 0; i < n.args.size(); ++i) {
    if (static_cast<int32_t>(i) == state_arg) {
      w.put(10); // per-call state (a collector's token), not structure
    } else {
      w.value(n.args[i], floats);
    }
  }
  const uint64_t* r = refs;
  for (const Def& d : n.defs) {
    w.put(static_cast<uint32_t>(d.ret) | (static_cast<uint64_t>(static_cast<uint32_t>(d.elem)) << 32));
    w.put(r[0]);
    w.put(r[1]);
    w.meta(d.ref.meta);
    r += Tape::kOpenDef;
  }
  for (const Use& u : n.uses) {
    w.put(static_cast<uint32_t>(u.arg) | (static_cast<uint64_t>(static_cast<uint32_t>(u.elem)) << 32));
    w.put(r[0]);
    w.put(r[1] ^ (uint64_t{u.write} << 62) ^ (uint64_t{u.write_only} << 63));
    if (u.write) w.put(r[2]);
    w.put(u.covered_nbytes);
    w.meta(u.ref.meta);
    r += Tape::kOpenUse;
  }
  return static_cast<size_t>(r - refs);
}

bool same_tape(const Tape& a, const Tape& b) {
  return a.nodes == b.nodes && a.words == b.words && a.buffers == b.buffers && a.base == b.base && a.open == b.open;
}

} // namespace

void fingerprint(const PlanInput& in, Fingerprint& fp) {
  fp.words = 0;
  fp.hash = 0;
  fp.budget = -1;
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
  thread_local size_t open_words = 16; // words per open node last time
  KeyWriter w(fp.key, tape->words.size() + tape->open.size() * open_words + tape->buffers.size() * 4 + 64);
  // The nodes: the tape's words, open nodes written out from the nodes (fetched ahead: they are cold).
  const uint64_t* words = tape->words.data();
  size_t pos = 0;
  const size_t opens = tape->open.size();
  for (size_t k = 0; k < std::min<size_t>(opens, 4); ++k) __builtin_prefetch(in.nodes[tape->open[k].second]);
  const size_t before = w.n;
  for (size_t k = 0; k < opens; ++k) {
    if (k + 4 < opens) __builtin_prefetch(in.nodes[tape->open[k + 4].second]);
    const auto [offset, node] = tape->open[k];
    w.copy(words + pos, offset - pos);
    pos = offset + write_open(w, *in.nodes[node], words + offset);
  }
  w.copy(words + pos, tape->words.size() - pos);
  if (opens) open_words = (w.n - before - tape->words.size()) / opens + 8;
  // Per buffer, in the tape's numbering, the facts the plan depends on. The buffers are numbered in
  // the planner's scratch for the needed ones below.
  const uint64_t stamp = g_stamps.fetch_add(1, std::memory_order_relaxed) + 1;
  const std::vector<LazyBuffer*>& bufs = tape->buffers;
  fp.buffers.assign(bufs.begin(), bufs.end());
  fp.base.assign(tape->base.begin(), tape->base.end());
  const size_t nb = bufs.size();
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
    // A leaf uploaded by an earlier materialization whose data is still the upload (plan/batch.cpp).
    if (b->upload_version != 0 && b->has_real() && b->real_version == b->upload_version) {
      w.put_i(b->upload_rows);
      w.put_i(b->upload_stride_bytes);
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
  w.put(uint64_t{in.budget < 0});
  w.put_i(in.resident);
  w.put_i(in.force_chunks);
  w.put(uint64_t{in.keep_pending} | (uint64_t{config().debug.load(std::memory_order_relaxed) >= 3} << 1) |
        (static_cast<uint64_t>(in.recompute) << 2));
  w.put(Workspace::get().generation());
  fp.words = w.n;
  fp.cacheable = w.ok;
  // The hash only picks the candidate entry (keys are compared whole): a sample of the key.
  uint64_t h = fp.words;
  const size_t step = std::max<size_t>(1, fp.words / 64);
  for (size_t i = 0; i < fp.words; i += step) h = mix(h, fp.key[i]);
  fp.hash = h;
}

} // namespace lazymem
