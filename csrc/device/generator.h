// device: the lazymem random generator. Each LazyGenerator owns a generator on the backing device
// that replays its draws in program order; with the CPU backing device and the same seed, lazymem
// reproduces eager CPU's random stream exactly. State queries and changes (manual_seed,
// get_rng_state, ...) first run the pending nodes that draw from it, so they act at the point in
// program order where the user called them.
#pragma once

#include <atomic>
#include <mutex>

#include <ATen/core/Generator.h>
#include <c10/core/GeneratorImpl.h>

namespace lazymem {

class LazyGenerator final : public c10::GeneratorImpl {
 public:
  explicit LazyGenerator(c10::DeviceIndex index = 0, uint64_t seed = c10::default_rng_seed_val);
  ~LazyGenerator() override = default;

  void set_current_seed(uint64_t seed) override;
  void set_offset(uint64_t offset) override;
  uint64_t get_offset() const override;
  uint64_t current_seed() const override;
  uint64_t seed() override;
  void set_state(const c10::TensorImpl& new_state) override;
  c10::intrusive_ptr<c10::TensorImpl> get_state() const override;
  static c10::DeviceType device_type() {
    return c10::DeviceType::PrivateUse1;
  }

  // The generator on the backing device that replays this generator's draws. Only the executor
  // (holding the flush lock) draws from it.
  at::Generator backing() const;
  // One 64-bit draw from the backing generator (the executor holds the flush lock): the seed of a
  // node whose random numbers are keyed by batch rows.
  uint64_t draw_seed();
  // A seed derived from the backing generator's state without drawing (Philox generators: seed and
  // offset); the caller advances the state itself.
  uint64_t peek_seed();
  // Called by the recorder for every random node that draws from this generator.
  void note_draw(uint64_t seq) {
    last_draw_seq_.store(seq, std::memory_order_release);
  }

 private:
  LazyGenerator* clone_impl() const override;
  void flush_draws() const;

  mutable std::mutex backing_mu_;
  mutable at::Generator backing_;
  uint64_t seed_;
  mutable std::atomic<uint64_t> last_draw_seq_{0};
};

const at::Generator& default_lazy_generator(c10::DeviceIndex index = 0);
// A fresh generator on the backing device seeded with `seed`.
at::Generator make_backing_generator(uint64_t seed);
at::Generator new_lazy_generator(c10::DeviceIndex index = 0);
// The LazyGenerator behind `g`; throws a lazymem: error for a generator of another device.
LazyGenerator* lazy_generator_of(const at::Generator& g, const char* op_name);

} // namespace lazymem
