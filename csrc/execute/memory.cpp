// execute: counting CPU allocator and memory counters.
#include "execute/memory.h"

#include <mutex>
#include <vector>

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/alignment.h>
#include <c10/core/impl/alloc_cpu.h>

#include "core/check.h"
#include "core/config.h"

namespace lazymem {

void MemoryCounter::charge(size_t n) {
  int64_t bytes = static_cast<int64_t>(n);
  int64_t now = allocated_.fetch_add(bytes, std::memory_order_relaxed) + bytes;
  int64_t cap = capacity_.load(std::memory_order_relaxed);
  if (cap >= 0 && now > cap) {
    allocated_.fetch_sub(bytes, std::memory_order_relaxed);
    TORCH_CHECK_WITH(OutOfMemoryError, false, "lazymem: ", name_, " out of memory. Tried to allocate ",
                     format_bytes(bytes), "; capacity ", format_bytes(cap), ", of which ",
                     format_bytes(now - bytes), " is already allocated.");
  }
  int64_t p = peak_.load(std::memory_order_relaxed);
  while (now > p && !peak_.compare_exchange_weak(p, now)) {}
  p = window_peak_.load(std::memory_order_relaxed);
  while (now > p && !window_peak_.compare_exchange_weak(p, now)) {}
}

void MemoryCounter::release(size_t n) {
  allocated_.fetch_sub(static_cast<int64_t>(n), std::memory_order_relaxed);
}

MemoryCounter& device_counter() {
  static MemoryCounter* c = new MemoryCounter("the lazymem device");
  return *c;
}

MemoryCounter& eager_counter() {
  static MemoryCounter* c = new MemoryCounter("memory_cap (eager CPU)");
  return *c;
}

namespace {

thread_local MemoryCounter* t_counter = nullptr;

// Every block carries a header recording its size and the counter it was charged to, so frees
// are exact on any thread, after any scope has ended. The header keeps the data 64-byte aligned.
struct alignas(c10::gAlignment) Header {
  MemoryCounter* counter;
  size_t nbytes;
};
constexpr size_t kHeader = sizeof(Header);

void counted_free(void* p) {
  if (!p) return;
  auto* h = reinterpret_cast<Header*>(static_cast<char*>(p) - kHeader);
  if (h->counter) h->counter->release(h->nbytes);
  c10::profiledCPUMemoryReporter().Delete(p);
  c10::free_cpu(h);
}

class CountingCPUAllocator final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t n) override {
    MemoryCounter* c = t_counter;
    if (c) c->charge(n);
    void* raw = nullptr;
    try {
      raw = c10::alloc_cpu(n + kHeader);
    } catch (...) {
      if (c) c->release(n);
      throw;
    }
    auto* h = static_cast<Header*>(raw);
    h->counter = c;
    h->nbytes = n;
    void* p = static_cast<char*>(raw) + kHeader;
    c10::profiledCPUMemoryReporter().New(p, n);
    return {p, p, &counted_free, c10::Device(c10::DeviceType::CPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override {
    return &counted_free;
  }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
};

CountingCPUAllocator g_counting;
std::once_flag g_install_once;
bool g_installed = false;

} // namespace

CountingScope::CountingScope(MemoryCounter* counter) : prev_(t_counter) {
  if (counter) install_counting_cpu_allocator();
  t_counter = counter;
}

CountingScope::~CountingScope() {
  t_counter = prev_;
}

MemoryCounter* current_counting_scope() {
  return t_counter;
}

namespace {
thread_local std::vector<MemoryCounter*> t_scope_stack;
} // namespace

void push_counting_scope(MemoryCounter* counter) {
  if (counter) install_counting_cpu_allocator();
  t_scope_stack.push_back(t_counter);
  t_counter = counter;
}

void pop_counting_scope() {
  if (t_scope_stack.empty()) return;
  t_counter = t_scope_stack.back();
  t_scope_stack.pop_back();
}

bool install_counting_cpu_allocator() {
  std::call_once(g_install_once, [] {
    // Priority 1 beats ATen's default registration (0); a higher-priority custom allocator wins
    // and counting is reported as unavailable instead of silently wrong.
    c10::SetCPUAllocator(&g_counting, /*priority=*/1);
  });
  g_installed = c10::GetCPUAllocator() == &g_counting;
  return g_installed;
}

bool counting_cpu_allocator_active() {
  return c10::GetCPUAllocator() == &g_counting;
}

} // namespace lazymem
