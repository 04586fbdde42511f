// ops: meta probes.
#include "ops/meta_probe.h"

#include <atomic>
#include <cstring>
#include <mutex>
#include <unordered_map>

#include <ATen/core/Tensor.h>
#include <c10/core/impl/LocalDispatchKeySet.h>

#include <ATen/OpMathType.h>
#include <c10/util/hash.h>

#include "core/boxed.h"
#include "core/runtime.h"

namespace lazymem {
namespace {

struct Key {
  std::vector<int64_t> words;
  size_t hash = 0;
  bool operator==(const Key& o) const {
    return words == o.words;
  }
};
struct KeyHash {
  size_t operator()(const Key& k) const {
    return k.hash;
  }
};

void value_words(const c10::IValue& v, std::vector<int64_t>& w) {
  if (v.isInt()) {
    w.push_back(1);
    w.push_back(v.toInt());
  } else if (v.isDouble()) {
    double d = v.toDouble();
    int64_t b;
    std::memcpy(&b, &d, sizeof(b));
    w.push_back(2);
    w.push_back(b);
  } else if (v.isBool()) {
    w.push_back(3 + v.toBool());
  } else if (v.isIntList()) {
    w.push_back(5);
    for (int64_t x : v.toIntList()) w.push_back(x);
    w.push_back(-7);
  } else if (v.isNone()) {
    w.push_back(6);
  } else if (v.isScalar()) {
    c10::Scalar s = v.toScalar();
    w.push_back(8);
    w.push_back(s.isIntegral(false) ? s.toLong() : static_cast<int64_t>(s.toDouble() * 1e6));
  } else if (v.isString()) {
    w.push_back(9);
    w.push_back(static_cast<int64_t>(std::hash<std::string>()(v.toStringRef())));
  } else {
    w.push_back(10); // other values: the same value every time for a given node
  }
}

Key make_key(const c10::OperatorHandle& op, const std::vector<c10::IValue>& args,
             const std::vector<ProbeTensor>& tensors) {
  Key k;
  k.words.push_back(reinterpret_cast<intptr_t>(&op.schema()));
  for (const auto& v : args) value_words(v, k.words);
  for (const ProbeTensor& t : tensors) {
    k.words.push_back(t.arg * 1000 + t.elem);
    k.words.push_back(static_cast<int64_t>(t.dtype));
    k.words.push_back(t.storage);
    k.words.push_back(t.storage_bytes);
    k.words.push_back(t.offset);
    for (int64_t s : t.sizes) k.words.push_back(s);
    k.words.push_back(-1);
    for (int64_t s : t.strides) k.words.push_back(s);
    k.words.push_back(-2);
  }
  size_t h = 1469598103934665603ull;
  for (int64_t x : k.words) h = c10::hash_combine(h, static_cast<size_t>(x));
  k.hash = h;
  return k;
}

std::mutex g_mu;
std::unordered_map<Key, std::optional<ProbeOutput>, KeyHash>& cache() {
  static auto* c = new std::unordered_map<Key, std::optional<ProbeOutput>, KeyHash>();
  return *c;
}

void set_slot(torch::jit::Stack& stack, int32_t arg, int32_t elem, at::Tensor t) {
  if (elem < 0) {
    stack[arg] = std::move(t);
  } else {
    stack[arg].toList().set(elem, c10::IValue(std::move(t)));
  }
}

} // namespace

std::optional<c10::ScalarType> backing_result_dtype(const c10::OperatorHandle& op, size_t ret,
                                                     c10::ScalarType input) {
  static const c10::OperatorName flash_cpu("aten::_scaled_dot_product_flash_attention_for_cpu", "");
  if (ret == 1 && backing_device().is_cpu() && op.operator_name() == flash_cpu &&
      input != c10::ScalarType::Undefined) {
    return at::toOpMathType(input);
  }
  return std::nullopt;
}

namespace {

std::atomic<MetaFirst> g_meta_first{nullptr};

std::optional<ProbeOutput> run(const c10::OperatorHandle& op, const std::vector<c10::IValue>& args,
                               const std::vector<ProbeTensor>& tensors) {
  c10::impl::ExcludeDispatchKeyGuard guard(kAboveBackendKeys);
  torch::jit::Stack stack;
  for (const auto& a : args) stack.push_back(a.isList() ? c10::IValue(a.toList().copy()) : a);
  std::unordered_map<int32_t, c10::intrusive_ptr<c10::StorageImpl>> storages;
  for (const ProbeTensor& t : tensors) {
    auto& st = storages[t.storage];
    if (!st) {
      st = c10::make_intrusive<c10::StorageImpl>(c10::StorageImpl::use_byte_size_t(), t.storage_bytes,
                                                 c10::DataPtr(nullptr, c10::Device(c10::DeviceType::Meta)),
                                                 c10::GetAllocator(c10::DeviceType::Meta), /*resizable=*/true);
    }
    auto impl = c10::make_intrusive<c10::TensorImpl>(c10::Storage(st), c10::DispatchKeySet(c10::DispatchKey::Meta),
                                                     caffe2::TypeMeta::fromScalarType(t.dtype));
    impl->set_sizes_and_strides(t.sizes, t.strides, t.offset);
    set_slot(stack, t.arg, t.elem, at::Tensor(std::move(impl)));
  }
  for (size_t i = 0; i < op.schema().arguments().size() && i < stack.size(); ++i) {
    const auto& type = op.schema().arguments()[i].type();
    bool device = type->kind() == c10::TypeKind::DeviceObjType ||
        (type->kind() == c10::TypeKind::OptionalType &&
         type->castRaw<c10::OptionalType>()->getElementType()->kind() == c10::TypeKind::DeviceObjType);
    if (device && !stack[i].isNone()) stack[i] = c10::IValue(c10::Device(c10::DeviceType::Meta));
    bool generator = type->kind() == c10::TypeKind::GeneratorType ||
        (type->kind() == c10::TypeKind::OptionalType &&
         type->castRaw<c10::OptionalType>()->getElementType()->kind() == c10::TypeKind::GeneratorType);
    if (generator) stack[i] = c10::IValue();
  }
  try {
    const MetaFirst first = g_meta_first.load(std::memory_order_acquire);
    if (!first || !first(op, stack)) redispatch_boxed(op, c10::DispatchKeySet(c10::DispatchKey::Meta), &stack);
  } catch (const std::exception&) {
    return std::nullopt;
  }
  ProbeOutput out;
  c10::ScalarType input = c10::ScalarType::Undefined; // the first tensor argument's dtype
  for (const ProbeTensor& t : tensors) {
    if (t.arg == 0 && t.elem < 0) input = t.dtype;
  }
  auto add = [&](const c10::IValue& v, int32_t ret, int32_t elem) {
    ProbeOutput::Item item;
    item.ret = ret;
    item.elem = elem;
    if (v.isTensor() && v.toTensor().defined()) {
      item.sizes.assign(v.toTensor().sizes().begin(), v.toTensor().sizes().end());
      item.dtype = backing_result_dtype(op, static_cast<size_t>(ret), input).value_or(v.toTensor().scalar_type());
    }
    out.items.push_back(std::move(item));
  };
  for (size_t r = 0; r < stack.size(); ++r) {
    const c10::IValue& v = stack[r];
    if (v.isTensorList() || (v.isList() && !v.isIntList())) {
      auto l = v.toList();
      for (size_t e = 0; e < l.size(); ++e) add(l.get(e), static_cast<int32_t>(r), static_cast<int32_t>(e));
    } else {
      add(v, static_cast<int32_t>(r), -1);
    }
  }
  return out;
}

} // namespace

void set_meta_first(MetaFirst f) {
  g_meta_first.store(f, std::memory_order_release);
}

std::optional<ProbeOutput> meta_probe(const c10::OperatorHandle& op, const std::vector<c10::IValue>& args,
                                      const std::vector<ProbeTensor>& tensors) {
  Key k = make_key(op, args, tensors);
  {
    std::lock_guard<std::mutex> lock(g_mu);
    auto it = cache().find(k);
    if (it != cache().end()) return it->second;
  }
  std::optional<ProbeOutput> r = run(op, args, tensors);
  std::lock_guard<std::mutex> lock(g_mu);
  if (cache().size() > (1u << 16)) cache().clear();
  cache().emplace(std::move(k), r);
  return r;
}

} // namespace lazymem
