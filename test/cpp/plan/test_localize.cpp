// plan/localize: where the batch sits in a view of a [outer][batch][row] storage, and the view over
// a chunk (no device).
#include <gtest/gtest.h>

#include "plan/localize.h"

namespace lazymem {
namespace {

TensorMeta view(std::vector<int64_t> sizes, std::vector<int64_t> strides, int64_t offset = 0) {
  TensorMeta m;
  m.sizes.assign(sizes.begin(), sizes.end());
  m.strides.assign(strides.begin(), strides.end());
  m.offset = offset;
  m.dtype = c10::ScalarType::Float;
  return m;
}

// A contiguous (B=10, T=3, H=4) float buffer.
const RowLayout kBTH{1, 10, 3 * 4 * 4};

TEST(Localize, TheBatchDimOfAContiguousTensor) {
  auto at = analyze_view(view({10, 3, 4}, {12, 4, 1}), kBTH);
  ASSERT_TRUE(at);
  EXPECT_EQ(at->dim, 0);
  EXPECT_EQ(at->unit, 1);
  TensorMeta local = localize(view({10, 3, 4}, {12, 4, 1}), kBTH, 0, 4);
  EXPECT_EQ(local.sizes, (c10::SmallVector<int64_t, 5>{4, 3, 4}));
  EXPECT_EQ(local.strides, (c10::SmallVector<int64_t, 5>{12, 4, 1}));
}

TEST(Localize, AFlattenWithTheBatchAsMajorFactorShrinksByItsUnit) {
  auto at = analyze_view(view({30, 4}, {4, 1}), kBTH); // (B*T, H)
  ASSERT_TRUE(at);
  EXPECT_EQ(at->dim, 0);
  EXPECT_EQ(at->unit, 3);
  EXPECT_EQ(localize(view({30, 4}, {4, 1}), kBTH, 0, 4).sizes[0], 12);
}

TEST(Localize, ATransposeKeepsTheBatchInItsNewDim) {
  auto at = analyze_view(view({3, 10, 4}, {4, 12, 1}), kBTH); // (T, B, H) view of (B, T, H)
  ASSERT_TRUE(at);
  EXPECT_EQ(at->dim, 1);
  TensorMeta local = localize(view({3, 10, 4}, {4, 12, 1}), kBTH, 0, 2);
  EXPECT_EQ(local.sizes, (c10::SmallVector<int64_t, 5>{3, 2, 4}));
  EXPECT_EQ(local.strides, (c10::SmallVector<int64_t, 5>{4, 12, 1}));
}

TEST(Localize, OuterDimsRescaleWithTheChunk) {
  const RowLayout tbh{3, 10, 4 * 4}; // a contiguous (T=3, B=10, H=4) buffer
  auto at = analyze_view(view({3, 10, 4}, {40, 4, 1}), tbh);
  ASSERT_TRUE(at);
  EXPECT_EQ(at->dim, 1);
  TensorMeta local = localize(view({2, 10, 4}, {40, 4, 1}, 40), tbh, 0, 5); // from the second block on
  EXPECT_EQ(local.strides[0], 20);
  EXPECT_EQ(local.offset, 20);
  EXPECT_EQ(local.sizes[1], 5);
}

TEST(Localize, ViewsThatMixRowsDoNotLocalize) {
  EXPECT_FALSE(analyze_view(view({3, 4}, {4, 1}, 12), kBTH));             // a select: one row
  EXPECT_FALSE(analyze_view(view({4, 3, 4}, {36, 4, 1}, 12), kBTH));       // rows 1, 4, 7, 10: past the last
  const RowLayout tbh{3, 10, 16};
  EXPECT_FALSE(analyze_view(view({20, 4}, {4, 1}, 8), tbh));              // (T*B, H) from inside a row
  EXPECT_FALSE(analyze_view(view({15, 4}, {4, 1}), tbh));                 // 1.5 blocks
  EXPECT_FALSE(analyze_view(view({40, 4}, {4, 1}), tbh));                 // past the last block
}

TEST(Localize, SlicesAlongTheBatchAreRowMaps) {
  auto head = analyze_view(view({5, 3, 4}, {12, 4, 1}), kBTH); // x[:5]
  ASSERT_TRUE(head);
  EXPECT_EQ(head->dim, 0);
  EXPECT_EQ(head->first, 0);
  EXPECT_EQ(head->step, 1);
  EXPECT_EQ(head->count, 5);
  auto odd = analyze_view(view({5, 3, 4}, {24, 4, 1}, 12), kBTH); // x[1::2]
  ASSERT_TRUE(odd);
  EXPECT_EQ(odd->first, 1);
  EXPECT_EQ(odd->step, 2);
  EXPECT_EQ(odd->count, 5);
  const RowMap m = odd->map(RowMap{}, 10);
  EXPECT_EQ(m, (RowMap{1, 2, 5}));
  // Batch rows [4, 8) hold the slice's rows 2 and 3 (batch rows 5 and 7): in the chunk's storage of
  // rows 4..7 they are rows 1 and 3.
  EXPECT_EQ(m.local(4, 8), (std::pair<int64_t, int64_t>{2, 4}));
  TensorMeta local = localize(view({5, 3, 4}, {24, 4, 1}, 12), kBTH, 4, 8);
  EXPECT_EQ(local.sizes, (c10::SmallVector<int64_t, 5>{2, 3, 4}));
  EXPECT_EQ(local.strides, (c10::SmallVector<int64_t, 5>{24, 4, 1}));
  EXPECT_EQ(local.offset, 12);
  // A chunk without any of its rows.
  EXPECT_EQ(RowMap({0, 1, 5}).local(6, 10), (std::pair<int64_t, int64_t>{5, 5}));
  // The tail x[7:] of a value that is itself rows 2.. of the batch (a map composed with a slice).
  EXPECT_EQ(analyze_view(view({3, 3, 4}, {12, 4, 1}, 84), kBTH)->map(RowMap{2, 1, 10}, 12), (RowMap{9, 1, 3}));
  // Every row after all: the identity.
  EXPECT_EQ(analyze_view(view({10, 3, 4}, {12, 4, 1}), kBTH)->count, 0);
}

TEST(Localize, ATimeMajorFlattenCarriesItsBlocks) {
  const RowLayout tbh{3, 10, 16}; // a contiguous (T=3, B=10, H=4) buffer, as attention's projections make
  auto at = analyze_view(view({30, 4}, {4, 1}), tbh); // (T*B, H): the batch a minor factor
  ASSERT_TRUE(at);
  EXPECT_EQ(at->dim, 0);
  EXPECT_EQ(at->unit, 1);
  EXPECT_EQ(at->outer, 3);
  TensorMeta local = localize(view({30, 4}, {4, 1}), tbh, 0, 4); // a chunk-local (3, 4, 4) storage
  EXPECT_EQ(local.sizes, (c10::SmallVector<int64_t, 5>{12, 4}));
  EXPECT_EQ(local.strides, (c10::SmallVector<int64_t, 5>{4, 1}));
  // (T*B*heads, head_dim) with 2 heads of 2: flattened with row positions too.
  auto heads = analyze_view(view({60, 2}, {2, 1}), tbh);
  ASSERT_TRUE(heads);
  EXPECT_EQ(heads->unit, 2);
  EXPECT_EQ(heads->outer, 3);
  EXPECT_EQ(localize(view({60, 2}, {2, 1}), tbh, 0, 4).sizes[0], 24);
  // The second and third blocks only.
  auto tail = analyze_view(view({20, 4}, {4, 1}, 40), tbh);
  ASSERT_TRUE(tail);
  EXPECT_EQ(tail->outer, 2);
  EXPECT_EQ(localize(view({20, 4}, {4, 1}, 40), tbh, 0, 4).offset, 16);
  // The layout a (T*B, H) result defines.
  auto l = layout_of(view({30, 4}, {4, 1}), 30 * 16, BatchDim{0, 1, 3}, 10);
  ASSERT_TRUE(l);
  EXPECT_TRUE(*l == tbh);
  EXPECT_FALSE(layout_of(view({30, 4}, {4, 1}), 30 * 16, BatchDim{0, 1, 1}, 10)); // without its blocks
}

TEST(Localize, RowsOfEveryBlockAreGatheredThroughOneMoreDim) {
  // Rows 4..5 of a (T*B, H) flatten, T=3, B=10: (3, 2, 4) at offset 4 rows, blocks 40 apart.
  TensorMeta e = narrow_rows_blocks(view({30, 4}, {4, 1}), 0, 1, 3, 4, 2);
  EXPECT_EQ(e.sizes, (c10::SmallVector<int64_t, 5>{3, 2, 4}));
  EXPECT_EQ(e.strides, (c10::SmallVector<int64_t, 5>{40, 4, 1}));
  EXPECT_EQ(e.offset, 16);
  TensorMeta g = gathered_rows(view({30, 4}, {4, 1}), 0, 1, 3, 2);
  EXPECT_EQ(g.sizes, (c10::SmallVector<int64_t, 5>{6, 4}));
  EXPECT_EQ(g.strides, (c10::SmallVector<int64_t, 5>{4, 1}));
}

TEST(Localize, LayoutOfADefinedBuffer) {
  auto l = layout_of(view({10, 3, 4}, {12, 4, 1}), 10 * 12 * 4, BatchDim{0, 1}, 10);
  ASSERT_TRUE(l);
  EXPECT_TRUE(*l == kBTH);
  EXPECT_FALSE(layout_of(view({10, 3, 4}, {12, 4, 1}), 10 * 12 * 4, BatchDim{1, 1}, 10)); // dim 1 is not 10 rows
  auto t = layout_of(view({3, 10, 4}, {40, 4, 1}), 3 * 40 * 4, BatchDim{1, 1}, 10);
  ASSERT_TRUE(t);
  EXPECT_EQ(t->outer, 3);
  EXPECT_EQ(t->row_bytes, 16);
}

TEST(Localize, NarrowingTakesTheChunksRows) {
  TensorMeta n = narrow_rows(view({30, 4}, {4, 1}), 0, 3, 4, 2); // rows 4..5 of (B*T, H), unit 3
  EXPECT_EQ(n.offset, 4 * 3 * 4);
  EXPECT_EQ(n.sizes[0], 6);
}

} // namespace
} // namespace lazymem
