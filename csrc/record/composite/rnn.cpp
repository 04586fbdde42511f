// record: the RNN family (lstm, gru, rnn_tanh, rnn_relu, lstm_cell, gru_cell) on the CPU backing
// device. Their CompositeImplicitAutograd kernels branch on the input's device type: a lazymem
// (PrivateUse1) input takes the fused-cell branch whose kernels exist only for CUDA, skips the
// input projection that CPU precomputes for the whole sequence, and never takes lstm's oneDNN path.
// These kernels, on AutogradPrivateUse1 (and PrivateUse1, for inference mode), make the CPU's
// decisions and the CPU's sequence of ATen calls, so autograd records the graph eager CPU records
// and replay runs the CPU's kernels: bitwise-equal results. Other backing devices keep the
// original composites. rnn_tanh_cell and rnn_relu_cell do not branch on the device: untouched.
#include <ATen/Config.h>
#include <ATen/Context.h>
#include <ATen/TensorOperators.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/dropout.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/gru_cell_native.h>
#include <ATen/ops/gru_native.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/lstm_cell_native.h>
#include <ATen/ops/lstm_native.h>
#include <ATen/ops/matmul.h>
#include <ATen/ops/mkldnn_rnn_layer.h>
#include <ATen/ops/relu.h>
#include <ATen/ops/rnn_relu_native.h>
#include <ATen/ops/rnn_tanh_native.h>
#include <ATen/ops/stack.h>
#include <ATen/ops/tanh.h>
#include <ATen/ops/zeros.h>
#include <c10/core/GradMode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/library.h>

#include <algorithm>
#include <map>
#include <mutex>

#include "core/check.h"
#include "core/runtime.h"
#include "device/phantom.h"
#include "record/recorder.h"

namespace lazymem {
namespace {

using at::Tensor;
using at::TensorList;
using Tensors = std::vector<Tensor>;

enum class Kind { kLstm, kGru, kTanh, kRelu };

// One layer-direction's weights (RNN.cpp's CellParams). Undefined biases / projection when absent.
struct Weights {
  Tensor w_ih, w_hh, b_ih, b_hh, w_hr;
  Tensor linear_ih(const Tensor& x) const { return at::linear(x, w_ih, b_ih); }
  Tensor linear_hh(const Tensor& h) const { return at::linear(h, w_hh, b_hh); }
  Tensor project(const Tensor& h) const { return w_hr.defined() ? at::matmul(h, w_hr.t()) : h; }
};

// A hidden state: h, plus c for LSTM. The composite builds LSTM pairs with std::make_tuple, whose
// arguments GCC evaluates right to left: c's op comes first. The order matters beyond style, as
// autograd's sequence numbers order the backward, and with it how gradients are summed.
struct Hidden {
  Tensor h, c;
  Hidden slice(int64_t start, int64_t end) const {
    Tensor c2 = c.defined() ? c.narrow(0, start, end - start) : Tensor();
    return {h.narrow(0, start, end - start), c2};
  }
};

Hidden concat(const std::vector<Hidden>& hs) {
  Tensors h, c;
  for (const Hidden& x : hs) {
    h.push_back(x.h);
    if (x.c.defined()) c.push_back(x.c);
  }
  Tensor c2 = c.empty() ? Tensor() : at::cat(c, 0);
  return {at::cat(h, 0), c2};
}

// The CPU branch of each cell. `pre`: x is the precomputed input projection.
Hidden cell(Kind kind, const Tensor& x, const Hidden& hid, const Weights& w, bool pre) {
  switch (kind) {
    case Kind::kLstm: {
      Tensor gates = w.linear_hh(hid.h).add_(pre ? x : w.linear_ih(x));
      Tensors g = gates.unsafe_chunk(4, 1);
      Tensor in = g[0].sigmoid_(), forget = g[1].sigmoid_(), cell_gate = g[2].tanh_(), out = g[3].sigmoid_();
      Tensor cy = (forget * hid.c).add_(in * cell_gate);
      Tensor hy = out * cy.tanh();
      return {w.project(hy), cy};
    }
    case Kind::kGru: {
      Tensors ig = pre ? x.unsafe_chunk(3, 1) : w.linear_ih(x).unsafe_chunk(3, 1);
      Tensors hg = w.linear_hh(hid.h).unsafe_chunk(3, 1);
      Tensor reset = hg[0].add_(ig[0]).sigmoid_();
      Tensor update = hg[1].add_(ig[1]).sigmoid_();
      Tensor fresh = ig[2].add(hg[2].mul_(reset)).tanh_();
      return {(hid.h - fresh).mul_(update).add_(fresh), Tensor()};
    }
    case Kind::kTanh:
      return {at::tanh(w.linear_hh(hid.h).add_(pre ? x : w.linear_ih(x))), Tensor()};
    case Kind::kRelu:
      return {at::relu(w.linear_hh(hid.h).add_(pre ? x : w.linear_ih(x))), Tensor()};
  }
  TORCH_INTERNAL_ASSERT(false);
}

struct LayerOut {
  Tensor out;
  std::vector<Hidden> hidden; // one per direction
};

// A padded sequence, one direction (FullLayer on the CPU: the input projection is precomputed).
std::pair<Tensor, Hidden> full_dir(Kind kind, const Tensor& input, Hidden hid, const Weights& w, bool reverse) {
  Tensors steps = w.linear_ih(input).unbind(0);
  if (reverse) std::reverse(steps.begin(), steps.end());
  Tensors outs;
  for (const Tensor& x : steps) {
    hid = cell(kind, x, hid, w, true);
    outs.push_back(hid.h);
  }
  TORCH_CHECK(!outs.empty(), "Expected sequence length to be larger than 0 in RNN");
  if (reverse) std::reverse(outs.begin(), outs.end());
  return {at::stack(outs, 0), hid};
}

// A packed sequence, forward direction (PackedLayer): finished sequences leave the batch.
std::pair<Tensor, Hidden> packed_fw(Kind kind, const Tensor& data, c10::ArrayRef<int64_t> bs, Hidden hid,
                                    const Weights& w) {
  Tensor input_w = w.linear_ih(data);
  std::vector<Hidden> done;
  Tensors outs;
  int64_t offset = 0, last = bs[0];
  for (int64_t b : bs) {
    Tensor x = input_w.narrow(0, offset, b);
    offset += b;
    if (last - b > 0) {
      done.push_back(hid.slice(b, last));
      hid = hid.slice(0, b);
    }
    last = b;
    hid = cell(kind, x, hid, w, true);
    outs.push_back(hid.h);
  }
  done.push_back(hid);
  std::reverse(done.begin(), done.end());
  return {at::cat(outs, 0), concat(done)};
}

// A packed sequence, reverse direction (ReversedPackedLayer): sequences join the batch.
std::pair<Tensor, Hidden> packed_bw(Kind kind, const Tensor& data, c10::ArrayRef<int64_t> bs, const Hidden& hid0,
                                    const Weights& w) {
  Tensor input_w = w.linear_ih(data);
  int64_t offset = data.size(0), last = bs.back();
  Hidden hid = hid0.slice(0, last);
  Tensors outs;
  for (int64_t i = static_cast<int64_t>(bs.size()) - 1; i >= 0; --i) {
    int64_t b = bs[i];
    if (b - last > 0) hid = concat({hid, hid0.slice(last, b)});
    Tensor x = input_w.narrow(0, offset - b, b);
    offset -= b;
    last = b;
    hid = cell(kind, x, hid, w, true);
    outs.push_back(hid.h);
  }
  std::reverse(outs.begin(), outs.end());
  return {at::cat(outs, 0), hid};
}

// One layer, one or two directions (Full/Packed, Bidirectional or not). `bs` empty: padded input.
LayerOut layer(Kind kind, const Tensor& input, c10::ArrayRef<int64_t> bs, const std::vector<Hidden>& hid,
               const std::vector<Weights>& w) {
  auto fw = bs.empty() ? full_dir(kind, input, hid[0], w[0], false) : packed_fw(kind, input, bs, hid[0], w[0]);
  if (hid.size() == 1) return {fw.first, {fw.second}};
  auto bw = bs.empty() ? full_dir(kind, input, hid[1], w[1], true) : packed_bw(kind, input, bs, hid[1], w[1]);
  return {at::cat({fw.first, bw.first}, bs.empty() ? fw.first.dim() - 1 : -1), {fw.second, bw.second}};
}

std::vector<Weights> gather_params(TensorList p, bool has_biases, bool has_projections) {
  const size_t stride = (has_biases ? 4 : 2) + (has_projections ? 1 : 0);
  TORCH_CHECK(p.size() % stride == 0, "got an incorrect number of RNN parameters");
  std::vector<Weights> out;
  for (size_t i = 0; i < p.size(); i += stride) {
    Weights w{p[i], p[i + 1]};
    if (has_biases) {
      w.b_ih = p[i + 2];
      w.b_hh = p[i + 3];
    }
    if (has_projections) w.w_hr = p[i + stride - 1];
    out.push_back(std::move(w));
  }
  return out;
}

// RNN.h's check_attributes (device check only).
void check_attributes(const Tensor& input, TensorList params, TensorList hiddens) {
  auto check = [&](const char* name, const Tensor& t) {
    if (!t.defined() || (t.is_cpu() && t.dim() == 0)) return;
    TORCH_CHECK(input.device() == t.device(), "Input and ", name, " tensors are not at the same device, found ",
                "input tensor at ", input.device(), " and ", name, " tensor at ", t.device());
  };
  for (const Tensor& h : hiddens) check("hidden", h);
  for (const Tensor& p : params) check("parameter", p);
}

// The layer stack (apply_layer_stack): the output and the final hidden state of every layer and
// direction, in hx order.
std::pair<Tensor, std::vector<Hidden>> run_stack(Kind kind, Tensor input, c10::ArrayRef<int64_t> bs,
                                                 const std::vector<Hidden>& hiddens, const std::vector<Weights>& weights,
                                                 int64_t num_layers, double dropout_p, bool train, bool bidirectional) {
  const size_t dirs = bidirectional ? 2 : 1;
  TORCH_CHECK(hiddens.size() % dirs == 0 && weights.size() % dirs == 0,
              "Odd number of params or hiddens given to a bidirectional RNN");
  TORCH_CHECK(num_layers == static_cast<int64_t>(hiddens.size() / dirs), "Expected more hidden states in stacked_rnn");
  TORCH_CHECK(num_layers == static_cast<int64_t>(weights.size() / dirs), "Expected more weights in stacked_rnn");
  std::vector<Hidden> finals;
  for (int64_t l = 0; l < num_layers; ++l) {
    std::vector<Hidden> h(hiddens.begin() + l * dirs, hiddens.begin() + (l + 1) * dirs);
    std::vector<Weights> w(weights.begin() + l * dirs, weights.begin() + (l + 1) * dirs);
    LayerOut r = layer(kind, input, bs, h, w);
    finals.insert(finals.end(), r.hidden.begin(), r.hidden.end());
    input = r.out;
    if (dropout_p != 0 && train && l < num_layers - 1) input = at::dropout(input, dropout_p, true);
  }
  return {input, finals};
}

std::vector<Hidden> split_hidden(const Tensor& hx, const Tensor& cx) {
  Tensors h = hx.unbind(0), c;
  if (cx.defined()) c = cx.unbind(0);
  std::vector<Hidden> out;
  for (size_t i = 0; i < h.size(); ++i) out.push_back({h[i], cx.defined() ? c[i] : Tensor()});
  return out;
}

Tensor stack_hidden(const std::vector<Hidden>& hs, bool cell_state) {
  Tensors t;
  for (const Hidden& h : hs) t.push_back(cell_state ? h.c : h.h);
  return at::stack(t, 0);
}

std::vector<int64_t> batch_sizes_of(const Tensor& batch_sizes) {
  LAZYMEM_CHECK(batch_sizes.device().is_cpu() && batch_sizes.scalar_type() == at::kLong && batch_sizes.dim() == 1,
                "packed RNN: batch_sizes must be a 1-D int64 CPU tensor (PackedSequence keeps it on the CPU), got ",
                batch_sizes.toString(), " on ", batch_sizes.device());
  Tensor b = batch_sizes.contiguous();
  const int64_t* p = b.data_ptr<int64_t>();
  return std::vector<int64_t>(p, p + b.numel());
}

bool cpu_backed() {
  return backing_device().is_cpu();
}

// ---- lstm's oneDNN path (mkldnn/RNN.cpp's mkldnn_rnn): one at::mkldnn_rnn_layer per layer and
// direction. ----

#if AT_MKLDNN_ENABLED()
constexpr int64_t kMkldnnLstm = 2; // ideep::rnn_kind::LSTM

bool ask_bool(const char* op_name) {
  c10::impl::ExcludeDispatchKeyGuard no_python(c10::python_ks); // a one-off query, not the user's op
  return c10::Dispatcher::singleton().findSchemaOrThrow(op_name, "").typed<bool()>().call();
}

// RNN.cpp's use_mkldnn, with lazymem tensors counted as CPU tensors (they run on the CPU).
bool use_mkldnn(const Tensor& input, TensorList params, TensorList hx) {
  if (!at::globalContext().userEnabledMkldnn()) return false;
  auto on_cpu = [](const Tensor& t) { return is_lazy(t) || t.options().backend() == c10::Backend::CPU; };
  if (!on_cpu(input) || !std::all_of(params.begin(), params.end(), on_cpu) || !std::all_of(hx.begin(), hx.end(), on_cpu)) {
    return false;
  }
  static const bool bf16 = ask_bool("mkldnn::_is_mkldnn_bf16_supported");
  static const bool fp16 = ask_bool("mkldnn::_is_mkldnn_fp16_supported");
  auto st = input.scalar_type();
  bool dtype_ok = st == at::kFloat || (st == at::kBFloat16 && bf16) ||
      (st == at::kHalf && !c10::GradMode::is_enabled() && fp16);
  return dtype_ok && input.numel() != 0;
}

std::tuple<Tensor, Tensor, Tensor> mkldnn_lstm(const Tensor& input_, TensorList hx_, TensorList params,
                                               bool has_biases, int64_t num_layers, double dropout_p, bool train,
                                               bool bidirectional, bool batch_first) {
  const int64_t hidden_size = hx_[0].size(2);
  Tensor input = (batch_first ? input_.transpose(0, 1) : input_).contiguous();
  Tensor hx = hx_[0].contiguous(), cx = hx_[1].contiguous();
  const size_t stride = has_biases ? 4 : 2;
  const int64_t dirs = bidirectional ? 2 : 1;
  Tensors layer_out(dirs), hy(num_layers * dirs), cy(num_layers * dirs);
  for (int64_t l = 0; l < num_layers; ++l) {
    for (int64_t d = 0; d < dirs; ++d) {
      const int64_t index = l * dirs + d;
      TORCH_CHECK(static_cast<size_t>(index + 1) * stride <= params.size(), "got an incorrect number of RNN parameters");
      TensorList w = params.slice(index * stride, stride);
      Tensor h = hx[index], c = cx[index];
      // Without biases the composite passes zeros shaped like the weights (the kernel ignores them).
      Tensor b_hh = has_biases ? w[3] : at::zeros(w[1].sizes(), w[1].options());
      Tensor b_ih = has_biases ? w[2] : at::zeros(w[0].sizes(), w[0].options());
      auto r = at::mkldnn_rnn_layer(input, w[0], w[1], b_ih, b_hh, h, c, /*reverse=*/d > 0, /*batch_sizes=*/{},
                                    kMkldnnLstm, hidden_size, num_layers, has_biases, bidirectional, batch_first, train);
      layer_out[d] = std::get<0>(r);
      hy[index] = std::get<1>(r);
      cy[index] = std::get<2>(r);
    }
    input = dirs == 1 ? layer_out[0] : at::cat(layer_out, -1);
    if (dropout_p != 0 && train && l < num_layers - 1) input = at::dropout(input, dropout_p, true);
  }
  Tensor h_n = at::stack(hy, 0), c_n = at::stack(cy, 0);
  return {batch_first ? input.transpose(0, 1) : input, h_n, c_n};
}

// at::mkldnn_rnn_layer on lazymem. Recording the aten op as is would go wrong twice at replay: its
// kernel reads GradMode (training workspace or none) when it runs, not when it was recorded, and
// its meta kernel gives the workspace 0 bytes while mkldnn_rnn_layer_backward reads the real one.
// So lazymem::mkldnn_rnn_layer is recorded instead: the same arguments plus the recording-time
// GradMode, with a meta kernel that knows the workspace size.
void record_mkldnn_layer(const c10::OperatorHandle&, torch::jit::Stack* stack) {
  LAZYMEM_CHECK(cpu_backed(), "mkldnn_rnn_layer runs on the CPU only, but the backing device is ", backing_device());
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("lazymem::mkldnn_rnn_layer", "");
  stack->push_back(c10::GradMode::is_enabled());
  Recorded r = record_call(op, stack);
  LAZYMEM_INTERNAL_ASSERT(r == Recorded::kDone, "lazymem::mkldnn_rnn_layer has a meta kernel and must record");
}

// Replay: the aten op's CPU kernel under the recorded GradMode; "no workspace" is an empty tensor,
// as meta promised.
void replay_mkldnn_layer(const c10::OperatorHandle&, torch::jit::Stack* stack) {
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("aten::mkldnn_rnn_layer", "");
  c10::AutoGradMode grad(stack->back().toBool());
  stack->pop_back();
  const Tensor input = (*stack)[stack->size() - 16].toTensor();
  op.callBoxed(stack);
  if (!stack->back().isTensor() || !stack->back().toTensor().defined()) {
    stack->back() = at::empty({0}, input.options().dtype(at::kByte));
  }
}

// The training workspace's size depends only on shapes, but only oneDNN knows it: run the CPU
// kernel once on zeros of these shapes and remember the answer.
int64_t workspace_bytes(const Tensor& input, const Tensor& w0, const Tensor& w1, const Tensor& w2, const Tensor& w3,
                        const Tensor& hx, const Tensor& cx, int64_t mode, int64_t hidden_size, bool has_biases) {
  static std::mutex mu;
  static std::map<std::vector<int64_t>, int64_t> sizes;
  std::vector<int64_t> key{static_cast<int64_t>(input.scalar_type()), mode, hidden_size, has_biases};
  for (const Tensor* t : {&input, &w0, &w1, &w2, &w3, &hx, &cx}) {
    key.push_back(-1);
    key.insert(key.end(), t->sizes().begin(), t->sizes().end());
  }
  std::lock_guard<std::mutex> lock(mu);
  auto it = sizes.find(key);
  if (it != sizes.end()) return it->second;
  auto zeros = [](const Tensor& t) { return at::zeros(t.sizes(), t.options().device(c10::kCPU)); };
  c10::AutoGradMode grad(true);
  auto r = at::mkldnn_rnn_layer(zeros(input), zeros(w0), zeros(w1), zeros(w2), zeros(w3), zeros(hx), zeros(cx), false,
                                {}, mode, hidden_size, 1, has_biases, false, false, true);
  return sizes[key] = std::get<3>(r).numel();
}

std::tuple<Tensor, Tensor, Tensor, Tensor> meta_mkldnn_layer(
    const Tensor& input, const Tensor& w0, const Tensor& w1, const Tensor& w2, const Tensor& w3, const Tensor& hx,
    const Tensor& cx, bool reverse, at::IntArrayRef batch_sizes, int64_t mode, int64_t hidden_size,
    int64_t num_layers, bool has_biases, bool bidirectional, bool batch_first, bool train, bool grad_mode) {
  TORCH_CHECK(input.dim() == 3, "mkldnn_rnn_layer: expected a 3-D input, got ", input.dim(), "-D");
  int64_t ws = grad_mode ? workspace_bytes(input, w0, w1, w2, w3, hx, cx, mode, hidden_size, has_biases) : 0;
  return {at::empty({input.size(0), input.size(1), hidden_size}, input.options()), at::empty(hx.sizes(), hx.options()),
          at::empty(cx.sizes(), cx.options()), at::empty({ws}, input.options().dtype(at::kByte))};
}

void register_mkldnn_layer(torch::Library& m) {
  m.impl("mkldnn_rnn_layer", torch::CppFunction::makeFromBoxedFunction<&record_mkldnn_layer>());
}
#else
bool use_mkldnn(const Tensor&, TensorList, TensorList) {
  return false;
}
std::tuple<Tensor, Tensor, Tensor> mkldnn_lstm(const Tensor&, TensorList, TensorList, bool, int64_t, double, bool,
                                               bool, bool) {
  TORCH_INTERNAL_ASSERT(false, "lazymem: built without oneDNN");
}
void register_mkldnn_layer(torch::Library&) {}
#endif

// ---- The registered kernels. ----

std::tuple<Tensor, Tensor, Tensor> lstm_input(const Tensor& input, TensorList hx, TensorList params, bool has_biases,
                                              int64_t num_layers, double dropout, bool train, bool bidirectional,
                                              bool batch_first) {
  if (!cpu_backed()) {
    return at::native::lstm(input, hx, params, has_biases, num_layers, dropout, train, bidirectional, batch_first);
  }
  TORCH_CHECK(hx.size() == 2, "lstm expects two hidden states");
  bool has_projections = hx[0].size(2) != hx[1].size(2);
  if (use_mkldnn(input, params, hx)) {
    if (!has_projections) {
      return mkldnn_lstm(input, hx, params, has_biases, num_layers, dropout, train, bidirectional, batch_first);
    }
    TORCH_WARN_ONCE("LSTM with projections is not supported with oneDNN. Using default implementation.");
  }
  check_attributes(input, params, hx);
  Tensor x = batch_first ? input.transpose(0, 1) : input;
  auto r = run_stack(Kind::kLstm, x, {}, split_hidden(hx[0], hx[1]), gather_params(params, has_biases, has_projections),
                     num_layers, dropout, train, bidirectional);
  Tensor c_n = stack_hidden(r.second, true); // make_tuple order again: c_n before h_n
  Tensor h_n = stack_hidden(r.second, false);
  return {batch_first ? r.first.transpose(0, 1) : r.first, h_n, c_n};
}

std::tuple<Tensor, Tensor, Tensor> lstm_data(const Tensor& data, const Tensor& batch_sizes, TensorList hx,
                                             TensorList params, bool has_biases, int64_t num_layers, double dropout,
                                             bool train, bool bidirectional) {
  if (!cpu_backed()) {
    return at::native::lstm(data, batch_sizes, hx, params, has_biases, num_layers, dropout, train, bidirectional);
  }
  TORCH_CHECK(hx.size() == 2, "lstm expects two hidden states");
  bool has_projections = hx[0].size(2) != hx[1].size(2);
  std::vector<int64_t> bs = batch_sizes_of(batch_sizes);
  auto r = run_stack(Kind::kLstm, data, bs, split_hidden(hx[0], hx[1]), gather_params(params, has_biases, has_projections),
                     num_layers, dropout, train, bidirectional);
  Tensor c_n = stack_hidden(r.second, true);
  return {r.first, stack_hidden(r.second, false), c_n};
}

// gru, rnn_tanh and rnn_relu (RNN.cpp's ONE_HIDDEN_RNN): no oneDNN path on the CPU.
template <Kind K>
std::tuple<Tensor, Tensor> one_hidden_input(const Tensor& input, const Tensor& hx, TensorList params, bool has_biases,
                                            int64_t num_layers, double dropout, bool train, bool bidirectional,
                                            bool batch_first) {
  if (!cpu_backed()) {
    using Fn = std::tuple<Tensor, Tensor> (*)(const Tensor&, const Tensor&, TensorList, bool, int64_t, double, bool,
                                              bool, bool);
    Fn f = K == Kind::kGru ? Fn(&at::native::gru) : K == Kind::kTanh ? Fn(&at::native::rnn_tanh) : Fn(&at::native::rnn_relu);
    return f(input, hx, params, has_biases, num_layers, dropout, train, bidirectional, batch_first);
  }
  check_attributes(input, params, {hx});
  Tensor x = batch_first ? input.transpose(0, 1) : input;
  auto r = run_stack(K, x, {}, split_hidden(hx, Tensor()), gather_params(params, has_biases, false), num_layers, dropout,
                     train, bidirectional);
  Tensor hy = stack_hidden(r.second, false);
  if (batch_first) r.first.transpose_(0, 1); // in place, as the composite does
  return {r.first, hy};
}

template <Kind K>
std::tuple<Tensor, Tensor> one_hidden_data(const Tensor& data, const Tensor& batch_sizes, const Tensor& hx,
                                           TensorList params, bool has_biases, int64_t num_layers, double dropout,
                                           bool train, bool bidirectional) {
  if (!cpu_backed()) {
    using Fn = std::tuple<Tensor, Tensor> (*)(const Tensor&, const Tensor&, const Tensor&, TensorList, bool, int64_t,
                                              double, bool, bool);
    Fn f = K == Kind::kGru ? Fn(&at::native::gru) : K == Kind::kTanh ? Fn(&at::native::rnn_tanh) : Fn(&at::native::rnn_relu);
    return f(data, batch_sizes, hx, params, has_biases, num_layers, dropout, train, bidirectional);
  }
  std::vector<int64_t> bs = batch_sizes_of(batch_sizes);
  auto r = run_stack(K, data, bs, split_hidden(hx, Tensor()), gather_params(params, has_biases, false), num_layers,
                     dropout, train, bidirectional);
  return {r.first, stack_hidden(r.second, false)};
}

void check_cell(const Tensor& input, const Tensor& w_ih, const Tensor& w_hh, int64_t gates, TensorList hx) {
  const int64_t hidden_size = w_hh.size(1);
  TORCH_CHECK(input.size(1) == w_ih.size(1), "input has inconsistent input_size: got ", input.size(1), " expected ",
              w_ih.size(1));
  TORCH_CHECK(w_ih.size(0) == gates * hidden_size, "weight_ih first dim must be ", gates, " * hidden_size = ",
              gates * hidden_size, ", but got ", w_ih.size(0));
  TORCH_CHECK(w_hh.size(0) == gates * hidden_size, "weight_hh first dim must be ", gates, " * hidden_size = ",
              gates * hidden_size, ", but got ", w_hh.size(0));
  for (size_t i = 0; i < hx.size(); ++i) {
    TORCH_CHECK(input.size(0) == hx[i].size(0), "Input batch size ", input.size(0), " doesn't match hidden", i,
                " batch size ", hx[i].size(0));
    TORCH_CHECK(hx[i].size(1) == hidden_size, "hidden", i, " has inconsistent hidden_size: got ", hx[i].size(1),
                ", expected ", hidden_size);
  }
}

Weights cell_weights(const Tensor& w_ih, const Tensor& w_hh, const std::optional<Tensor>& b_ih,
                     const std::optional<Tensor>& b_hh) {
  return {w_ih, w_hh, b_ih.value_or(Tensor()), b_hh.value_or(Tensor())};
}

std::tuple<Tensor, Tensor> lstm_cell(const Tensor& input, TensorList hx, const Tensor& w_ih, const Tensor& w_hh,
                                     const std::optional<Tensor>& b_ih, const std::optional<Tensor>& b_hh) {
  if (!cpu_backed()) return at::native::lstm_cell(input, hx, w_ih, w_hh, b_ih, b_hh);
  TORCH_CHECK(hx.size() == 2, "lstm_cell expects two hidden states");
  check_cell(input, w_ih, w_hh, 4, hx);
  Hidden r = cell(Kind::kLstm, input, {hx[0], hx[1]}, cell_weights(w_ih, w_hh, b_ih, b_hh), false);
  return {r.h, r.c};
}

Tensor gru_cell(const Tensor& input, const Tensor& hx, const Tensor& w_ih, const Tensor& w_hh,
                const std::optional<Tensor>& b_ih, const std::optional<Tensor>& b_hh) {
  if (!cpu_backed()) return at::native::gru_cell(input, hx, w_ih, w_hh, b_ih, b_hh);
  check_cell(input, w_ih, w_hh, 3, {hx});
  return cell(Kind::kGru, input, {hx, Tensor()}, cell_weights(w_ih, w_hh, b_ih, b_hh), false).h;
}

void register_rnn(torch::Library& m) {
  m.impl("lstm.input", TORCH_FN(lstm_input));
  m.impl("lstm.data", TORCH_FN(lstm_data));
  m.impl("gru.input", TORCH_FN(one_hidden_input<Kind::kGru>));
  m.impl("gru.data", TORCH_FN(one_hidden_data<Kind::kGru>));
  m.impl("rnn_tanh.input", TORCH_FN(one_hidden_input<Kind::kTanh>));
  m.impl("rnn_tanh.data", TORCH_FN(one_hidden_data<Kind::kTanh>));
  m.impl("rnn_relu.input", TORCH_FN(one_hidden_input<Kind::kRelu>));
  m.impl("rnn_relu.data", TORCH_FN(one_hidden_data<Kind::kRelu>));
  m.impl("lstm_cell", TORCH_FN(lstm_cell));
  m.impl("gru_cell", TORCH_FN(gru_cell));
}

} // namespace
} // namespace lazymem

// Autograd sits above these kernels' at:: calls exactly as above a composite's.
TORCH_LIBRARY_IMPL(aten, AutogradPrivateUse1, m) {
  lazymem::register_rnn(m);
}

// Under inference mode the autograd keys are skipped and the composite would run on PrivateUse1.
TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  lazymem::register_rnn(m);
  lazymem::register_mkldnn_layer(m);
}

#if AT_MKLDNN_ENABLED()
TORCH_LIBRARY_FRAGMENT(lazymem, m) {
  m.def("mkldnn_rnn_layer(Tensor input, Tensor weight0, Tensor weight1, Tensor weight2, Tensor weight3, Tensor hx_, "
        "Tensor cx_, bool reverse, int[] batch_sizes, int mode, int hidden_size, int num_layers, bool has_biases, "
        "bool bidirectional, bool batch_first, bool train, bool grad_mode) -> (Tensor, Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(lazymem, CPU, m) {
  m.impl("mkldnn_rnn_layer", torch::CppFunction::makeFromBoxedFunction<&lazymem::replay_mkldnn_layer>());
}

TORCH_LIBRARY_IMPL(lazymem, Meta, m) {
  m.impl("mkldnn_rnn_layer", TORCH_FN(lazymem::meta_mkldnn_layer));
}
#endif
