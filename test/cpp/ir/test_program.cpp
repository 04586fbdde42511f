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

// The tape a segment carries (kept by the Program as nodes were appended) must be the one built
// from its nodes: the plan fingerprint trusts it.
void expect_tape_of_nodes(const Segment& seg) {
  ASSERT_TRUE(seg.tape.valid);
  Tape built;
  built.reset(Tape::Scratch::kPlanner);
  for (const NodePtr& n : seg.nodes) built.add(*n);
  EXPECT_EQ(seg.tape.nodes, built.nodes);
  EXPECT_EQ(seg.tape.words, built.words);
  EXPECT_EQ(seg.tape.buffers, built.buffers);
  EXPECT_EQ(seg.tape.base, built.base);
  EXPECT_EQ(seg.tape.describable, built.describable);
}

NodePtr with_sig(NodePtr n, uint64_t sig) {
  n->sig = sig;
  return n;
}

TEST(Tape, NumbersBuffersByFirstAppearanceWithRelativeVersions) {
  Program p;
  auto a = buffer(), b = buffer();
  p.append(with_sig(NodeBuilder().def(a).build(), 7));
  p.append(NodeBuilder().read(a).write(a).def(b).build()); // open (no sig): its references only
  p.append(with_sig(NodeBuilder().read(b).write(a).build(), 9));
  Segment seg = p.take_prefix(UINT64_MAX);
  expect_tape_of_nodes(seg);
  // node 0 (sig 7): header, sig, then a (number 0, version 1 - base 1) in one word
  const std::vector<uint64_t> head{Tape::kSigMark, 7, 0};
  EXPECT_TRUE(std::equal(head.begin(), head.end(), seg.tape.words.begin()));
  // node 1 has no sig: described in full, from its schema's address
  EXPECT_EQ(seg.tape.words[3], reinterpret_cast<uintptr_t>(&any_op().schema()));
  // node 2 (sig 9): b read at its first version, a read at version 2 and written to 3
  const std::vector<uint64_t> last{Tape::kSigMark, 9, uint64_t{1} << 32, 1, 2};
  ASSERT_GT(seg.tape.words.size(), 8u + last.size());
  EXPECT_TRUE(std::equal(last.begin(), last.end(), seg.tape.words.end() - last.size()));
  EXPECT_EQ(seg.tape.buffers, (std::vector<LazyBuffer*>{a.get(), b.get()}));
  EXPECT_EQ(seg.tape.base, (std::vector<uint32_t>{1, 1}));
}

TEST(Tape, StaysTheNodesTapeThroughPrefixesAndRestores) {
  Program p;
  auto a = buffer(), b = buffer(), c = buffer(), d = buffer();
  uint64_t s1 = p.append(with_sig(NodeBuilder().def(a).build(), 3));
  p.append(NodeBuilder().read(a).def(b).build());
  p.append(with_sig(NodeBuilder().read(b).write(a).def(c).build(), 4));
  // A prefix that leaves nodes behind carries no tape; what stays is numbered from its first node.
  Segment first = p.take_prefix(s1);
  EXPECT_FALSE(first.tape.valid);
  p.append(with_sig(NodeBuilder().read(c).def(d).build(), 5));
  Segment rest = p.take_prefix(UINT64_MAX);
  ASSERT_EQ(rest.nodes.size(), 3u);
  expect_tape_of_nodes(rest);
  // Nodes put back in front of nodes recorded meanwhile: the tape is renumbered over all of them.
  auto e = buffer();
  p.append(with_sig(NodeBuilder().read(d).def(e).build(), 6));
  std::vector<NodePtr> back;
  back.push_back(std::move(rest.nodes[1]));
  back.push_back(std::move(rest.nodes[2]));
  back[0]->sig = 0; // (changed while detached, as put_back does)
  p.restore_prefix(std::move(back));
  Segment again = p.take_prefix(UINT64_MAX);
  ASSERT_EQ(again.nodes.size(), 3u);
  expect_tape_of_nodes(again);
  // A new tape starts empty after everything was taken.
  auto f = buffer();
  p.append(with_sig(NodeBuilder().def(f).build(), 8));
  Segment last = p.take_prefix(UINT64_MAX);
  expect_tape_of_nodes(last);
  EXPECT_EQ(last.tape.buffers, (std::vector<LazyBuffer*>{f.get()}));
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
