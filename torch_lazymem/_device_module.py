"""``torch.lazymem``: the device module PyTorch looks up for the ``lazymem`` device (device count,
synchronization, random number generation and memory statistics, mirroring ``torch.cuda``)."""

from __future__ import annotations

from typing import Any

import torch

from . import _C

_current = 0


def is_available() -> bool:
    return True


def is_initialized() -> bool:
    return True


def _lazy_init() -> None:
    pass


def _is_in_bad_fork() -> bool:
    return False


def device_count() -> int:
    return 1


def current_device() -> int:
    return _current


def _check_index(device: Any) -> int:
    if isinstance(device, torch.device):
        if device.type != "lazymem":
            raise ValueError(f"lazymem: expected a lazymem device, got {device}")
        index = 0 if device.index is None else device.index
    elif isinstance(device, str):
        return _check_index(torch.device(device))
    elif device is None:
        index = 0
    else:
        index = int(device)
    if index not in (0, -1):
        raise ValueError(f"lazymem: device index {index} is out of range; lazymem has a single device, lazymem:0")
    return 0


def set_device(device: Any) -> None:
    _check_index(device)


class device:
    """Context manager selecting a lazymem device (there is only lazymem:0)."""

    def __init__(self, device: Any):
        self.idx = _check_index(device)

    def __enter__(self) -> None:
        pass

    def __exit__(self, *args: Any) -> None:
        pass


def synchronize(device: Any = None) -> None:
    """Runs every recorded op now (then waits for the backing device)."""
    _check_index(device)
    _C._synchronize()


# Streams and events. lazymem runs every op in the order it was recorded (one program, one
# order), so each stream is the device's one stream: waits between streams are already satisfied,
# synchronizing one runs what is recorded. torch.Stream / torch.Event of the lazymem device (its
# DeviceGuardImpl) are what these return; FSDP2 and DDP's stream handling use them.


def Stream(device: Any = None, priority: int = 0, **kwargs: Any) -> torch.Stream:  # noqa: N802 - torch's name
    _check_index(device)
    return torch.Stream(device="lazymem", priority=priority)


def Event(enable_timing: bool = False, blocking: bool = False, interprocess: bool = False) -> torch.Event:  # noqa: N802
    return torch.Event(device="lazymem", enable_timing=enable_timing, blocking=blocking, interprocess=interprocess)


def current_stream(device: Any = None) -> torch.Stream:
    _check_index(device)
    return torch.Stream(device="lazymem")


def default_stream(device: Any = None) -> torch.Stream:
    return current_stream(device)


def set_stream(stream: torch.Stream) -> None:
    pass


class stream:  # noqa: N801 - torch's name (torch.cuda.stream)
    """Context manager selecting a stream: every lazymem stream is the one stream."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream

    def __enter__(self) -> Any:
        return self.stream

    def __exit__(self, *args: Any) -> None:
        pass


def get_amp_supported_dtype() -> list[torch.dtype]:
    return [torch.float16, torch.bfloat16]


# ---------------------------------------------------------------- random numbers
def _generator(device: Any = None) -> torch.Generator:
    return _C._default_generator(_check_index(device))


def manual_seed(seed: int) -> None:
    _generator().manual_seed(int(seed))


def manual_seed_all(seed: int) -> None:
    manual_seed(seed)


def seed() -> None:
    _generator().seed()


def seed_all() -> None:
    seed()


def initial_seed() -> int:
    return _generator().initial_seed()


def get_rng_state(device: Any = None) -> torch.Tensor:
    return _generator(device).get_state()


def get_rng_state_all() -> list[torch.Tensor]:
    return [get_rng_state()]


def set_rng_state(new_state: torch.Tensor, device: Any = None) -> None:
    _generator(device).set_state(new_state)


def set_rng_state_all(new_states: list[torch.Tensor]) -> None:
    for state in new_states:
        set_rng_state(state)


# ---------------------------------------------------------------- memory
def memory_allocated(device: Any = None) -> int:
    """Bytes lazymem holds on the backing device (exact on the CPU backing device)."""
    _check_index(device)
    return int(_C._memory_allocated())


def max_memory_allocated(device: Any = None) -> int:
    _check_index(device)
    return int(_C._max_memory_allocated())


def reset_peak_memory_stats(device: Any = None) -> None:
    _check_index(device)
    _C._reset_peak_memory_stats()


def reset_max_memory_allocated(device: Any = None) -> None:
    reset_peak_memory_stats(device)


def memory_reserved(device: Any = None) -> int:
    """Bytes allocated plus, on the CPU backing device, the freed blocks its pool keeps for reuse."""
    _check_index(device)
    return memory_allocated(device) + int(_C._device_pool_bytes())


def empty_cache() -> None:
    """Gives the CPU backing device's pooled free blocks back to the host (as torch.cuda.empty_cache)."""
    _C._empty_device_pool()


def mem_get_info(device: Any = None) -> tuple[int, int]:
    """(free, total) bytes of the simulated device when a capacity is set."""
    cap = int(_C._device_capacity())
    used = memory_allocated(device)
    if cap < 0:  # the plain CPU backing device: the host's memory
        import os  # noqa: PLC0415

        page = os.sysconf("SC_PAGE_SIZE")
        return int(os.sysconf("SC_AVPHYS_PAGES") * page), int(os.sysconf("SC_PHYS_PAGES") * page)
    return max(cap - used, 0), cap
