// dist: the lazymem c10d backend (collectives.h). Three parts:
//   - the ops lazymem::c10d_*(outputs!, inputs, token!, backend, ...) -> (): what a collective
//     records. Every collective of a backend reads and writes its token (a one-byte lazymem value),
//     so the plan runs them in the order they were recorded on every rank, whatever else it moves;
//   - their kernels on the backing device: the real collective through the inner backend, waited
//     for, counted in stats() (collectives, collective_bytes). Meta kernels do nothing (the outputs
//     are the written arguments);
//   - DistBackend, the c10d::Backend whose methods check their arguments (a `lazymem:` error before
//     anything is recorded) and call those ops on the lazymem tensors, and DistWork, its Work: the
//     collective is recorded, so its future is complete at once with the (lazy) outputs — DDP's
//     reducer, comm hooks and `.then` chains record what follows without a sync — and wait() is a
//     sync point that materializes the outputs (and so runs the collective).
#include "distributed/collectives.h"

#include <cstdlib>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/ivalue.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/library.h>

#include "core/check.h"
#include "core/config.h"
#include "device/phantom.h"
#include "sync/sync.h"

namespace lazymem {
namespace {

// The inner backends, by id (the ops' `backend` argument). Never removed: a pending collective may
// name a backend whose process group was destroyed (it then fails when run, as eager would).
std::mutex g_mu;
std::vector<c10::intrusive_ptr<c10d::Backend>>& inners() {
  static auto* v = new std::vector<c10::intrusive_ptr<c10d::Backend>>();
  return *v;
}

int64_t add_inner(c10::intrusive_ptr<c10d::Backend> b) {
  std::lock_guard<std::mutex> lock(g_mu);
  inners().push_back(std::move(b));
  return static_cast<int64_t>(inners().size()) - 1;
}

c10::intrusive_ptr<c10d::Backend> inner_of(int64_t id) {
  std::lock_guard<std::mutex> lock(g_mu);
  LAZYMEM_CHECK(id >= 0 && id < static_cast<int64_t>(inners().size()) && inners()[id],
                "a collective names process group backend ", id, ", which does not exist");
  return inners()[id];
}

std::vector<at::Tensor> vec(at::TensorList ts) {
  return std::vector<at::Tensor>(ts.begin(), ts.end());
}

int64_t nbytes(at::TensorList ts) {
  int64_t n = 0;
  for (const at::Tensor& t : ts) n += static_cast<int64_t>(t.numel() * t.element_size());
  return n;
}

// Runs a collective's work to completion on the backing device, counted.
void finish(const c10::intrusive_ptr<c10d::Work>& w, int64_t bytes) {
  w->wait();
  stats().collectives.fetch_add(1, std::memory_order_relaxed);
  stats().collective_bytes.fetch_add(static_cast<uint64_t>(bytes), std::memory_order_relaxed);
}

c10d::ReduceOp reduce_op(int64_t code) {
  return c10d::ReduceOp(static_cast<c10d::ReduceOp::RedOpType>(code));
}

// ---- kernels on the backing device ---------------------------------------------------------------

void all_reduce(at::TensorList tensors, const at::Tensor&, int64_t backend, int64_t op, bool coalesced) {
  std::vector<at::Tensor> ts = vec(tensors);
  auto b = inner_of(backend);
  if (coalesced) {
    c10d::AllreduceCoalescedOptions o;
    o.reduceOp = reduce_op(op);
    finish(b->allreduce_coalesced(ts, o), nbytes(tensors));
  } else {
    c10d::AllreduceOptions o;
    o.reduceOp = reduce_op(op);
    finish(b->allreduce(ts, o), nbytes(tensors));
  }
}

void broadcast(at::TensorList tensors, const at::Tensor&, int64_t backend, int64_t root, int64_t root_tensor) {
  std::vector<at::Tensor> ts = vec(tensors);
  c10d::BroadcastOptions o;
  o.rootRank = root;
  o.rootTensor = root_tensor;
  finish(inner_of(backend)->broadcast(ts, o), nbytes(tensors));
}

void reduce(at::TensorList tensors, const at::Tensor&, int64_t backend, int64_t op, int64_t root, int64_t root_tensor) {
  std::vector<at::Tensor> ts = vec(tensors);
  c10d::ReduceOptions o;
  o.reduceOp = reduce_op(op);
  o.rootRank = root;
  o.rootTensor = root_tensor;
  finish(inner_of(backend)->reduce(ts, o), nbytes(tensors));
}

void all_gather(at::TensorList outputs, const at::Tensor& input, const at::Tensor&, int64_t backend) {
  std::vector<std::vector<at::Tensor>> outs{vec(outputs)};
  std::vector<at::Tensor> ins{input};
  finish(inner_of(backend)->allgather(outs, ins), nbytes(ins));
}

void all_gather_into_tensor(at::TensorList outputs, at::TensorList inputs, const at::Tensor&, int64_t backend) {
  std::vector<at::Tensor> outs = vec(outputs), ins = vec(inputs);
  auto b = inner_of(backend);
  if (outs.size() == 1) {
    finish(b->_allgather_base(outs[0], ins[0]), nbytes(inputs));
  } else {
    finish(b->allgather_into_tensor_coalesced(outs, ins), nbytes(inputs));
  }
}

void reduce_scatter_tensor(at::TensorList outputs, at::TensorList inputs, const at::Tensor&, int64_t backend,
                           int64_t op) {
  std::vector<at::Tensor> outs = vec(outputs), ins = vec(inputs);
  c10d::ReduceScatterOptions o;
  o.reduceOp = reduce_op(op);
  auto b = inner_of(backend);
  if (outs.size() == 1) {
    finish(b->_reduce_scatter_base(outs[0], ins[0], o), nbytes(inputs));
  } else {
    finish(b->reduce_scatter_tensor_coalesced(outs, ins, o), nbytes(inputs));
  }
}

void all_to_all_single(const at::Tensor& output, const at::Tensor& input, const at::Tensor&, int64_t backend,
                       at::IntArrayRef out_splits, at::IntArrayRef in_splits) {
  at::Tensor out = output, in = input;
  std::vector<int64_t> os(out_splits.begin(), out_splits.end()), is(in_splits.begin(), in_splits.end());
  finish(inner_of(backend)->alltoall_base(out, in, os, is), static_cast<int64_t>(in.numel() * in.element_size()));
}

// gather / scatter: the root's list is `lists` (one tensor per rank); other ranks pass none.
void gather(at::TensorList lists, const at::Tensor& input, const at::Tensor&, int64_t backend, int64_t root) {
  std::vector<std::vector<at::Tensor>> outs;
  if (!lists.empty()) outs.push_back(vec(lists));
  std::vector<at::Tensor> ins{input};
  c10d::GatherOptions o;
  o.rootRank = root;
  finish(inner_of(backend)->gather(outs, ins, o), nbytes(ins));
}

void scatter(const at::Tensor& output, at::TensorList lists, const at::Tensor&, int64_t backend, int64_t root) {
  std::vector<at::Tensor> outs{output};
  std::vector<std::vector<at::Tensor>> ins;
  if (!lists.empty()) ins.push_back(vec(lists));
  c10d::ScatterOptions o;
  o.rootRank = root;
  finish(inner_of(backend)->scatter(outs, ins, o), nbytes(lists));
}

void barrier(const at::Tensor&, int64_t backend) {
  finish(inner_of(backend)->barrier(), 0);
}

TORCH_LIBRARY_FRAGMENT(lazymem, m) {
  m.def("c10d_all_reduce_(Tensor(a!)[] tensors, Tensor(t!) token, int backend, int op, bool coalesced) -> ()");
  m.def("c10d_broadcast_(Tensor(a!)[] tensors, Tensor(t!) token, int backend, int root, int root_tensor) -> ()");
  m.def("c10d_reduce_(Tensor(a!)[] tensors, Tensor(t!) token, int backend, int op, int root, int root_tensor) -> ()");
  m.def("c10d_all_gather_(Tensor(a!)[] outputs, Tensor input, Tensor(t!) token, int backend) -> ()");
  m.def("c10d_all_gather_into_tensor_(Tensor(a!)[] outputs, Tensor[] inputs, Tensor(t!) token, int backend) -> ()");
  m.def("c10d_reduce_scatter_tensor_(Tensor(a!)[] outputs, Tensor[] inputs, Tensor(t!) token, int backend, "
        "int op) -> ()");
  m.def("c10d_all_to_all_single_(Tensor(a!) output, Tensor input, Tensor(t!) token, int backend, int[] out_splits, "
        "int[] in_splits) -> ()");
  m.def("c10d_gather_(Tensor(a!)[] outputs, Tensor input, Tensor(t!) token, int backend, int root) -> ()");
  m.def("c10d_scatter_(Tensor(a!) output, Tensor[] inputs, Tensor(t!) token, int backend, int root) -> ()");
  m.def("c10d_barrier_(Tensor(t!) token, int backend) -> ()");
}

#define LAZYMEM_C10D_KERNELS(m)                                                       \
  m.impl("c10d_all_reduce_", TORCH_FN(all_reduce));                                    \
  m.impl("c10d_broadcast_", TORCH_FN(broadcast));                                      \
  m.impl("c10d_reduce_", TORCH_FN(reduce));                                            \
  m.impl("c10d_all_gather_", TORCH_FN(all_gather));                                    \
  m.impl("c10d_all_gather_into_tensor_", TORCH_FN(all_gather_into_tensor));            \
  m.impl("c10d_reduce_scatter_tensor_", TORCH_FN(reduce_scatter_tensor));              \
  m.impl("c10d_all_to_all_single_", TORCH_FN(all_to_all_single));                      \
  m.impl("c10d_gather_", TORCH_FN(gather));                                            \
  m.impl("c10d_scatter_", TORCH_FN(scatter));                                          \
  m.impl("c10d_barrier_", TORCH_FN(barrier))

TORCH_LIBRARY_IMPL(lazymem, CPU, m) {
  LAZYMEM_C10D_KERNELS(m);
}

TORCH_LIBRARY_IMPL(lazymem, CUDA, m) {
  LAZYMEM_C10D_KERNELS(m);
}

// Meta: nothing to infer (every output is a written argument).
TORCH_LIBRARY_IMPL(lazymem, Meta, m) {
  m.impl("c10d_all_reduce_", [](at::TensorList, const at::Tensor&, int64_t, int64_t, bool) {});
  m.impl("c10d_broadcast_", [](at::TensorList, const at::Tensor&, int64_t, int64_t, int64_t) {});
  m.impl("c10d_reduce_", [](at::TensorList, const at::Tensor&, int64_t, int64_t, int64_t, int64_t) {});
  m.impl("c10d_all_gather_", [](at::TensorList, const at::Tensor&, const at::Tensor&, int64_t) {});
  m.impl("c10d_all_gather_into_tensor_", [](at::TensorList, at::TensorList, const at::Tensor&, int64_t) {});
  m.impl("c10d_reduce_scatter_tensor_", [](at::TensorList, at::TensorList, const at::Tensor&, int64_t, int64_t) {});
  m.impl("c10d_all_to_all_single_",
         [](const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t, at::IntArrayRef, at::IntArrayRef) {});
  m.impl("c10d_gather_", [](at::TensorList, const at::Tensor&, const at::Tensor&, int64_t, int64_t) {});
  m.impl("c10d_scatter_", [](const at::Tensor&, at::TensorList, const at::Tensor&, int64_t, int64_t) {});
  m.impl("c10d_barrier_", [](const at::Tensor&, int64_t) {});
}

// ---- the Work and the Backend of the lazymem device --------------------------------------------

class DistWork final : public c10d::Work {
 public:
  DistWork(int rank, c10d::OpType type, std::vector<at::Tensor> outputs)
      : Work(rank, type), outputs_(std::move(outputs)) {
    future_ = c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()));
    future_->markCompleted(c10::IValue(outputs_));
  }
  bool isCompleted() override {
    return true;
  }
  bool isSuccess() const override {
    return true;
  }
  // A sync point: the outputs are materialized (running the collective and what it reads); a
  // collective that failed raises its error here.
  bool wait(std::chrono::milliseconds /*timeout*/) override {
    std::vector<LazyBuffer*> bufs;
    for (const at::Tensor& t : outputs_) {
      if (LazyBuffer* b = buffer_of(t)) bufs.push_back(b);
    }
    materialize(bufs);
    return true;
  }
  void synchronize() override {}
  std::vector<at::Tensor> result() override {
    return outputs_;
  }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override {
    return future_;
  }

 private:
  std::vector<at::Tensor> outputs_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};


// Records `name` on the lazymem tensors of `args` (below autograd, as c10d's own ops run).
void record(const char* name, std::vector<c10::IValue> args) {
  c10::impl::ExcludeDispatchKeyGuard no_autograd(c10::autograd_dispatch_keyset_with_ADInplaceOrView);
  torch::jit::Stack stack(std::move(args));
  c10::Dispatcher::singleton().findSchemaOrThrow(name, "").callBoxed(stack);
}

class DistBackend final : public c10d::Backend {
 public:
  DistBackend(c10::intrusive_ptr<c10d::Backend> inner, int rank, int size)
      : Backend(rank, size), gloo_(inner->getBackendName() == "gloo"), id_(add_inner(std::move(inner))) {
    token_ = at::zeros({1}, at::TensorOptions().dtype(at::kByte).device(c10::DeviceType::PrivateUse1));
  }

  const std::string getBackendName() const override {
    return "lazymem";
  }

  // Coalescing (dist._coalescing_manager with a device): the collectives are recorded one by one
  // and run in that order anyway; the coalesced Work waits for all of their outputs.
  bool supportsCoalescing() const override {
    return true;
  }
  void startCoalescing() override {
    coalescing_ = true;
    coalesced_.clear();
  }
  c10::intrusive_ptr<c10d::Work> endCoalescing() override {
    coalescing_ = false;
    return c10::make_intrusive<DistWork>(rank_, c10d::OpType::COALESCED, std::exchange(coalesced_, {}));
  }

  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override {
    check("all_reduce", tensors);
    LAZYMEM_CHECK(!opts.sparseIndices.has_value(), "dist.all_reduce of sparse tensors is not supported");
    record("lazymem::c10d_all_reduce_", {tensors, token_, id_, code("all_reduce", opts.reduceOp), false});
    return work(c10d::OpType::ALLREDUCE, tensors);
  }

  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(std::vector<at::Tensor>& tensors,
                                                     const c10d::AllreduceCoalescedOptions& opts) override {
    check("all_reduce_coalesced", tensors);
    record("lazymem::c10d_all_reduce_", {tensors, token_, id_, code("all_reduce_coalesced", opts.reduceOp), true});
    return work(c10d::OpType::ALLREDUCE_COALESCED, tensors);
  }

  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts) override {
    check("broadcast", tensors);
    record("lazymem::c10d_broadcast_", {tensors, token_, id_, opts.rootRank, opts.rootTensor});
    return work(c10d::OpType::BROADCAST, tensors);
  }

  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& tensors, const c10d::ReduceOptions& opts) override {
    check("reduce", tensors);
    record("lazymem::c10d_reduce_",
           {tensors, token_, id_, code("reduce", opts.reduceOp), opts.rootRank, opts.rootTensor});
    return work(c10d::OpType::REDUCE, tensors);
  }

  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                           std::vector<at::Tensor>& inputs,
                                           const c10d::AllgatherOptions& opts) override {
    LAZYMEM_CHECK(outputs.size() == 1 && inputs.size() == 1, "dist.all_gather expects one input tensor and ",
                  "one list of outputs, got ", inputs.size(), " inputs and ", outputs.size(), " lists");
    check("all_gather", inputs);
    check("all_gather", outputs[0]);
    LAZYMEM_CHECK(static_cast<int>(outputs[0].size()) == size_, "dist.all_gather needs one output per rank (",
                  size_, "), got ", outputs[0].size());
    record("lazymem::c10d_all_gather_", {outputs[0], inputs[0], token_, id_});
    return work(c10d::OpType::ALLGATHER, outputs[0]);
  }

  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                 const c10d::AllgatherOptions& opts) override {
    std::vector<at::Tensor> outs{output}, ins{input};
    return allgather_into_tensor_coalesced(outs, ins, opts);
  }

  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                 std::vector<at::Tensor>& inputs,
                                                                 const c10d::AllgatherOptions&) override {
    check("all_gather_into_tensor", outputs);
    check("all_gather_into_tensor", inputs);
    pairs("all_gather_into_tensor", outputs, inputs, /*out_per_in=*/size_);
    record("lazymem::c10d_all_gather_into_tensor_", {outputs, inputs, token_, id_});
    return work(c10d::OpType::_ALLGATHER_BASE, outputs);
  }

  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                      const c10d::ReduceScatterOptions& opts) override {
    std::vector<at::Tensor> outs{output}, ins{input};
    return reduce_scatter_tensor_coalesced(outs, ins, opts);
  }

  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                 std::vector<at::Tensor>& inputs,
                                                                 const c10d::ReduceScatterOptions& opts) override {
    check("reduce_scatter_tensor", outputs);
    check("reduce_scatter_tensor", inputs);
    pairs("reduce_scatter_tensor", inputs, outputs, /*in_per_out=*/size_);
    record("lazymem::c10d_reduce_scatter_tensor_",
           {outputs, inputs, token_, id_, code("reduce_scatter_tensor", opts.reduceOp)});
    return work(c10d::OpType::_REDUCE_SCATTER_BASE, outputs);
  }

  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& output, at::Tensor& input,
                                               std::vector<int64_t>& out_splits, std::vector<int64_t>& in_splits,
                                               const c10d::AllToAllOptions&) override {
    std::vector<at::Tensor> both{output, input};
    check("all_to_all_single", both);
    record("lazymem::c10d_all_to_all_single_",
           {output, input, token_, id_, c10::IValue(out_splits), c10::IValue(in_splits)});
    return work(c10d::OpType::ALLTOALL_BASE, {output});
  }

  c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
                                        const c10d::GatherOptions& opts) override {
    LAZYMEM_CHECK(inputs.size() == 1 && outputs.size() <= 1, "dist.gather expects one input tensor and at most one ",
                  "list of outputs, got ", inputs.size(), " and ", outputs.size());
    check("gather", inputs);
    std::vector<at::Tensor> list = outputs.empty() ? std::vector<at::Tensor>{} : outputs[0];
    check("gather", list);
    LAZYMEM_CHECK(rank_ == opts.rootRank ? static_cast<int>(list.size()) == size_ : list.empty(),
                  "dist.gather: the destination rank passes one output per rank (", size_, "), the others none; rank ",
                  rank_, " passed ", list.size());
    record("lazymem::c10d_gather_", {list, inputs[0], token_, id_, opts.rootRank});
    return work(c10d::OpType::GATHER, list.empty() ? std::vector<at::Tensor>{token_} : list);
  }

  c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
                                         const c10d::ScatterOptions& opts) override {
    LAZYMEM_CHECK(outputs.size() == 1 && inputs.size() <= 1, "dist.scatter expects one output tensor and at most one ",
                  "list of inputs, got ", outputs.size(), " and ", inputs.size());
    check("scatter", outputs);
    std::vector<at::Tensor> list = inputs.empty() ? std::vector<at::Tensor>{} : inputs[0];
    check("scatter", list);
    LAZYMEM_CHECK(rank_ == opts.rootRank ? static_cast<int>(list.size()) == size_ : list.empty(),
                  "dist.scatter: the source rank passes one input per rank (", size_, "), the others none; rank ",
                  rank_, " passed ", list.size());
    record("lazymem::c10d_scatter_", {outputs[0], list, token_, id_, opts.rootRank});
    return work(c10d::OpType::SCATTER, outputs);
  }

  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions&) override {
    record("lazymem::c10d_barrier_", {token_, id_});
    return work(c10d::OpType::BARRIER, {token_});
  }

  // What is not supported says so, naming what is.
  c10::intrusive_ptr<c10d::Work> allgather_coalesced(std::vector<std::vector<at::Tensor>>&, std::vector<at::Tensor>&,
                                                     const c10d::AllgatherOptions&) override {
    unsupported("all_gather_coalesced");
  }
  c10::intrusive_ptr<c10d::Work> reduce_scatter(std::vector<at::Tensor>&, std::vector<std::vector<at::Tensor>>&,
                                                const c10d::ReduceScatterOptions&) override {
    unsupported("reduce_scatter (of tensor lists; reduce_scatter_tensor is supported)");
  }
  c10::intrusive_ptr<c10d::Work> alltoall(std::vector<at::Tensor>&, std::vector<at::Tensor>&,
                                          const c10d::AllToAllOptions&) override {
    unsupported("all_to_all (of tensor lists; all_to_all_single is supported)");
  }
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>&, int, int) override {
    unsupported("send");
  }
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>&, int, int) override {
    unsupported("recv");
  }
  c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>&, int) override {
    unsupported("recv");
  }

 private:
  [[noreturn]] static void unsupported(const char* what) {
    LAZYMEM_CHECK(false, "torch.distributed ", what, " is not supported on lazymem tensors (supported: ",
                  "all_reduce, broadcast, reduce, all_gather, all_gather_into_tensor, reduce_scatter_tensor, ",
                  "all_to_all_single, gather, scatter, barrier and their coalesced forms); move the tensors to the backing device ",
                  "with .cpu() / .cuda() for it");
    std::abort(); // (unreachable: the check throws)
  }

  void check(const char* what, const std::vector<at::Tensor>& ts) const {
    for (const at::Tensor& t : ts) {
      LAZYMEM_CHECK(t.defined() && t.device().type() == c10::DeviceType::PrivateUse1, "dist.", what,
                    " on the lazymem backend expects lazymem tensors, got ",
                    t.defined() ? t.device().str() : std::string("an undefined tensor"));
      LAZYMEM_CHECK(t.layout() == c10::kStrided && !t.is_sparse(), "dist.", what,
                    " expects dense tensors, got layout ", t.layout());
      LAZYMEM_CHECK(t.is_contiguous(), "dist.", what, " expects contiguous tensors (as gloo and NCCL do), ",
                    "got sizes ", t.sizes(), " strides ", t.strides(), "; pass .contiguous() and copy the result back");
    }
  }

  // Each of `one` pairs with one of `many`, which holds `k` times its elements.
  static void pairs(const char* what, const std::vector<at::Tensor>& many, const std::vector<at::Tensor>& one,
                    int k) {
    LAZYMEM_CHECK(many.size() == one.size(), "dist.", what, ": ", many.size(), " tensors against ",
                  one.size());
    for (size_t i = 0; i < many.size(); ++i) {
      LAZYMEM_CHECK(many[i].numel() == one[i].numel() * k && many[i].scalar_type() == one[i].scalar_type(),
                    "dist.", what, " with ", k, " ranks needs a tensor of ", k, " times the other's ",
                    one[i].numel(), " elements of ", one[i].scalar_type(), ", got ", many[i].numel(), " of ",
                    many[i].scalar_type());
    }
  }

  int64_t code(const char* what, const c10d::ReduceOp& op) const {
    using R = c10d::ReduceOp::RedOpType;
    const R t = op.op_;
    const bool ok = t == R::SUM || t == R::PRODUCT || t == R::MIN || t == R::MAX ||
        (gloo_ ? (t == R::BAND || t == R::BOR || t == R::BXOR) : t == R::AVG);
    static const char* names[] = {"SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR", "PREMUL_SUM", "UNUSED"};
    const int i = static_cast<int>(t);
    LAZYMEM_CHECK(ok, "dist.", what, " with ReduceOp.", i >= 0 && i < 10 ? names[i] : "?", " is not supported by the ",
                  gloo_ ? "gloo" : "backing", " backend lazymem runs collectives through (gloo: SUM, PRODUCT, MIN, ",
                  "MAX, BAND, BOR, BXOR)");
    return static_cast<int64_t>(t);
  }

  c10::intrusive_ptr<c10d::Work> work(c10d::OpType type, const std::vector<at::Tensor>& outputs) {
    if (coalescing_) coalesced_.insert(coalesced_.end(), outputs.begin(), outputs.end());
    return c10::make_intrusive<DistWork>(rank_, type, outputs);
  }

  bool gloo_;
  int64_t id_;
  at::Tensor token_;
  bool coalescing_ = false;
  std::vector<at::Tensor> coalesced_;
};

} // namespace

c10::intrusive_ptr<c10d::Backend> make_dist_backend(c10::intrusive_ptr<c10d::Backend> inner, int rank, int size) {
  LAZYMEM_CHECK(inner, "the lazymem process group backend needs a backend of the backing device");
  return c10::make_intrusive<DistBackend>(std::move(inner), rank, size);
}

} // namespace lazymem
