// device: LazyGenerator.
#include "device/generator.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>
#include <ATen/core/Tensor.h>

#include "core/check.h"
#include "core/runtime.h"

namespace lazymem {
at::Generator make_backing_generator(uint64_t seed) {
  c10::Device dev = backing_device();
  at::Generator g;
  if (dev.is_cpu()) {
    g = at::detail::createCPUGenerator(seed);
  } else {
    init_backing_device();
    g = at::globalContext().getAcceleratorHooksInterface(dev.type()).getNewGenerator(dev.index());
    g.set_current_seed(seed);
  }
  return g;
}

LazyGenerator::LazyGenerator(c10::DeviceIndex index, uint64_t seed)
    : c10::GeneratorImpl(c10::Device(c10::DeviceType::PrivateUse1, index),
                         c10::DispatchKeySet(c10::DispatchKey::PrivateUse1)),
      seed_(seed) {}

at::Generator LazyGenerator::backing() const {
  std::lock_guard<std::mutex> lock(backing_mu_);
  if (!backing_.defined() || backing_.device().type() != backing_device().type()) {
    backing_ = make_backing_generator(seed_);
  }
  return backing_;
}

uint64_t LazyGenerator::draw_seed() {
  at::Generator b = backing();
  std::lock_guard<std::mutex> lock(b.mutex());
  if (auto* cpu = dynamic_cast<at::CPUGeneratorImpl*>(b.unsafeGetGeneratorImpl())) return cpu->random64();
  // Philox generators: a seed from their state, and the stream moves on by one draw.
  uint64_t offset = b.get_offset();
  b.set_offset(offset + 4);
  uint64_t x = b.current_seed() ^ (offset * 0x9e3779b97f4a7c15ull);
  x ^= x >> 31;
  return x * 0xbf58476d1ce4e5b9ull;
}

uint64_t LazyGenerator::peek_seed() {
  at::Generator b = backing();
  std::lock_guard<std::mutex> lock(b.mutex());
  uint64_t x = b.current_seed() ^ (b.get_offset() * 0x9e3779b97f4a7c15ull + 0x632be59bd9b4e019ull);
  x ^= x >> 31;
  return x * 0xbf58476d1ce4e5b9ull;
}

void LazyGenerator::flush_draws() const {
  flush_until(last_draw_seq_.load(std::memory_order_acquire));
}

void LazyGenerator::set_current_seed(uint64_t seed) {
  flush_draws();
  at::Generator b = backing();
  std::lock_guard<std::mutex> lock(b.mutex());
  b.set_current_seed(seed);
  seed_ = seed;
}

void LazyGenerator::set_offset(uint64_t offset) {
  flush_draws();
  at::Generator b = backing();
  std::lock_guard<std::mutex> lock(b.mutex());
  b.set_offset(offset);
}

uint64_t LazyGenerator::get_offset() const {
  flush_draws();
  at::Generator b = backing();
  std::lock_guard<std::mutex> lock(b.mutex());
  return b.get_offset();
}

uint64_t LazyGenerator::current_seed() const {
  return seed_;
}

uint64_t LazyGenerator::seed() {
  flush_draws();
  at::Generator b = backing();
  std::lock_guard<std::mutex> lock(b.mutex());
  seed_ = b.seed();
  return seed_;
}

void LazyGenerator::set_state(const c10::TensorImpl& new_state) {
  flush_draws();
  at::Generator b = backing();
  std::lock_guard<std::mutex> lock(b.mutex());
  b.set_state(at::Tensor(c10::intrusive_ptr<c10::TensorImpl>::reclaim_copy(
      const_cast<c10::TensorImpl*>(&new_state))));
  seed_ = b.current_seed();
}

c10::intrusive_ptr<c10::TensorImpl> LazyGenerator::get_state() const {
  flush_draws();
  at::Generator b = backing();
  std::lock_guard<std::mutex> lock(b.mutex());
  return b.get_state().getIntrusivePtr();
}

LazyGenerator* LazyGenerator::clone_impl() const {
  flush_draws();
  auto* g = new LazyGenerator(device().index(), seed_);
  at::Generator b = backing();
  std::lock_guard<std::mutex> lock(b.mutex());
  g->backing_ = b.clone();
  return g;
}

const at::Generator& default_lazy_generator(c10::DeviceIndex index) {
  LAZYMEM_CHECK(index == -1 || index == 0, "device index ", static_cast<int>(index),
                " is out of range; lazymem has a single device, lazymem:0");
  static at::Generator* g = new at::Generator(at::make_generator<LazyGenerator>(0));
  return *g;
}

at::Generator new_lazy_generator(c10::DeviceIndex index) {
  LAZYMEM_CHECK(index == -1 || index == 0, "device index ", static_cast<int>(index),
                " is out of range; lazymem has a single device, lazymem:0");
  return at::make_generator<LazyGenerator>(0);
}

LazyGenerator* lazy_generator_of(const at::Generator& g, const char* op_name) {
  auto* impl = dynamic_cast<LazyGenerator*>(g.unsafeGetGeneratorImpl());
  TORCH_CHECK(impl != nullptr, "lazymem: ", op_name, " expected a 'lazymem' device type for generator but found '",
              g.device().type(), "'; create it with torch.Generator(device='lazymem')");
  return impl;
}

} // namespace lazymem
