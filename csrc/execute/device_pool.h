// execute: the simulated device's pool of freed blocks (memory.cpp's allocator keeps them here).
#pragma once

#include <cstddef>
#include <cstdint>
#include <list>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "core/config.h"

namespace lazymem {

// The simulated device's memory is a pool of its own, as a GPU's is. Its blocks come from the host's
// malloc, and without a pool a freed block went back to malloc's free lists, where lazymem's own
// small allocations (nodes, tensors' metadata) split it: the next block of the same size came from
// elsewhere, memory no kernel had touched lately. An MLP inference step (three 4.75 MiB activations)
// walked through four to six different blocks a step and spent twice eager's time in its copy and
// clamp kernels (the same instructions: callgrind), 0.93x eager's step. Eager's own blocks, freed
// and allocated again in the same order, come back from malloc at the same addresses. The pool keeps
// freed device blocks of 64 KiB or more by size (rounded to 512 bytes, as CUDA's caching allocator
// rounds) and hands out the most recently freed first; what it holds is not allocated (the counter is
// charged and released as before) but reserved (torch.lazymem.memory_reserved()), at most the
// device's capacity (1 GiB when it has none), the oldest blocks going back to malloc first, and all
// of it on torch.lazymem.empty_cache() or when the host cannot give a block.
class DevicePool {
 public:
  static constexpr size_t kMin = size_t{64} << 10; // smaller blocks come from malloc and go back to it
  static bool on(); // LAZYMEM_DEVICE_POOL=0: every block from malloc and back (to measure the pool)

  void* take(size_t bytes);        // a kept block of exactly `bytes` (header included), or nullptr
  bool put(void* block, size_t bytes); // keeps a freed block (false: larger than the bound)
  void trim();                     // gives back the oldest blocks past the bound (the capacity changed)
  int64_t empty();                 // gives back every block; returns the bytes
  int64_t held();

 private:
  struct Entry {
    void* block;
    size_t bytes;
  };
  void evict_locked(int64_t bound, std::vector<void*>* evicted);
  static int64_t limit(); // the device's capacity, 1 GiB when it has none

  std::mutex mu_;
  std::list<Entry> lru_; // most recently freed first
  std::unordered_map<size_t, std::vector<std::list<Entry>::iterator>> by_size_; // oldest first
  int64_t held_ = 0;
};

DevicePool& device_pool();

} // namespace lazymem
