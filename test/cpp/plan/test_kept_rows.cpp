// plan/plan: KeptRows — rows a loop writes into a value held in host memory and reads again in the
// chunk, read from the device (no device, nothing runs): which readers qualify, and the memory model
// holding the rows from the writer through the last reader.
#include <gtest/gtest.h>

#include "plan/plan.h"
#include "program_builder.h"

namespace lazymem::testing {
namespace {

// y = x @ w (512 x 64 float64, held by the caller), then readers of y's rows in the same loop; the
// chunks priced so that y is held in host memory (as in test_split's AHeldResultGoesToHostMemory...).
struct Held {
  ProgramBuilder b;
  T x, w, y;
  Held() {
    x = b.upload({512, 64});
    w = b.upload({64, 64}, /*module_state=*/true);
    y = b.op("aten::mm", "", {kNone, kNone}, {{0, x}, {1, w}}, {{512, 64}})[0];
  }
  T sum(const T& t) {
    return b.op("aten::sum", "dim_IntList", {kNone, c10::IValue(std::vector<int64_t>{0}), c10::IValue(false), kNone},
                {{0, t}}, {{64}})[0];
  }
  Plan plan(std::vector<T> out) {
    std::vector<T> live{y};
    live.insert(live.end(), out.begin(), out.end());
    const int64_t budget = (32 << 10) + (32 << 10) + (256 << 10) + (40 << 10);
    return b.plan(live, live, 0, budget, -1, /*chunk_node_ns=*/5000);
  }
};

const Stage* loop_holding(const Plan& p, const LazyBuffer* b) {
  for (const Stage& st : p.stages) {
    for (const FullStore& f : st.stores) {
      if (st.loop && f.buf == b && f.host) return &st;
    }
  }
  return nullptr;
}

size_t index_of(const Stage& st, const char* op) {
  for (size_t i = 0; i < st.nodes.size(); ++i) {
    if (st.nodes[i].node->op.schema().name() == op) return i;
  }
  return SIZE_MAX;
}

TEST(KeptRows, ReadersOfTheRowsWrittenInTheChunkTakeThemFromTheDevice) {
  Held h;
  T s = h.sum(h.y);
  T g = h.b.op("aten::mm", "", {kNone, kNone}, {{0, transposed(h.x)}, {1, h.y}}, {{64, 64}})[0];
  Plan p = h.plan({s, g});
  const Stage* st = loop_holding(p, h.y.buf.get());
  ASSERT_NE(st, nullptr) << p.to_string(true);
  const auto kept = kept_rows(*st, [&](const LazyBuffer* b) { return b == h.y.buf.get(); });
  ASSERT_EQ(kept.size(), 1u) << p.to_string(true);
  EXPECT_EQ(st->nodes[kept[0].writer].node->defs[kept[0].def].ref.buf, h.y.buf);
  // Both readers (the sum and the weight gradient's mm), the last of them last.
  EXPECT_EQ(kept[0].readers.size(), 2u) << p.to_string(true);
  EXPECT_EQ(kept[0].last, kept[0].readers.back().first);
  // Nothing crosses back in: the stage's transfers count y's rows out only.
  const auto transfers = plan_transfers(p);
  int64_t in = 0, out = 0;
  for (const StageTransfers& t : transfers) {
    in += t.h2d;
    out += t.d2h;
  }
  EXPECT_EQ(out, 512 * 64 * 8);
  EXPECT_EQ(in, (512 * 64 + 64 * 64) * 8); // (the uploads of x and w only)
  // Held in the model from the writer through the last reader, so the plan stays within its budget.
  EXPECT_LE(p.predicted_peak, p.budget);
}

TEST(KeptRows, ANodeWritingTheValueReadsItAsEagerDoesAndEndsTheKeeping) {
  // y.mul_(2) after the writer: the in-place node reads and writes y's rows (aliased, as in eager),
  // and a read after it reads a later version: neither takes the kept rows.
  Held h;
  h.b.inplace("aten::mul_", "Scalar", {kNone, c10::IValue(2.0)}, h.y);
  T s = h.sum(h.y);
  Plan p = h.plan({s});
  const Stage* st = loop_holding(p, h.y.buf.get());
  if (st == nullptr) GTEST_SKIP() << "y not held in host memory by this plan: " << p.to_string(true);
  const auto kept = kept_rows(*st, [&](const LazyBuffer* b) { return b == h.y.buf.get(); });
  EXPECT_TRUE(kept.empty()) << p.to_string(true);
}

TEST(KeptRows, OnlyValuesHeldInHostMemoryAndOnlyLoops) {
  Held h;
  T s = h.sum(h.y);
  Plan p = h.plan({s});
  const Stage* st = loop_holding(p, h.y.buf.get());
  ASSERT_NE(st, nullptr) << p.to_string(true);
  EXPECT_TRUE(kept_rows(*st, [](const LazyBuffer*) { return false; }).empty());
  const size_t writer = index_of(*st, "aten::mm");
  ASSERT_NE(writer, SIZE_MAX);
  Stage whole = *st;
  whole.loop = false;
  EXPECT_TRUE(kept_rows(whole, [](const LazyBuffer*) { return true; }).empty());
}

} // namespace
} // namespace lazymem::testing
