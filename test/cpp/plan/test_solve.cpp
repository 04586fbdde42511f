// plan/solve: the batch solved for (no device, nothing runs): each source gets one of its dims or
// none, the assignment the rules accept that holds the fewest bytes whatever the chunk size.
#include <gtest/gtest.h>

#include "program_builder.h"

namespace lazymem::testing {
namespace {

int64_t loop_batch(const Plan& p) {
  int64_t rows = 0;
  for (const Stage& st : p.stages) {
    if (st.loop) rows = st.batch;
  }
  return rows;
}

TEST(Solve, ASequenceFirstInputSplitsAlongDim1) {
  // x (T=4, B=6, F=3), targets y (B=6, F=3): (x.mean(0) - y).abs().sum(). Dim 0 of x, the upload's
  // first guess, would make the mean over it a partial the targets' rows cannot meet.
  ProgramBuilder b;
  T x = b.upload({4, 6, 3}), y = b.upload({6, 3});
  T m = b.op("aten::mean", "dim", {kNone, c10::IValue(std::vector<int64_t>{0}), c10::IValue(false), kNone},
             {{0, x}}, {{6, 3}})[0];
  T d = b.op("aten::sub", "Tensor", {kNone, kNone, c10::IValue(1)}, {{0, m}, {1, y}}, {{6, 3}})[0];
  T s = b.op("aten::sum", "", {kNone, kNone}, {{0, d}}, {{}})[0];
  Plan p = b.plan({s}, {s}, /*force_chunks=*/3);
  ASSERT_TRUE(p.split) << p.to_string();
  EXPECT_EQ(loop_batch(p), 6);
  EXPECT_EQ(p.barriers, 0u);
  EXPECT_NE(p.to_string().find("on dim 1"), std::string::npos) << p.to_string();
}

TEST(Solve, AWeightMatrixUploadedBesideTheBatchEndsUnsharded) {
  // x (12 x 5) @ w (5 x 7), w uploaded from the host (a data leaf by provenance): w as a batch of 5
  // rows would be read whole by the matmul anyway; it is not a batch.
  ProgramBuilder b;
  T x = b.upload({12, 5}), w = b.upload({5, 7});
  T y = b.op("aten::mm", "", {kNone, kNone}, {{0, x}, {1, w}}, {{12, 7}})[0];
  T t = b.op("aten::tanh", "", {kNone}, {{0, y}}, {{12, 7}})[0];
  Plan p = b.plan({t}, {t}, /*force_chunks=*/3);
  ASSERT_TRUE(p.split) << p.to_string();
  EXPECT_EQ(loop_batch(p), 12);
  size_t loops = 0;
  for (const Stage& st : p.stages) loops += st.loop;
  EXPECT_EQ(loops, 1u) << p.to_string(); // one batch: w is no loop of its own
  EXPECT_NE(p.to_string().find("not a batch"), std::string::npos) << p.to_string();
}

TEST(Solve, AMarkIsNeverChanged) {
  // x marked along dim 0 (4 rows) although dim 1 would pair with y: the mark holds, and the
  // reduction over the marked batch is partial.
  ProgramBuilder b;
  T x = b.upload({4, 6, 3}), y = b.upload({6, 3});
  x.buf->batch_hint = LazyBuffer::BatchHint::kMarked;
  x.buf->mark_rows = 4;
  x.buf->mark_stride_bytes = 6 * 3 * 8;
  T m = b.op("aten::mean", "dim", {kNone, c10::IValue(std::vector<int64_t>{0}), c10::IValue(false), kNone},
             {{0, x}}, {{6, 3}})[0];
  T d = b.op("aten::sub", "Tensor", {kNone, kNone, c10::IValue(1)}, {{0, m}, {1, y}}, {{6, 3}})[0];
  Plan p = b.plan({d}, {d}, /*force_chunks=*/2);
  ASSERT_TRUE(p.split) << p.to_string();
  EXPECT_NE(p.to_string().find("as marked"), std::string::npos) << p.to_string();
}

} // namespace
} // namespace lazymem::testing
