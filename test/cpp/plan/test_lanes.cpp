// plan/lanes: chains of per-tensor ops over a list (an optimizer step's _foreach_ ops as recorded),
// found and run in groups of tensors when the whole list at once does not fit (no device).
#include <gtest/gtest.h>

#include "plan/lanes.h"
#include "plan/memory.h"
#include "program_builder.h"

namespace lazymem::testing {
namespace {

// For each of `lanes` parameters p (module state) with state s: t = sqrt(s); t /= 2; p += t — op by
// op over the list, as a _foreach_ chain records it.
struct Step {
  std::vector<T> params, states;
};

Step record_step(ProgramBuilder& b, size_t lanes, int64_t rows) {
  Step st;
  for (size_t k = 0; k < lanes; ++k) st.params.push_back(b.upload({rows, 4}, /*module_state=*/true));
  for (size_t k = 0; k < lanes; ++k) st.states.push_back(b.upload({rows, 4}, /*module_state=*/true));
  std::vector<T> t;
  for (size_t k = 0; k < lanes; ++k) t.push_back(b.op("aten::sqrt", "", {kNone}, {{0, st.states[k]}}, {{rows, 4}})[0]);
  for (size_t k = 0; k < lanes; ++k) b.inplace("aten::div_", "Scalar", {kNone, c10::IValue(2.0)}, t[k]);
  for (size_t k = 0; k < lanes; ++k) b.inplace("aten::add_", "Tensor", {kNone, kNone, c10::IValue(1)}, st.params[k], {{1, t[k]}});
  return st;
}

std::vector<T> all(const Step& st) {
  std::vector<T> v = st.params;
  v.insert(v.end(), st.states.begin(), st.states.end());
  return v;
}

TEST(Lanes, AChainOfPerTensorOpsIsFoundLaneByLane) {
  ProgramBuilder b;
  Step st = record_step(b, 3, 8);
  Plan whole = b.plan(all(st), {}, 0);
  // Uploads (6), then runs of 3 sqrt, 3 div_, 3 add_: one chain of 3 lanes and 3 ops.
  std::vector<const Node*> nodes;
  for (const PlannedNode& pn : whole.stages[0].nodes) nodes.push_back(pn.node);
  Schedule s = plan_segment(nodes, [&](const LazyBuffer& buf) {
    for (const T& t : all(st)) {
      if (t.buf.get() == &buf) return true;
    }
    return false;
  });
  std::vector<LaneChain> chains = find_lane_chains(nodes, s);
  ASSERT_EQ(chains.size(), 1u);
  EXPECT_EQ(chains[0].lanes, 3u);
  EXPECT_EQ(chains[0].runs, 3u);
  run_lanes_in_groups(s, nodes, chains, 3);
  // Lane by lane: sqrt, div_, add_ of parameter 0, then of 1, then of 2.
  for (size_t k = 0; k < 3; ++k) {
    EXPECT_EQ(std::string(nodes[s.run[6 + 3 * k]]->name()), "aten::sqrt");
    EXPECT_EQ(std::string(nodes[s.run[7 + 3 * k]]->name()), "aten::div_");
    EXPECT_EQ(std::string(nodes[s.run[8 + 3 * k]]->name()), "aten::add_");
    EXPECT_EQ(nodes[s.run[8 + 3 * k]]->uses[1].ref.buf, nodes[s.run[6 + 3 * k]]->defs[0].ref.buf);
  }
  // Each temporary is released right after its lane's last op.
  EXPECT_EQ(s.release[8].size(), 1u);
  EXPECT_EQ(s.release[8][0], nodes[s.run[6]]->defs[0].ref.buf.get());
}

TEST(Lanes, AStepThatDoesNotFitRunsInGroupsOfTensors) {
  // Each temporary is 8 x 4 doubles (256 bytes); params and states hold 6 x 256.
  ProgramBuilder b;
  Step st = record_step(b, 4, 8);
  const int64_t held = 8 * 256;
  Plan p = b.plan(all(st), {}, 0, held + 2 * 256); // two temporaries at once fit, four do not
  EXPECT_FALSE(p.split);
  EXPECT_LE(p.predicted_peak, held + 2 * 256);
  EXPECT_NE(p.to_string().find("over 4 tensors runs in 2 groups of tensors"), std::string::npos) << p.to_string();
}

TEST(Lanes, APositionTouchingAnotherLanesBufferEndsTheChain) {
  ProgramBuilder b;
  T a = b.upload({4}, true), c = b.upload({4}, true);
  T ta = b.op("aten::sqrt", "", {kNone}, {{0, a}}, {{4}})[0];
  T tc = b.op("aten::sqrt", "", {kNone}, {{0, c}}, {{4}})[0];
  b.inplace("aten::add_", "Tensor", {kNone, kNone, c10::IValue(1)}, a, {{1, tc}}); // lane 0 reads lane 1's
  b.inplace("aten::add_", "Tensor", {kNone, kNone, c10::IValue(1)}, c, {{1, ta}});
  Plan whole = b.plan({a, c}, {}, 0);
  std::vector<const Node*> nodes;
  for (const PlannedNode& pn : whole.stages[0].nodes) nodes.push_back(pn.node);
  Schedule s = plan_segment(nodes, [&](const LazyBuffer& buf) { return &buf == a.buf.get() || &buf == c.buf.get(); });
  EXPECT_TRUE(find_lane_chains(nodes, s).empty());
}

TEST(Lanes, ChainsAlikeAreDescribedOnceWithHowMany) {
  // An optimizer's per-tensor chains, one per parameter group: an out-of-memory message said the same
  // chain eight times over.
  auto chain = [](size_t runs, size_t lanes) {
    LaneChain c;
    c.runs = runs;
    c.lanes = lanes;
    return c;
  };
  EXPECT_EQ(describe_lane_groups({chain(2, 2), chain(2, 2), chain(7, 14), chain(2, 2)}, 4),
            "3 chains of 2 per-tensor ops over 2 tensors each run in 2 groups of tensors; "
            "a chain of 7 per-tensor ops over 14 tensors runs in 4 groups of tensors");
  EXPECT_EQ(describe_lane_groups({chain(3, 5)}, 8), "a chain of 3 per-tensor ops over 5 tensors runs in 5 groups of tensors");
}

} // namespace
} // namespace lazymem::testing
