// ops: the placement-rule registry.
#include "ops/placement.h"

#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include <ATen/core/enum_tag.h>

namespace lazymem {
namespace {

struct Registry {
  std::mutex mu;
  std::unordered_map<std::string, RuleEntry> exact; // "aten::add.Tensor"
  std::unordered_map<std::string, RuleEntry> any;   // "aten::add": every overload
  std::vector<std::pair<std::string, RuleEntry>> prefix; // "aten::_foreach_": every op starting so
  PlaceRule pointwise = nullptr;
  bool pointwise_outer_aware = false;
};

Registry& registry() {
  static Registry* r = new Registry(); // leaked: lookups may run during static destruction
  return *r;
}

// The functional form of an in-place or out= overload: add_.Tensor -> add.Tensor, mul.out -> mul.Tensor
// (any overload of the base name is tried when the exact one does not exist).
bool functional_is_pointwise(const c10::OperatorHandle& op) {
  if (op.hasTag(at::Tag::pointwise)) return true;
  const auto& name = op.operator_name();
  std::string base = name.name;
  std::string overload = name.overload_name;
  bool changed = false;
  if (!base.empty() && base.back() == '_') {
    base.pop_back();
    changed = true;
  }
  for (const char* suffix : {"_out", "out"}) {
    std::string s(suffix);
    if (overload.size() >= s.size() && overload.compare(overload.size() - s.size(), s.size(), s) == 0) {
      overload.erase(overload.size() - s.size());
      if (!overload.empty() && overload.back() == '_') overload.pop_back();
      changed = true;
      break;
    }
  }
  if (!changed) return false;
  auto& d = c10::Dispatcher::singleton();
  for (const std::string& ov : {overload, std::string("Tensor"), std::string()}) {
    auto f = d.findOp(c10::OperatorName(base, ov));
    if (f && f->hasTag(at::Tag::pointwise)) return true;
  }
  return false;
}

RuleEntry lookup(const c10::OperatorHandle& op) {
  Registry& r = registry();
  const auto& name = op.operator_name();
  std::string full = name.name + (name.overload_name.empty() ? "" : "." + name.overload_name);
  std::lock_guard<std::mutex> lock(r.mu);
  auto it = r.exact.find(full);
  if (it != r.exact.end()) return it->second;
  it = r.any.find(name.name);
  if (it != r.any.end()) return it->second;
  for (const auto& [p, e] : r.prefix) {
    if (name.name.compare(0, p.size(), p) == 0) return e;
  }
  if (r.pointwise && functional_is_pointwise(op)) return RuleEntry{r.pointwise, "pointwise", r.pointwise_outer_aware};
  return RuleEntry{};
}

} // namespace

bool is_pointwise_op(const c10::OperatorHandle& op) {
  return functional_is_pointwise(op);
}

const char* reduce_name(Reduce r) {
  switch (r) {
    case Reduce::kSum:
      return "+";
    case Reduce::kMax:
      return "max";
    case Reduce::kMin:
      return "min";
    case Reduce::kMoments:
      return "moments";
    case Reduce::kLogSumExp:
      return "logsumexp";
    case Reduce::kNorm:
      return "norm";
    case Reduce::kNone:
      break;
  }
  return "none";
}

const Operand* RuleCall::operand(int32_t arg, int32_t elem) const {
  int64_t i = operand_index(arg, elem);
  return i < 0 ? nullptr : &ins[i];
}

int64_t RuleCall::operand_index(int32_t arg, int32_t elem) const {
  for (size_t i = 0; i < ins.size(); ++i) {
    if (ins[i].arg == arg && ins[i].elem == elem) return static_cast<int64_t>(i);
  }
  return -1;
}

const RuleEntry* placement_rule(const c10::OperatorHandle& op) {
  // Per-thread front over a shared cache keyed by schema (entries never move once inserted).
  thread_local std::unordered_map<const c10::FunctionSchema*, const RuleEntry*> local;
  const c10::FunctionSchema* key = &op.schema();
  auto hit = local.find(key);
  if (hit != local.end()) return hit->second;
  static std::mutex mu;
  static auto* cache = new std::unordered_map<const c10::FunctionSchema*, RuleEntry>();
  const RuleEntry* entry = nullptr;
  {
    std::lock_guard<std::mutex> lock(mu);
    auto it = cache->find(key);
    if (it == cache->end()) it = cache->emplace(key, lookup(op)).first;
    entry = it->second.fn ? &it->second : nullptr;
  }
  local.emplace(key, entry);
  return entry;
}

void register_placement_rules(const char* family, std::initializer_list<const char*> ops, PlaceRule fn,
                              bool outer_aware) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  for (const char* name : ops) {
    std::string s(name);
    if (!s.empty() && s.back() == '*') {
      s.pop_back();
      r.prefix.emplace_back(s, RuleEntry{fn, family, outer_aware});
    } else if (!s.empty() && s.back() == '.') { // the overload without a name only
      s.pop_back();
      r.exact[s] = RuleEntry{fn, family, outer_aware};
    } else if (s.find('.') == std::string::npos) {
      r.any[s] = RuleEntry{fn, family, outer_aware};
    } else {
      r.exact[s] = RuleEntry{fn, family, outer_aware};
    }
  }
}

void register_pointwise_default(PlaceRule fn, bool outer_aware) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  r.pointwise = fn;
  r.pointwise_outer_aware = outer_aware;
}

} // namespace lazymem
