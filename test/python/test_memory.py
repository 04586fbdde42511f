"""Memory accounting, the simulated device and the eager memory cap."""

from __future__ import annotations

import gc

import pytest
import torch

import torch_lazymem
from torch_lazymem.testing import eager_max_memory_allocated, memory_cap, simulated_device

MiB = 1024 * 1024


def test_accounting_is_byte_exact():
    gc.collect()
    base = torch.lazymem.memory_allocated()
    x = torch.randn(1000, device="lazymem")
    assert torch.lazymem.memory_allocated() == base
    x.cpu()
    assert torch.lazymem.memory_allocated() == base + 4000
    del x
    gc.collect()
    assert torch.lazymem.memory_allocated() == base


def test_intermediates_are_freed_after_their_last_use():
    gc.collect()  # (what earlier tests in this worker left in reference cycles)
    base = torch.lazymem.memory_allocated()
    x = torch.randn(256, 1024, device="lazymem")  # 1 MiB
    y = x
    for _ in range(20):
        y = (y * 1.01).tanh()  # 40 intermediates of 1 MiB, each dead after one use
    torch.lazymem.reset_peak_memory_stats()
    y.sum().item()
    peak = torch_lazymem.stats()["peak_bytes"]
    assert peak <= base + 3 * MiB + 4096, (peak, base)  # x, one live temporary and the one being produced
    assert torch.lazymem.max_memory_allocated() <= base + 3 * MiB + 4096
    del x, y
    gc.collect()
    assert torch.lazymem.memory_allocated() == base


def test_memory_returns_to_baseline():
    gc.collect()
    base = torch.lazymem.memory_allocated()
    for _ in range(3):
        a = torch.randn(64, 64, device="lazymem")
        b = (a @ a).relu()
        b.sum().item()
    del a, b
    gc.collect()
    assert torch.lazymem.memory_allocated() == base


def chain(device: str, n: int = 8 * MiB) -> torch.Tensor:
    # ~32 MiB input; the two 32 MiB temporaries of the next line are alive at once in eager
    x = torch.ones(n, device=device)
    return ((x * 2) + (x * 3)).sum()


def test_simulated_device_oom_loses_nothing():
    # A 48 MiB input on a 40 MiB device: nothing splits it (the element-wise ops after it would run in
    # blocks of its elements, but it does not fit itself).
    with simulated_device("40MiB"):
        free, total = torch.lazymem.mem_get_info()
        assert total == 40 * MiB and free == total - torch.lazymem.memory_allocated()
        y = chain("lazymem", 12 * MiB)
        with pytest.raises(torch.OutOfMemoryError, match="lazymem: out of memory while materializing.*Nothing was lost"):
            y.item()
        assert torch_lazymem.stats()["pending_nodes"] > 0
    with simulated_device("200MiB"):
        torch.lazymem.reset_peak_memory_stats()
        assert y.item() == 5.0 * 12 * MiB
        assert torch.lazymem.max_memory_allocated() <= 200 * MiB  # never above the device's capacity
        assert torch_lazymem.stats()["peak_bytes"] <= 200 * MiB
    gc.collect()


def test_an_element_wise_chain_over_a_tensor_too_large_for_its_temporaries_runs_in_blocks():
    """x (32 MiB) fits a 40 MiB device, x * 2 and x * 3 beside it do not (eager: memory_cap raises):
    the element-wise run reading x goes in blocks of its elements (the third split axis), exactly."""
    with simulated_device("40MiB"):
        torch.lazymem.reset_peak_memory_stats()
        y = chain("lazymem")
        assert y.item() == 5.0 * 8 * MiB
        assert torch.lazymem.max_memory_allocated() <= 40 * MiB
        assert torch_lazymem.stats()["row_loops"] >= 1, torch_lazymem.explain(print_it=False)


def test_eager_cap_uses_the_same_accounting():
    with memory_cap("40MiB"):
        with pytest.raises(torch.OutOfMemoryError, match="memory_cap"):
            chain("cpu")
    with memory_cap("200MiB"):
        assert chain("cpu").item() == 5.0 * 8 * MiB
        assert eager_max_memory_allocated() >= 64 * MiB


def test_simulated_capacity_bounds_what_lazymem_holds():
    gc.collect()
    x = torch.randn(1024, 256)
    with simulated_device(MiB + 1024):
        # One row (1 KiB) beside the first MiB: `a * 2` reaches the host a row at a time, exactly at
        # the capacity (it did not fit while the kernel also allocated the number 2 converted to float).
        torch.lazymem.reset_peak_memory_stats()
        a = x.to("lazymem")
        a.cpu()
        assert torch.equal((a * 2).cpu(), x * 2)
        assert torch.lazymem.max_memory_allocated() <= MiB + 1024
        del a
        gc.collect()
    with simulated_device(MiB + 512):
        torch.lazymem.reset_peak_memory_stats()
        a = torch.randn(1024, 256, device="lazymem")  # exactly 1 MiB
        a.cpu()
        with pytest.raises(torch.OutOfMemoryError):
            (a * 2).cpu()  # not even a row of a second MiB fits beside the first
        del a
        gc.collect()
        # the failed op's pending node was dead; its input is released before the next run
        b = torch.randn(1024, 256, device="lazymem")
        assert b.sum().item() == pytest.approx(b.cpu().sum().item())
        assert torch.lazymem.max_memory_allocated() <= MiB + 512


def test_the_simulated_device_keeps_freed_blocks_for_its_next_allocations():
    # The simulated device's memory is a pool of its own, as a GPU's: a step that repeats takes every
    # block of 64 KiB or more from what the last one freed, and none from the host's malloc, whose free
    # lists lazymem's own small allocations would otherwise split (an MLP step then ran its kernels
    # on memory nothing had touched lately). What the pool holds is reserved, not allocated.
    if not torch_lazymem._C._device_pool_enabled():
        pytest.skip("the device pool is off (LAZYMEM_DEVICE_POOL=0, or LAZYMEM_GUARD_FREED: the sanitizer "
                    "job runs this module again unguarded)")
    gc.collect()
    xh, wh = torch.randn(256, 1024), torch.randn(1024, 1024)
    expected = (xh @ wh).relu() @ wh

    def step(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return ((x @ w).relu() @ w).cpu()

    with simulated_device("64MiB"):
        torch.lazymem.empty_cache()
        assert torch.lazymem.memory_reserved() == torch.lazymem.memory_allocated()
        x, w = xh.to("lazymem"), wh.to("lazymem")
        assert torch.equal(step(x, w), expected)
        held = torch.lazymem.memory_allocated()
        assert torch.lazymem.memory_reserved() >= held + 2 * MiB  # the two freed 1 MiB intermediates
        torch_lazymem.reset_stats()
        torch.lazymem.reset_peak_memory_stats()
        assert torch.equal(step(x, w), expected)
        st = torch_lazymem.stats()
        assert st["device_pool_misses"] == 0, st
        assert torch.lazymem.max_memory_allocated() == st["peak_bytes"] == st["predicted_peak_bytes"], st
        assert torch.lazymem.memory_reserved() - torch.lazymem.memory_allocated() <= 64 * MiB
        torch.lazymem.empty_cache()
        assert torch.lazymem.memory_reserved() == torch.lazymem.memory_allocated() == held
        torch_lazymem.reset_stats()
        assert torch.equal(step(x, w), expected)
        assert torch_lazymem.stats()["device_pool_misses"] >= 2  # (the pool was empty)
        del x, w
        gc.collect()
    with simulated_device("3MiB"):  # at most the capacity is kept (the oldest blocks go first)
        assert torch.lazymem.memory_reserved() - torch.lazymem.memory_allocated() <= 3 * MiB
    torch.lazymem.empty_cache()


def test_a_plan_over_a_budget_nothing_enforces_is_refused_and_nothing_is_lost():
    # No simulated device: nothing would stop the plan from holding more than the budget promises.
    a = torch.randn(512, 512)
    w = a.to("lazymem")
    y = (w @ w).relu().sum()  # no batch to split along: 1 MiB inputs, 1 MiB product
    torch_lazymem.set_memory_budget("1MiB")
    try:
        with pytest.raises(torch.OutOfMemoryError, match=r"lazymem: out of memory: the program's plan needs .* over the memory budget of 1\.00 MiB.*Nothing ran and nothing was lost"):
            y.item()
    finally:
        torch_lazymem.set_memory_budget(None)
    assert torch.equal(y.cpu(), (a @ a).relu().sum())

