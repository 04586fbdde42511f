// ir/node.cpp's node shells and core/block_pool.h's recycled blocks: what a node held is released when
// it is recycled (not when its shell is reused), a shell comes back empty, and blocks released on one
// thread are reused by another.
#include <thread>
#include <unordered_set>

#include "core/block_pool.h"
#include "test_util.h"

namespace lazymem::testing {
namespace {

TEST(NodeShells, RecyclingReleasesBuffersAtOnceAndShellsComeBackEmpty) {
  auto a = buffer(), b = buffer();
  std::vector<NodePtr> nodes;
  nodes.push_back(NodeBuilder().read(a).def(b).build());
  nodes.push_back(nullptr); // (a node put back pending leaves a null: skipped)
  nodes.front()->random = true;
  nodes.front()->site = "somewhere";
  const Node* shell = nodes.front().get();
  const int64_t alive = buffers_alive();
  a.reset();
  b.reset();
  EXPECT_EQ(buffers_alive(), alive); // the node still names them
  recycle_nodes(nodes);
  EXPECT_TRUE(nodes.empty());
  EXPECT_EQ(buffers_alive(), alive - 2); // released by the recycle, not by a later reuse
  const c10::OperatorHandle op = c10::Dispatcher::singleton().findSchemaOrThrow("aten::mul", "Tensor");
  NodePtr n;
  // (A fresh thread's stash is empty: it takes the shared shells, the one recycled last on top.)
  std::thread([&] { n = new_node(op); }).join();
  if (kRecycleBlocks) EXPECT_EQ(n.get(), shell);
  EXPECT_EQ(n->op.operator_name().name, "aten::mul");
  EXPECT_TRUE(n->args.empty());
  EXPECT_TRUE(n->uses.empty());
  EXPECT_TRUE(n->defs.empty());
  EXPECT_FALSE(n->random);
  EXPECT_TRUE(n->site.empty());
  EXPECT_EQ(n->seq, 0u);
}

TEST(BlockPool, BlocksReleasedOnAnotherThreadAreReused) {
  using Pool = BlockPool<200>;
  constexpr int kN = 1000;
  std::vector<void*> made;
  for (int i = 0; i < kN; ++i) made.push_back(Pool::allocate());
  std::thread([&] {
    for (void* p : made) Pool::release(p); // a worker destroys what this thread made
  }).join();                               // (its cache goes to the shared list at its exit)
  const std::unordered_set<void*> before(made.begin(), made.end());
  size_t reused = 0;
  std::vector<void*> again;
  for (int i = 0; i < kN; ++i) {
    again.push_back(Pool::allocate());
    reused += before.count(again.back());
  }
  if (kRecycleBlocks) {
    EXPECT_EQ(reused, static_cast<size_t>(kN));
  }
  for (void* p : again) Pool::release(p);
}

} // namespace
} // namespace lazymem::testing
