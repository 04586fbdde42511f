// execute: random streams (see streams.h).
#include "execute/streams.h"

#include <cstdio>
#include <optional>
#include <unordered_map>
#include <vector>

#include <ATen/ops/argmax.h>
#include <ATen/ops/div.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/empty_strided.h>
#include <ATen/ops/full.h>
#include <ATen/ops/lt.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/topk.h>

#include "core/check.h"
#include "core/config.h"
#include "core/runtime.h"
#include "device/generator.h"
#include "execute/memory.h"
#include "execute/replay.h"
#include "execute/transfer.h"

namespace lazymem {
namespace {

thread_local DrawOrder* t_order = nullptr;

// The operand a node writes (in-place / out=), or -1.
int32_t written_use(const Node& n) {
  for (size_t k = 0; k < n.uses.size(); ++k) {
    if (n.uses[k].write) return static_cast<int32_t>(k);
  }
  return -1;
}

// The use reading argument `arg`.
size_t use_at(const Node& n, int32_t arg) {
  for (size_t k = 0; k < n.uses.size(); ++k) {
    if (n.uses[k].arg == arg && !n.uses[k].write) return k;
  }
  LAZYMEM_INTERNAL_ASSERT(false, n.describe(), " has no tensor at argument ", arg);
  return 0;
}

at::TensorOptions on_backing(c10::ScalarType dtype) {
  return at::TensorOptions().dtype(dtype).device(backing_device());
}

at::Tensor empty_as(const TensorMeta& m, c10::ScalarType dtype) {
  return at::empty_strided(m.sizes, m.strides, on_backing(dtype));
}

// Uninitialized memory with `m`'s geometry at `m`'s storage offset: a kernel that picks its launch by
// the operand's alignment (CUDA's vectorized dropout) picks eager's.
at::Tensor empty_at(const TensorMeta& m) {
  const int64_t elem = static_cast<int64_t>(c10::elementSize(m.dtype));
  const int64_t extent = static_cast<int64_t>(m.extent_bytes());
  return at::empty({(extent + elem - 1) / elem}, on_backing(m.dtype)).as_strided(m.sizes, m.strides, m.offset);
}

// The op itself on uninitialized operands of its recorded geometry: a fill's values depend on the
// generator and that geometry only. Returns what it wrote (or its first result).
at::Tensor draw_fill(const Node& n, const at::Generator& g, bool at_offset = false, bool zeros = false) {
  torch::jit::Stack stack;
  for (const c10::IValue& a : n.args) stack.push_back(a.isList() ? c10::IValue(a.toList().copy()) : a);
  std::vector<at::Tensor> operands(n.uses.size());
  for (size_t k = 0; k < n.uses.size(); ++k) {
    const Use& u = n.uses[k];
    operands[k] = at_offset ? empty_at(u.ref.meta) : empty_as(u.ref.meta, u.ref.meta.dtype);
    if (zeros && !u.write) operands[k].zero_(); // (kernels that check their inputs' values: bernoulli's p)
    c10::IValue& slot = stack[u.arg];
    if (u.elem < 0) {
      slot = c10::IValue(operands[k]);
    } else {
      slot.toList().set(u.elem, c10::IValue(operands[k]));
    }
  }
  redispatch_with(n.op, stack, n.device_args, n.generator_arg, g, n.grad_mode);
  const int32_t w = written_use(n);
  if (w >= 0) return operands[w];
  // A fill's result, or dropout's mask (its second result).
  const Def& d = n.defs.at(n.rng_form == RngForm::kDropout ? 1 : 0);
  const c10::IValue& r = stack[d.ret];
  return d.elem < 0 ? r.toTensor() : r.toList().get(d.elem).toTensor();
}

bool bernoulli_fill(const Node& n) {
  const std::string& name = n.op.schema().name();
  return name == "aten::bernoulli_" || name == "aten::bernoulli";
}

// The form's draw, whole, on the backing device (eager's kernel, on the geometry eager gives it).
at::Tensor draw(const Node& n, const at::Generator& g) {
  switch (n.rng_form) {
    case RngForm::kFill: {
      at::Tensor v = draw_fill(n, g);
      // A bernoulli draw is 0 or 1 in any dtype: kept as bool (copied back exactly).
      return bernoulli_fill(n) ? v.to(at::kBool) : v;
    }
    case RngForm::kBernoulliP: { // one uniform per element of self, in self's order, compared with p
      const int32_t w = written_use(n);
      const TensorMeta& out = w >= 0 ? n.uses[w].ref.meta : n.defs.at(0).ref.meta;
      const Use& p = n.uses[w >= 0 ? use_at(n, 1) : use_at(n, 0)];
      const c10::ScalarType t = p.ref.meta.dtype == c10::kDouble ? c10::kDouble : c10::kFloat;
      return empty_as(out, t).uniform_(0, 1, g);
    }
    case RngForm::kNormalTF:
    case RngForm::kNormalFT:
    case RngForm::kNormalTT: { // normal_ of a contiguous result, then element-wise ops (replay)
      const TensorMeta& out = n.defs.at(0).ref.meta;
      const double std = n.rng_form == RngForm::kNormalTF ? n.args.at(1).toDouble() : 1.0;
      return at::empty(out.sizes, on_backing(out.dtype)).normal_(0, std, g);
    }
    case RngForm::kDropout: { // the op itself on the input's geometry: its mask
      return draw_fill(n, g, /*at_offset=*/true);
    }
    case RngForm::kMultinomial: { // exponential_(1) of empty_like(probabilities)
      const TensorMeta& self = n.uses.at(use_at(n, 0)).ref.meta;
      return at::empty_like(empty_as(self, self.dtype)).exponential_(1, g);
    }
    default:
      break;
  }
  LAZYMEM_INTERNAL_ASSERT(false, n.describe(), " has no stream form");
  return at::Tensor();
}

} // namespace

uint64_t row_keyed_seed(const Node& n) {
  auto* gen = static_cast<LazyGenerator*>(n.generator.get());
  if (backing_device().is_cpu()) return gen->draw_seed();
  // A seed from the generator's state, which then moves on exactly as eager's kernel moves it (the
  // op run once on uninitialized operands of its geometry): later draws are eager's.
  const uint64_t seed = gen->peek_seed();
  draw_fill(n, gen->backing(), /*at_offset=*/true, /*zeros=*/true);
  return seed;
}

namespace {

// Takes node m's draws now, as its plan would have taken them: its stream, or its row-keyed seed.
void take_draws(Node& m, const Node& before) {
  if (streams_here(m)) {
    generate_stream(m);
    return;
  }
  LAZYMEM_INTERNAL_ASSERT(rng_form_streams(m.rng_form), m.describe(), " has not drawn from its generator yet, but ",
                          before.describe(), ", recorded after it, draws now");
  m.row_seed = row_keyed_seed(m);
  m.drawn = true;
}

// A chunk's rows of the stream on the device, in `dtype`: what the form's element-wise ops read.
at::Tensor on_device(const at::Tensor& rows, c10::ScalarType dtype) {
  return copy_to_device(rows, dtype);
}

// out = the chunk's rows of the stream (host memory): copied over.
void copy_rows_in(const at::Tensor& out, const at::Tensor& rows) {
  out.copy_(rows);
  count_transfer(static_cast<int64_t>(rows.numel() * rows.element_size()), true);
}

} // namespace

DrawOrder::DrawOrder(c10::ArrayRef<Node*> random_nodes) : nodes_(random_nodes), outer_(t_order) {
  t_order = this;
}

DrawOrder::~DrawOrder() {
  t_order = outer_;
}

void DrawOrder::before(const Node& n) {
  DrawOrder* o = t_order;
  if (!o) return;
  // Nodes of other generators are passed by too: their draws do not interact with n's, and they
  // are taken in their own turn (each node's own draw runs this first).
  for (size_t i = o->next_; i < o->nodes_.size() && o->nodes_[i]->seq < n.seq; ++i) {
    Node& m = *o->nodes_[i];
    if (!m.drawn && m.generator.get() == n.generator.get()) take_draws(m, n);
  }
  while (o->next_ < o->nodes_.size() && o->nodes_[o->next_]->drawn) ++o->next_;
}

void DrawOrder::finish() {
  for (Node* m : nodes_) {
    if (!m->drawn && rng_form_streams(m->rng_form)) take_draws(*m, *m);
  }
  next_ = nodes_.size();
}

bool streams_here(const Node& n) {
  return rng_form_streams(n.rng_form) && (backing_device().is_cpu() || rng_form_device_generic(n.rng_form));
}

void generate_stream(Node& n) {
  if (n.drawn) return;
  DrawOrder::before(n);
  at::Generator g = static_cast<LazyGenerator*>(n.generator.get())->backing();
  at::Tensor values;
  if (backing_device().is_cpu()) {
    CountingScope host(&host_counter()); // host memory, not the device's
    values = draw(n, g);
  } else {
    // Drawn on the device (eager's kernel), kept in host memory.
    values = draw(n, g).to(at::kCPU);
    count_transfer(static_cast<int64_t>(values.nbytes()), false);
  }
  auto s = std::make_shared<Node::Stream>();
  s->values = values;
  n.stream = std::move(s);
  n.drawn = true;
  if (config().debug >= 2) {
    std::fprintf(stderr, "[lazymem] %s: its draws generated whole (%s in host memory)\n", n.describe().c_str(),
                 format_bytes(static_cast<int64_t>(values.nbytes())).c_str());
  }
  stats().random_streams.fetch_add(1, std::memory_order_relaxed);
  stats().random_stream_bytes.fetch_add(values.nbytes(), std::memory_order_relaxed);
}

void replay_from_stream(const PlannedNode& pn, Binder& binder) {
  Node& n = *pn.node;
  if (!n.stream) generate_stream(n);
  LAZYMEM_INTERNAL_ASSERT(n.stream != nullptr, n.describe(), " drew from its generator without a stream");
  const at::Tensor& s = n.stream->values;
  auto use_bound = [&](size_t k) { return pn.uses.empty() ? nullptr : &pn.uses[k]; };
  auto def_bound = [&](size_t j) { return pn.defs.empty() ? nullptr : &pn.defs[j]; };
  const int32_t w = written_use(n);
  // The result (written operand or first def), its binding, and the stream's rows for it.
  at::Tensor out = w >= 0 ? binder.use(pn, w) : binder.bound_def(pn, 0);
  const Bound* ob = w >= 0 ? use_bound(w) : def_bound(0);
  switch (n.rng_form) {
    case RngForm::kFill:
      if (out.defined()) copy_rows_in(out, binder.rows_along(ob, s));
      break;
    case RngForm::kBernoulliP: {
      if (!out.defined()) break;
      const at::Tensor p = binder.use(pn, w >= 0 ? use_at(n, 1) : use_at(n, 0));
      out.copy_(at::lt(on_device(binder.rows_along(ob, s), s.scalar_type()), p));
      break;
    }
    case RngForm::kNormalTF:
      if (!out.defined()) break;
      copy_rows_in(out, binder.rows_along(ob, s));
      out.add_(binder.use(pn, use_at(n, 0)));
      break;
    case RngForm::kNormalFT:
      if (!out.defined()) break;
      copy_rows_in(out, binder.rows_along(ob, s));
      out.mul_(binder.use(pn, use_at(n, 1))).add_(at::full({}, n.args.at(0).toDouble(), out.options()));
      break;
    case RngForm::kNormalTT:
      if (!out.defined()) break;
      copy_rows_in(out, binder.rows_along(ob, s));
      out.mul_(binder.use(pn, use_at(n, 1))).add_(binder.use(pn, use_at(n, 0)));
      break;
    case RngForm::kDropout: { // output = input * mask * scale, mask as bool
      const size_t k = use_at(n, 0);
      const at::Tensor x = binder.use(pn, k);
      const at::Tensor m = on_device(binder.rows_along(use_bound(k), s), x.scalar_type());
      const double p1m = 1 - n.args.at(1).toDouble();
      const double scale = p1m == 0 ? 0. : 1. / p1m;
      if (out.defined()) at::mul_out(out, x, m).mul_(scale);
      at::Tensor mask = binder.bound_def(pn, 1);
      if (mask.defined()) mask.copy_(m);
      break;
    }
    case RngForm::kMultinomial: { // argmax / topk of p / q
      if (!out.defined()) break;
      const size_t k = use_at(n, 0);
      const at::Tensor p = binder.use(pn, k);
      at::Tensor q = on_device(binder.rows_along(use_bound(k), s), s.scalar_type());
      at::div_out(q, p, q);
      const int64_t samples = n.args.at(1).toInt();
      if (samples == 1) {
        at::argmax_out(out, q, -1, true);
      } else {
        at::Tensor values = at::empty(out.sizes(), q.options());
        at::topk_out(values, out, q, samples);
      }
      break;
    }
    default:
      LAZYMEM_INTERNAL_ASSERT(false, n.describe(), " has no stream form");
  }
  binder.done(pn);
}

} // namespace lazymem
