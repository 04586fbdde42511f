"""lazymem beside the user's own CUDA: eager CUDA autograd keeps working, the default budget sees
the CUDA allocator's per-process memory fraction, and the allocator holds lazymem's runs to the
budget (the fraction lowered for a run's duration, then put back).

Autograd (pytorch issue 161129).

Registering a PrivateUse1 backend makes ``at::getAccelerator()`` return it, and the autograd engine
then finds no stream for nodes over CUDA tensors and asserts on every CUDA backward. Every Python
backward (``Tensor.backward``, ``torch.autograd.backward`` and ``grad``, checkpointing, DDP/FSDP
callbacks) goes through ``Variable._execution_engine``; lazymem wraps it so that a backward whose
graph holds CUDA nodes and no lazymem node runs with the registration hidden from the engine
(csrc/device/cuda_autograd.h), exactly as without the import. A graph through both CUDA and lazymem
nodes cannot run on either accelerator's streams and gets a clear error before anything runs.

While such a CUDA backward runs, the name ``lazymem`` does not parse as a device in other threads;
``torch.accelerator`` reports CUDA for its duration.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.autograd.variable import Variable

from . import _C


class _Engine:
    """The autograd engine, with CUDA-only backwards run as they would be without lazymem."""

    _lazymem = True

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def run_backward(self, tensors: Any, *args: Any, **kwargs: Any) -> Any:
        roots = [t for t in tensors if isinstance(t, torch.Tensor)]
        if not any(t.is_cuda for t in roots):
            return self._inner.run_backward(tensors, *args, **kwargs)
        devices = _C._backward_devices(roots)
        if devices == "cuda+lazymem":
            raise RuntimeError(
                "lazymem: this backward runs through both CUDA and lazymem tensors (a value moved between "
                "the two devices inside the graph). PyTorch's autograd engine can run a backward on one "
                "accelerator's streams only once a PrivateUse1 device is registered (pytorch issue 161129). "
                "Keep the graph on one device: compute the loss where the model runs, or .detach() the "
                "value where it crosses."
            )
        if devices != "cuda":
            return self._inner.run_backward(tensors, *args, **kwargs)
        return _C._run_hiding_registration(lambda: self._inner.run_backward(tensors, *args, **kwargs))


def _read_memory_fraction(device: torch.device) -> None:
    """Called once by the core when it initializes a CUDA backing device."""
    index = device.index or 0
    _C._set_device_memory_fraction(index, float(torch.cuda.get_per_process_memory_fraction(index)))


def _set_allocator_fraction(device: torch.device, fraction: float) -> None:
    """Called by the core around a plan's run (csrc/execute/memory.h ScopedAllocatorCap): the
    allocator's own setter, not the wrapper below, so the user's fraction stays what they set."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    torch._C._cuda_setMemoryFraction(float(fraction), index)


def _wrap_set_fraction() -> None:
    """torch.cuda.set_per_process_memory_fraction also tells the core (the budget's cap)."""
    original = torch.cuda.memory.set_per_process_memory_fraction
    if getattr(original, "_lazymem", False):
        return

    def set_per_process_memory_fraction(fraction: float, device: Any = None) -> None:
        original(fraction, device)
        index = torch.cuda._utils._get_device_index(device, optional=True)
        if fraction > 0:
            _C._set_device_memory_fraction(index, float(fraction))

    set_per_process_memory_fraction.__doc__ = original.__doc__
    set_per_process_memory_fraction._lazymem = True  # type: ignore[attr-defined]
    torch.cuda.memory.set_per_process_memory_fraction = set_per_process_memory_fraction
    torch.cuda.set_per_process_memory_fraction = set_per_process_memory_fraction


def install() -> None:
    """Wraps the engine and the fraction setter once (idempotent); a no-op without CUDA in this
    torch build."""
    if not torch.backends.cuda.is_built():
        return
    if hasattr(torch.cuda, "get_per_process_memory_fraction"):
        _C._set_backing_initialized_callback(_read_memory_fraction)
    if hasattr(torch._C, "_cuda_setMemoryFraction"):
        _C._set_allocator_fraction_callback(_set_allocator_fraction)
    _wrap_set_fraction()
    engine = Variable._execution_engine
    if not getattr(engine, "_lazymem", False):
        Variable._execution_engine = _Engine(engine)  # type: ignore[assignment]


def guard_available() -> bool:
    """Whether lazymem could find the registration flag to hide (else a CUDA backward raises)."""
    return bool(_C._cuda_autograd_guard_available())
