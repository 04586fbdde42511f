// plan: the memory model. Before anything runs, the plan is simulated allocation by allocation as
// the executor will run it: buffers already held, every output and first-touched buffer allocated
// at its node, kernel workspace learned per op and shape (plan/workspace.h), releases after last
// uses; in loops, chunk-local storages proportional to the chunk's rows, partials and accumulators,
// full storages assembled for the loop. Every program point's live bytes are affine in its loop's
// chunk size — bytes + per_row * chunk — so the peak is a max of lines, and the largest chunk that
// fits a budget has a closed form (batch_split_theory.md §6).
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "plan/plan.h"

namespace lazymem {

struct MemPoint {
  int32_t stage = -1;      // the stage the point is in
  bool loop = false;       // per_row scales with that loop's chunk size
  int64_t bytes = 0;       // device bytes at the point, constant part (resident bytes included)
  int64_t per_row = 0;     // bytes per row of the loop's chunk
  const Node* node = nullptr;
  int64_t at(int64_t chunk) const {
    return bytes + per_row * (loop ? chunk : 0);
  }
};

struct MemoryModel {
  std::vector<MemPoint> points;
  // The predicted peak with the plan's chunk sizes, and where it is.
  int64_t peak(const Plan& plan, const MemPoint** where = nullptr) const;
  // The largest chunk of `stage` whose every point stays within `budget` (0: none fits; the stage's
  // batch if everything fits), and the smallest constant part of its points above the budget (0 if
  // none) for explanations.
  int64_t max_chunk(int32_t stage, int64_t batch, int64_t budget) const;
  // The point of loop `stage` that bounds its chunk within `budget` (the least rows fit there), or
  // nullptr: no point grows with the rows.
  const MemPoint* bounding(int32_t stage, int64_t budget) const;
  // Whole-stage points above `budget` (values that cannot be split and do not fit).
  std::vector<const MemPoint*> over(int64_t budget) const;
  // Records each node's predicted bytes (at its stage's chunk size) in the plan.
  void annotate(Plan& plan) const;
};

MemoryModel model_memory(const Plan& plan);

// The chunk size for `batch` rows when at most `cmax` fit: the fewest chunks, balanced
// (ceil(batch / n) rows each), rounded up to a multiple of `align` when that still fits, else down
// to one when that adds no chunk.
int64_t balanced_chunk(int64_t batch, int64_t cmax, int64_t align = 8);

// What becomes of a value stored whole on the device when no chunk size fits with it there.
enum class Relief : uint8_t {
  kHost,      // assembled in host memory and read back chunk by chunk
  kRecompute, // the caller plans it again, recomputed chunk by chunk where it is read
};

enum class ChunkChoice : uint8_t { kFits, kNoFit, kReplan };

// Sets each loop's chunk size: the largest that fits `budget` (-1: unlimited), balanced over the
// batch and aligned, or `forced` chunks per loop (> 0, testing); then the plan's predicted peak.
// When stored values make every size too large, the largest is given up: `relieve` (if any) says
// how; kHost moves it to host memory and sizes are chosen again, kRecompute returns kReplan (the
// caller rebuilds the plan without that store). kNoFit (with a note) when nothing fits.
ChunkChoice choose_chunks(Plan& plan, int64_t budget, int64_t forced, std::vector<std::string>& notes,
                          const std::function<Relief(const FullStore&)>& relieve = {});

// Where each node costs `node_ns` per chunk beyond its share of the work (a kernel launch on a GPU),
// what the plan's loops spend on it: nodes x chunks x node_ns, in seconds.
double chunk_overhead_seconds(const Plan& plan, int64_t node_ns);
// The largest value the plan stores whole on the device (nullptr: none), and what holding it in host
// memory instead would cost in copies (its bytes out, and back for each later loop reading it).
const FullStore* largest_device_store(const Plan& plan, double* copy_seconds);

} // namespace lazymem
