// core: recycled blocks for objects one thread makes and another destroys. glibc frees a block into
// the arena of the thread that allocated it, under that arena's lock; a pipelined worker destroying
// what the recording thread made (buffers, nodes) held that lock against every allocation of the
// recording thread, whose futex wake-ups were then an eighth of its time. Blocks freed here stay in
// the process: in the freeing thread's cache, then in a shared list a batch at a time, from which an
// allocating thread refills its own cache a batch at a time.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdlib>
#include <mutex>
#include <new>
#include <vector>

namespace lazymem {

// Off under AddressSanitizer: a block read after its object's destruction is reported, not reused.
#if defined(__SANITIZE_ADDRESS__)
inline constexpr bool kRecycleBlocks = false;
#else
inline constexpr bool kRecycleBlocks = true;
#endif

template <size_t Size>
class BlockPool {
 public:
  static void* allocate() {
    if (kRecycleBlocks && !t_gone) {
      Cache& c = t_cache;
      if (c.blocks.empty()) c.refill();
      if (!c.blocks.empty()) {
        void* p = c.blocks.back();
        c.blocks.pop_back();
        return p;
      }
    }
    void* p = std::malloc(Size);
    if (p == nullptr) throw std::bad_alloc();
    return p;
  }

  static void release(void* p) noexcept {
    if (p == nullptr) return;
    if (!kRecycleBlocks || t_gone) return std::free(p);
    Cache& c = t_cache;
    if (c.blocks.size() == c.blocks.capacity() && c.blocks.size() < 2 * kBatch) c.blocks.reserve(2 * kBatch);
    if (c.blocks.size() >= 2 * kBatch) c.spill(kBatch);
    c.blocks.push_back(p); // (room reserved above: no allocation that could throw)
  }

 private:
  static constexpr size_t kBatch = 64;
  static constexpr size_t kMaxShared = 16384; // past this, blocks go back to malloc

  struct Shared {
    std::mutex mu;
    std::vector<void*> blocks;
  };
  static Shared& shared() {
    static Shared* s = new Shared(); // leaked: blocks may be released during interpreter exit
    return *s;
  }

  struct Cache {
    std::vector<void*> blocks;
    void refill() {
      Shared& s = shared();
      std::lock_guard<std::mutex> lock(s.mu);
      const size_t n = std::min(kBatch, s.blocks.size());
      blocks.insert(blocks.end(), s.blocks.end() - static_cast<std::ptrdiff_t>(n), s.blocks.end());
      s.blocks.resize(s.blocks.size() - n);
    }
    void spill(size_t n) noexcept {
      n = std::min(n, blocks.size());
      size_t freed = 0;
      {
        Shared& s = shared();
        std::lock_guard<std::mutex> lock(s.mu);
        while (freed < n && s.blocks.size() < kMaxShared) {
          if (s.blocks.size() == s.blocks.capacity()) {
            try {
              s.blocks.reserve(std::max<size_t>(2 * s.blocks.size(), kBatch));
            } catch (...) {
              break;
            }
          }
          s.blocks.push_back(blocks[blocks.size() - 1 - freed]);
          ++freed;
        }
      }
      for (size_t i = freed; i < n; ++i) std::free(blocks[blocks.size() - 1 - i]);
      blocks.resize(blocks.size() - n);
    }
    ~Cache() {
      spill(blocks.size());
      t_gone = true; // (a release after this, at thread exit, frees directly)
    }
  };
  static thread_local Cache t_cache;
  static thread_local bool t_gone;
};

template <size_t Size>
thread_local typename BlockPool<Size>::Cache BlockPool<Size>::t_cache;
template <size_t Size>
thread_local bool BlockPool<Size>::t_gone = false;

} // namespace lazymem
