// ops: placement rules on synthetic calls (no device): the algebra of each family.
#include <gtest/gtest.h>

#include "ops/placement.h"

namespace lazymem {
namespace {

c10::OperatorHandle op(const char* name, const char* overload) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, overload);
}

struct Call {
  c10::OperatorHandle handle;
  std::vector<c10::IValue> args;
  std::vector<std::vector<int64_t>> shapes; // operands' sizes (kept alive for the IntArrayRefs)
  std::vector<std::vector<int64_t>> strides;
  std::vector<Operand> ins;
  std::vector<std::vector<int64_t>> out_shapes;
  std::vector<Output> outs;
  RuleResult r;

  Call(const char* name, const char* overload, std::vector<c10::IValue> a) : handle(op(name, overload)), args(std::move(a)) {
    shapes.reserve(8);
    strides.reserve(8);
    out_shapes.reserve(8);
  }
  Call& in(int32_t arg, std::vector<int64_t> sizes, Place p = Place::R(), bool write = false) {
    shapes.push_back(sizes);
    std::vector<int64_t> st(sizes.size(), 1);
    for (size_t k = sizes.size(); k-- > 1;) st[k - 1] = st[k] * sizes[k];
    strides.push_back(st);
    Operand o;
    o.sizes = shapes.back();
    o.strides = strides.back();
    o.dtype = c10::ScalarType::Float;
    o.place = p;
    o.write = write;
    o.arg = arg;
    ins.push_back(o);
    return *this;
  }
  Call& out(std::vector<int64_t> sizes, int32_t ret = -1) {
    out_shapes.push_back(sizes);
    Output o;
    o.sizes = out_shapes.back();
    o.dtype = c10::ScalarType::Float;
    o.ret = ret < 0 ? static_cast<int32_t>(outs.size()) : ret;
    outs.push_back(o);
    return *this;
  }
  bool run(std::vector<Place> want = {}) {
    // re-point the operands at their (now stable) storage
    for (size_t i = 0; i < ins.size(); ++i) {
      ins[i].sizes = shapes[i];
      ins[i].strides = strides[i];
    }
    for (size_t j = 0; j < outs.size(); ++j) outs[j].sizes = out_shapes[j];
    r = RuleResult{};
    r.outs.assign(outs.size(), Place::R());
    r.ins.assign(ins.size(), OperandMode::whole());
    r.finalize.assign(outs.size(), Finalize{});
    r.post_div.assign(outs.size(), 0.0);
    r.discard.assign(outs.size(), false);
    const RuleEntry* e = placement_rule(handle);
    EXPECT_NE(e, nullptr);
    RuleCall c{handle, args, ins, outs, 10, want};
    return e && e->fn(c, r);
  }
};

const c10::IValue kNone;

TEST(Rules, PointwiseBroadcastsReplicatedOperands) {
  Call c("aten::add", "Tensor", {kNone, kNone, c10::IValue(1)});
  c.in(0, {10, 4}, Place::S(0)).in(1, {1, 4}).out({10, 4});
  ASSERT_TRUE(c.run());
  EXPECT_EQ(c.r.outs[0], Place::S(0));
  EXPECT_EQ(c.r.ins[1].mode, Mode::kWhole); // broadcast along the batch
  Call d("aten::add", "Tensor", {kNone, kNone, c10::IValue(1)});
  d.in(0, {10, 4}, Place::S(0)).in(1, {10, 4}).out({10, 4});
  ASSERT_TRUE(d.run());
  EXPECT_EQ(d.r.ins[1].mode, Mode::kRows); // a replicated operand used row by row
}

TEST(Rules, PointwiseRefusesOperandsShardedAlongDifferentDims) {
  Call c("aten::mul", "Tensor", {kNone, kNone});
  c.in(0, {10, 10}, Place::S(0)).in(1, {10, 10}, Place::S(1)).out({10, 10});
  EXPECT_FALSE(c.run());
  EXPECT_NE(c.r.why, nullptr);
}

TEST(Rules, PartialsPassOnlyThroughLinearOps) {
  Call sum("aten::add", "Tensor", {kNone, kNone, c10::IValue(1)});
  sum.in(0, {4}, Place::P(Reduce::kSum)).in(1, {4}, Place::P(Reduce::kSum)).out({4});
  ASSERT_TRUE(sum.run());
  EXPECT_EQ(sum.r.outs[0], Place::P(Reduce::kSum));
  Call mixed("aten::add", "Tensor", {kNone, kNone, c10::IValue(1)});
  mixed.in(0, {4}, Place::P(Reduce::kSum)).in(1, {4}).out({4});
  ASSERT_TRUE(mixed.run());
  EXPECT_EQ(mixed.r.outs[0], Place::R()); // P + R needs P finished
  Call exp("aten::exp", "", {kNone});
  exp.in(0, {4}, Place::P(Reduce::kSum)).out({4});
  ASSERT_TRUE(exp.run());
  EXPECT_EQ(exp.r.outs[0], Place::R());
}

TEST(Rules, MatmulContractingTheBatchIsPartial) {
  Call c("aten::mm", "", {kNone, kNone});
  c.in(0, {5, 10}, Place::S(1)).in(1, {10, 3}, Place::S(0)).out({5, 3}); // g^T x: a weight gradient
  ASSERT_TRUE(c.run());
  EXPECT_EQ(c.r.outs[0], Place::P(Reduce::kSum));
  Call rows("aten::mm", "", {kNone, kNone});
  rows.in(0, {10, 5}, Place::S(0)).in(1, {5, 3}).out({10, 3});
  ASSERT_TRUE(rows.run());
  EXPECT_EQ(rows.r.outs[0], Place::S(0));
  EXPECT_EQ(rows.r.ins[1].mode, Mode::kWhole);
}

TEST(Rules, AddmmWithAnAddedInputDoesNotContractTheBatch) {
  Call c("aten::addmm", "", {kNone, kNone, kNone, c10::IValue(1), c10::IValue(1)});
  c.in(0, {3}).in(1, {5, 10}, Place::S(1)).in(2, {10, 3}, Place::S(0)).out({5, 3});
  EXPECT_FALSE(c.run()); // the bias would be added once per chunk
}

TEST(Rules, MeanOverTheBatchIsASumFinishedByTheGlobalCount) {
  Call c("aten::mean", "dim", {kNone, c10::IValue(std::vector<int64_t>{0}), c10::IValue(false), kNone});
  c.in(0, {10, 4}, Place::S(0)).out({4});
  ASSERT_TRUE(c.run());
  EXPECT_EQ(c.r.outs[0], Place::P(Reduce::kSum));
  EXPECT_STREQ(c.r.replace_op, "aten::sum.dim_IntList");
  EXPECT_EQ(c.r.finalize[0].kind, Finalize::kDivConst);
  EXPECT_EQ(c.r.finalize[0].value, 10.0);
  Call keep("aten::mean", "dim", {kNone, c10::IValue(std::vector<int64_t>{1}), c10::IValue(false), kNone});
  keep.in(0, {10, 4}, Place::S(0)).out({10});
  ASSERT_TRUE(keep.run());
  EXPECT_EQ(keep.r.outs[0], Place::S(0));
  EXPECT_EQ(keep.r.replace_op, nullptr);
}

TEST(Rules, SoftmaxAlongTheBatchNeedsEveryRow) {
  Call c("aten::_softmax", "", {kNone, c10::IValue(int64_t{0}), c10::IValue(false)});
  c.in(0, {10, 4}, Place::S(0)).out({10, 4});
  EXPECT_FALSE(c.run());
  Call d("aten::_softmax", "", {kNone, c10::IValue(int64_t{1}), c10::IValue(false)});
  d.in(0, {10, 4}, Place::S(0)).out({10, 4});
  EXPECT_TRUE(d.run());
}

TEST(Rules, NllMeanSumsChunksAndAsksForTheTotalWeight) {
  Call c("aten::nll_loss_forward", "",
         {kNone, kNone, kNone, c10::IValue(int64_t{1}), c10::IValue(int64_t{-100})});
  c.in(0, {10, 5}, Place::S(0)).in(1, {10}, Place::S(0)).out({}).out({});
  ASSERT_TRUE(c.run());
  EXPECT_TRUE(c.r.needs_total_weight);
  EXPECT_EQ(c.r.outs[0], Place::P(Reduce::kSum));
  EXPECT_EQ(c.r.finalize[0].kind, Finalize::kDivOutput);
  ASSERT_EQ(c.r.rewrites.size(), 1u);
  EXPECT_EQ(c.r.rewrites[0].base, 2); // reduction = sum per chunk
}

TEST(Rules, ConvolutionBackwardMapsOutputsByReturnPosition) {
  // grad_input masked off: the defs are grad_weight (ret 1) and grad_bias (ret 2).
  Call c("aten::convolution_backward", "",
         {kNone, kNone, kNone, c10::IValue(std::vector<int64_t>{8}), c10::IValue(std::vector<int64_t>{1, 1}),
          c10::IValue(std::vector<int64_t>{1, 1}), c10::IValue(std::vector<int64_t>{1, 1}), c10::IValue(false),
          c10::IValue(std::vector<int64_t>{0, 0}), c10::IValue(int64_t{1}),
          c10::IValue(std::vector<bool>{false, true, true})});
  c.in(0, {10, 8, 6, 6}, Place::S(0)).in(1, {10, 3, 6, 6}, Place::S(0)).in(2, {8, 3, 3, 3});
  c.out({8, 3, 3, 3}, 1).out({8}, 2);
  ASSERT_TRUE(c.run());
  EXPECT_EQ(c.r.outs[0], Place::P(Reduce::kSum));
  EXPECT_EQ(c.r.outs[1], Place::P(Reduce::kSum));
}

TEST(Rules, GroupNormRewritesItsBatchArgument) {
  Call c("aten::native_group_norm", "",
         {kNone, kNone, kNone, c10::IValue(int64_t{10}), c10::IValue(int64_t{8}), c10::IValue(int64_t{36}),
          c10::IValue(int64_t{2}), c10::IValue(1e-5)});
  c.in(0, {10, 8, 6, 6}, Place::S(0)).in(1, {8}).in(2, {8}).out({10, 8, 6, 6}).out({10, 2}).out({10, 2});
  ASSERT_TRUE(c.run());
  ASSERT_EQ(c.r.rewrites.size(), 1u);
  EXPECT_EQ(c.r.rewrites[0].arg, 3);
  EXPECT_EQ(c.r.rewrites[0].kind, ArgRewrite::kRows);
}

TEST(Rules, EmbeddingBackwardIsPartialUnlessScaledByFrequency) {
  Call c("aten::embedding_dense_backward", "",
         {kNone, kNone, c10::IValue(int64_t{50}), c10::IValue(int64_t{-1}), c10::IValue(false)});
  c.in(0, {10, 4}, Place::S(0)).in(1, {10}, Place::S(0)).out({50, 4});
  ASSERT_TRUE(c.run());
  EXPECT_EQ(c.r.outs[0], Place::P(Reduce::kSum));
  Call f("aten::embedding_dense_backward", "",
         {kNone, kNone, c10::IValue(int64_t{50}), c10::IValue(int64_t{-1}), c10::IValue(true)});
  f.in(0, {10, 4}, Place::S(0)).in(1, {10}, Place::S(0)).out({50, 4});
  EXPECT_FALSE(f.run());
}

TEST(Rules, DemandMakesAReplicatedFillBatchSharded) {
  Call c("aten::fill_", "Scalar", {kNone, c10::IValue(1.0)});
  c.in(0, {10, 4}, Place::S(0), /*write=*/true);
  ASSERT_TRUE(c.run());
  EXPECT_EQ(c.r.ins[0].mode, Mode::kRows);
}

TEST(Rules, OpsWithoutRulesAreBarriersOnlyWhenBatched) {
  EXPECT_EQ(placement_rule(op("aten::_fft_r2c", "")), nullptr);
  EXPECT_NE(placement_rule(op("aten::_foreach_add", "List")), nullptr); // optimizer: replicated only
}

} // namespace
} // namespace lazymem
