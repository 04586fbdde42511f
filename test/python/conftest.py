"""Shared fixtures: every test starts with nothing pending and fresh statistics."""

from __future__ import annotations

import pytest
import torch

import torch_lazymem


@pytest.fixture(autouse=True)
def _clean_program():
    torch.lazymem.synchronize()
    torch_lazymem.reset_stats()
    yield
    try:
        torch.lazymem.synchronize()
    except Exception:  # noqa: BLE001 - a test that left a failing op pending has already failed
        pass


def assert_bitwise(lazy: torch.Tensor, expected: torch.Tensor) -> None:
    """lazymem on the CPU backing device runs the same kernels on the same data as eager CPU."""
    assert lazy.device.type == "lazymem"
    got = lazy.cpu()
    assert got.dtype == expected.dtype, (got.dtype, expected.dtype)
    assert got.shape == expected.shape, (got.shape, expected.shape)
    assert torch.equal(got, expected), (got, expected)
