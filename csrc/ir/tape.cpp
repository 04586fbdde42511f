// ir: the tape (see ir/tape.h).
#include "ir/tape.h"

#include <atomic>

namespace lazymem {

namespace {
// Stamps apart from the memory model's (small numbers) and the fingerprint's (from 2^60).
std::atomic<uint64_t> g_tape_stamps{uint64_t{1} << 61};
} // namespace

void Tape::reset(Scratch scratch) {
  words.clear();
  buffers.clear();
  base.clear();
  open.clear();
  nodes = 0;
  valid = true;
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
  auto rel = [&](uint32_t c, uint32_t version) {
    return static_cast<uint32_t>(static_cast<int64_t>(version) - static_cast<int64_t>(base[c]));
  };
  if (n.sig == 0) {
    open.emplace_back(static_cast<uint32_t>(words.size()), static_cast<uint32_t>(nodes));
    ++nodes;
    for (const Def& d : n.defs) {
      const uint32_t c = number(d.ref.buf.get(), d.ref.version);
      words.push_back(c);
      words.push_back(rel(c, d.ref.version));
    }
    for (const Use& u : n.uses) {
      const uint32_t c = number(u.ref.buf.get(), u.ref.version);
      words.push_back(c);
      words.push_back(rel(c, u.ref.version));
      words.push_back(u.write ? rel(c, u.write_version) : 0);
    }
    return;
  }
  ++nodes;
  words.push_back(kSigMark | uint64_t{n.grad_mode} | (uint64_t{n.row_keyed != nullptr} << 1));
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
}

} // namespace lazymem
