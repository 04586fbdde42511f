// execute: the ragged sink's kernel and the collector of its pieces (execute/ragged.h).
#include "execute/ragged.h"

#include <atomic>
#include <mutex>
#include <unordered_map>
#include <vector>

#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/index.h>
#include <ATen/ops/masked_select.h>
#include <ATen/ops/nonzero.h>
#include <ATen/ops/scalar_tensor.h>
#include <torch/library.h>

#include "core/check.h"
#include "core/runtime.h"
#include "execute/memory.h"

namespace lazymem {
namespace {

std::mutex g_mu;
std::unordered_map<int64_t, RaggedCollector*>& armed() { // by token
  static auto* m = new std::unordered_map<int64_t, RaggedCollector*>();
  return *m;
}
std::atomic<int64_t> g_next_token{1};

at::Tensor run_kind(RaggedKind kind, const at::Tensor& a, const std::optional<at::Tensor>& b) {
  switch (kind) {
    case RaggedKind::kNonzero:
      return at::nonzero(a);
    case RaggedKind::kMaskedSelect:
      return at::masked_select(a, *b);
    case RaggedKind::kMaskIndex: {
      c10::List<std::optional<at::Tensor>> idx;
      idx.push_back(*b);
      return at::index(a, idx);
    }
  }
  LAZYMEM_INTERNAL_ASSERT(false, "lazymem::ragged_sink: unknown kind ", static_cast<int64_t>(kind));
  return at::Tensor();
}

// The device kernel: the op on what it was given, the piece offered to the armed collector, the
// piece's length returned (the counts of a split sum to the result's length).
at::Tensor ragged_sink(const at::Tensor& a, const std::optional<at::Tensor>& b, int64_t kind, int64_t token,
                       int64_t start, int64_t rows) {
  const auto k = static_cast<RaggedKind>(kind);
  at::Tensor piece = run_kind(k, a, b);
  if (k == RaggedKind::kNonzero && start > 0 && piece.size(0) > 0) piece.select(1, 0).add_(start);
  const bool whole = rows < 0;
  RaggedCollector::offer(token, whole ? 0 : start, whole ? a.size(0) : rows, piece, whole);
  return at::scalar_tensor(piece.size(0), a.options().dtype(at::kLong));
}

// The meta kernel (recording, planner probes): the count.
at::Tensor ragged_sink_meta(const at::Tensor& a, const std::optional<at::Tensor>&, int64_t, int64_t, int64_t,
                            int64_t) {
  return at::empty({}, a.options().dtype(at::kLong));
}

} // namespace

RaggedCollector::RaggedCollector() : token_(g_next_token.fetch_add(1)) {
  std::lock_guard<std::mutex> lock(g_mu);
  armed().emplace(token_, this);
}

RaggedCollector::~RaggedCollector() {
  std::lock_guard<std::mutex> lock(g_mu);
  armed().erase(token_);
}

void RaggedCollector::offer(int64_t token, int64_t start, int64_t rows, const at::Tensor& piece, bool whole) {
  std::lock_guard<std::mutex> lock(g_mu);
  auto it = armed().find(token);
  if (it == armed().end()) return; // a stale node: its caller is gone
  at::Tensor kept = piece;
  if (!whole) {
    // A chunk's piece waits in host memory, not counted against the device.
    CountingScope host(nullptr);
    kept = piece.to(at::kCPU, /*non_blocking=*/false, /*copy=*/true);
  }
  it->second->pieces_[start] = Piece{rows, std::move(kept), whole};
}

std::optional<at::Tensor> RaggedCollector::assemble(int64_t total) {
  std::lock_guard<std::mutex> lock(g_mu);
  std::vector<at::Tensor> chain;
  int64_t at_row = 0;
  bool whole = false;
  do { // (an empty batch has one piece of 0 rows)
    auto it = pieces_.find(at_row);
    if (it == pieces_.end() || (it->second.rows <= 0 && total > 0)) return std::nullopt;
    chain.push_back(it->second.value);
    whole = it->second.whole;
    at_row += it->second.rows;
  } while (at_row < total);
  if (at_row != total) return std::nullopt;
  if (chain.size() == 1 && whole) return chain[0]; // already on the device, counted
  at::Tensor host;
  {
    CountingScope none(nullptr);
    host = chain.size() == 1 ? chain[0] : at::cat(chain);
  }
  // The result lives on the device, allocated there like any eager result (counted), in the
  // layout the kernel gave it.
  at::Tensor out = at::empty_like(host, host.options().device(backing_device()));
  out.copy_(host);
  return out;
}

} // namespace lazymem

TORCH_LIBRARY_FRAGMENT(lazymem, m) {
  m.def("ragged_sink(Tensor a, Tensor? b, int kind, int token, int start, int rows) -> Tensor");
}

TORCH_LIBRARY_IMPL(lazymem, CPU, m) {
  m.impl("ragged_sink", TORCH_FN(lazymem::ragged_sink));
}

TORCH_LIBRARY_IMPL(lazymem, CUDA, m) {
  m.impl("ragged_sink", TORCH_FN(lazymem::ragged_sink));
}

TORCH_LIBRARY_IMPL(lazymem, Meta, m) {
  m.impl("ragged_sink", TORCH_FN(lazymem::ragged_sink_meta));
}
