// execute: the simulated device's pool of freed blocks (device_pool.h).
#include "execute/device_pool.h"

#include <c10/core/impl/alloc_cpu.h>

#include "execute/memory.h"

namespace lazymem {

bool DevicePool::on() {
  static const bool v = env_flag("LAZYMEM_DEVICE_POOL").value_or(true);
  return v;
}

void* DevicePool::take(size_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = by_size_.find(bytes);
  if (it == by_size_.end() || it->second.empty()) return nullptr;
  auto entry = it->second.back();
  it->second.pop_back();
  void* h = entry->block;
  lru_.erase(entry);
  held_ -= static_cast<int64_t>(bytes);
  return h;
}

bool DevicePool::put(void* h, size_t bytes) {
  const int64_t bound = limit();
  if (static_cast<int64_t>(bytes) > bound) return false;
  std::vector<void*> evicted;
  {
    std::lock_guard<std::mutex> lock(mu_);
    lru_.push_front({h, bytes});
    by_size_[bytes].push_back(lru_.begin());
    held_ += static_cast<int64_t>(bytes);
    evict_locked(bound, &evicted);
  }
  for (void* v : evicted) c10::free_cpu(v);
  return true;
}

void DevicePool::trim() {
  std::vector<void*> evicted;
  {
    std::lock_guard<std::mutex> lock(mu_);
    evict_locked(limit(), &evicted);
  }
  for (void* v : evicted) c10::free_cpu(v);
}

int64_t DevicePool::empty() {
  std::vector<void*> blocks;
  int64_t freed = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const Entry& e : lru_) blocks.push_back(e.block);
    freed = held_;
    lru_.clear();
    by_size_.clear();
    held_ = 0;
  }
  for (void* v : blocks) c10::free_cpu(v);
  return freed;
}

int64_t DevicePool::held() {
  std::lock_guard<std::mutex> lock(mu_);
  return held_;
}

void DevicePool::evict_locked(int64_t bound, std::vector<void*>* evicted) {
  while (held_ > bound) {
    const Entry& oldest = lru_.back(); // also the oldest of its size: the front of its bucket
    auto& bucket = by_size_[oldest.bytes];
    bucket.erase(bucket.begin());
    held_ -= static_cast<int64_t>(oldest.bytes);
    evicted->push_back(oldest.block);
    lru_.pop_back();
  }
}

int64_t DevicePool::limit() {
  const int64_t cap = device_counter().capacity();
  return cap >= 0 ? cap : int64_t{1} << 30;
}

DevicePool& device_pool() {
  static DevicePool* p = new DevicePool(); // (never destroyed: blocks are freed at exit too)
  return *p;
}

} // namespace lazymem
