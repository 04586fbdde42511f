// record: eager's C++ meta kernels where torch's Python meta kernels shadow them (see cpp_meta.h).
#include "record/cpp_meta.h"

#include <mutex>
#include <optional>
#include <unordered_map>

#include "core/config.h"

namespace lazymem {
namespace {

// The dispatcher keeps every kernel registered for a key, newest first, and dispatches to the first;
// it offers no public way to call an inactive one. Two private members are read here through the
// explicit-instantiation rule ([temp.spec.general]: access is not checked in the template arguments
// of an explicit instantiation): OperatorHandle::operatorDef_ and OperatorEntry::kernels_. Their
// types are taken from the headers this is compiled against, so a torch whose layout differs fails to
// compile rather than misread; the kernel's registration site is checked before it is used.
template <typename Tag, auto Member>
struct Rob {
  friend auto rob(Tag) {
    return Member;
  }
};
struct OperatorDefTag {
  friend auto rob(OperatorDefTag);
};
struct KernelsTag {
  friend auto rob(KernelsTag);
};
template struct Rob<OperatorDefTag, &c10::OperatorHandle::operatorDef_>;
template struct Rob<KernelsTag, &c10::impl::OperatorEntry::kernels_>;

std::optional<c10::KernelFunction> find_shadowed(const c10::OperatorHandle& op) {
  const auto* def = op.*rob(OperatorDefTag{});
  const auto& kernels = def->op.*rob(KernelsTag{});
  auto it = kernels.find(c10::DispatchKey::Meta);
  if (it == kernels.end()) return std::nullopt;
  bool active = true;
  for (const auto& k : it->second) {
    // (The generated file's name: RegisterMeta.cpp, or RegisterMeta_0.cpp ... where it is sharded.)
    const bool generated = k.debug.find("RegisterMeta") != std::string::npos && k.kernel.isValid();
    if (generated) {
      if (active) return std::nullopt; // the Meta key runs it already
      return k.kernel;
    }
    active = false;
  }
  return std::nullopt;
}

} // namespace

const c10::KernelFunction* shadowed_cpp_meta_kernel(const c10::OperatorHandle& op) {
  static const bool on = env_flag("LAZYMEM_CPP_META").value_or(true);
  if (!on) return nullptr;
  static std::mutex mu;
  static auto* cache = new std::unordered_map<const c10::FunctionSchema*, std::optional<c10::KernelFunction>>();
  std::lock_guard<std::mutex> lock(mu);
  auto [it, inserted] = cache->try_emplace(&op.schema());
  if (inserted) it->second = find_shadowed(op);
  return it->second ? &*it->second : nullptr;
}

} // namespace lazymem
