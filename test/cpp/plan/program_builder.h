// test helpers: synthetic programs of real ops for planner tests (no device, nothing runs).
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/zeros.h>

#include "ir/program.h"
#include "plan/planner.h"

namespace lazymem::testing {

struct T {
  BufferPtr buf;
  TensorMeta meta;
};

inline TensorMeta contiguous(std::vector<int64_t> sizes, c10::ScalarType dtype = c10::ScalarType::Double) {
  return TensorMeta::contiguous(sizes, dtype);
}

inline T transposed(const T& t) {
  T v = t;
  std::swap(v.meta.sizes[0], v.meta.sizes[1]);
  std::swap(v.meta.strides[0], v.meta.strides[1]);
  return v;
}

class ProgramBuilder {
 public:
  // A host tensor uploaded to the device: a data leaf unless `module_state`.
  T upload(std::vector<int64_t> sizes, bool module_state = false, c10::ScalarType dtype = c10::ScalarType::Double) {
    TensorMeta m = contiguous(sizes, dtype);
    T dst{c10::make_intrusive<LazyBuffer>(m.extent_bytes()), m};
    if (module_state) dst.buf->batch_hint = LazyBuffer::BatchHint::kNever;
    auto n = std::make_unique<Node>(c10::Dispatcher::singleton().findSchemaOrThrow("aten::copy_", ""));
    n->args = {c10::IValue(), c10::IValue(at::zeros(sizes, at::TensorOptions().dtype(dtype))), c10::IValue(false)};
    n->upload = true;
    Use u;
    u.arg = 0;
    u.ref = TensorRef{dst.buf, m, 0};
    u.write = u.write_only = true;
    n->uses.push_back(std::move(u));
    program_.append(std::move(n));
    return dst;
  }
  // A fresh buffer filled with `value` (what autograd's gradient seed records: empty + fill_).
  T fill(std::vector<int64_t> sizes, double value, c10::ScalarType dtype = c10::ScalarType::Double) {
    TensorMeta m = contiguous(sizes, dtype);
    T t{c10::make_intrusive<LazyBuffer>(std::max<size_t>(m.extent_bytes(), 1)), m};
    auto n = std::make_unique<Node>(c10::Dispatcher::singleton().findSchemaOrThrow("aten::fill_", "Scalar"));
    n->args = {c10::IValue(), c10::IValue(value)};
    Use u;
    u.arg = 0;
    u.ref = TensorRef{t.buf, m, 0};
    u.write = u.write_only = true;
    n->uses.push_back(std::move(u));
    program_.append(std::move(n));
    return t;
  }
  // A functional op reading `ins` (argument position, tensor) and defining outputs of `outs` sizes.
  std::vector<T> op(const char* name, const char* overload, std::vector<c10::IValue> args,
                    std::vector<std::pair<int32_t, T>> ins, std::vector<std::vector<int64_t>> outs,
                    c10::ScalarType dtype = c10::ScalarType::Double) {
    auto n = std::make_unique<Node>(c10::Dispatcher::singleton().findSchemaOrThrow(name, overload));
    n->args = std::move(args);
    for (auto& [arg, t] : ins) {
      Use u;
      u.arg = arg;
      u.ref = TensorRef{t.buf, t.meta, 0};
      n->uses.push_back(std::move(u));
    }
    std::vector<T> out;
    for (size_t j = 0; j < outs.size(); ++j) {
      TensorMeta m = contiguous(outs[j], dtype);
      T t{c10::make_intrusive<LazyBuffer>(m.extent_bytes()), m};
      n->defs.push_back(Def{static_cast<int32_t>(j), -1, TensorRef{t.buf, m, 0}});
      out.push_back(t);
    }
    mark_random(*n);
    program_.append(std::move(n));
    return out;
  }
  // The next node appended draws from `g` with form `f` (a random op).
  void next_random(c10::GeneratorImpl* g, RngForm f) {
    random_ = {g, f};
  }
  // An in-place op writing `self` (argument 0, its old contents read) and reading `ins`.
  void inplace(const char* name, const char* overload, std::vector<c10::IValue> args, const T& self,
               std::vector<std::pair<int32_t, T>> ins = {}) {
    auto n = std::make_unique<Node>(c10::Dispatcher::singleton().findSchemaOrThrow(name, overload));
    n->args = std::move(args);
    Use w;
    w.arg = 0;
    w.ref = TensorRef{self.buf, self.meta, 0};
    w.write = true;
    n->uses.push_back(std::move(w));
    for (auto& [arg, t] : ins) {
      Use u;
      u.arg = arg;
      u.ref = TensorRef{t.buf, t.meta, 0};
      n->uses.push_back(std::move(u));
    }
    mark_random(*n);
    program_.append(std::move(n));
  }
  // Detaches everything and plans it with `live` surviving and `needed` read.
  Plan plan(std::vector<T> live, std::vector<T> needed, int64_t force_chunks, int64_t budget = -1,
            int64_t whole_budget = -1, int64_t chunk_node_ns = 0) {
    seg_ = program_.take_prefix(UINT64_MAX);
    live_.clear();
    for (const T& t : live) live_.insert(t.buf.get());
    PlanInput in;
    for (auto& n : seg_.nodes) in.nodes.push_back(n.get());
    in.live_out = [this](const LazyBuffer& b) { return live_.count(&b) > 0; };
    for (const T& t : needed) in.needed.push_back(t.buf.get());
    in.force_chunks = force_chunks;
    in.budget = budget;
    in.whole_budget = whole_budget;
    in.chunk_node_ns = chunk_node_ns;
    return make_plan(in);
  }

 private:
  void mark_random(Node& n) {
    if (!random_.first) return;
    n.random = true;
    n.generator = c10::intrusive_ptr<c10::GeneratorImpl>::reclaim_copy(random_.first);
    n.rng_form = random_.second;
    random_ = {};
  }

  std::pair<c10::GeneratorImpl*, RngForm> random_{nullptr, RngForm::kNone};
  Program program_;
  Segment seg_;
  std::unordered_set<const LazyBuffer*> live_;
};

inline const c10::IValue kNone;

} // namespace lazymem::testing
