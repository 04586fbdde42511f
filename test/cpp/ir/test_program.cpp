// ir/program: versions (SSA over buffer writes), prefix detachment, liveness snapshot, restore.
#include "test_util.h"

namespace lazymem::testing {
namespace {

TEST(Program, AppendAssignsSeqsAndVersions) {
  Program p;
  auto x = buffer();
  auto y = buffer();
  uint64_t s1 = p.append(NodeBuilder().def(x).build());
  uint64_t s2 = p.append(NodeBuilder().read(x).write(x).def(y).build());  // add_(x, x)-like
  EXPECT_EQ(s2, s1 + 1);
  EXPECT_EQ(x->version, 2u);
  EXPECT_EQ(y->version, 1u);
  EXPECT_EQ(x->last_writer_seq, s2);
  Segment seg = p.take_prefix(UINT64_MAX);
  ASSERT_EQ(seg.nodes.size(), 2u);
  const Node& n = *seg.nodes[1];
  // reads of an argument that is also written see the version before the write
  EXPECT_EQ(n.uses[0].ref.version, 1u);
  EXPECT_EQ(n.uses[1].ref.version, 1u);
  EXPECT_EQ(n.uses[1].write_version, 2u);
  EXPECT_EQ(n.defs[0].ref.version, 1u);
}

TEST(Program, PendingWriterAndPrefix) {
  Program p;
  auto a = buffer(), b = buffer();
  uint64_t s1 = p.append(NodeBuilder().def(a).build());
  uint64_t s2 = p.append(NodeBuilder().read(a).def(b).build());
  EXPECT_EQ(p.pending_writer(*a), s1);
  EXPECT_EQ(p.pending_writer(*b), s2);
  Segment seg = p.take_prefix(s1);
  ASSERT_EQ(seg.nodes.size(), 1u);
  EXPECT_EQ(p.pending_count(), 1u);
  EXPECT_EQ(p.pending_writer(*a), 0u);  // its writer left the program
  // `a` is read by the node that stayed pending: its value must survive the segment
  EXPECT_TRUE(seg.is_live_out(*a));
  p.verify();
}

TEST(Program, LiveOutIsSnapshotAtTheCut) {
  Program p;
  auto a = buffer(), dead = buffer();
  dead->storage_alive = false;
  p.append(NodeBuilder().def(a).build());
  p.append(NodeBuilder().read(a).def(dead).build());
  Segment seg = p.take_prefix(UINT64_MAX);
  EXPECT_TRUE(seg.is_live_out(*a));     // named by a tensor at the cut
  EXPECT_FALSE(seg.is_live_out(*dead)); // no tensor and no pending reader
  a->storage_alive = false;             // dying later does not change the snapshot
  EXPECT_TRUE(seg.is_live_out(*a));
}

TEST(Program, RestoredNodesGoBackInFrontInOrder) {
  Program p;
  auto a = buffer(), b = buffer(), c = buffer();
  p.append(NodeBuilder().def(a).build());
  p.append(NodeBuilder().def(b).build());
  Segment seg = p.take_prefix(UINT64_MAX);
  uint64_t s3 = p.append(NodeBuilder().def(c).build());  // recorded while the segment was out
  std::vector<NodePtr> rest;
  rest.push_back(std::move(seg.nodes[1]));
  p.restore_prefix(std::move(rest));
  EXPECT_EQ(p.pending_count(), 2u);
  EXPECT_EQ(p.pending_writer(*b), s3 - 1);
  EXPECT_EQ(p.last_seq(), s3);
  p.verify();
  EXPECT_NE(p.to_string().find("2 pending nodes"), std::string::npos);
}

TEST(Program, PendingBytesTrackDefs) {
  Program p;
  auto a = buffer(1000), b = buffer(24);
  p.append(NodeBuilder().def(a).build());
  p.append(NodeBuilder().read(a).def(b).build());
  EXPECT_EQ(p.pending_def_bytes(), 1024u);
  p.take_prefix(UINT64_MAX);
  EXPECT_EQ(p.pending_def_bytes(), 0u);
}

TEST(TensorMeta, CoversAndExtent) {
  TensorMeta m = dense(16);
  EXPECT_TRUE(m.covers(64));
  EXPECT_FALSE(m.covers(128));
  EXPECT_EQ(m.extent_bytes(), 64u);
  TensorMeta t;  // a transposed 4x2 view of 8 floats: dense, covers the buffer
  t.sizes = {4, 2};
  t.strides = {1, 4};
  t.dtype = c10::ScalarType::Float;
  EXPECT_TRUE(t.covers(32));
  TensorMeta s = t;  // every other column: not dense
  s.strides = {2, 8};
  s.sizes = {2, 2};
  EXPECT_FALSE(s.covers(32));
  EXPECT_EQ(s.extent_bytes(), (2 + 8 + 1) * 4u);
  TensorMeta e = dense(0);
  EXPECT_EQ(e.extent_bytes(), 0u);
}

} // namespace
} // namespace lazymem::testing
