// plan/workspace: the learned workspace line (no device).
#include <gtest/gtest.h>

#include "plan/workspace.h"
#include "test_util.h"

namespace lazymem::testing {
namespace {

// Keys apart from anything a real run learns (the table is process-wide).
constexpr uint64_t kKey = 0x5eed0000ull;
const c10::FunctionSchema* const kOp = reinterpret_cast<const c10::FunctionSchema*>(uintptr_t{0x10});

int64_t predict(uint64_t key, int64_t rows) {
  Workspace::Affine a = Workspace::get().predict(key);
  return a.alpha + a.beta * rows;
}

TEST(Workspace, TheLineCoversEveryObservation) {
  Workspace& w = Workspace::get();
  const uint64_t key = kKey + 1;
  EXPECT_TRUE(w.observe(key, kOp, 10, 1000));
  EXPECT_EQ(predict(key, 10), 1000);
  EXPECT_EQ(predict(key, 20), 2000); // one observation: proportional to the rows
  EXPECT_TRUE(w.observe(key, kOp, 40, 2500));
  EXPECT_TRUE(w.observe(key, kOp, 25, 2400)); // above the line through the first two
  for (auto [rows, bytes] : {std::pair<int64_t, int64_t>{10, 1000}, {40, 2500}, {25, 2400}}) {
    EXPECT_GE(predict(key, rows), bytes) << rows;
  }
  EXPECT_FALSE(w.observe(key, kOp, 30, 100)); // below: nothing learned, nothing changes
}

TEST(Workspace, ManyChunkSizesSettle) {
  // The same key run at several chunk sizes in turn (one layer in passes of different chunk sizes,
  // a recomputed node): once every size has been seen the model stops changing, so plans made from
  // it can be reused.
  Workspace& w = Workspace::get();
  const uint64_t key = kKey + 2;
  const int64_t rows[] = {104, 72, 32, 11, 10, 208};
  auto bytes = [](int64_t r) { return 4096 + 1000 * r + (r % 7) * 300; }; // affine-ish, with noise
  for (int round = 0; round < 3; ++round) {
    const uint64_t before = w.generation();
    for (int64_t r : rows) w.observe(key, kOp, r, bytes(r));
    if (round > 0) {
      EXPECT_EQ(w.generation(), before) << "round " << round;
    }
  }
  for (int64_t r : rows) EXPECT_GE(predict(key, r), bytes(r)) << r;
}

TEST(Workspace, AFullTableKeepsCoveringWhatItKept) {
  Workspace& w = Workspace::get();
  const uint64_t key = kKey + 3;
  for (int64_t r = 1; r <= 3 * Workspace::kPoints; ++r) w.observe(key, kOp, r, r * r); // convex: always above
  EXPECT_GE(predict(key, 3 * Workspace::kPoints), 9 * Workspace::kPoints * Workspace::kPoints);
}


TEST(Workspace, BoundsFromRefusedAllocationsScaleWithTheRows) {
  // Issue 21, defect 2: a kernel refused at 392 and at 196 rows learned the same lower bound (what it
  // held when the allocation past it was refused). Before, the line through them was flat: that
  // bound became a constant no chunk size escaped, and the next step raised out of memory.
  Workspace& w = Workspace::get();
  const uint64_t key = kKey + 4;
  EXPECT_TRUE(w.observe(key, kOp, 392, 19'000'000, Workspace::kBound));
  EXPECT_TRUE(w.observe(key, kOp, 196, 19'000'000, Workspace::kBound));
  EXPECT_GE(predict(key, 196), 19'000'000);
  EXPECT_LE(predict(key, 98), 9'600'000); // scales with the rows: half the chunk, half the bound
  // A run that completed at 98 rows anchors the line, even below what the bounds predicted there.
  EXPECT_TRUE(w.observe(key, kOp, 98, 11'000'000));
  EXPECT_GE(predict(key, 98), 11'000'000);
  EXPECT_GE(predict(key, 112), 112 * (11'000'000 / 98)); // proportional from one completed run
  EXPECT_EQ(w.predict(key).alpha, 0);
  // A second completed run: the line through the one of fewest rows, covering everything.
  EXPECT_TRUE(w.observe(key, kOp, 56, 6'300'000));
  for (auto [rows, bytes] : {std::pair<int64_t, int64_t>{56, 6'300'000}, {98, 11'000'000}, {196, 19'000'000}}) {
    EXPECT_GE(predict(key, rows), bytes) << rows;
  }
  EXPECT_LT(predict(key, 8), 2'000'000);
  // A bound below the line teaches nothing.
  EXPECT_FALSE(w.observe(key, kOp, 150, 1'000'000, Workspace::kBound));
}

TEST(Workspace, KeysIgnoreFloatingPointScalarsButNotIntegers) {
  // AdamW's bias correction (and any scheduler's learning rate) gives its div_.Scalar / addcdiv_ a
  // new float scalar every step. With the value in the key, each step learned a "new" key, moved the
  // workspace generation, and so no step's plan was ever reused (bench_split (e): 5 of 9 steps
  // reused, MLP training none in a plain loop).
  const c10::OperatorHandle op = c10::Dispatcher::singleton().findSchemaOrThrow("aten::div_", "Scalar");
  auto key = [&](c10::IValue scalar) {
    BufferPtr b = buffer(64);
    NodePtr n = NodeBuilder().write(b).build();
    n->op = op;
    n->args = {at::Tensor(), std::move(scalar)};
    return workspace_key(PlannedNode(n.get(), 0));
  };
  EXPECT_EQ(key(0.9990004998), key(0.9980014993));
  EXPECT_NE(key(int64_t{3}), key(int64_t{4}));   // an integer can size a kernel's scratch (a dim, k)
  EXPECT_NE(key(int64_t{3}), key(0.9990004998)); // ...and is told apart from a float
}

} // namespace
} // namespace lazymem::testing
