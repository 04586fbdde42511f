// execute: data-dependent ops over the batch, chunk by chunk (batch_split_theory.md §3.8, rule 28).
// nonzero, masked_select and boolean-mask indexing of a pending batch-sharded value are recorded as
// one node, lazymem::ragged_sink(a, b?, kind, token, start, rows) -> count, whose placement rule
// binds the operands' rows (start and rows rewritten per chunk) and sums the counts. Its kernel runs
// the real op on whatever it is given — the whole value in an unsplit plan, a chunk's rows in a
// loop — adds the chunk's first row to nonzero's leading index, and hands the piece to the
// collector the eager path armed for this call (`token`). A chunk's piece is kept in host memory
// (only the current chunk's result occupies the device), and the pieces are joined in row order
// once the materialization is done: the rows of a ragged S, concatenated as eager returns them.
//
// Retries are safe: pieces are keyed by their first row, a retried chunk's pieces replace what a
// failed attempt left, and assembly follows the chain of pieces from row 0 to the end.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <utility>

#include <ATen/core/Tensor.h>

namespace lazymem {

enum class RaggedKind : int64_t { kNonzero = 0, kMaskedSelect = 1, kMaskIndex = 2 };

// The pieces one eager call collects while it is armed.
class RaggedCollector {
 public:
  RaggedCollector();   // arms a collector with a fresh token (one per call; threads may each arm one)
  ~RaggedCollector();  // disarms it
  RaggedCollector(const RaggedCollector&) = delete;
  RaggedCollector& operator=(const RaggedCollector&) = delete;
  int64_t token() const {
    return token_;
  }
  // The result over rows [0, total) of dim 0 in row order, on the backing device (allocated there
  // as the eager path's results are); nullopt if the pieces do not cover them.
  std::optional<at::Tensor> assemble(int64_t total);

  // The kernel's side: a piece for rows [start, start + rows) of call `token` (ignored when no
  // collector with that token is armed). `whole`: computed over every row (an unsplit plan).
  static void offer(int64_t token, int64_t start, int64_t rows, const at::Tensor& piece, bool whole);

 private:
  struct Piece {
    int64_t rows = 0;
    at::Tensor value;
    bool whole = false; // computed over every row, left on the device (counted there)
  };
  int64_t token_;
  std::map<int64_t, Piece> pieces_; // by first row
};

} // namespace lazymem
