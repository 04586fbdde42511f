// plan: turns a detached program prefix into a Schedule: which nodes run (dead-code elimination
// over buffer versions) and when each real buffer can be released (liveness). Pure: it reads node
// metadata only and never touches a device, so it is tested without one.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "ir/node.h"

namespace lazymem {

// Dense numbering of the buffers a node list touches, with each node's defs and uses as indices
// (so planning passes use vectors, not hash maps).
struct ProgramIndex {
  std::vector<LazyBuffer*> buffers;
  std::vector<int32_t> def_ix, use_ix;       // node i's defs: def_ix[def_start[i] .. def_start[i+1])
  std::vector<int32_t> def_start, use_start; // size nodes + 1
  int32_t def(size_t node, size_t k) const {
    return def_ix[def_start[node] + k];
  }
  int32_t use(size_t node, size_t k) const {
    return use_ix[use_start[node] + k];
  }
  size_t size() const {
    return buffers.size();
  }
  static ProgramIndex build(const std::vector<const Node*>& nodes);
};

struct Schedule {
  std::vector<int32_t> run;                       // segment indices to execute, program order
  std::vector<std::vector<LazyBuffer*>> release;  // parallel to run: buffers dead after that node
  std::vector<LazyBuffer*> release_unused;        // dead buffers no executed node touches
  size_t eliminated = 0;
  ProgramIndex index;                             // of every node of the segment
  std::vector<char> live;                         // per buffer of the index: live out of the segment
  std::string to_string(const std::vector<const Node*>& nodes) const;
};

// live_out(b): the value of `b` after the segment is still wanted (a tensor refers to it, or a node
// left pending reads it). Every version a live value depends on is computed; random and effectful
// nodes always run so the generator stream and asserts match eager.
Schedule plan_segment(const std::vector<const Node*>& nodes,
                      const std::function<bool(const LazyBuffer&)>& live_out);

} // namespace lazymem
