// ir: the tape (see ir/tape.h).
#include "ir/tape.h"

#include <atomic>
#include <cstring>
#include <functional>
#include <string>

namespace lazymem {

namespace {

// Stamps apart from the memory model's (small numbers) and the fingerprint's (from 2^60).
std::atomic<uint64_t> g_tape_stamps{uint64_t{1} << 61};

// Appends the words of an open node's arguments and metas.
struct Words {
  std::vector<uint64_t>& w;
  bool& ok;

  void put(uint64_t v) {
    w.push_back(v);
  }
  void put_i(int64_t v) {
    w.push_back(static_cast<uint64_t>(v));
  }
  void put_d(double d) {
    uint64_t bits;
    std::memcpy(&bits, &d, sizeof(bits));
    w.push_back(bits);
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
      ok = false; // an argument the tape cannot describe: the program is not cached
    }
  }
};

} // namespace

void Tape::reset(Scratch scratch) {
  words.clear();
  buffers.clear();
  base.clear();
  nodes = 0;
  valid = true;
  describable = true;
  scratch_ = scratch;
  stamp_ = g_tape_stamps.fetch_add(1, std::memory_order_relaxed) + 1;
}

uint32_t Tape::number(LazyBuffer* b, uint32_t version) {
  uint64_t& stamp = scratch_ == Scratch::kProgram ? b->tape_stamp : b->plan_stamp;
  if (stamp != stamp_) {
    stamp = stamp_;
    const auto c = static_cast<uint32_t>(buffers.size());
    if (scratch_ == Scratch::kProgram) {
      b->tape_number = c;
    } else {
      b->plan_bytes = c;
    }
    buffers.push_back(b);
    base.push_back(version);
    return c;
  }
  return scratch_ == Scratch::kProgram ? b->tape_number : static_cast<uint32_t>(b->plan_bytes);
}

void Tape::add(const Node& n) {
  ++nodes;
  auto rel = [&](uint32_t c, uint32_t version) {
    return static_cast<uint32_t>(static_cast<int64_t>(version) - static_cast<int64_t>(base[c]));
  };
  if (n.sig != 0) {
    words.push_back(kSigMark | uint64_t{n.grad_mode} | (uint64_t{n.row_keyed != nullptr} << 1) |
                    (uint64_t{n.kept} << 2));
    words.push_back(n.sig);
    if (n.row_keyed) words.push_back(n.row_keyed->block);
    auto ref = [&](uint32_t c, uint32_t version) { return (uint64_t{c} << 32) | rel(c, version); };
    for (const Def& d : n.defs) {
      const uint32_t c = number(d.ref.buf.get(), d.ref.version);
      words.push_back(ref(c, d.ref.version));
    }
    for (const Use& u : n.uses) {
      const uint32_t c = number(u.ref.buf.get(), u.ref.version);
      words.push_back(ref(c, u.ref.version));
      if (u.write) words.push_back(rel(c, u.write_version));
    }
    return;
  }
  Words w{words, describable};
  w.put(reinterpret_cast<uintptr_t>(&n.op.schema()));
  w.put(uint64_t{n.upload} | (uint64_t{n.random} << 1) | (uint64_t{n.effectful} << 2) |
        (uint64_t{n.grad_mode} << 3) | (uint64_t{n.row_keyed != nullptr} << 4) | (uint64_t{n.kept} << 5) |
        (static_cast<uint64_t>(n.uses.size()) << 8) | (static_cast<uint64_t>(n.defs.size()) << 24) |
        (static_cast<uint64_t>(n.args.size()) << 40));
  if (n.row_keyed) w.put(n.row_keyed->block);
  // Floating-point arguments of pointwise and _foreach_ ops (AdamW's per-step scalars) cannot
  // change placements; elsewhere (batch norm's momentum, a norm's order) they are part of the key.
  const bool floats = !n.floats_shape_free;
  for (size_t i = 0; i < n.args.size(); ++i) {
    if (static_cast<int32_t>(i) == n.state_arg) {
      w.put(10); // per-call state (a collector's token), not structure
    } else {
      w.value(n.args[i], floats);
    }
  }
  for (const Def& d : n.defs) {
    const uint32_t c = number(d.ref.buf.get(), d.ref.version);
    w.put(static_cast<uint32_t>(d.ret) | (static_cast<uint64_t>(static_cast<uint32_t>(d.elem)) << 32));
    w.put(c);
    w.put(rel(c, d.ref.version));
    w.meta(d.ref.meta);
  }
  for (const Use& u : n.uses) {
    const uint32_t c = number(u.ref.buf.get(), u.ref.version);
    w.put(static_cast<uint32_t>(u.arg) | (static_cast<uint64_t>(static_cast<uint32_t>(u.elem)) << 32));
    w.put(c);
    w.put(uint64_t{rel(c, u.ref.version)} ^ (uint64_t{u.write} << 62) ^ (uint64_t{u.write_only} << 63));
    if (u.write) w.put(rel(c, u.write_version));
    w.put(u.covered_nbytes);
    w.meta(u.ref.meta);
  }
}

} // namespace lazymem
