// ops: the per-op rule registry.
#include "ops/op_rules.h"

#include <mutex>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include <ATen/core/enum_tag.h>

namespace lazymem {
namespace {

// Data-dependent ops not tagged as such in native_functions.yaml (their meta kernels would either
// fail or give a wrong answer).
const std::unordered_set<std::string>& forced_eager() {
  static const std::unordered_set<std::string> s = {
      "aten::_local_scalar_dense", "aten::equal", "aten::_assert_scalar", "aten::_print",
      "aten::nonzero", "aten::nonzero_numpy", "aten::masked_select", "aten::unique_consecutive",
      "aten::_unique", "aten::_unique2", "aten::unique_dim", "aten::unique_dim_consecutive",
      "aten::argwhere", "aten::bincount", "aten::histc", "aten::segment_reduce",
      "aten::_nested_tensor_from_mask", "aten::item",
      // Meta inference gives offset2bag/max_indices shapes the CPU kernel does not, and the backward
      // kernel reads them: run for real so the outputs have the backing device's shapes.
      "aten::_embedding_bag", "aten::_embedding_bag_forward_only",
  };
  return s;
}

// In-place ops that write every element of `self` without reading its previous value.
const std::unordered_set<std::string>& overwriting_inplace() {
  static const std::unordered_set<std::string> s = {
      "aten::fill_", "aten::zero_", "aten::copy_", "aten::normal_", "aten::uniform_",
      "aten::random_", "aten::exponential_", "aten::geometric_", "aten::log_normal_",
      "aten::cauchy_", "aten::bernoulli_",
  };
  return s;
}

// Ops that write arguments their schema does not mark as written (schema lies): argument indices.
// native_batch_norm updates running_mean/running_var in training mode; its schema predates alias
// annotations (_native_batch_norm_legit is the annotated successor).
const std::unordered_map<std::string, std::vector<int32_t>>& unannotated_writes() {
  static const std::unordered_map<std::string, std::vector<int32_t>> m = {
      {"aten::native_batch_norm", {3, 4}},
      {"aten::miopen_batch_norm", {3, 4}},
      {"aten::cudnn_batch_norm", {3, 4}},
  };
  return m;
}

const std::unordered_set<std::string>& noop_ops() {
  static const std::unordered_set<std::string> s = {"aten::record_stream"};
  return s;
}

OpRules compute(const c10::OperatorHandle& op) {
  OpRules r;
  const auto& schema = op.schema();
  const std::string& name = schema.name();
  r.eager = op.hasTag(at::Tag::dynamic_output_shape) || op.hasTag(at::Tag::data_dependent_output) ||
      forced_eager().count(name) > 0;
  r.eager_if_mask_index = name == "aten::index" || name == "aten::index_put_" ||
      name == "aten::index_put" || name == "aten::_index_put_impl_" || name == "aten::_unsafe_index_put";
  // (index.Tensor is tagged dynamic_output_shape for its boolean masks; with long indices its shape
  // is the indices': recorded, and eager only when a mask is among them.)
  if (r.eager_if_mask_index && !forced_eager().count(name)) r.eager = false;
  r.noop = noop_ops().count(name) > 0;
  if (name == "lazymem::ragged_sink") r.state_arg = 3;
  r.random = op.hasTag(at::Tag::nondeterministic_seeded);
  const auto& args = schema.arguments();
  r.writes.assign(args.size(), 0);
  for (size_t i = 0; i < args.size(); ++i) {
    const auto& a = args[i];
    const auto& type = a.type();
    if (type->kind() == c10::TypeKind::OptionalType) {
      const auto& elem = type->castRaw<c10::OptionalType>()->getElementType();
      if (elem->kind() == c10::TypeKind::GeneratorType) r.generator_arg = static_cast<int32_t>(i);
      if (elem->kind() == c10::TypeKind::DeviceObjType) r.device_args.push_back(static_cast<int32_t>(i));
    } else if (type->kind() == c10::TypeKind::GeneratorType) {
      r.generator_arg = static_cast<int32_t>(i);
    } else if (type->kind() == c10::TypeKind::DeviceObjType) {
      r.device_args.push_back(static_cast<int32_t>(i));
    }
    if (a.alias_info() && a.alias_info()->isWrite()) {
      r.writes[i] = a.is_out() ? 2 : 1;
      r.any_write = true;
    }
  }
  // bernoulli_.Tensor reads p from another tensor but still overwrites self entirely; the
  // self-reading in-place ops (add_ etc.) are simply not in the table.
  r.overwrites_self = overwriting_inplace().count(name) > 0;
  auto lie = unannotated_writes().find(name);
  if (lie != unannotated_writes().end()) {
    for (int32_t i : lie->second) {
      if (i < static_cast<int32_t>(r.writes.size()) && !r.writes[i]) {
        r.writes[i] = 1;
        r.any_write = true;
      }
    }
  }
  bool tensor_return = false;
  for (const auto& ret : schema.returns()) {
    auto k = ret.type()->kind();
    if (k == c10::TypeKind::TensorType) tensor_return = true;
    if (k == c10::TypeKind::ListType) {
      tensor_return = true;
      r.has_tensor_list_return = true;
    }
    if (k == c10::TypeKind::OptionalType) tensor_return = true;
  }
  r.effect_only = !tensor_return && !r.any_write && !r.eager;
  r.collective = name.rfind("lazymem::c10d_", 0) == 0;
  r.float_values_shape_free = op.hasTag(at::Tag::pointwise) || name.rfind("aten::_foreach_", 0) == 0;
  r.casts_wrapped_number = schema.overload_name() == "Tensor" &&
      (name == "aten::add" || name == "aten::add_" || name == "aten::sub" || name == "aten::sub_" ||
       name == "aten::mul" || name == "aten::mul_" || name == "aten::div" || name == "aten::div_");
  r.placeholder_outputs = name == "aten::native_batch_norm" || name == "aten::_native_batch_norm_legit" ||
      name == "aten::_native_batch_norm_legit_no_training";
  r.structured = op.hasKernelForDispatchKey(c10::DispatchKey::CompositeExplicitAutogradNonFunctional);
  r.iterator_overlap_checks = r.any_write &&
      (op.hasTag(at::Tag::pointwise) || name == "aten::copy_" || name == "aten::fill_" || name == "aten::zero_");
  return r;
}

} // namespace

const OpRules& op_rules(const c10::OperatorHandle& op) {
  // A per-thread front (no lock on the recording hot path) over the shared table; entries are never
  // removed, so the pointers stay valid.
  thread_local std::unordered_map<const c10::FunctionSchema*, const OpRules*> local;
  const c10::FunctionSchema* key = &op.schema();
  auto hit = local.find(key);
  if (hit != local.end()) return *hit->second;
  static std::mutex mu;
  static auto* cache = new std::unordered_map<const c10::FunctionSchema*, OpRules>();
  const OpRules* rules = nullptr;
  {
    std::lock_guard<std::mutex> lock(mu);
    auto it = cache->find(key);
    rules = it != cache->end() ? &it->second : &cache->emplace(key, compute(op)).first->second;
  }
  local.emplace(key, rules);
  return *rules;
}

} // namespace lazymem
