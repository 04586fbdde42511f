// plan: view geometry under splitting. A batch-sharded buffer's storage is [outer][batch][row]; a
// chunk-local storage is [outer][chunk][row]. A view of the buffer is localized by its strides:
// outer dims rescale, the dim whose major factor is the batch shrinks to the chunk, dims inside a
// row are unchanged; a dim that flattens whole blocks with the batch (outer, batch, row positions:
// time-major (T*B, E)) shrinks to outer * chunk. Anything else (a slice or select along the batch,
// rows that overlap) cannot be localized. Narrowing is the other binding: the same view
// restricted to the chunk's rows, for values kept whole (replicated values used row by row, results
// assembled in full storage). Pure integer geometry, shared by the planner and the executor.
#pragma once

#include <optional>

#include "ir/node.h"
#include "plan/plan.h"

namespace lazymem {

struct BatchDim {
  int8_t dim = -1;   // the view dim carrying the batch
  int64_t unit = 1;  // that dim's size is outer * batch * unit
  int64_t outer = 1; // blocks flattened into that dim before the batch (a time-major flatten)
  // A slice of the buffer's rows along the batch (x[a:b:s], split, chunk): view row r is the
  // buffer's row first + step * r, for r in [0, count). count == 0: every row, in order.
  int64_t first = 0;
  int64_t step = 1;
  int64_t count = 0;
  // The batch rows the view holds, over a buffer whose rows are `buffer` (of a batch of `rows`).
  RowMap map(const RowMap& buffer, int64_t rows) const {
    return count == 0 ? buffer : (buffer.identity() ? RowMap{0, 1, rows} : buffer).then(first, step, count, rows);
  }
};

// Where the batch sits in `view` of a buffer with `layout`, or nullopt if the view cannot be
// localized: it must hold each row it holds of the buffer exactly once, batch-major — every row in
// order (possibly flattened with row dims or outer blocks), or a slice of whole rows along the batch.
std::optional<BatchDim> analyze_view(const TensorMeta& view, const RowLayout& layout);

// The row layout of a buffer of `nbytes` whose view `view` has the batch (`rows` rows) at `at`, or
// nullopt when the storage is not [outer][rows][row] with that view covering it.
std::optional<RowLayout> layout_of(const TensorMeta& view, size_t nbytes, BatchDim at, int64_t rows);

// `view` (analyzed against `layout`) over the chunk-local storage of the buffer's rows that fall in
// batch rows [c0, c1) (its storage holds exactly those, in order).
TensorMeta localize(const TensorMeta& view, const RowLayout& layout, int64_t c0, int64_t c1);
// The buffer's own rows [first, last) in batch rows [c0, c1).
inline std::pair<int64_t, int64_t> local_rows(const RowLayout& layout, int64_t c0, int64_t c1) {
  return layout.map.local(c0, c1);
}

// `view` restricted to batch rows [start, start + rows) along `dim` (unit elements per row).
TensorMeta narrow_rows(const TensorMeta& view, int64_t dim, int64_t unit, int64_t start, int64_t rows);

// The same for a dim that flattens `outer` blocks of every batch row (a time-major flatten): no view
// of the dim's rank gives a chunk's rows, so this is a view of one more dim, (outer, rows * unit) in
// place of `dim`, to gather from or scatter into.
TensorMeta narrow_rows_blocks(const TensorMeta& view, int64_t dim, int64_t unit, int64_t outer, int64_t start,
                              int64_t rows);
// What the kernel sees of such a gather: `view` with `dim` of outer * rows * unit, contiguous.
TensorMeta gathered_rows(const TensorMeta& view, int64_t dim, int64_t unit, int64_t outer, int64_t rows);

} // namespace lazymem
