// execute/memory: byte-exact accounting, including intra-op worker threads, and host failures.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <gtest/gtest.h>

#include <mutex>

#include "execute/memory.h"

namespace lazymem {
namespace {

TEST(Counting, WorkerThreadAllocationsAreChargedToTheScope) {
  MemoryCounter counter("test device");
  const int64_t workers_before = worker_allocations();
  std::mutex mu;
  std::vector<at::Tensor> kept;
  {
    CountingScope scope(&counter, /*workers=*/true);
    // A kernel that allocates per-thread buffers inside at::parallel_for.
    at::parallel_for(0, 64, 1, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        at::Tensor t = at::empty({1024}, at::kFloat);
        std::lock_guard<std::mutex> lock(mu);
        kept.push_back(t);
      }
    });
  }
  EXPECT_EQ(counter.allocated(), 64 * 4096);
  EXPECT_EQ(counter.peak(), 64 * 4096);
  if (at::get_num_threads() > 1) EXPECT_GT(worker_allocations(), workers_before);
  kept.clear();
  EXPECT_EQ(counter.allocated(), 0);
}

TEST(Counting, WorkersOutsideAScopeAreNotCharged) {
  MemoryCounter counter("test device");
  {
    CountingScope scope(&counter); // no workers: only this thread
  }
  at::parallel_for(0, 16, 1, [&](int64_t, int64_t) { (void)at::empty({256}, at::kFloat); });
  EXPECT_EQ(counter.allocated(), 0);
}

TEST(Counting, CapacityRaisesOutOfMemory) {
  MemoryCounter counter("test device");
  counter.set_capacity(1000);
  CountingScope scope(&counter);
  EXPECT_THROW((void)at::empty({2000}, at::kByte), c10::OutOfMemoryError);
  EXPECT_EQ(counter.allocated(), 0);
}

TEST(Counting, HostThatCannotAllocateRaisesOutOfMemoryNotRuntimeError) {
  MemoryCounter counter("test device");
  CountingScope scope(&counter);
  try {
    (void)at::empty({int64_t{1} << 60}, at::kByte);
    FAIL() << "allocated 2^60 bytes";
  } catch (const c10::OutOfMemoryError& e) {
    EXPECT_NE(std::string(e.what()).find("lazymem:"), std::string::npos) << e.what();
  }
  EXPECT_EQ(counter.allocated(), 0);
}

} // namespace
} // namespace lazymem

namespace lazymem {
namespace {

// The simulated device's two memories: a storage is the device's when the counting allocator
// charged it to the device counter, the host's otherwise (lazymem's host memory, the user's
// tensors), and a kernel operand in host memory is an internal error while the boundary is checked.
TEST(TwoMemories, StoragesAreToldApartByTheCounterTheyWereChargedTo) {
  ASSERT_TRUE(install_counting_cpu_allocator());
  at::Tensor dev, host, mine;
  {
    CountingScope scope(&device_counter());
    dev = at::empty({256}, at::kFloat);
  }
  {
    CountingScope scope(&host_counter());
    host = at::empty({256}, at::kFloat);
  }
  mine = at::empty({256}, at::kFloat); // the user's: no scope
  EXPECT_EQ(storage_domain(dev.storage()), Domain::kDevice);
  EXPECT_EQ(storage_domain(host.storage()), Domain::kHost);
  EXPECT_EQ(storage_domain(mine.storage()), Domain::kHost);
  // A view at an offset is in its storage's memory.
  EXPECT_EQ(storage_domain(dev.narrow(0, 8, 8).storage()), Domain::kDevice);
  EXPECT_EQ(storage_domain(c10::Storage()), Domain::kUnknown);
}

} // namespace
} // namespace lazymem
