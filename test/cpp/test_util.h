// test helpers: synthetic nodes for planner and program tests (no device, no kernels run).
#pragma once

#include <gtest/gtest.h>

#include "ir/program.h"

namespace lazymem::testing {

inline c10::OperatorHandle any_op() {
  return c10::Dispatcher::singleton().findSchemaOrThrow("aten::add", "Tensor");
}

inline BufferPtr buffer(size_t nbytes = 64) {
  return c10::make_intrusive<LazyBuffer>(nbytes);
}

inline TensorMeta dense(int64_t numel) {
  TensorMeta m;
  m.sizes = {numel};
  m.strides = {1};
  m.dtype = c10::ScalarType::Float;
  return m;
}

// Builds a node: defines `defs`, reads `reads`, writes `writes` (in place unless overwrite).
struct NodeBuilder {
  NodePtr n = std::make_unique<Node>(any_op());
  NodeBuilder& def(const BufferPtr& b) {
    n->defs.push_back(Def{0, -1, TensorRef{b, dense(b->nbytes / 4), 0}});
    return *this;
  }
  NodeBuilder& read(const BufferPtr& b) {
    Use u;
    u.arg = 0;
    u.ref = TensorRef{b, dense(b->nbytes / 4), 0};
    n->uses.push_back(std::move(u));
    return *this;
  }
  NodeBuilder& write(const BufferPtr& b, bool overwrite = false, int64_t numel = -1) {
    Use u;
    u.arg = 0;
    u.ref = TensorRef{b, dense(numel < 0 ? b->nbytes / 4 : numel), 0};
    u.write = true;
    u.write_only = overwrite;
    n->uses.push_back(std::move(u));
    return *this;
  }
  NodeBuilder& random() {
    n->random = true;
    return *this;
  }
  NodeBuilder& effect() {
    n->effectful = true;
    return *this;
  }
  NodePtr build() {
    return std::move(n);
  }
};

} // namespace lazymem::testing
