// The whole pipeline from C++ without Python: recording through the dispatcher, meta-cache keys,
// materialization on the CPU backing device, dead-code elimination and memory accounting.
#include <ATen/ATen.h>
#include <c10/core/impl/PythonDispatcherTLS.h>
#include <gtest/gtest.h>

#include "core/config.h"
#include "device/phantom.h"
#include "execute/memory.h"
#include "ir/program.h"
#include "record/call.h"

namespace lazymem {
namespace {

at::TensorOptions lazy() {
  return at::TensorOptions().device(c10::Device(c10::DeviceType::PrivateUse1, 0));
}

class Pipeline : public ::testing::Test {
 protected:
  void SetUp() override {
    c10::register_privateuse1_backend("lazymem");
    flush_all_pending();
    stats().reset();
  }
  static void flush_all_pending() {
    at::Tensor t = at::zeros({1}, lazy());
    (void)t.cpu();  // everything before it runs too
  }
};

TEST_F(Pipeline, RecordsWithoutRealMemoryThenMatchesEager) {
  int64_t before = device_counter().allocated();
  at::Tensor a = at::arange(12, at::kFloat).reshape({3, 4});
  at::Tensor x = a.to(lazy());
  at::Tensor y = at::matmul(x, x.t()).relu_().sum(1);
  EXPECT_EQ(device_counter().allocated(), before);
  EXPECT_GE(Program::get().pending_count(), 4u);
  EXPECT_EQ(stats().nodes_executed.load(), 0u);
  at::Tensor expected = at::matmul(a, a.t()).relu_().sum(1);
  EXPECT_TRUE(at::equal(y.cpu(), expected));
  EXPECT_EQ(Program::get().pending_count(), 0u);
}

TEST_F(Pipeline, RepeatedOpsHitTheMetaCache) {
  at::Tensor x = at::ones({5, 5}, lazy());
  for (int i = 0; i < 4; ++i) x = x.exp();
  EXPECT_GE(stats().meta_cache_hits.load(), 3u);
}

TEST_F(Pipeline, ViewsAreMetadataOnly) {
  at::Tensor x = at::ones({4, 6}, lazy());
  size_t pending = Program::get().pending_count();
  at::Tensor v = x.t().slice(0, 1, 3).unsqueeze(0).view({2, 4});
  EXPECT_EQ(Program::get().pending_count(), pending);
  EXPECT_EQ(buffer_of(v), buffer_of(x));
}

TEST_F(Pipeline, DeadCodeIsNotRun) {
  at::Tensor x = at::ones({16}, lazy());
  { at::Tensor dead = x * 3; }
  at::Tensor live = x + 1;
  stats().reset();
  (void)live.cpu();
  EXPECT_EQ(stats().nodes_eliminated.load(), 1u);
  EXPECT_EQ(stats().nodes_executed.load(), 2u);  // fill (ones) and add
}

TEST_F(Pipeline, FreedAfterLastUseAndExactAccounting) {
  int64_t base = device_counter().allocated();
  {
    at::Tensor x = at::ones({1024}, lazy());  // 4 KiB
    at::Tensor y = x;
    for (int i = 0; i < 10; ++i) y = y * 2;
    device_counter().reset_window_peak();
    (void)y.sum().item<float>();
    EXPECT_LE(stats().peak_bytes.load(), 3 * 4096 + 64);
    EXPECT_EQ(device_counter().allocated(), base + 2 * 4096);  // x and y stay live; the sum was a temporary
  }
  EXPECT_EQ(device_counter().allocated(), base);
}

TEST_F(Pipeline, OutOfMemoryLosesNothing) {
  at::Tensor x = at::ones({1 << 16}, lazy());  // 256 KiB
  at::Tensor y = (x * 2).sum();
  device_counter().set_capacity(device_counter().allocated() + 100 * 1024);
  EXPECT_THROW((void)y.item<float>(), c10::OutOfMemoryError);
  EXPECT_GT(Program::get().pending_count(), 0u);
  device_counter().set_capacity(-1);
  EXPECT_EQ(y.item<float>(), 2.0f * (1 << 16));
}

TEST_F(Pipeline, PhantomBytesCannotBeCopied) {
  char buf[8];
  EXPECT_THROW(phantom_allocator()->copy_data(buf, buf, 8), c10::Error);
}

// Cache keys: same op and metadata -> same key; aliasing, shapes and scalar values -> different keys.
CallKey key_of(const char* name, const char* overload, torch::jit::Stack stack) {
  auto op = c10::Dispatcher::singleton().findSchemaOrThrow(name, overload);
  Call call(op, op_rules(op), &stack);
  analyze_call(call, false);
  return call.key;
}

TEST_F(Pipeline, CacheKeys) {
  at::Tensor x = at::ones({3}, lazy()), y = at::ones({3}, lazy()), z = at::ones({4}, lazy());
  auto k_xy = key_of("aten::add_", "Tensor", {x, y, 1});
  auto k_yx = key_of("aten::add_", "Tensor", {y, x, 1});
  auto k_xx = key_of("aten::add_", "Tensor", {x, x, 1});
  auto k_xz = key_of("aten::add_", "Tensor", {x, z, 1});
  auto k_alpha = key_of("aten::add_", "Tensor", {x, y, 2});
  EXPECT_EQ(k_xy, k_yx);
  EXPECT_FALSE(k_xy == k_xx);
  EXPECT_FALSE(k_xy == k_xz);
  EXPECT_FALSE(k_xy == k_alpha);
  auto k_mul = key_of("aten::mul_", "Tensor", {x, y});
  EXPECT_FALSE(k_xy == k_mul);
}

TEST_F(Pipeline, MixingDevicesIsRejectedLikeEager) {
  at::Tensor x = at::ones({3}, lazy());
  try {
    (void)(x + at::ones({3}));
    FAIL() << "expected an error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("Expected all tensors to be on the same device"), std::string::npos);
  }
}

TEST(Config, ParseBytes) {
  EXPECT_EQ(parse_bytes("256MiB"), 256LL << 20);
  EXPECT_EQ(parse_bytes("1.5 GB"), 1500000000LL);
  EXPECT_EQ(parse_bytes("4096"), 4096);
  EXPECT_EQ(parse_bytes("2k"), 2000);
  EXPECT_THROW(parse_bytes("lots"), c10::ValueError);
  EXPECT_THROW(parse_bytes("3 parsecs"), c10::ValueError);
  EXPECT_EQ(format_bytes(3 << 20), "3.00 MiB");
}

} // namespace
} // namespace lazymem
