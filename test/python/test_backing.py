"""The backing device: CUDA when present, else CPU; CUDA tests skip without CUDA."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import torch_lazymem

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_backing_device_defaults():
    # A fresh process: the suite itself chooses its backing device (conftest.BACKING).
    code = "import torch, torch_lazymem; print(torch_lazymem.backing_device().type)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == ("cuda" if torch.cuda.is_available() else "cpu")


def test_set_backing_device_cpu():
    before = torch_lazymem.backing_device()
    torch_lazymem.set_backing_device("cpu")
    assert torch_lazymem.backing_device() == torch.device("cpu")
    if before.type == "cuda":
        torch_lazymem.set_backing_device(before)


@cuda
def test_cuda_backing_runs_and_matches_cuda():
    before = torch_lazymem.backing_device()
    torch_lazymem.set_backing_device("cuda")
    try:
        a = torch.randn(64, 64)
        x = a.to("lazymem")
        got = (x @ x).relu().cpu()
        ref = (a.cuda() @ a.cuda()).relu().cpu()
        assert torch.equal(got, ref)
        assert torch.lazymem.memory_allocated() >= 0
    finally:
        torch_lazymem.set_backing_device(before)


@cuda
def test_cuda_tensor_to_lazymem_is_snapshotted():
    before = torch_lazymem.backing_device()
    torch_lazymem.set_backing_device("cuda")
    try:
        src = torch.arange(4.0, device="cuda")
        x = src.to("lazymem")
        src.zero_()
        assert x.tolist() == [0.0, 1.0, 2.0, 3.0]
    finally:
        torch_lazymem.set_backing_device(before)
