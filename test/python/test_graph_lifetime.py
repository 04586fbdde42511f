"""Graph lifetime: loops that never read a value do not grow the program without bound."""

from __future__ import annotations

import gc

import pytest
import torch

import torch_lazymem


@pytest.fixture
def threshold():
    old = torch_lazymem._C._flush_threshold()
    yield
    torch_lazymem._C._set_flush_threshold(*old)


def test_default_threshold_is_on():
    nodes, _ = torch_lazymem._C._flush_threshold()
    assert nodes > 0


def test_node_threshold_flushes_automatically(threshold):
    torch_lazymem.set_flush_threshold(nodes=100)
    x = torch.zeros(16, device="lazymem")
    peak = 0
    for _ in range(1000):
        x.add_(1)
        peak = max(peak, torch_lazymem.stats()["pending_nodes"])
    assert peak <= 100
    assert torch_lazymem.stats()["auto_flushes"] >= 9
    assert x.tolist() == [1000.0] * 16


def test_byte_threshold_flushes_automatically(threshold):
    torch_lazymem.set_flush_threshold(nodes=0, bytes="1MiB")
    x = torch.zeros(64 * 1024, device="lazymem")  # 256 KiB per new buffer
    for _ in range(40):
        x = x + 1
        assert torch_lazymem._C._pending_nodes() <= 5
    assert torch_lazymem.stats()["auto_flushes"] >= 8
    assert x[0].item() == 40.0


def test_training_loop_without_reads_is_bounded(threshold):
    torch_lazymem.set_flush_threshold(nodes=300)
    gc.collect()
    base = torch.lazymem.memory_allocated()
    buffers = torch_lazymem._C._buffers_alive()
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)).to("lazymem")
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(50):
        opt.zero_grad()
        model(torch.randn(16, 32, device="lazymem")).square().mean().backward()
        opt.step()
        assert torch_lazymem.stats()["pending_nodes"] <= 300
    torch_lazymem.sync()
    assert torch_lazymem.stats()["pending_nodes"] == 0
    del model, opt
    gc.collect()
    assert torch.lazymem.memory_allocated() == base
    assert torch_lazymem._C._buffers_alive() == buffers  # no buffer (or node) leaks


def test_sync_is_a_step_marker():
    x = torch.randn(4, device="lazymem") * 2
    assert torch_lazymem.stats()["pending_nodes"] == 2
    torch_lazymem.sync()
    assert torch_lazymem.stats()["pending_nodes"] == 0
    assert torch_lazymem.buffer_info(x)["has_real"]
