"""Shared fixtures: every test starts with nothing pending and fresh statistics."""

from __future__ import annotations

import gc
import os
import threading

# Every plan checks that the program's tape, kept as nodes are recorded, equals one built from the
# nodes (csrc/ir/tape.h): a stale tape would hand out another program's plan.
os.environ.setdefault("LAZYMEM_CHECK_TAPE", "1")
# Kernels are handed device memory only (DESIGN.md §3, execute/transfer.h): checked in every test.
os.environ.setdefault("LAZYMEM_CHECK_BOUNDARY", "1")

from typing import Any, Callable  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_map_only  # noqa: E402

import torch_lazymem  # noqa: E402
from torch_lazymem.testing.compare import compare  # noqa: E402

# The suite's backing device: LAZYMEM_TEST_BACKING=cpu|cuda, CUDA by default where present. In the
# CUDA mode the modules below compare against eager on CUDA (bitwise where the kernels are
# deterministic); every other module compares against eager CPU or measures the simulated,
# memory-capped device (a CPU backing, DESIGN.md §3), and is skipped there.
BACKING = os.environ.get("LAZYMEM_TEST_BACKING") or ("cuda" if torch.cuda.is_available() else "cpu")
CUDA_MODULES = {"test_backing.py", "test_cuda.py", "test_cuda_graphs.py", "test_opinfo.py"}
torch_lazymem.set_backing_device(BACKING)


def pytest_collection_modifyitems(config, items):  # noqa: ARG001 - pytest's hook signature
    if BACKING == "cpu":
        return
    skip = pytest.mark.skip(reason="compares against eager CPU or the simulated device (CPU backing only)")
    for item in items:
        if item.path.name not in CUDA_MODULES:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _clean_program():
    torch.lazymem.synchronize()
    torch_lazymem.reset_stats()
    # The device's peak too: under two pytest workers a test that reads max_memory_allocated() may
    # follow any other test in its process (one that peaked above its cap failed it).
    torch.lazymem.reset_peak_memory_stats()
    yield
    try:
        torch.lazymem.synchronize()
    except Exception:  # noqa: BLE001 - a test that left a failing op pending has already failed
        pass
    # Device memory still held after the test is garbage in reference cycles (an exception's
    # traceback holding the test's tensors, a Trainer and its callbacks), freed only when Python's
    # collector next runs: collected now, or a later test on a small simulated device would count it
    # as held (a 64 KiB cap met 63.5 KiB that a Trainer test left). A few tests leave any.
    if torch.lazymem.memory_allocated():
        gc.collect()


def run_in_threads(target: Callable[[int], None], count: int, timeout: float = 120) -> None:
    """Runs target(0) ... target(count - 1) on as many threads at once; raises what any of them raised."""
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            target(i)
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=timeout)
    assert not any(t.is_alive() for t in threads), f"threads still running after {timeout} s"
    assert not errors, errors


def assert_bitwise(lazy: torch.Tensor, expected: torch.Tensor) -> None:
    """lazymem on the CPU backing device runs the same kernels on the same data as eager CPU: equal
    dtype, shape and values (assert_close with rtol=atol=0 and equal_nan; -0.0 equals 0.0)."""
    assert lazy.device.type == "lazymem"
    result = compare(expected, lazy.cpu())
    assert result.equal, result.message


def to_lazy(obj: Any) -> Any:
    """`obj` with every tensor moved to lazymem, any pytree (tuples, namedtuples, lists, dicts) keeping its type."""
    return tree_map_only(torch.Tensor, lambda t: t.to("lazymem"), obj)


class OpTrace(TorchDispatchMode):
    """Records the ATen ops that reach the dispatcher below autograd (forward and backward), except
    device transfers and detaches, which differ between a CPU run and a lazymem run by construction."""

    IGNORED = ("aten._to_copy.default", "aten.detach.default")

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if str(func) not in self.IGNORED:
            self.ops.append(str(func))
        return func(*args, **(kwargs or {}))
