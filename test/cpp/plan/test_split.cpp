// plan/split: split plans of synthetic programs (no device, nothing runs): stages, bindings,
// partials and their finishes, the targets' total-weight pass, seeds and conflicts, what stays
// pending, the memory model and the chunk size.
#include <algorithm>

#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>

#include "plan/memory.h"
#include "program_builder.h"

namespace lazymem::testing {
namespace {

const Stage* only_loop(const Plan& p) {
  const Stage* loop = nullptr;
  for (const Stage& st : p.stages) {
    if (!st.loop) continue;
    EXPECT_EQ(loop, nullptr) << p.to_string(true);
    loop = &st;
  }
  return loop;
}

// x (10 x 20) @ w (20 x 5); the batch's sum; a weight gradient x^T y.
struct Linear {
  ProgramBuilder b;
  T x, w, y, s, g;
  Linear() {
    x = b.upload({10, 20});
    w = b.upload({20, 5}, /*module_state=*/true);
    y = b.op("aten::mm", "", {kNone, kNone}, {{0, x}, {1, w}}, {{10, 5}})[0];
    s = b.op("aten::sum", "dim_IntList", {kNone, c10::IValue(std::vector<int64_t>{0}), c10::IValue(false), kNone},
             {{0, y}}, {{5}})[0];
    g = b.op("aten::mm", "", {kNone, kNone}, {{0, transposed(x)}, {1, y}}, {{20, 5}})[0];
  }
};

TEST(SplitPlan, OneLoopOfRowsAndPartials) {
  Linear l;
  Plan p = l.b.plan({l.s, l.g}, {l.s, l.g}, /*force_chunks=*/3);
  ASSERT_TRUE(p.split) << p.to_string();
  EXPECT_EQ(p.batch, 10);
  const Stage* loop = only_loop(p);
  ASSERT_NE(loop, nullptr);
  EXPECT_EQ(loop->chunk, 4);
  EXPECT_EQ(loop->chunks(), 3);
  EXPECT_EQ(loop->accs.size(), 2u); // the batch's sum and the weight gradient
  for (const Accumulator& a : loop->accs) {
    EXPECT_EQ(a.reduce, Reduce::kSum);
    EXPECT_EQ(a.finalize, Finalize::kNone);
  }
  // The upload reads only the chunk's rows of its host tensor; y lives chunk by chunk.
  const PlannedNode& upload = loop->nodes.front();
  ASSERT_EQ(upload.consts.size(), 1u);
  EXPECT_EQ(upload.consts[0].dim, 0);
  const PlannedNode& mm = loop->nodes[1]; // upload of x, mm, sum, mm
  EXPECT_EQ(mm.uses[0].bind, Bind::kLocal);
  EXPECT_EQ(mm.uses[1].bind, Bind::kWhole);
  EXPECT_EQ(mm.defs[0].bind, Bind::kLocal);
}

TEST(SplitPlan, NothingSplitsWithoutADataLeaf) {
  ProgramBuilder b;
  T w = b.upload({10, 4}, /*module_state=*/true);
  T y = b.op("aten::exp", "", {kNone}, {{0, w}}, {{10, 4}})[0];
  Plan p = b.plan({y}, {y}, 3);
  EXPECT_FALSE(p.split);
  ASSERT_FALSE(p.notes.empty());
  EXPECT_NE(p.to_string().find("no data leaf"), std::string::npos);
}

TEST(SplitPlan, SourcesOfDifferentSizesAreTwoBatchesEachInItsOwnLoop) {
  ProgramBuilder b;
  T x = b.upload({10, 4}), z = b.upload({6, 4});
  T sx = b.op("aten::sum", "", {kNone, kNone}, {{0, x}}, {{}})[0];
  T sz = b.op("aten::sum", "", {kNone, kNone}, {{0, z}}, {{}})[0];
  Plan p = b.plan({sx, sz}, {sx, sz}, 3);
  ASSERT_TRUE(p.split);
  std::vector<int64_t> rows;
  for (const Stage& st : p.stages) {
    if (!st.loop) continue;
    rows.push_back(st.batch);
    EXPECT_EQ(st.chunks(), 3);
    ASSERT_EQ(st.accs.size(), 1u); // each loop accumulates its own sum
  }
  std::sort(rows.begin(), rows.end());
  EXPECT_EQ(rows, (std::vector<int64_t>{6, 10}));
  EXPECT_NE(p.to_string().find("split along 2 batches"), std::string::npos) << p.to_string();
}

TEST(SplitPlan, AMeanOverTheBatchIsFinishedByTheGlobalCount) {
  ProgramBuilder b;
  T x = b.upload({10, 4});
  T m = b.op("aten::mean", "dim", {kNone, c10::IValue(std::vector<int64_t>{0}), c10::IValue(false), kNone},
             {{0, x}}, {{4}})[0];
  Plan p = b.plan({m}, {m}, 3);
  const Stage* loop = only_loop(p);
  ASSERT_NE(loop, nullptr);
  ASSERT_EQ(loop->accs.size(), 1u);
  EXPECT_EQ(loop->accs[0].finalize, Finalize::kDivConst);
  EXPECT_EQ(loop->accs[0].divisor, 10.0);
  EXPECT_EQ(loop->nodes.back().op.operator_name().name, "aten::sum");
}

TEST(SplitPlan, CrossEntropysTotalWeightComesFromAPassOverTheTargets) {
  ProgramBuilder b;
  T x = b.upload({10, 5});
  T t = b.upload({10}, false, c10::ScalarType::Long);
  T lp = b.op("aten::_log_softmax", "", {kNone, c10::IValue(int64_t{1}), c10::IValue(false)}, {{0, x}}, {{10, 5}})[0];
  auto nll = b.op("aten::nll_loss_forward", "",
                  {kNone, kNone, kNone, c10::IValue(int64_t{1}), c10::IValue(int64_t{-100})}, {{0, lp}, {1, t}}, {{}, {}});
  T one = b.fill({}, 1.0); // the gradient seed
  T grad = b.op("aten::nll_loss_backward", "",
                {kNone, kNone, kNone, kNone, c10::IValue(int64_t{1}), c10::IValue(int64_t{-100}), kNone},
                {{0, one}, {1, lp}, {2, t}, {6, nll[1]}}, {{10, 5}})[0];
  T gx = b.op("aten::_log_softmax_backward_data", "",
              {kNone, kNone, c10::IValue(int64_t{1}), c10::IValue(c10::ScalarType::Double)}, {{0, grad}, {1, lp}},
              {{10, 5}})[0];
  T gs = b.op("aten::sum", "dim_IntList", {kNone, c10::IValue(std::vector<int64_t>{0}), c10::IValue(false), kNone},
              {{0, gx}}, {{5}})[0];
  Plan p = b.plan({nll[0], gs}, {nll[0], gs}, 2);
  ASSERT_TRUE(p.split) << p.to_string(true);
  std::vector<const Stage*> loops;
  for (const Stage& st : p.stages) {
    if (st.loop) loops.push_back(&st);
  }
  ASSERT_EQ(loops.size(), 2u) << p.to_string(true);
  // Pass 1: the targets only (ne, sum) into the total weight; pass 2: forward and backward.
  EXPECT_LE(loops[0]->nodes.size(), 3u) << p.to_string(true);
  bool divided = false;
  for (const Accumulator& a : loops[1]->accs) divided = divided || a.finalize == Finalize::kDivOutput;
  EXPECT_TRUE(divided);
  EXPECT_FALSE(p.owned.empty()); // the synthesized total-weight nodes
}

TEST(SplitPlan, SurvivingBatchShardedValuesStayPending) {
  Linear l;
  // y survives (autograd holds it) but only s is read: y's producers stay pending.
  Plan p = l.b.plan({l.y, l.s, l.x}, {l.s}, 3);
  ASSERT_TRUE(p.split);
  EXPECT_EQ(p.retained.size(), 2u); // the upload of x and the mm producing y
}

TEST(SplitPlan, ABatchEqualToTheHiddenSizeFollowsProvenance) {
  ProgramBuilder b;
  T x = b.upload({16, 16});
  T w = b.upload({16, 16}, true);
  T y = b.op("aten::mm", "", {kNone, kNone}, {{0, x}, {1, w}}, {{16, 16}})[0];
  Plan p = b.plan({y}, {y}, 2);
  const Stage* loop = only_loop(p);
  ASSERT_NE(loop, nullptr);
  const PlannedNode& mm = loop->nodes.back();
  EXPECT_EQ(mm.uses[1].bind, Bind::kWhole); // the weight is whole although 16 x 16
}

TEST(MemoryModel, TheLoopsPeakIsAffineInTheChunkAndFitsTheBudget) {
  Linear l;
  Plan p = l.b.plan({l.s, l.g}, {l.s, l.g}, 3);
  MemoryModel m = model_memory(p);
  int64_t per_row = 0;
  for (const MemPoint& pt : m.points) per_row = std::max(per_row, pt.per_row);
  EXPECT_EQ(per_row, 20 * 8 + 5 * 8); // a row of x and a row of y live together
  const Stage* loop = only_loop(p);
  const int32_t s = static_cast<int32_t>(loop - p.stages.data());
  const int64_t budget = m.peak(p) + 3 * per_row;
  const int64_t c = m.max_chunk(s, 10, budget);
  for (const MemPoint& pt : m.points) {
    if (pt.stage == s) EXPECT_LE(pt.at(c), budget);
  }
  bool tight = false;
  for (const MemPoint& pt : m.points) tight = tight || (pt.stage == s && pt.at(c + 1) > budget);
  EXPECT_TRUE(tight || c == 10);
}

TEST(ChunkSize, BalancedAlignedAndTheLargestThatFits) {
  for (int64_t batch : {1, 7, 8, 10, 64, 100, 1000, 1023}) {
    for (int64_t cmax = 1; cmax <= batch + 2; ++cmax) {
      const int64_t c = balanced_chunk(batch, cmax);
      ASSERT_GE(c, 1);
      ASSERT_LE(c, std::min(cmax, batch)) << batch << " " << cmax;
      // the fewest chunks the largest fitting chunk allows
      const int64_t fewest = (batch + std::min(cmax, batch) - 1) / std::min(cmax, batch);
      const int64_t n = (batch + c - 1) / c;
      ASSERT_EQ(n, fewest) << batch << " " << cmax;
      if (cmax >= batch) ASSERT_EQ(c, batch);
      // aligned to 8 whenever a multiple of 8 between the balanced size and the limit exists
      const int64_t balanced = (batch + fewest - 1) / fewest;
      if ((balanced + 7) / 8 * 8 <= cmax && cmax < batch) ASSERT_EQ(c % 8, 0) << batch << " " << cmax;
    }
  }
  EXPECT_EQ(balanced_chunk(16384, 2348), 2344); // 7 chunks, aligned up
  EXPECT_EQ(balanced_chunk(16384, 2341), 2341); // aligning would take an 8th chunk
  EXPECT_EQ(balanced_chunk(10, 4), 4);          // 4, 4, 2
}

// A program none of whose results survive (an upload kept pending, then dropped): every node is
// eliminated and every buffer released, nothing scheduled; one whose result survives runs.
// On CUDA an unsplit plan may use more of the budget than a split one (PlanInput::whole_budget: a
// split's chunk-sized blocks fragment the caching allocator; eager's order does not). A program that
// fits the whole allowance runs unsplit, a stored unsplit plan is reused under another budget while
// it fits that budget's allowance, and without the allowance the same program splits.
TEST(Plans, AProgramThatFitsTheWholeAllowanceIsNotSplit) {
  Linear a;
  const int64_t unsplit = a.b.plan({a.s, a.g}, {a.s, a.g}, 0).predicted_peak; // no budget: unsplit
  ASSERT_GT(unsplit, 0);
  Linear l1;
  Plan p1 = l1.b.plan({l1.s, l1.g}, {l1.s, l1.g}, 0, unsplit - 1, /*whole_budget=*/unsplit);
  EXPECT_FALSE(p1.split) << p1.to_string();
  EXPECT_EQ(p1.predicted_peak, unsplit);
  Linear l2;
  Plan p2 = l2.b.plan({l2.s, l2.g}, {l2.s, l2.g}, 0, unsplit - 2, /*whole_budget=*/unsplit);
  EXPECT_FALSE(p2.split) << p2.to_string();
  EXPECT_TRUE(p2.reused);
  Linear l3;
  Plan p3 = l3.b.plan({l3.s, l3.g}, {l3.s, l3.g}, 0, unsplit - 1);
  EXPECT_TRUE(p3.split) << p3.to_string();
  EXPECT_LE(p3.predicted_peak, unsplit - 1);
}

// A result the user holds, stored whole on the device, leaves its chunks little room. Where each
// node costs a kernel launch per chunk (a GPU), holding it in host memory (one copy out) and running
// fewer, larger chunks is faster: the planner weighs the two (issue 30 item 4). Where chunks cost
// only their work (the CPU: node cost 0), it stays on the device.
TEST(Plans, AHeldResultGoesToHostMemoryWhenItSavesManyChunks) {
  struct Held {
    ProgramBuilder b;
    T x, w, y, s, g;
    Held() {
      x = b.upload({512, 64});
      w = b.upload({64, 64}, /*module_state=*/true);
      y = b.op("aten::mm", "", {kNone, kNone}, {{0, x}, {1, w}}, {{512, 64}})[0];
      s = b.op("aten::sum", "dim_IntList", {kNone, c10::IValue(std::vector<int64_t>{0}), c10::IValue(false), kNone},
               {{0, y}}, {{64}})[0];
      g = b.op("aten::mm", "", {kNone, kNone}, {{0, transposed(x)}, {1, y}}, {{64, 64}})[0];
    }
  };
  auto stored = [](const Plan& p) -> const FullStore* {
    for (const Stage& st : p.stages) {
      for (const FullStore& f : st.stores) return &f;
    }
    return nullptr;
  };
  // (float64) w 32 KiB and g, the held result y 256 KiB, and 40 KiB for the chunks' rows
  const int64_t budget = (32 << 10) + (32 << 10) + (256 << 10) + (40 << 10);
  Held a;
  Plan on_device = a.b.plan({a.y, a.s, a.g}, {a.y, a.s, a.g}, 0, budget);
  ASSERT_TRUE(on_device.split) << on_device.to_string();
  ASSERT_NE(stored(on_device), nullptr) << on_device.to_string();
  EXPECT_FALSE(stored(on_device)->host) << on_device.to_string();
  Held c;
  Plan on_host = c.b.plan({c.y, c.s, c.g}, {c.y, c.s, c.g}, 0, budget, -1, /*chunk_node_ns=*/5000);
  ASSERT_TRUE(on_host.split) << on_host.to_string();
  ASSERT_NE(stored(on_host), nullptr) << on_host.to_string();
  EXPECT_TRUE(stored(on_host)->host) << on_host.to_string();
  ASSERT_NE(only_loop(on_host), nullptr);
  EXPECT_LT(only_loop(on_host)->chunks(), only_loop(on_device)->chunks()) << on_host.to_string() << on_device.to_string();
  EXPECT_LE(on_host.predicted_peak, budget);
  EXPECT_NE(on_host.to_string().find("held in host memory rather than on the device"), std::string::npos)
      << on_host.to_string();
}

TEST(Plans, NothingRunsWhenNoResultSurvives) {
  for (bool survives : {false, true}) {
    ProgramBuilder b;
    T x = b.upload({4, 3});
    T y = b.op("aten::relu", "", {kNone}, {{0, x}}, {{4, 3}})[0];
    Plan p = b.plan(survives ? std::vector<T>{y} : std::vector<T>{}, {}, /*force_chunks=*/0);
    size_t run = 0;
    for (const Stage& st : p.stages) run += st.nodes.size();
    if (survives) {
      EXPECT_EQ(run, 2u) << p.to_string(true);
      EXPECT_EQ(p.eliminated, 0u);
      continue;
    }
    EXPECT_EQ(run, 0u) << p.to_string(true);
    EXPECT_EQ(p.eliminated, 2u);
    EXPECT_FALSE(p.split);
    EXPECT_EQ(p.predicted_peak, p.resident); // nothing allocated
    std::vector<const LazyBuffer*> released(p.release_unused.begin(), p.release_unused.end());
    std::sort(released.begin(), released.end());
    std::vector<const LazyBuffer*> expect{x.buf.get(), y.buf.get()};
    std::sort(expect.begin(), expect.end());
    EXPECT_EQ(released, expect);
  }
}


// Random ops draw in program order (DESIGN.md §7 RNG). A loop's random node whose draws are a stream
// has them taken ahead when a later random op runs first (execute/streams.cpp): it constrains no
// stage, and the later draw (read whole by the loop) runs in the whole stage before it. One whose
// draws depend on its inputs' values (poisson) is a fence: a later draw runs after it.
struct TwoDraws {
  ProgramBuilder b;
  at::Generator g = at::detail::createCPUGenerator(7);
  T s, s2;
  explicit TwoDraws(bool fence) {
    T x = b.upload({12, 4});
    b.next_random(g.unsafeGetGeneratorImpl(), fence ? RngForm::kWhole : RngForm::kBernoulliP);
    T r = b.op(fence ? "aten::poisson" : "aten::bernoulli", "", {kNone, kNone}, {{0, x}}, {{12, 4}})[0];
    T w = b.fill({4}, 0.0);
    b.next_random(g.unsafeGetGeneratorImpl(), RngForm::kFill);
    b.inplace("aten::normal_", "", {kNone, c10::IValue(0.0), c10::IValue(1.0), kNone}, w);
    // (the poisson barrier's result summed apart: the loop is over x's rows)
    T y = b.op("aten::mul", "Tensor", {kNone, kNone}, {{0, fence ? x : r}, {1, w}}, {{12, 4}})[0];
    s = b.op("aten::sum", "", {kNone, kNone}, {{0, y}}, {{}})[0];
    if (fence) s2 = b.op("aten::sum", "", {kNone, kNone}, {{0, r}}, {{}})[0];
  }
  // Where the first random node and normal_ run: (stage, position in it).
  using At = std::pair<int, int>;
  std::pair<At, At> stages(const Plan& p) {
    At first{-1, -1}, normal{-1, -1};
    for (size_t k = 0; k < p.stages.size(); ++k) {
      for (size_t i = 0; i < p.stages[k].nodes.size(); ++i) {
        const std::string name = p.stages[k].nodes[i].node->op.schema().name();
        const At at{static_cast<int>(k), static_cast<int>(i)};
        if ((name == "aten::bernoulli" || name == "aten::poisson") && first.first < 0) first = at;
        if (name == "aten::normal_") normal = at;
      }
    }
    return {first, normal};
  }
};

TEST(SplitPlan, AStreamedDrawConstrainsNoStage) {
  TwoDraws t(/*fence=*/false);
  Plan p = t.b.plan({t.s}, {t.s}, /*force_chunks=*/3);
  ASSERT_TRUE(p.split) << p.to_string();
  auto [bernoulli, normal] = t.stages(p);
  ASSERT_GE(bernoulli.first, 0);
  EXPECT_TRUE(p.stages[bernoulli.first].loop);
  EXPECT_LT(normal.first, bernoulli.first) << p.to_string(true); // one pass: the later draw runs first
  for (const PlannedNode& pn : p.stages[bernoulli.first].nodes) {
    if (pn.node->op.schema().name() == "aten::bernoulli") EXPECT_TRUE(pn.rng_stream);
  }
}

TEST(SplitPlan, ADrawThatDependsOnItsInputsIsAFenceForLaterDraws) {
  TwoDraws t(/*fence=*/true);
  Plan p = t.b.plan({t.s, t.s2}, {t.s, t.s2}, /*force_chunks=*/3);
  ASSERT_TRUE(p.split) << p.to_string();
  auto [poisson, normal] = t.stages(p);
  ASSERT_GE(poisson.first, 0);
  EXPECT_FALSE(p.stages[poisson.first].loop); // a barrier: it runs whole
  EXPECT_GT(normal, poisson) << p.to_string(true);
}

} // namespace
} // namespace lazymem::testing
