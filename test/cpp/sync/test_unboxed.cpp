// record_call's borrowed mode, which the unboxed kernels (sync/unboxed.cpp) rely on: the stack's
// tensors are never dropped or copied for nothing, the returns follow the arguments, an in-place
// op's return is None, and a call the recorder cannot take leaves the stack untouched. Then the
// unboxed kernels themselves, through the dispatcher: no reference kept or lost.
#include <ATen/ATen.h>
#include <c10/util/MaybeOwned.h>
#include <gtest/gtest.h>

#include "core/config.h"
#include "ir/program.h"
#include "record/recorder.h"
#include "sync/sync.h"

namespace lazymem {
namespace {

at::TensorOptions lazy() {
  return at::TensorOptions().device(c10::Device(c10::DeviceType::PrivateUse1, 0));
}

c10::IValue borrow(const at::Tensor& t) {
  return c10::IValue(c10::MaybeOwnedTraits<at::Tensor>::createBorrow(t));
}

void release(torch::jit::Stack& stack, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    if (!stack[i].isTensor()) continue;
    at::Tensor t = std::move(stack[i]).toTensor();
    c10::MaybeOwnedTraits<at::Tensor>::destroyBorrow(t);
  }
}

class Borrowed : public ::testing::Test {
 protected:
  void SetUp() override {
    c10::register_privateuse1_backend("lazymem");
  }
};

TEST_F(Borrowed, FunctionalCallLeavesItsArgumentsAndPushesItsReturn) {
  at::Tensor a = at::rand({4, 3}, lazy()), b = at::rand({4, 3}, lazy());
  const size_t ua = a.use_count(), ub = b.use_count();
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("aten::add", "Tensor");
  torch::jit::Stack stack{borrow(a), borrow(b), c10::IValue(c10::Scalar(2))};
  ASSERT_EQ(record_call(op, &stack, false, /*borrowed=*/true), Recorded::kDone);
  ASSERT_EQ(stack.size(), 4u);
  EXPECT_EQ(stack[0].toTensor().unsafeGetTensorImpl(), a.unsafeGetTensorImpl());
  EXPECT_EQ(stack[1].toTensor().unsafeGetTensorImpl(), b.unsafeGetTensorImpl());
  at::Tensor out = std::move(stack[3]).toTensor();
  release(stack, 3);
  EXPECT_EQ(a.use_count(), ua);
  EXPECT_EQ(b.use_count(), ub);
  EXPECT_TRUE(at::equal(out.cpu(), a.cpu() + 2 * b.cpu()));
}

TEST_F(Borrowed, InPlaceCallPushesNoneForItsSelf) {
  at::Tensor a = at::rand({5}, lazy()), b = at::rand({5}, lazy());
  at::Tensor expected = a.cpu() * b.cpu();
  const size_t ua = a.use_count();
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("aten::mul_", "Tensor");
  torch::jit::Stack stack{borrow(a), borrow(b)};
  ASSERT_EQ(record_call(op, &stack, false, /*borrowed=*/true), Recorded::kDone);
  ASSERT_EQ(stack.size(), 3u);
  EXPECT_TRUE(stack[2].isNone());
  release(stack, 2);
  EXPECT_EQ(a.use_count(), ua);
  EXPECT_TRUE(at::equal(a.cpu(), expected));
}

TEST_F(Borrowed, ACallTheRecorderCannotTakeLeavesTheStackUntouched) {
  at::Tensor a = at::tensor({0.f, 1.f, 0.f, 2.f}).to(lazy());
  const size_t ua = a.use_count();
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("aten::nonzero", "");
  torch::jit::Stack stack{borrow(a)};
  ASSERT_EQ(record_call(op, &stack, false, /*borrowed=*/true), Recorded::kNeedsEager);
  ASSERT_EQ(stack.size(), 1u);
  EXPECT_EQ(stack[0].toTensor().unsafeGetTensorImpl(), a.unsafeGetTensorImpl());
  release(stack, 1);
  EXPECT_EQ(a.use_count(), ua);
}

TEST_F(Borrowed, TheUnboxedKernelsKeepNoReferenceAndReturnSelf) {
  at::Tensor a = at::rand({6}, lazy()), b = at::rand({6}, lazy());
  at::Tensor ea = a.cpu(), eb = b.cpu();
  const size_t ua = a.use_count(), ub = b.use_count();
  at::Tensor y = at::sigmoid(at::mul(a, b) + at::div(a, b) - at::relu(b).exp());
  at::Tensor& r = a.add_(b, 0.5);
  EXPECT_EQ(r.unsafeGetTensorImpl(), a.unsafeGetTensorImpl());
  EXPECT_EQ(a.use_count(), ua);
  EXPECT_EQ(b.use_count(), ub);
  EXPECT_TRUE(at::equal(y.cpu(), at::sigmoid(ea * eb + ea / eb - at::relu(eb).exp())));
  EXPECT_TRUE(at::equal(a.cpu(), ea.add(eb, 0.5)));
  // A mixed-device call raises eager's error and the arguments stay whole.
  EXPECT_THROW((void)at::mul(a, at::rand({6})), c10::Error);
  EXPECT_EQ(a.use_count(), ua);
}

TEST_F(Borrowed, EveryListedUnboxedKernelIsRegistered) {
  // sync/unboxed.cpp lists 40 ops; none is composite-implicit or had a PrivateUse1 kernel before.
  EXPECT_EQ(unboxed_kernels_registered(), 40);
}

} // namespace
} // namespace lazymem
