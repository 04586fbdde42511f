// plan/timing: what the planner prices a copy across the host/device boundary at (no device).
#include <gtest/gtest.h>

#include "core/config.h"
#include "plan/timing.h"

namespace lazymem::testing {
namespace {

// The link as configured, then the copies measured: only copies large enough to measure the link
// teach it. A 64 KiB copy that took a millisecond (a launch, a wait for the device, the pages' first
// touch) left the planner pricing every copy at 64 MB/s, so holding a large result in host memory
// never looked worth its copies (issue 30 item 4).
TEST(CopyTimes, OnlyLargeCopiesTeachTheLinkRate) {
  const double link = config().link_bandwidth.load();
  config().link_bandwidth.store(25e9);
  clear_copy_times();
  const int64_t gib = int64_t{1} << 30;
  EXPECT_DOUBLE_EQ(predicted_copy_seconds(gib), static_cast<double>(gib) / 25e9);
  observe_copy(64 << 10, 1e-3);
  observe_copy(kLearnedCopyBytes - 1, 1.0);
  EXPECT_DOUBLE_EQ(predicted_copy_seconds(gib), static_cast<double>(gib) / 25e9);
  observe_copy(kLearnedCopyBytes * 4, 4 * static_cast<double>(kLearnedCopyBytes) / 5e9); // 5 GB/s
  EXPECT_NEAR(predicted_copy_seconds(gib), static_cast<double>(gib) / 5e9, 1e-9);
  // Never faster than the modeled link.
  observe_copy(kLearnedCopyBytes * 4, 1e-9);
  EXPECT_GE(predicted_copy_seconds(gib), static_cast<double>(gib) / 25e9);
  clear_copy_times();
  config().link_bandwidth.store(link);
}

} // namespace
} // namespace lazymem::testing
