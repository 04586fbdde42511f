// plan: view localization and narrowing.
#include "plan/localize.h"

#include <algorithm>

namespace lazymem {
namespace {

struct Geometry {
  int64_t item = 0;  // bytes per element of the view
  int64_t row = 0;   // elements per batch row
  int64_t block = 0; // elements per outer block (rows * row)
};

std::optional<Geometry> geometry(const TensorMeta& view, const RowLayout& layout) {
  if (view.dtype == c10::ScalarType::Undefined || layout.rows <= 0 || layout.row_bytes <= 0) return std::nullopt;
  int64_t item = static_cast<int64_t>(c10::elementSize(view.dtype));
  if (layout.row_bytes % item != 0) return std::nullopt;
  Geometry g;
  g.item = item;
  g.row = layout.row_bytes / item;
  g.block = g.row * layout.rows;
  return g;
}

} // namespace

std::optional<BatchDim> analyze_view(const TensorMeta& view, const RowLayout& layout) {
  auto g = geometry(view, layout);
  if (!g || view.numel() == 0) return std::nullopt;
  // Split the offset into (block, row, position inside the row).
  int64_t off = view.offset;
  if (off < 0) return std::nullopt;
  const int64_t block_index = off / g->block;
  if (block_index >= layout.outer) return std::nullopt;
  const int64_t in_block = off % g->block;
  const int64_t o = in_block / g->row; // the first row the view holds
  const int64_t r0 = in_block % g->row;

  BatchDim found;
  bool slice = false;
  int64_t row_extent = 0;        // max position inside a row reached by row dims (from r0)
  int64_t outer_extent = 0;      // max block index reached by outer dims
  int64_t flat_stride = 0;       // the batch dim's stride when it is flattened with row dims
  for (size_t k = 0; k < view.sizes.size(); ++k) {
    const int64_t n = view.sizes[k];
    const int64_t t = view.strides[k];
    if (n == 1 || t == 0) continue; // contributes no address offset beyond the first element
    if (t < 0) return std::nullopt;
    if (t % g->block == 0) {
      outer_extent += (n - 1) * (t / g->block);
      continue;
    }
    if (t <= g->row && g->row % t == 0 && (n * t) % g->block == 0) {
      // The batch dim: every row of n * t / block consecutive blocks (more than one: a time-major
      // flatten), positions inside a row in steps of t (fewer than a row's: a flatten of the batch
      // with row dims, batch-major).
      if (found.dim >= 0) return std::nullopt;
      const int64_t blocks = n * t / g->block;
      found = BatchDim{static_cast<int8_t>(k), g->row / t, blocks};
      outer_extent += blocks - 1;
      if (t < g->row) flat_stride = t;
      continue;
    }
    if (t % g->row == 0 && t < g->block) {
      // A slice of whole rows along the batch: rows o, o + s, ..., o + s * (n - 1).
      if (found.dim >= 0) return std::nullopt;
      const int64_t s = t / g->row;
      if (o + s * (n - 1) >= layout.rows) return std::nullopt;
      found = BatchDim{static_cast<int8_t>(k), 1, 1, o, s, n};
      slice = true;
      continue;
    }
    if (t < g->row) {
      row_extent += (n - 1) * t;
      continue;
    }
    return std::nullopt; // steps over batch rows without covering all of them once
  }
  if (found.dim < 0) return std::nullopt;
  if (!slice && o != 0) return std::nullopt; // (whole rows from a later start: a slice of one row, not split)
  if (slice && found.count == layout.rows && found.step == 1) found.count = 0; // every row after all
  if (block_index + outer_extent >= layout.outer) return std::nullopt;
  // Row dims must stay inside one row, and inside one step of a flattened batch dim.
  const int64_t limit = flat_stride > 0 ? flat_stride : g->row;
  if (r0 + row_extent >= limit) return std::nullopt;
  return found;
}

std::optional<RowLayout> layout_of(const TensorMeta& view, size_t nbytes, BatchDim at, int64_t rows) {
  if (at.dim < 0 || static_cast<size_t>(at.dim) >= view.sizes.size() || rows <= 0) return std::nullopt;
  if (at.outer < 1 || view.sizes[at.dim] != at.outer * rows * at.unit) return std::nullopt;
  const int64_t item = static_cast<int64_t>(c10::elementSize(view.dtype));
  const int64_t t = view.strides[at.dim];
  if (t <= 0) return std::nullopt;
  RowLayout l;
  l.rows = rows;
  l.row_bytes = at.unit * t * item;
  const int64_t block = rows * l.row_bytes;
  if (block <= 0 || static_cast<int64_t>(nbytes) % block != 0) return std::nullopt;
  l.outer = static_cast<int64_t>(nbytes) / block;
  auto back = analyze_view(view, l);
  if (!back || back->dim != at.dim || back->unit != at.unit || back->outer != at.outer || back->count != 0) {
    return std::nullopt;
  }
  return l;
}

TensorMeta localize(const TensorMeta& view, const RowLayout& layout, int64_t c0, int64_t c1) {
  auto g = geometry(view, layout);
  TensorMeta m = view;
  if (!g) return m;
  auto at = analyze_view(view, layout);
  const auto [first, last] = local_rows(layout, c0, c1); // the buffer's rows the storage holds
  const int64_t local_block = g->row * (last - first);
  int64_t start_row = 0; // the view's first row, in the chunk-local storage
  for (size_t k = 0; k < m.sizes.size(); ++k) {
    if (at && static_cast<int64_t>(k) == at->dim) {
      if (at->count == 0) {
        m.sizes[k] = at->outer * (last - first) * at->unit;
      } else {
        // The slice's rows among the storage's: those at first .. last - 1.
        auto in = [&](int64_t row) {
          const int64_t r = row <= at->first ? 0 : (row - at->first + at->step - 1) / at->step;
          return std::min(r, at->count);
        };
        const int64_t v0 = in(first), v1 = std::max(in(last), v0);
        m.sizes[k] = v1 - v0;
        start_row = at->first + at->step * v0 - first;
      }
      continue;
    }
    const int64_t t = m.strides[k];
    if (t != 0 && t % g->block == 0) m.strides[k] = (t / g->block) * local_block;
  }
  const int64_t block_index = view.offset / g->block;
  m.offset = block_index * local_block + start_row * g->row + view.offset % g->row;
  return m;
}

TensorMeta narrow_rows(const TensorMeta& view, int64_t dim, int64_t unit, int64_t start, int64_t rows) {
  TensorMeta m = view;
  m.offset += start * unit * view.strides[dim];
  m.sizes[dim] = rows * unit;
  return m;
}

TensorMeta narrow_rows_blocks(const TensorMeta& view, int64_t dim, int64_t unit, int64_t outer, int64_t start,
                              int64_t rows) {
  TensorMeta m = view;
  const int64_t t = view.strides[dim];
  const int64_t per_block = view.sizes[dim] / outer; // batch * unit elements
  m.offset += start * unit * t;
  m.sizes[dim] = rows * unit;
  m.sizes.insert(m.sizes.begin() + dim, outer);
  m.strides.insert(m.strides.begin() + dim, per_block * t);
  return m;
}

TensorMeta gathered_rows(const TensorMeta& view, int64_t dim, int64_t unit, int64_t outer, int64_t rows) {
  TensorMeta m = view;
  m.sizes[dim] = outer * rows * unit;
  m.offset = 0;
  int64_t stride = 1;
  for (size_t k = m.sizes.size(); k-- > 0;) {
    m.strides[k] = stride;
    stride *= std::max<int64_t>(m.sizes[k], 1);
  }
  return m;
}

} // namespace lazymem
