// ops: the batch-placement vocabulary and the placement-rule registry. A rule says, for one op, how
// its outputs relate to the batch given how its operands do (DESIGN.md §7, batch_split_theory.md §4),
// in the style of functorch batch rules: one function per op family, registered in one line.
//
//   S(dim, unit)  batch-sharded: view dim `dim` has size batch*unit with the batch as its major factor
//                 (or outer*batch*unit: a flatten of `outer` blocks, each holding every batch row, as
//                 time-major attention makes; only rules registered outer-aware see those)
//   R             replicated: one value, the same for every chunk
//   P(op)         partial: each chunk produces a piece; the value is their reduction (sum, max, ...)
//
// A rule also says how each operand is bound while a chunk runs (its rows, whole, or its partial),
// which int arguments carry the batch (rewritten per chunk), and how partial results are finished.
// Rules see operands as plain metadata (sizes, strides, dtype, placement) and the node's boxed
// arguments: they never see buffers, devices or kernels.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <utility>
#include <vector>

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/ivalue.h>
#include <c10/core/ScalarType.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/SmallVector.h>

namespace lazymem {

// kMoments: [2, ...] (biased variance, mean) of each chunk, merged by Chan's update with the rows'
// element counts (batch norm's statistics pass, variance over the batch). kLogSumExp: each chunk's
// log-sum-exp, merged by logaddexp. kNorm: each chunk's p-norm, merged as (a^p + b^p)^(1/p) (hypot
// for p = 2, max / min for p = +-inf, a sum for p = 0 and 1) with p the finish's value.
enum class Reduce : uint8_t { kNone, kSum, kMax, kMin, kMoments, kLogSumExp, kNorm };
const char* reduce_name(Reduce r);

// Which rows of its batch a batch-sharded value holds (notes/batch_everywhere.md §4): its row r is the
// batch's row off + step * r, for r in [0, n). n == 0 is the identity: every row of the batch, in
// order. Slices along the batch (x[:h], x[h:], x[::2], split / chunk) have maps; rows pair only
// between values with the same map, and cat of pieces whose maps tile a range in order has one map.
struct RowMap {
  int64_t off = 0;
  int64_t step = 1;
  int64_t n = 0;
  bool identity() const {
    return n == 0;
  }
  bool operator==(const RowMap& o) const {
    return off == o.off && step == o.step && n == o.n;
  }
  bool operator!=(const RowMap& o) const {
    return !(*this == o);
  }
  // This map followed by a slice (first, step, count) of its own rows, with `rows` the batch's.
  RowMap then(int64_t first, int64_t by, int64_t count, int64_t rows) const {
    RowMap m;
    m.off = off + step * first;
    m.step = step * by;
    m.n = count;
    if (m.off == 0 && m.step == 1 && m.n == rows) m = RowMap{};
    return m;
  }
  // Own rows [first, last) whose batch rows fall in [c0, c1).
  std::pair<int64_t, int64_t> local(int64_t c0, int64_t c1) const {
    if (identity()) return {c0, c1};
    auto at = [&](int64_t b) {
      const int64_t r = b <= off ? 0 : (b - off + step - 1) / step;
      return r < n ? r : n;
    };
    const int64_t first = at(c0), last = at(c1);
    return {first, last > first ? last : first};
  }
};

struct Place {
  enum Kind : uint8_t { kR, kS, kP };
  Kind kind = kR;
  int8_t dim = -1;               // kS: the view dim carrying the batch
  // kS / kP: which batch (the planner's number for it). A plan may split several independent
  // batches, each in its own loops; rules never pair rows of two batches (places of different
  // batches compare unequal), and the planner sets the batch of every output a rule places.
  int8_t batch = 0;
  int64_t unit = 1;              // kS: that dim has size outer * batch * unit (batch-major in each block)
  int64_t outer = 1;             // kS: blocks flattened into that dim before the batch (1: none)
  RowMap map;                    // kS: which of the batch's rows it holds
  Reduce reduce = Reduce::kNone; // kP

  static Place R() {
    return Place{};
  }
  static Place S(int64_t dim, int64_t unit = 1, int64_t outer = 1) {
    Place p;
    p.kind = kS;
    p.dim = static_cast<int8_t>(dim);
    p.unit = unit;
    p.outer = outer;
    return p;
  }
  // The same sharding along another dim.
  Place at(int64_t d) const {
    Place p = S(d, unit, outer);
    p.batch = batch;
    p.map = map;
    return p;
  }
  static Place P(Reduce r) {
    Place p;
    p.kind = kP;
    p.reduce = r;
    return p;
  }
  bool is_s() const {
    return kind == kS;
  }
  bool is_p() const {
    return kind == kP;
  }
  bool is_r() const {
    return kind == kR;
  }
  bool operator==(const Place& o) const {
    return kind == o.kind && (kind != kS || (dim == o.dim && unit == o.unit && outer == o.outer && map == o.map)) &&
        (kind != kP || reduce == o.reduce) && (kind == kR || batch == o.batch);
  }
  bool operator!=(const Place& o) const {
    return !(*this == o);
  }
};

// How an operand is bound while its node runs in a chunk loop.
enum class Mode : uint8_t {
  kWhole,   // the whole value (R operands, broadcast operands)
  kRows,    // the chunk's rows along view dim `dim` (unit elements per batch row)
  kPartial, // this chunk's partial of a P value (linear ops on partials)
};

struct OperandMode {
  Mode mode = Mode::kWhole;
  int8_t dim = -1;
  int64_t unit = 1;
  int64_t outer = 1; // Place::outer of the rows' dim
  static OperandMode whole() {
    return OperandMode{};
  }
  static OperandMode rows(int64_t dim, int64_t unit, int64_t outer = 1) {
    return OperandMode{Mode::kRows, static_cast<int8_t>(dim), unit, outer};
  }
  // Rows along `dim`, sharded as `p` is.
  static OperandMode rows(int64_t dim, const Place& p) {
    return rows(dim, p.unit, p.outer);
  }
  static OperandMode partial() {
    return OperandMode{Mode::kPartial, -1, 1, 1};
  }
};

// A tensor operand: one lazymem tensor argument of the node, or a host tensor snapshotted into its
// arguments (an upload's source: always R).
struct Operand {
  c10::IntArrayRef sizes;
  c10::IntArrayRef strides;
  c10::ScalarType dtype = c10::ScalarType::Undefined;
  Place place;
  bool write = false;    // written in place or as out=
  bool constant = false; // a host tensor in the node's arguments
  int32_t arg = -1;      // argument position (elem: position inside a tensor list, or -1)
  int32_t elem = -1;
  int64_t dim() const {
    return static_cast<int64_t>(sizes.size());
  }
};

// A functional output of the node (a fresh buffer).
struct Output {
  c10::IntArrayRef sizes;
  c10::ScalarType dtype = c10::ScalarType::Undefined;
  int32_t ret = -1;
  int32_t elem = -1;
  int64_t dim() const {
    return static_cast<int64_t>(sizes.size());
  }
};

// An int argument (or element of an int list) rewritten per chunk: base + scale * rows (the chunk's
// row count), base + scale * start (its first row), base + scale * (start + rows) (one past its last
// row), or base alone.
struct ArgRewrite {
  enum Kind : uint8_t { kRows, kStart, kEnd, kConst };
  int32_t arg = -1;
  int32_t elem = -1;
  Kind kind = kRows;
  int64_t base = 0;
  int64_t scale = 1;
};

// How a partial output is finished after its loop: divided by a constant (mean over the batch as a
// sum times 1/N) or by another output of the node, itself a sum (NLL's total weight).
// kMoments: a Reduce::kMoments partial, complete once merged (`per_row` elements per batch row).
// kNorm: a Reduce::kNorm partial of order `value`, complete once merged.
// Partials with a finish are only ever read finished.
struct Finalize {
  enum Kind : uint8_t { kNone, kDivConst, kDivOutput, kMoments, kNorm };
  Kind kind = kNone;
  double value = 1.0;
  int32_t output = -1;
  int64_t per_row = 0;
};

struct RuleResult {
  c10::SmallVector<Place, 3> outs;       // per Output
  c10::SmallVector<OperandMode, 4> ins;  // per Operand
  c10::SmallVector<ArgRewrite, 2> rewrites;
  c10::SmallVector<Finalize, 2> finalize; // per Output (kNone when not partial)
  c10::SmallVector<double, 2> post_div;   // per Output: divide each chunk's rows by this (0 = none)
  double post_div_written = 0;            // the same for the written operand (out= forms)
  c10::SmallVector<bool, 2> discard;      // per Output: value not produced by this node when split
  const char* replace_op = nullptr;       // run this overload instead ("aten::sum.dim_IntList")
  bool needs_total_weight = false;        // NLL mean: output 1 is computed by a pre-pass over targets
  bool expand = false;                    // (with a failure) the planner can replace the node by nodes
                                          // over passes of the batch (batch norm in training mode)
  bool no_draws = false;                  // tagged random, but this call draws nothing (dropout_p = 0)
  bool writes_unchanged = false;          // its written operands keep their values in this call (batch
                                          // norm in eval mode "writes" its running statistics)
  const char* why = nullptr;              // when the rule fails: why the op cannot be split
};

struct RuleCall {
  const c10::OperatorHandle& op;
  const std::vector<c10::IValue>& args; // boxed arguments; tensor slots hold None or a host constant
  c10::ArrayRef<Operand> ins;
  c10::ArrayRef<Output> outs;
  int64_t batch; // rows of the batch the batch-sharded operands (or demanded outputs) carry; 0: none
  // Demand mode: placements the planner wants for the outputs (kR = no demand). Empty otherwise.
  c10::ArrayRef<Place> want;

  const Operand* operand(int32_t arg, int32_t elem = -1) const;
  int64_t operand_index(int32_t arg, int32_t elem = -1) const;
  const Place* wanted(size_t out) const {
    return out < want.size() && want[out].kind != Place::kR ? &want[out] : nullptr;
  }
  // An int argument (concrete SymInts too, as C++ composites pass them).
  int64_t int_arg(size_t i) const {
    const c10::IValue& v = args[i];
    if (v.isSymInt()) return v.toSymInt().guard_int(__FILE__, __LINE__);
    return v.toInt();
  }
};

// A rule returns false (with r.why) when it cannot split this call; the op then runs whole.
using PlaceRule = bool (*)(const RuleCall&, RuleResult&);

struct RuleEntry {
  PlaceRule fn = nullptr;
  const char* family = "";
  // The rule handles operands sharded with Place::outer > 1 (it keeps `outer` wherever it passes
  // the batch on). Other rules never see them: such a node runs whole.
  bool outer_aware = false;
};

// The rule for `op`, or nullptr when none is registered (cached per op, thread-safe).
const RuleEntry* placement_rule(const c10::OperatorHandle& op);
// Registers `fn` for each op ("aten::add.Tensor"; a name without an overload covers every overload,
// one ending in '.' only the overload without a name; a name ending in '*' covers every op whose
// name starts with what precedes it).
void register_placement_rules(const char* family, std::initializer_list<const char*> ops, PlaceRule fn,
                              bool outer_aware = false);
// Ops tagged pointwise in native_functions.yaml (or whose functional form is) get `fn` by default.
void register_pointwise_default(PlaceRule fn, bool outer_aware = false);
// Whether `op` is tagged pointwise, or is the in-place or out= form of an op that is.
bool is_pointwise_op(const c10::OperatorHandle& op);

} // namespace lazymem
