"""Values that cross passes of a split (batch_split_theory.md §5, §6): a batch-sharded value computed in
one pass over the batch and read by a later one (a convolution's output that batch norm reads after
its statistics pass, an activation the backward reads) is stored whole when that fits the device; when
it does not, it is recomputed chunk by chunk in each pass that reads it — the nodes computing it run
again for the chunk's rows — when they can run again (no effect, nothing written but chunk-local
values, inputs unchanged by then; random ops read the draws generated for them once), else it is held in
host memory. explain() says which.

Exactness: with torch_lazymem.testing.force_recompute() every value that can be is recomputed, and
training is compared with eager in float64 at assert_close defaults, force_chunks 2/3/8 over a batch
of 10 (ragged). Memory: a batch-norm CNN under a simulated device that cannot hold its activations,
recompute against host memory (set_recompute(False)), peak ≤ capacity; fault injection."""

from __future__ import annotations

import contextlib
import copy
import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from splitting import B, assert_state_close, batch_of, ce, sgd_step_where_eager_runs_out, train_split
from test_split_cross_batch import CASES as CROSS_BATCH
from test_split_models import BatchNormResNet

import torch_lazymem
from torch_lazymem.testing import (
    fail_allocation,
    force_chunks,
    force_recompute,
    injected_failures,
    memory_cap,
    no_workspace_probes,
    simulated_device,
)


def inplace_relu_cnn(width: int = 8):
    """torchvision's ResNet habit: ReLU(inplace=True) overwrites batch norm's output."""
    return nn.Sequential(
        nn.Conv2d(3, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True),
        nn.Conv2d(width, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(width, 10))


MODELS = {
    "resnet_batchnorm": (BatchNormResNet, batch_of(3, 8, 8, classes=10)),
    "inplace_relu_cnn": (inplace_relu_cnn, batch_of(3, 8, 8, classes=10)),
    "bn1d_mlp": (lambda: nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.BatchNorm1d(8), nn.ReLU(),
                                       nn.Linear(8, 8), nn.BatchNorm1d(8, momentum=None), nn.Linear(8, 5)),
                 batch_of(6, classes=5)),
}


@pytest.mark.parametrize("chunks", [2, 3, 8])
@pytest.mark.parametrize("name", list(MODELS))
def test_training_with_every_crossing_value_recomputed_equals_eager(name, chunks):
    make, data = MODELS[name]
    stats = train_split(make, data, ce, chunks, context=force_recompute)
    assert stats["values_recomputed"] > 0 and stats["values_in_host_memory"] == 0
    assert stats["splits"] >= 5 and stats["passes"] >= 3 and stats["barriers"] == 0


def on_features(fn):
    """`fn` applied to computed features (tanh of the input): what crosses passes is a computed value."""
    return lambda x: fn(torch.tanh(x) * 1.5 + x.square())


@pytest.mark.parametrize("chunks", [2, 3, 8])
@pytest.mark.parametrize("name", [n for n, (_, passes) in CROSS_BATCH.items() if passes >= 2])
def test_cross_batch_ops_recompute_their_input_exactly(name, chunks):
    fn = on_features(CROSS_BATCH[name][0])
    x = torch.randn(B, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(chunks))
    cpu = x.clone().requires_grad_()
    out = fn(cpu)
    (grad,) = torch.autograd.grad(out.sum(), cpu)
    lazy = x.to("lazymem").requires_grad_()
    torch_lazymem.reset_stats()
    with force_chunks(chunks), force_recompute():
        lout = fn(lazy)
        (lgrad,) = torch.autograd.grad(lout.sum(), lazy)
        torch.testing.assert_close(lout.cpu(), out.detach())
        torch.testing.assert_close(lgrad.cpu(), grad)
    assert torch_lazymem.stats()["values_recomputed"] > 0


def test_explain_names_the_recomputed_values_and_the_nodes_run_again():
    torch.manual_seed(0)
    model = inplace_relu_cnn().double().to("lazymem")
    x, t = batch_of(3, 8, 8, classes=10)(0)
    with force_chunks(3), force_recompute():
        ce(model, (x.to("lazymem"), t.to("lazymem"))).backward()
        torch.lazymem.synchronize()
    text = torch_lazymem.explain(print_it=False)
    assert "recomputed chunk by chunk from an earlier pass" in text, text
    assert "are recomputed chunk by chunk in the passes that read them" in text, text
    assert "assembled whole in host memory" not in text, text


@pytest.mark.parametrize("chunks", [2, 3, 8])
def test_a_random_op_is_recomputed_with_the_same_draws(chunks):
    """Dropout before a batch norm: the linear layer's output crosses the statistics pass and its cone
    holds the dropout. Split, the dropout's draws are generated once (eager's mask), so run again
    for a chunk's rows in a later pass it reads the same mask: recomputing at 2/3/8 chunks gives
    eager's forward, gradients and three SGD steps (issue 27), as storing at 3 does."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Dropout(0.3), nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 5)).double()
    runs = []
    for dev, forced in (("cpu", False), ("lazymem", False), ("lazymem", True)):
        lazy = copy.deepcopy(model).to(dev)
        opt = torch.optim.SGD(lazy.parameters(), lr=0.1)
        torch.manual_seed(1)
        outs, recomputed = [], 0
        for step in range(3):
            x = torch.randn(B, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(step))
            torch_lazymem.reset_stats()
            with force_chunks(chunks if forced else 3), (force_recompute() if forced else contextlib.nullcontext()):
                y = lazy(x.to(dev))
                y.square().mean().backward()
                opt.step()
                opt.zero_grad()
                outs.append(y.detach().cpu())
            recomputed += torch_lazymem.stats()["values_recomputed"]
        runs.append((outs, [p.detach().cpu() for p in lazy.parameters()], recomputed))
    for run in runs[1:]:
        for a, b in zip(runs[0][0] + runs[0][1], run[0] + run[1]):
            torch.testing.assert_close(b, a)
    assert runs[1][2] == 0
    assert runs[2][2] >= 3  # every step recomputed the dropout's cone


class WideBNNet(nn.Module):
    """Batch norm CNN whose activations (2 MiB each at a batch of 64) cannot all be stored in 3 MiB."""

    def __init__(self) -> None:
        super().__init__()
        self.body = inplace_relu_cnn(16)

    def forward(self, x):
        return self.body(x)


@contextlib.contextmanager
def recompute_set_to(value: bool | None):
    previous = torch_lazymem.recompute()
    torch_lazymem.set_recompute(value)
    try:
        yield
    finally:
        torch_lazymem.set_recompute(previous)


@pytest.mark.parametrize("recompute", [True, False])
def test_activations_that_do_not_fit_are_recomputed_or_held_in_host_memory(recompute):
    torch.manual_seed(0)
    model = WideBNNet().double()
    x, t = torch.randn(64, 3, 16, 16, dtype=torch.float64), torch.randint(0, 10, (64,))
    s, text = sgd_step_where_eager_runs_out(model, x, t, "3MiB", context=lambda: recompute_set_to(recompute))
    if recompute:
        assert s["values_recomputed"] >= 2 and s["values_in_host_memory"] == 0, text
        assert "recomputed chunk by chunk" in text
    else:
        assert s["values_recomputed"] == 0 and s["values_in_host_memory"] > 0, text


def test_out_of_memory_in_a_recomputing_pass_is_retried():
    """Fails each of the first allocations of a split step whose crossing values are all recomputed:
    the same losses and state as without a failure (float64 tolerance: a retried chunk runs smaller)."""
    torch.manual_seed(0)
    model = inplace_relu_cnn(4).double()
    data = batch_of(3, 6, 6, classes=10)(0)

    def step(n):
        lazy = copy.deepcopy(model).to("lazymem")
        opt = torch.optim.AdamW(lazy.parameters(), lr=1e-2)
        torch.lazymem.synchronize()
        before = injected_failures()
        with force_chunks(3), force_recompute():
            if n:
                fail_allocation(n)
            loss = ce(lazy, (data[0].to("lazymem"), data[1].to("lazymem")))
            loss.backward()
            opt.step()
            value = loss.item()
            state = {k: v.cpu() for k, v in lazy.state_dict().items()}
        return value, state, injected_failures() > before

    ref_loss, ref_state, _ = step(0)
    assert torch_lazymem.stats()["values_recomputed"] > 0
    fired = 0
    for n in range(1, 121, 3):
        loss, state, hit = step(n)
        if not hit:
            break
        fired += 1
        torch.testing.assert_close(loss, ref_loss)
        for k, v in state.items():
            torch.testing.assert_close(v, ref_state[k], msg=lambda m, n=n, k=k: f"{k} after failing allocation {n}: {m}")
    assert fired >= 20


@pytest.mark.parametrize("recompute", [False, True])
def test_an_upload_written_in_place_crosses_passes_as_a_value(recompute):
    """x.add_(w) in one pass, w overwritten in between, x read in a later pass: x is a computed value
    (stored, or recomputed only if that were safe — here it is not: w changed), never the upload read
    again with the in-place op re-run on the new w."""
    data = torch.randn(B, 6, dtype=torch.float64)
    w0 = torch.linspace(0.5, 1.5, 6, dtype=torch.float64)
    x, w = data.clone(), w0.clone()
    x.add_(w)
    w.mul_(2)
    expected = (x * w).sum()
    lw = w0.to("lazymem")
    torch_lazymem.mark_batch(lw, None)
    torch_lazymem.reset_stats()
    with force_chunks(2), (force_recompute() if recompute else memory_cap("1TiB")):
        lx = data.to("lazymem")
        lx.add_(lw)
        lw.mul_(2)
        out = (lx * lw).sum()
        del lx
        torch.testing.assert_close(out.cpu(), expected)
    assert torch_lazymem.stats()["passes"] >= 2


def test_set_recompute_rejects_non_bools():
    with pytest.raises(TypeError, match="lazymem: set_recompute"):
        torch_lazymem.set_recompute("yes")  # type: ignore[arg-type]


def test_dropout_free_transformer_block_unchanged_by_force_recompute():
    """A program with one pass has nothing crossing passes: forcing recomputation changes nothing."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, dropout=0.0, batch_first=True).double()
    x = torch.randn(B, 5, 16, dtype=torch.float64)
    lazy = copy.deepcopy(layer).to("lazymem")
    torch_lazymem.reset_stats()
    with force_chunks(3), force_recompute():
        y = lazy(x.to("lazymem")).cpu()
    torch.testing.assert_close(y, layer(x))
    assert torch_lazymem.stats()["values_recomputed"] == 0
    _ = F  # (F used by the shared helpers' models)


NOTE = re.compile(
    r"(holding|recomputing) (\d+) values? crossing passes (?:in host memory|chunk by chunk): recomputing runs (\d+) "
    r"nodes again \(([\d.]+) (us|ms|s) measured\), host memory copies .* \(([\d.]+) (us|ms|s) predicted\)")


def seconds(value: str, unit: str) -> float:
    return float(value) * {"us": 1e-6, "ms": 1e-3, "s": 1.0}[unit]


@pytest.mark.parametrize("probes", [True, False])
@pytest.mark.parametrize("link", ["1MB/s", "25GB/s"])
def test_the_default_prices_recomputing_against_host_memory(link, probes):
    """set_recompute(None), the default: a plan prices both ways — the recomputing nodes' measured time
    against the copies' time over the link — and takes the cheaper, saying so in explain(). Over a
    1 MB/s link, copying MiBs costs seconds: recomputing wins. In a fresh process no node has run: the
    first step's recomputing nodes are timed by probes, one chunk of zeros each, and it is priced with
    those (its plan is not kept: the next is priced with real runs); without probes it recomputes
    unpriced. Either way, eager's state after every step."""
    assert torch_lazymem.recompute() is None
    torch_lazymem._C._clear_node_times()  # as in a fresh process: no node has run yet
    torch.manual_seed(0)
    model = WideBNNet().double()
    batches = [(torch.randn(64, 3, 16, 16, dtype=torch.float64), torch.randint(0, 10, (64,))) for _ in range(3)]
    ref = copy.deepcopy(model)
    opt_r = torch.optim.SGD(ref.parameters(), lr=0.1)
    with simulated_device("3MiB", link=link), (contextlib.nullcontext() if probes else no_workspace_probes()):
        lazy = copy.deepcopy(model).to("lazymem")
        opt = torch.optim.SGD(lazy.parameters(), lr=0.1)
        notes, texts = [], []
        for x, t in batches:
            torch_lazymem.reset_stats()
            loss = F.cross_entropy(lazy(x.to("lazymem")), t.to("lazymem"))
            loss.backward()
            opt.step()
            opt.zero_grad()
            loss.item()
            texts.append(torch_lazymem.explain(print_it=False))
            notes.append(NOTE.search(texts[-1]))
            s = torch_lazymem.stats()
            F.cross_entropy(ref(x), t).backward()
            opt_r.step()
            opt_r.zero_grad()
            assert_state_close(ref, lazy)
    if probes:
        assert notes[0] is not None and "times were probed on one chunk" in texts[0], texts[0]
        assert "probed" not in texts[1]  # priced with real runs
    else:
        assert notes[0] is None, notes[0][0]  # unpriced: nothing measured before the first step
    for priced in notes[0 if probes else 1:2]:
        assert priced is not None
        recompute_s, host_s = seconds(priced[4], priced[5]), seconds(priced[6], priced[7])
        assert priced[1] == ("holding" if host_s < recompute_s else "recomputing"), priced[0]
        if link == "1MB/s":
            assert priced[1] == "recomputing", priced[0]
    priced = notes[1]
    if link == "1MB/s":
        assert priced[1] == "recomputing" and s["values_recomputed"] > 0, priced[0]
        assert s["values_in_host_memory"] == 0 and s["d2h_bytes"] == 0, s
    # The last step reuses the priced plan, or prices again; its values are where the note says.
    if priced[1] == "holding":
        assert s["values_in_host_memory"] > 0, s
