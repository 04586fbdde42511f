// device: eager CUDA autograd beside a registered PrivateUse1 backend (see cuda_autograd.h).
#include "device/cuda_autograd.h"

#include <dlfcn.h>
#include <elf.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <mutex>
#include <unordered_set>

#include <c10/core/DeviceType.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/variable.h>

#include "core/check.h"

namespace lazymem {
namespace {

// The flag register_privateuse1_backend sets (c10/core/DeviceType.cpp): a file-local atomic, in the
// symbol table of the c10 library that defines is_privateuse1_backend_registered.
constexpr const char* kFlagSymbol = "_ZN3c10L28privateuse1_backend_name_setE";

// The flag's address: the library's load base plus the symbol's value, read from the library's
// file (.symtab is not loaded). Null when anything is missing or unexpected.
std::atomic<bool>* find_flag() {
  Dl_info info{};
  if (dladdr(reinterpret_cast<void*>(&c10::is_privateuse1_backend_registered), &info) == 0 || !info.dli_fname ||
      !info.dli_fbase)
    return nullptr;
  const int fd = open(info.dli_fname, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return nullptr;
  struct stat st{};
  std::atomic<bool>* found = nullptr;
  if (fstat(fd, &st) == 0 && st.st_size > static_cast<off_t>(sizeof(Elf64_Ehdr))) {
    void* map = mmap(nullptr, static_cast<size_t>(st.st_size), PROT_READ, MAP_PRIVATE, fd, 0);
    if (map != MAP_FAILED) {
      const auto* base = static_cast<const char*>(map);
      const auto size = static_cast<size_t>(st.st_size);
      const auto* eh = reinterpret_cast<const Elf64_Ehdr*>(base);
      const bool elf64 = std::memcmp(eh->e_ident, ELFMAG, SELFMAG) == 0 && eh->e_ident[EI_CLASS] == ELFCLASS64 &&
          eh->e_shentsize == sizeof(Elf64_Shdr) && eh->e_shoff + size_t{eh->e_shnum} * sizeof(Elf64_Shdr) <= size;
      if (elf64) {
        const auto* sh = reinterpret_cast<const Elf64_Shdr*>(base + eh->e_shoff);
        for (int i = 0; i < eh->e_shnum && !found; ++i) {
          if (sh[i].sh_type != SHT_SYMTAB || sh[i].sh_link >= eh->e_shnum) continue;
          const Elf64_Shdr& strtab = sh[sh[i].sh_link];
          if (sh[i].sh_offset + sh[i].sh_size > size || strtab.sh_offset + strtab.sh_size > size) continue;
          const auto* syms = reinterpret_cast<const Elf64_Sym*>(base + sh[i].sh_offset);
          const size_t n = sh[i].sh_size / sizeof(Elf64_Sym);
          for (size_t k = 0; k < n; ++k) {
            if (syms[k].st_name >= strtab.sh_size || ELF64_ST_TYPE(syms[k].st_info) != STT_OBJECT ||
                syms[k].st_size != sizeof(std::atomic<bool>))
              continue;
            const char* name = base + strtab.sh_offset + syms[k].st_name;
            if (std::strncmp(name, kFlagSymbol, strtab.sh_size - syms[k].st_name) == 0) {
              found = reinterpret_cast<std::atomic<bool>*>(static_cast<char*>(info.dli_fbase) + syms[k].st_value);
              break;
            }
          }
        }
      }
      munmap(map, size);
    }
  }
  close(fd);
  return found;
}

std::mutex g_mu;
int g_depth = 0; // backward scopes alive (nested backwards, several threads)

// The flag, verified: it is set now (lazymem registered its name), clearing it is what
// is_privateuse1_backend_registered reports, and setting it again restores that.
std::atomic<bool>* flag() {
  static std::atomic<bool>* const f = [] {
    std::atomic<bool>* p = find_flag();
    if (!p || !c10::is_privateuse1_backend_registered() || !p->load()) return static_cast<std::atomic<bool>*>(nullptr);
    std::lock_guard<std::mutex> lock(g_mu);
    p->store(false, std::memory_order_release);
    const bool cleared = !c10::is_privateuse1_backend_registered();
    p->store(true, std::memory_order_release);
    return cleared && c10::is_privateuse1_backend_registered() ? p : nullptr;
  }();
  return f;
}

} // namespace

BackwardDevices backward_devices(const std::vector<at::Tensor>& roots) {
  bool cuda = false;
  bool lazy = false;
  std::vector<torch::autograd::Node*> stack;
  std::unordered_set<torch::autograd::Node*> seen;
  auto note = [&](c10::DeviceType t) {
    cuda = cuda || t == c10::DeviceType::CUDA;
    lazy = lazy || t == c10::DeviceType::PrivateUse1;
  };
  for (const auto& r : roots) {
    if (!r.defined()) continue;
    note(r.device().type());
    auto edge = torch::autograd::impl::gradient_edge(r);
    if (edge.function && seen.insert(edge.function.get()).second) stack.push_back(edge.function.get());
  }
  while (!stack.empty() && !(cuda && lazy)) {
    torch::autograd::Node* n = stack.back();
    stack.pop_back();
    for (uint32_t i = 0; i < n->num_inputs(); ++i) note(n->input_metadata(i).device().type());
    for (const auto& e : n->next_edges()) {
      if (e.function && seen.insert(e.function.get()).second) stack.push_back(e.function.get());
    }
  }
  return !cuda ? BackwardDevices::kNoCuda : lazy ? BackwardDevices::kCudaAndLazy : BackwardDevices::kCudaOnly;
}

bool cuda_autograd_guard_available() {
  return flag() != nullptr;
}

CudaBackwardScope::CudaBackwardScope() {
  std::atomic<bool>* f = flag();
  LAZYMEM_CHECK(f != nullptr,
                "a CUDA backward cannot run in a process that registered the lazymem device with this PyTorch "
                "build: the autograd engine then looks for streams on the lazymem device only and asserts "
                "(pytorch issue 161129), and lazymem could not find the registration flag to hide itself. Run "
                "eager CUDA training in a process that does not import torch_lazymem");
  std::lock_guard<std::mutex> lock(g_mu);
  if (g_depth++ == 0) f->store(false, std::memory_order_release);
}

CudaBackwardScope::~CudaBackwardScope() {
  std::lock_guard<std::mutex> lock(g_mu);
  if (--g_depth == 0) flag()->store(true, std::memory_order_release);
}

} // namespace lazymem
