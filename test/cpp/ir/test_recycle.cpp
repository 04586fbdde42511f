// ir/node.cpp's node shells: a recycled node comes back empty for its next record, everything it held
// is released by the recycle, and the buffers whose last reference it held are handed to the caller
// (the pipeline's worker hands them back to the recording thread that made them).
#include <thread>

#include "test_util.h"

namespace lazymem::testing {
namespace {

TEST(NodeShells, RecyclingEmptiesNodesAndHandsOverTheirLastBufferReferences) {
  auto a = buffer(), b = buffer(), kept = buffer();
  std::vector<NodePtr> nodes;
  nodes.push_back(NodeBuilder().read(a).def(b).build());
  nodes.push_back(nullptr); // (a node put back pending leaves a null: skipped)
  nodes.push_back(NodeBuilder().read(b).read(kept).build());
  nodes.front()->random = true;
  nodes.front()->site = "somewhere";
  const Node* shell = nodes.front().get();
  const int64_t alive = buffers_alive();
  a.reset();
  b.reset();
  EXPECT_EQ(buffers_alive(), alive); // the nodes still name them
  std::vector<BufferPtr> released;
  recycle_nodes(nodes, released);
  EXPECT_TRUE(nodes.empty());
  // `a` and `b` (named twice) once each; `kept` is still held here, so its reference was just dropped.
  ASSERT_EQ(released.size(), 2u);
  EXPECT_EQ(kept.use_count(), 1u);
  EXPECT_EQ(buffers_alive(), alive);
  released.clear();
  EXPECT_EQ(buffers_alive(), alive - 2);

  const c10::OperatorHandle op = c10::Dispatcher::singleton().findSchemaOrThrow("aten::mul", "Tensor");
  NodePtr n;
  // (A fresh thread's stash is empty: it takes the shared shells, in the order they ran.)
  std::thread([&] { n = new_node(op); }).join();
#if !defined(__SANITIZE_ADDRESS__)
  EXPECT_EQ(n.get(), shell);
#endif
  EXPECT_EQ(n->op.operator_name().name, "aten::mul");
  EXPECT_TRUE(n->args.empty());
  EXPECT_TRUE(n->uses.empty());
  EXPECT_TRUE(n->defs.empty());
  EXPECT_FALSE(n->random);
  EXPECT_TRUE(n->site.empty());
  EXPECT_EQ(n->seq, 0u);
}

TEST(NodeShells, AShellKeepsRoomForAFewEntriesOnly) {
  auto b = buffer();
  NodeBuilder many;
  for (int i = 0; i < 100; ++i) many.read(b);
  std::vector<NodePtr> nodes;
  nodes.push_back(many.build());
  nodes.push_back(NodeBuilder().read(b).read(b).build());
  std::vector<BufferPtr> released;
  recycle_nodes(nodes, released);
  EXPECT_TRUE(released.empty()); // `b` is still held here
  NodePtr first, second;
  std::thread([&] {
    first = new_node(any_op());
    second = new_node(any_op());
  }).join();
  EXPECT_TRUE(first->uses.empty());
  EXPECT_TRUE(second->uses.empty());
#if !defined(__SANITIZE_ADDRESS__)
  EXPECT_EQ(first->uses.capacity(), 0u);  // a hundred uses' room was given back
  EXPECT_GE(second->uses.capacity(), 2u); // two were kept
#endif
}

} // namespace
} // namespace lazymem::testing
