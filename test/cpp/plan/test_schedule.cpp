// plan/schedule: dead-code elimination over buffer versions and release points (no device).
#include <functional>
#include <unordered_set>

#include "plan/planner.h"
#include "plan/schedule.h"
#include "test_util.h"

namespace lazymem::testing {
namespace {

struct Planned {
  Program program;
  Segment seg;
  std::vector<const Node*> nodes;
  Schedule schedule;

  // Appends the nodes, detaches them all and plans with `live` as the buffers still named by tensors.
  Planned(std::vector<NodePtr> ns, std::unordered_set<const LazyBuffer*> live) {
    for (auto& n : ns) program.append(std::move(n));
    seg = program.take_prefix(UINT64_MAX);
    for (const auto& n : seg.nodes) nodes.push_back(n.get());
    schedule = plan_segment(nodes, [&](const LazyBuffer& b) { return live.count(&b) > 0; });
  }
  std::vector<int32_t> run() const {
    return schedule.run;
  }
  std::unordered_set<const LazyBuffer*> released_after(size_t pos) const {
    return {schedule.release.at(pos).begin(), schedule.release.at(pos).end()};
  }
};

std::vector<NodePtr> list(NodePtr a, NodePtr b = nullptr, NodePtr c = nullptr, NodePtr d = nullptr) {
  std::vector<NodePtr> v;
  for (NodePtr* p : {&a, &b, &c, &d}) {
    if (*p) v.push_back(std::move(*p));
  }
  return v;
}

TEST(Schedule, DeadBranchIsEliminated) {
  auto b1 = buffer(), b2 = buffer(), b3 = buffer();
  Planned p(list(NodeBuilder().def(b1).build(), NodeBuilder().read(b1).def(b2).build(),
                 NodeBuilder().read(b1).def(b3).build()),
            {b3.get()});
  EXPECT_EQ(p.run(), (std::vector<int32_t>{0, 2}));
  EXPECT_EQ(p.schedule.eliminated, 1u);
  EXPECT_EQ(p.released_after(1), (std::unordered_set<const LazyBuffer*>{b1.get()}));
}

TEST(Schedule, EverythingDeadRunsNothing) {
  auto b1 = buffer(), b2 = buffer();
  Planned p(list(NodeBuilder().def(b1).build(), NodeBuilder().read(b1).def(b2).build()), {});
  EXPECT_TRUE(p.run().empty());
  EXPECT_EQ(p.schedule.eliminated, 2u);
}

TEST(Schedule, PartialWritesKeepTheWholeChain) {
  auto b1 = buffer(64);
  Planned p(list(NodeBuilder().def(b1).build(), NodeBuilder().write(b1, false).build(),
                 NodeBuilder().write(b1, true, /*numel=*/8).build()),  // overwrite of half the buffer
            {b1.get()});
  EXPECT_EQ(p.run(), (std::vector<int32_t>{0, 1, 2}));
}

TEST(Schedule, FullOverwriteMakesEarlierVersionsDead) {
  auto b1 = buffer(64);
  Planned p(list(NodeBuilder().def(b1).build(), NodeBuilder().write(b1, false).build(),
                 NodeBuilder().write(b1, true).build()),
            {b1.get()});
  EXPECT_EQ(p.run(), (std::vector<int32_t>{2}));
  EXPECT_EQ(p.schedule.eliminated, 2u);
}

TEST(Schedule, ReadBeforeAnOverwriteKeepsTheOldVersion) {
  auto b1 = buffer(), b2 = buffer();
  Planned p(list(NodeBuilder().def(b1).build(), NodeBuilder().read(b1).def(b2).build(),
                 NodeBuilder().write(b1, true).build()),
            {b1.get(), b2.get()});
  EXPECT_EQ(p.run(), (std::vector<int32_t>{0, 1, 2}));
}

TEST(Schedule, RandomAndEffectfulNodesAlwaysRun) {
  auto b1 = buffer(), b2 = buffer();
  Planned p(list(NodeBuilder().def(b1).random().build(), NodeBuilder().read(b1).effect().build(),
                 NodeBuilder().def(b2).build()),
            {});
  EXPECT_EQ(p.run(), (std::vector<int32_t>{0, 1}));
  EXPECT_EQ(p.schedule.eliminated, 1u);
}

TEST(Schedule, BuffersAreReleasedRightAfterTheirLastUse) {
  auto b1 = buffer(), b2 = buffer(), b3 = buffer(), b4 = buffer();
  Planned p(list(NodeBuilder().def(b1).build(), NodeBuilder().read(b1).def(b2).build(),
                 NodeBuilder().read(b2).def(b3).build(), NodeBuilder().read(b3).def(b4).build()),
            {b4.get()});
  ASSERT_EQ(p.run().size(), 4u);
  EXPECT_TRUE(p.released_after(0).empty());
  EXPECT_EQ(p.released_after(1), (std::unordered_set<const LazyBuffer*>{b1.get()}));
  EXPECT_EQ(p.released_after(2), (std::unordered_set<const LazyBuffer*>{b2.get()}));
  EXPECT_EQ(p.released_after(3), (std::unordered_set<const LazyBuffer*>{b3.get()}));
  // the live value is never released
  for (size_t i = 0; i < 4; ++i) EXPECT_EQ(p.released_after(i).count(b4.get()), 0u);
}

TEST(Schedule, DeadOutputsOfANeededNodeAreReleasedAtOnce) {
  auto in = buffer(), out = buffer(), aux = buffer();
  auto n = NodeBuilder().read(in).def(out).def(aux).build();
  Planned p(list(NodeBuilder().def(in).build(), std::move(n)), {out.get()});
  ASSERT_EQ(p.run().size(), 2u);
  EXPECT_EQ(p.released_after(1), (std::unordered_set<const LazyBuffer*>{in.get(), aux.get()}));
}

TEST(Schedule, PrintsAsText) {
  auto b1 = buffer(), b2 = buffer();
  Planned p(list(NodeBuilder().def(b1).build(), NodeBuilder().read(b1).def(b2).build()), {b2.get()});
  std::string text = p.schedule.to_string(p.nodes);
  EXPECT_NE(text.find("2 nodes run, 0 eliminated"), std::string::npos) << text;
  EXPECT_NE(text.find("aten::add.Tensor"), std::string::npos) << text;
  EXPECT_NE(text.find("free b" + std::to_string(b1->id)), std::string::npos) << text;
}

// make_plan takes a shortcut for small programs of which nothing runs (no schedule, memory model or
// fingerprint): it must agree with the scheduler on when that is and on what is released.
TEST(Schedule, ThePlannersNothingRunsShortcutAgreesWithTheSchedule) {
  using B = const BufferPtr&;
  struct Case {
    const char* name;
    std::function<std::vector<NodePtr>(B, B)> nodes;
    bool first_live;
  };
  const std::vector<Case> cases = {
      {"dead chain",
       [](B a, B b) { return list(NodeBuilder().def(a).build(), NodeBuilder().read(a).def(b).build()); }, false},
      {"reads a live value", [](B a, B b) { return list(NodeBuilder().read(a).def(b).build()); }, true},
      {"result survives",
       [](B a, B b) { return list(NodeBuilder().def(a).build(), NodeBuilder().read(a).def(b).build()); }, true},
      {"writes a live value",
       [](B a, B b) { return list(NodeBuilder().def(b).build(), NodeBuilder().read(b).write(a).build()); }, true},
      {"overwrites a dead value",
       [](B a, B) { return list(NodeBuilder().def(a).build(), NodeBuilder().write(a, true).build()); }, false},
      {"random", [](B a, B) { return list(NodeBuilder().def(a).random().build()); }, false},
      {"effect", [](B, B b) { return list(NodeBuilder().read(b).effect().build()); }, false},
  };
  for (const Case& c : cases) {
    auto a = buffer(), b = buffer();
    std::unordered_set<const LazyBuffer*> live;
    if (c.first_live) live.insert(a.get());
    Planned p(c.nodes(a, b), live);
    PlanInput in;
    in.nodes.reserve(p.seg.nodes.size());
    for (const auto& n : p.seg.nodes) in.nodes.push_back(n.get());
    in.live_out = [&](const LazyBuffer& x) { return live.count(&x) > 0; };
    Plan plan = make_plan(in);
    size_t run = 0;
    for (const Stage& st : plan.stages) run += st.nodes.size();
    EXPECT_EQ(run, p.run().size()) << c.name << "\n" << plan.to_string(true);
    EXPECT_EQ(plan.eliminated, p.schedule.eliminated) << c.name;
    if (p.run().empty()) {
      using Set = std::unordered_set<const LazyBuffer*>;
      EXPECT_EQ(Set(plan.release_unused.begin(), plan.release_unused.end()),
                Set(p.schedule.release_unused.begin(), p.schedule.release_unused.end()))
          << c.name;
    }
  }
}

} // namespace
} // namespace lazymem::testing
