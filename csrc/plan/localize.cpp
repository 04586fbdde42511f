// plan: view localization and narrowing.
#include "plan/localize.h"

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
  const int64_t B = layout.rows;
  // Split the offset into (block, row, position inside the row); the view must start at row 0.
  int64_t off = view.offset;
  if (off < 0) return std::nullopt;
  const int64_t block_index = off / g->block;
  if (block_index >= layout.outer) return std::nullopt;
  int64_t in_block = off % g->block;
  if (in_block / g->row != 0) return std::nullopt; // starts past the first batch row: a slice along it
  const int64_t r0 = in_block % g->row;

  BatchDim found;
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
    if (t == g->row && n == B) {
      if (found.dim >= 0) return std::nullopt;
      found = BatchDim{static_cast<int8_t>(k), 1};
      continue;
    }
    if (t < g->row && g->row % t == 0 && n * t == B * g->row) {
      // A flattened dim: batch-major, then positions inside the row in steps of t.
      if (found.dim >= 0) return std::nullopt;
      found = BatchDim{static_cast<int8_t>(k), g->row / t};
      flat_stride = t;
      continue;
    }
    if (t < g->row) {
      row_extent += (n - 1) * t;
      continue;
    }
    return std::nullopt; // steps over batch rows without covering all of them once
  }
  if (found.dim < 0) return std::nullopt;
  if (block_index + outer_extent >= layout.outer) return std::nullopt;
  // Row dims must stay inside one row, and inside one step of a flattened batch dim.
  const int64_t limit = flat_stride > 0 ? flat_stride : g->row;
  if (r0 + row_extent >= limit) return std::nullopt;
  return found;
}

std::optional<RowLayout> layout_of(const TensorMeta& view, size_t nbytes, BatchDim at, int64_t rows) {
  if (at.dim < 0 || static_cast<size_t>(at.dim) >= view.sizes.size() || rows <= 0) return std::nullopt;
  if (view.sizes[at.dim] != rows * at.unit) return std::nullopt;
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
  if (!back || back->dim != at.dim || back->unit != at.unit) return std::nullopt;
  return l;
}

TensorMeta localize(const TensorMeta& view, const RowLayout& layout, int64_t chunk_rows) {
  auto g = geometry(view, layout);
  TensorMeta m = view;
  if (!g) return m;
  auto at = analyze_view(view, layout);
  const int64_t local_block = g->row * chunk_rows;
  for (size_t k = 0; k < m.sizes.size(); ++k) {
    if (at && static_cast<int64_t>(k) == at->dim) {
      m.sizes[k] = chunk_rows * at->unit;
      continue;
    }
    const int64_t t = m.strides[k];
    if (t != 0 && t % g->block == 0) m.strides[k] = (t / g->block) * local_block;
  }
  const int64_t block_index = view.offset / g->block;
  m.offset = block_index * local_block + view.offset % g->block;
  return m;
}

TensorMeta narrow_rows(const TensorMeta& view, int64_t dim, int64_t unit, int64_t start, int64_t rows) {
  TensorMeta m = view;
  m.offset += start * unit * view.strides[dim];
  m.sizes[dim] = rows * unit;
  return m;
}

} // namespace lazymem
