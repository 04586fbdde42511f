"""Testing helpers: a simulated memory-capped device for lazymem and the same cap for eager code.

``simulated_device(capacity)`` makes lazymem's backing device a CPU "device" of that capacity: every
byte lazymem would hold on a GPU (uploaded inputs and parameters, intermediates, results) is counted
and an allocation past the capacity raises ``torch.OutOfMemoryError``, as CUDA does. Host memory is
a second memory: a value held there reaches a kernel only through a counted copy into the device,
and the copies take the time of a modeled link (``link``, default 25 GB/s each way); a kernel handed
host memory is an internal error.
``memory_cap(capacity)`` counts the plain eager CPU allocations made on the current thread the same way.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, Union

from .. import _C
from ..api import backing_device, byte_size, set_backing_device

Capacity = Union[int, str]


def parse_bytes(capacity: Capacity) -> int:
    return byte_size(capacity, "capacity")


def parse_bandwidth(link: Union[int, float, str, None]) -> float:
    """Bytes per second from ``25e9``, ``"25GB/s"`` or ``"12GiB/s"``; ``None`` or 0: not modeled."""
    if link is None:
        return 0.0
    if isinstance(link, bool):
        raise TypeError(f"lazymem: link must be bytes per second or a string such as '25GB/s', got {link!r}")
    if isinstance(link, (int, float)):
        if link < 0:
            raise ValueError(f"lazymem: link bandwidth must be non-negative, got {link}")
        return float(link)
    if isinstance(link, str):
        text = link.strip()
        if not text.endswith("/s"):
            raise ValueError(f"lazymem: link bandwidth must be given per second, such as '25GB/s', got {link!r}")
        return float(_C._parse_bytes(text[:-2].strip()))
    raise TypeError(f"lazymem: link must be bytes per second or a string such as '25GB/s', got {link!r}")


@contextlib.contextmanager
def simulated_device(capacity: Capacity, link: Union[int, float, str, None] = "25GB/s") -> Iterator[None]:
    """Runs lazymem on a CPU device of ``capacity`` bytes (e.g. ``"256MiB"``), with host memory
    across a link of ``link`` bandwidth each way (``None``: copies take only their memcpy)."""
    cap = parse_bytes(capacity)
    bandwidth = parse_bandwidth(link)
    previous_device = str(backing_device())
    previous_cap = int(_C._device_capacity())
    previous_link = float(_C._link_bandwidth())
    if previous_device != "cpu":
        set_backing_device("cpu")
    _C._set_device_capacity(cap)
    _C._set_link_bandwidth(bandwidth)
    try:
        yield
    finally:
        _C._set_link_bandwidth(previous_link)
        _C._set_device_capacity(previous_cap)
        if previous_device != "cpu":
            with contextlib.suppress(RuntimeError):
                set_backing_device(previous_device)


@contextlib.contextmanager
def memory_cap(capacity: Capacity) -> Iterator[None]:
    """Caps plain eager CPU allocations made on this thread at ``capacity`` bytes.

    What ATen allocates is counted (every op's result, ``clone``). Storages that Python constructs
    itself (``torch.UntypedStorage(n)``, so ``copy.deepcopy`` of a plain tensor or a module's buffers,
    and ``torch.load``) come from the default CPU allocator, which no hook reaches: they are not
    counted. Clone such tensors inside the cap (``module._apply(torch.clone)``) to count them."""
    cap = parse_bytes(capacity)
    _C._eager_cap_push(cap)
    try:
        yield
    finally:
        _C._eager_cap_pop()


@contextlib.contextmanager
def _switched(get: Callable[[], Any], set_: Callable[[Any], None], value: Any) -> Iterator[None]:
    """Sets one of the core's switches for the block, then puts back what it was."""
    previous = get()
    set_(value)
    try:
        yield
    finally:
        set_(previous)


@contextlib.contextmanager
def no_plan_reuse() -> Iterator[None]:
    """Plans every materialization from scratch (the plan cache off and emptied), as
    ``LAZYMEM_PLAN_CACHE=0`` does for a whole run."""
    with _switched(_C._plan_cache, _C._set_plan_cache, False):
        yield


@contextlib.contextmanager
def emulated_cuda_graphs() -> Iterator[None]:
    """CUDA graphs emulated on the CPU backing (execute/graphs.h): reused plans run in captured pieces
    and plain nodes as on a GPU, each "replay" running its nodes with the addresses a graph bakes in."""
    _C._set_graph_emulation(True)
    try:
        yield
    finally:
        _C._set_graph_emulation(False)


@contextlib.contextmanager
def force_chunks(n: int) -> Iterator[None]:
    """Splits every materialization into ``n`` chunks along the batch, whether it fits or not (for
    tests and debugging); ``n`` larger than the batch gives chunks of one row."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"lazymem: force_chunks expects a positive number of chunks, got {n!r}")
    with _switched(_C._force_chunks, _C._set_force_chunks, n):
        yield


@contextlib.contextmanager
def force_recompute() -> Iterator[None]:
    """Recomputes every batch-sharded value that crosses passes of a split, chunk by chunk where it is
    read, whenever the nodes computing it can run again, instead of storing it (normally only values
    that do not fit the device are recomputed; for tests)."""
    with _switched(_C._force_recompute, _C._set_force_recompute, True):
        yield


@contextlib.contextmanager
def no_workspace_probes() -> Iterator[None]:
    """Kernels that allocate inside are not measured on a row or two before they first run: their
    workspace is learned only from their runs, an out-of-memory retry included (for tests of that
    path). Nor are a first plan's recomputing nodes timed by probes to price holding values crossing
    passes in host memory: that plan recomputes them, unpriced."""
    with _switched(_C._workspace_probes, _C._set_workspace_probes, False):
        yield


def fail_allocation(n: int) -> None:
    """Makes the ``n``-th device allocation of the next materialization fail with
    ``torch.OutOfMemoryError``, as if the device were full at that moment (fault injection for the
    out-of-memory retry; ``injected_failures()`` counts the failures that fired)."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"lazymem: fail_allocation expects a positive allocation number, got {n!r}")
    _C._fail_allocation(n)


def injected_failures() -> int:
    """Allocation failures injected by fail_allocation() that fired, since the process started."""
    return int(_C._injected_failures())


def eager_memory_allocated() -> int:
    """Bytes allocated under memory_cap() and still alive."""
    return int(_C._eager_allocated())


def eager_max_memory_allocated() -> int:
    return int(_C._eager_peak())
