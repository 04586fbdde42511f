"""Reused plans replayed as CUDA graphs (execute/graphs.h, DESIGN.md §8; issue 30 item 2): every value
equals eager bitwise with graphs on, whatever moves between steps (a new batch, a held result, a
step-dependent scalar, a random op). On a CUDA backing (LAZYMEM_TEST_BACKING=cuda) with real graphs;
on the CPU backing with graphs emulated (torch_lazymem.testing.emulated_cuda_graphs: everything
around a graph runs as on a GPU, and a replay checks that no node's arguments changed since capture)."""

from __future__ import annotations

import contextlib
import copy
import gc

import pytest
import torch
import torch.nn.functional as F
from conftest import BACKING

import torch_lazymem
from torch_lazymem.testing import emulated_cuda_graphs

DEV = BACKING  # eager's device: the backing device
COUNTERS = ("cuda_graph_captures", "cuda_graph_replays", "cuda_graph_nodes", "cuda_graph_plain_nodes",
            "cuda_graph_fallbacks", "cuda_graph_pool_bytes")


@pytest.fixture
def graphs():
    """Graphs on (emulated on the CPU backing), counters reset; restored."""
    torch_lazymem.set_cuda_graphs(True)
    with emulated_cuda_graphs() if BACKING == "cpu" else contextlib.nullcontext():
        torch_lazymem.reset_stats()
        yield
    # Nothing of this test's stays for the next: its values, and the graphs with their pools.
    gc.collect()
    torch_lazymem.set_cuda_graphs(False)
    torch_lazymem.set_cuda_graphs(True)


@pytest.fixture
def plain_steps(graphs):
    """Pipelining off (one plan per read, the same every step); restored."""
    torch_lazymem.set_pipeline(False)
    yield
    torch_lazymem.set_pipeline(None)


def test_the_switch_checks_its_argument_and_the_counters_exist():
    with pytest.raises(TypeError, match="lazymem: set_cuda_graphs expects True or False, got 1"):
        torch_lazymem.set_cuda_graphs(1)  # type: ignore[arg-type]
    torch_lazymem.set_cuda_graphs(False)
    assert not torch_lazymem.cuda_graphs()
    torch_lazymem.set_cuda_graphs(True)
    assert torch_lazymem.cuda_graphs() == (torch_lazymem.backing_device().type == "cuda")
    if BACKING == "cpu":
        with emulated_cuda_graphs():
            assert torch_lazymem.cuda_graphs()
    assert set(COUNTERS) <= set(torch_lazymem.stats())


def _chain(a: torch.Tensor, n: int = 200) -> torch.Tensor:
    for _ in range(n):
        a = a * 1.0001 + 0.001
    return a


def test_a_repeated_program_replays_as_one_graph_with_eagers_values(plain_steps):
    x = torch.randn(1024, device=DEV)
    ref = _chain(x).cpu()
    a = x.to("lazymem")
    for _ in range(6):
        assert torch.equal(_chain(a).cpu(), ref)
    s = torch_lazymem.stats()
    # Run 1 plans, run 2 reuses the plan plainly (learning what moves), run 3 captures, 3-6 replay.
    assert s["cuda_graph_captures"] >= 1, s
    assert s["cuda_graph_replays"] >= 3, s
    assert s["cuda_graph_nodes"] >= 3 * 400, s
    assert s["cuda_graph_pool_bytes"] > 0 or BACKING == "cpu"


def test_a_new_input_each_run_and_results_held_across_replays_keep_eagers_values(plain_steps):
    """The input moves every run (copied into the graph's static copy); every result stays held while
    later replays write the graph's blocks (each moves out first, with its values)."""
    xs = [torch.randn(512, device=DEV) for _ in range(6)]
    refs = [_chain(x, 50) for x in xs]
    outs = []
    for x in xs:
        outs.append(_chain(x.to("lazymem"), 50))
        torch_lazymem.sync()
    assert torch_lazymem.stats()["cuda_graph_replays"] >= 3
    for out, ref in zip(outs, refs):
        assert torch.equal(out.cpu(), ref.cpu())


def _train(model: torch.nn.Module, device: str, batches: list[tuple[torch.Tensor, torch.Tensor]]):
    model = model.to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for x, y in batches:
        loss = F.cross_entropy(model(x.to(device)), y.to(device))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())  # held across steps: read at the end
        if device == "lazymem":
            torch_lazymem.sync()  # a step marker: one program per step
    return [float(v) for v in losses], [p.detach().cpu() for p in model.parameters()]


class _Net(torch.nn.Module):
    def __init__(self, dropout: float):
        super().__init__()
        self.emb = torch.nn.Embedding(50, 32)
        self.fc1 = torch.nn.Linear(32, 64)
        self.fc2 = torch.nn.Linear(64, 10)
        self.drop = torch.nn.Dropout(dropout)

    def forward(self, ids):
        return self.fc2(self.drop(F.gelu(self.fc1(self.emb(ids).mean(1)))))


@pytest.mark.parametrize("dropout", [0.0, 0.2])
def test_training_with_a_new_batch_each_step_equals_eager(plain_steps, dropout):
    """AdamW's step-dependent scalars and dropout's draws run plainly between graph pieces; the batch
    moves every step; the losses stay held. Bitwise eager, same seed."""
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, 50, (16, 7), generator=g), torch.randint(0, 10, (16,), generator=g)) for _ in range(7)]
    torch.manual_seed(0)
    base = _Net(dropout)
    torch.manual_seed(3)
    ref_losses, ref_params = _train(copy.deepcopy(base), DEV, batches)
    torch.manual_seed(3)
    losses, params = _train(copy.deepcopy(base), "lazymem", batches)
    assert losses == ref_losses
    for p, r in zip(params, ref_params):
        assert torch.equal(p, r)
    s = torch_lazymem.stats()
    assert s["cuda_graph_replays"] > 0, s
    assert s["cuda_graph_plain_nodes"] > 0, s  # AdamW's bias corrections change every step


def test_graphs_off_run_plainly_with_the_same_values(plain_steps):
    x = torch.randn(1024, device=DEV)
    a = x.to("lazymem")
    with_graphs = [_chain(a).cpu() for _ in range(4)]
    torch_lazymem.set_cuda_graphs(False)
    torch_lazymem.reset_stats()
    without = [_chain(a).cpu() for _ in range(4)]
    assert torch_lazymem.stats()["cuda_graph_replays"] == 0
    assert torch_lazymem.stats()["cuda_graph_pool_bytes"] == 0  # dropped with their graphs
    for u, v in zip(with_graphs, without):
        assert torch.equal(u, v)


def test_pipelined_batches_replay_as_graphs_and_equal_eager(graphs):
    torch_lazymem.set_pipeline(True)
    torch_lazymem._C._set_pipeline_batch(16)
    try:
        torch.manual_seed(0)
        ref = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 10))
        model = copy.deepcopy(ref).to("lazymem")
        ref.to(DEV)
        opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ref, model)]
        x, y = torch.randn(32, 64), torch.arange(32) % 10
        torch_lazymem.reset_stats()
        for step in range(8):
            losses = []
            for m, opt, dev in ((ref, opts[0], DEV), (model, opts[1], "lazymem")):
                loss = F.cross_entropy(m(x.to(dev)), y.to(dev))
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses.append(loss.item())
            assert losses[0] == losses[1], step
        assert torch_lazymem.stats()["cuda_graph_replays"] > 0
        for p, r in zip(model.parameters(), ref.parameters()):
            assert torch.equal(p.cpu(), r.cpu())
    finally:
        torch_lazymem._C._pipeline_drain()
        torch_lazymem._C._set_pipeline_batch(0)
        torch_lazymem.set_pipeline(None)
