// distributed: DDP's timer for the lazymem device. DDP's Reducer takes a c10d::Timer for its
// parameters' device type from c10d::TimerRegistry (torch registers CPU and CUDA only); without one,
// DDP's logger prints "Time stats are currently only collected for CPU and CUDA devices" at every
// rank and keeps no time statistics. lazymem records ops on the host thread, so its events are host
// timestamps, as CpuTimer's are (Timer::record's default): DDP's forward, backward and communication
// phases as recorded, not as later run on the backing device.
#include <cstdint>
#include <optional>

#include <c10/core/Device.h>
#include <c10/core/DeviceType.h>
#include <torch/csrc/distributed/c10d/reducer_timer.hpp>

namespace lazymem {
namespace {

class LazymemTimer : public c10d::Timer {
 public:
  explicit LazymemTimer(c10::Device /*device*/) {}

  std::optional<int64_t> measureDifference(Event start, Event end) override {
    const int64_t start_time = getTimeRef(start);
    const int64_t end_time = getTimeRef(end);
    // An event not recorded in this iteration (no communication under no_sync): no difference, and
    // DDP skips that average.
    if (start_time == c10d::kUnsetTime || end_time < start_time) return std::nullopt;
    return end_time - start_time;
  }
};

} // namespace
} // namespace lazymem

// (The macro names TimerRegistry unqualified.)
namespace c10d {
C10_REGISTER_TYPED_CLASS(TimerRegistry, c10::kPrivateUse1, lazymem::LazymemTimer);
} // namespace c10d
