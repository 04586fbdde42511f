// ir: LazyBuffer bookkeeping.
#include "ir/buffer.h"

namespace lazymem {
namespace {
std::atomic<uint64_t> g_next_id{1};
std::atomic<int64_t> g_with_real{0};
std::atomic<int64_t> g_alive{0};
std::atomic<int64_t> g_resident{0};
std::atomic<uint64_t> g_dead_pinned{0};
} // namespace

LazyBuffer::LazyBuffer(size_t n) : nbytes(n), id(g_next_id.fetch_add(1, std::memory_order_relaxed)) {
  g_alive.fetch_add(1, std::memory_order_relaxed);
}

LazyBuffer::~LazyBuffer() {
  drop_real();
  g_alive.fetch_sub(1, std::memory_order_relaxed);
}

void LazyBuffer::set_real(c10::Storage s, bool on_host) {
  real_impl.reset();
  if (!real && s) g_with_real.fetch_add(1, std::memory_order_relaxed);
  if (real && !s) g_with_real.fetch_sub(1, std::memory_order_relaxed);
  if (real && !real_on_host) g_resident.fetch_sub(static_cast<int64_t>(real.nbytes()), std::memory_order_relaxed);
  if (s && !on_host) g_resident.fetch_add(static_cast<int64_t>(s.nbytes()), std::memory_order_relaxed);
  real = std::move(s);
  real_on_host = on_host && static_cast<bool>(real);
  holds_data.store(static_cast<bool>(real), std::memory_order_relaxed);
}

void note_dead_pinned() {
  g_dead_pinned.fetch_add(1, std::memory_order_relaxed);
}

uint64_t dead_pinned_count() {
  return g_dead_pinned.load(std::memory_order_relaxed);
}

void LazyBuffer::drop_real() {
  set_real(c10::Storage());
}

int64_t buffers_with_real_data() {
  return g_with_real.load(std::memory_order_relaxed);
}

int64_t resident_bytes() {
  return g_resident.load(std::memory_order_relaxed);
}

int64_t buffers_alive() {
  return g_alive.load(std::memory_order_relaxed);
}

} // namespace lazymem
