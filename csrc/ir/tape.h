// ir: the tape — the structure of a list of nodes in the words the plan fingerprint compares
// (plan/reuse.h), kept up to date by the Program as nodes are appended. A training step's kernels
// evict its recorded program from the caches before the step's sync point plans it; the tape was
// written while each node was hot, so the fingerprint reads one flat array instead of chasing every
// node, reference and buffer again.
//
// Buffers are numbered by first appearance (per node its defs, then its uses) and every version is
// relative to its buffer's first reference (32 bits, modulo 2^32). A node recorded from a cached meta
// result (Node::sig != 0) takes a word per reference:
//   kSigMark | grad mode | row-keyed << 1 | kept << 2, sig, [row-keyed block],
//   per def number << 32 | version, per use number << 32 | version [, write version if it writes]
// (the sig stands for the op, arguments, geometry and which uses write, so it fixes the length).
// Any other node is described in full: its schema's address (never kSigMark's top bits), flags and
// counts, every argument (floating-point values where they can change placements), and per def and
// use its position, buffer number, versions and view.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "ir/node.h"

namespace lazymem {

struct Tape {
  // Which scratch fields of LazyBuffer number the buffers while the tape grows: the Program's
  // (under its mutex, across appends) or the planner's (under the flush lock, for one plan).
  enum class Scratch : uint8_t { kProgram, kPlanner };

  std::vector<uint64_t> words;
  std::vector<LazyBuffer*> buffers;               // by number (held by the nodes' references)
  std::vector<uint32_t> base;                     // per buffer: the version of its first reference
  size_t nodes = 0;
  bool valid = false; // describes exactly the nodes it was given since reset(), in order
  bool describable = true; // false: an argument it cannot describe (the program is not cached)

  // Empty and valid, numbering with a fresh stamp; the vectors keep their room.
  void reset(Scratch scratch);
  // Appends `n`, whose versions are assigned (Program::append).
  void add(const Node& n);
  // The first word of a node with a sig: top bits no user-space address has.
  static constexpr uint64_t kSigMark = uint64_t{0xF} << 60;

 private:
  uint32_t number(LazyBuffer* b, uint32_t version);
  uint64_t stamp_ = 0;
  Scratch scratch_ = Scratch::kProgram;
};

} // namespace lazymem
