"""Plans reused across steps (plan/reuse.h): a training loop's later steps, whose programs have the
structure of an earlier one, get the stored plan instantiated on their own buffers and nodes — no
planning, no meta probes — and run exactly the kernels a fresh plan would (bitwise equal results).
A program that differs in anything the planner reads (a shape, the budget, a value that must
survive, the workspace the memory model has learned) is planned anew."""

from __future__ import annotations

import contextlib
import copy
import gc
import os
import subprocess
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import torch_lazymem
from torch_lazymem.testing import force_chunks, no_plan_reuse, simulated_device


def bn_mlp():
    return nn.Sequential(nn.Linear(12, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 5))


def train(model, steps, rows=10, chunks=3, reuse=True, cap=None):
    """Trains a lazymem copy of `model` (float64) split into `chunks`; returns losses, parameters,
    buffers and per-step stats."""
    lazy = copy.deepcopy(model).double().to("lazymem")
    opt = torch.optim.AdamW(lazy.parameters(), lr=1e-2)
    torch.lazymem.synchronize()
    losses, per_step = [], []
    ctx = no_plan_reuse() if not reuse else contextlib.nullcontext()
    with ctx, (force_chunks(chunks) if chunks else simulated_device(cap)):
        for step in range(steps):
            g = torch.Generator().manual_seed(step)
            r = rows[step] if isinstance(rows, list) else rows
            x = torch.randn(r, 12, generator=g, dtype=torch.float64)
            y = torch.randint(0, 5, (r,), generator=g)
            torch_lazymem.reset_stats()
            loss = F.cross_entropy(lazy(x.to("lazymem")), y.to("lazymem"))
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
            per_step.append(torch_lazymem.stats())
    return losses, [p.detach().cpu() for p in lazy.parameters()], [b.cpu() for b in lazy.buffers()], per_step


def test_later_steps_reuse_the_plan_and_run_the_same_kernels():
    torch.manual_seed(0)
    model = bn_mlp()
    losses, params, bufs, stats = train(model, 8)
    losses0, params0, bufs0, stats0 = train(model, 8, reuse=False)
    assert losses == losses0  # bitwise: the same plan runs the same kernels on the same chunks
    for a, b in zip(params + bufs, params0 + bufs0):
        assert torch.equal(a, b)
    assert all(s["splits"] >= 1 for s in stats)
    # once the workspace model has settled (it learns over the first steps) steps reuse; how many
    # steps it takes to settle depends on where the machine's kernels allocate
    assert sum(s["plans_reused"] for s in stats[-4:]) >= 2, [s["plans_reused"] for s in stats]
    assert all(s["plans_reused"] == 0 for s in stats0)


def tape_loop(model, steps, reuse=True):
    """A training loop whose input stays named across `loss.item()`: the split keeps its batch-sharded
    value pending, and the next step is recorded behind it (no synchronize in between)."""
    lazy = copy.deepcopy(model).double().to("lazymem")
    opt = torch.optim.SGD(lazy.parameters(), lr=0.1)
    torch.lazymem.synchronize()
    losses, per_step = [], []
    with force_chunks(3), (contextlib.nullcontext() if reuse else no_plan_reuse()):
        for step in range(steps):
            g = torch.Generator().manual_seed(step)
            x = torch.randn(10, 12, generator=g, dtype=torch.float64).to("lazymem")
            y = torch.randint(0, 5, (10,), generator=g).to("lazymem")
            torch_lazymem.reset_stats()
            loss = F.cross_entropy(lazy(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
            per_step.append(torch_lazymem.stats())
    torch.lazymem.synchronize()
    return losses, [p.detach().cpu() for p in lazy.parameters()], per_step


def test_steps_are_fingerprinted_from_the_tape_recorded_with_them():
    # Each materialization's fingerprint is read from the tape the program kept as it was recorded,
    # also when a split left nodes pending in front of the next step's (the tape is renumbered when
    # they are put back). The suite runs with LAZYMEM_CHECK_TAPE=1 (conftest): every plan also
    # builds the tape from the nodes and raises an internal error if the two differ.
    assert os.environ.get("LAZYMEM_CHECK_TAPE") == "1"
    torch.manual_seed(0)
    model = bn_mlp()
    losses, params, stats = tape_loop(model, 6)
    assert all(s["fingerprints_from_tape"] >= 1 for s in stats), [s["fingerprints_from_tape"] for s in stats]
    assert all(s["nodes_kept_pending"] > 0 for s in stats), [s["nodes_kept_pending"] for s in stats]
    assert sum(s["plans_reused"] for s in stats[1:]) >= 2, [s["plans_reused"] for s in stats]
    losses0, params0, stats0 = tape_loop(model, 6, reuse=False)
    assert all(s["plans_reused"] == 0 for s in stats0)
    assert losses == losses0  # bitwise: the same plan
    for a, b in zip(params, params0):
        assert torch.equal(a, b)


def test_reused_plans_hold_no_buffer_once_the_step_is_over():
    # A plan handed back after it ran keeps its synthesized nodes (batch norm's passes) for the next
    # step, without their buffers: once the model and its data are gone, every buffer is freed.
    torch.manual_seed(0)
    torch.lazymem.synchronize()  # (whatever an earlier test left pending)
    gc.collect()
    base = torch.lazymem.memory_allocated()
    buffers = torch_lazymem._C._buffers_alive()
    _, params, bufs, stats = train(bn_mlp(), 6)
    assert sum(s["plans_reused"] for s in stats) >= 2
    del params, bufs, stats
    gc.collect()
    torch.lazymem.synchronize()
    assert torch.lazymem.memory_allocated() == base
    assert torch_lazymem._C._buffers_alive() == buffers


def test_a_new_shape_is_planned_anew_and_an_old_one_reused_again():
    torch.manual_seed(0)
    rows = [10] * 5 + [12] * 5 + [10] * 4
    _, _, _, stats = train(bn_mlp(), len(rows), rows=rows)
    reused = [s["plans_reused"] > 0 for s in stats]
    assert not reused[5]  # the first batch of 12 rows
    assert reused[4] and reused[9] and reused[13], reused


def test_the_explanation_says_the_plan_was_reused():
    torch.manual_seed(0)
    train(bn_mlp(), 4)
    assert "reused" in torch_lazymem.explain(print_it=False)


def test_the_budget_is_part_of_the_structure():
    torch.manual_seed(0)
    _, _, _, small = train(bn_mlp(), 3, chunks=0, cap=64 << 10, rows=256)
    assert small[-1]["splits"] >= 1
    _, _, _, large = train(bn_mlp(), 3, chunks=0, cap=64 << 20, rows=256)
    assert large[-1]["splits"] == 0  # fits: not the small budget's split plan


@pytest.mark.parametrize("env", ["0", "1"])
def test_the_cache_can_be_switched_off(env):
    code = ("import torch, torch_lazymem, torch.nn as nn\n"
            "m = nn.Linear(4, 2).to('lazymem')\n"
            "for s in range(4):\n"
            "    torch_lazymem.reset_stats(); m(torch.randn(8, 4).to('lazymem')).sum().item()\n"
            "print(torch_lazymem.stats()['plans_reused'])\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "LAZYMEM_PLAN_CACHE": env})
    assert out.stdout.strip() == ("0" if env == "0" else "1")


def test_results_kept_across_steps_do_not_stop_an_unsplit_plan_from_being_reused():
    """Memory held before a program (here: every earlier step's result, kept in a list) is not part of
    an unsplit plan's structure: the plan is reused while it fits, its peak shifted by what is held.
    A split plan is reused only under the same held memory (its chunks were chosen for it)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8))
    lazy = copy.deepcopy(model).to("lazymem")
    xs = [torch.randn(4, 16) for _ in range(6)]
    kept, reused, peaks = [], [], []
    for x in xs:
        torch_lazymem.reset_stats()
        kept.append(lazy(x.to("lazymem")))
        torch_lazymem.sync()
        reused.append(torch_lazymem.stats()["plans_reused"])
        peaks.append(torch_lazymem.stats()["predicted_peak_bytes"])
    assert reused[2:] == [1] * 4, reused
    assert all(b > a for a, b in zip(peaks[2:], peaks[3:])), peaks  # each kept result adds to it
    for x, y in zip(xs, kept):
        assert torch.equal(y.cpu(), model(x))


def test_a_reused_plan_shifted_by_kept_results_still_keeps_the_budget_and_splits_when_it_must():
    """The kept results grow the memory held until the stored unsplit plan no longer fits: it is not
    reused then, and the step splits (37 rows: every chunking has a ragged last chunk). Each step
    within the cap, every kept result equal to eager (float64)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64)).double()
    lazy = copy.deepcopy(model).to("lazymem")
    xs = [torch.randn(37, 64, dtype=torch.float64) for _ in range(40)]
    kept, reused, split = [], [], []
    with simulated_device(1200 << 10):
        for x in xs:
            torch_lazymem.reset_stats()
            torch.lazymem.reset_peak_memory_stats()
            kept.append(lazy(x.to("lazymem")))
            torch_lazymem.sync()
            s = torch_lazymem.stats()
            reused.append(s["plans_reused"])
            split.append(s["chunks"])
            assert torch.lazymem.max_memory_allocated() <= 1200 << 10
            if s["splits"] and len(split) > 3 and all(split[-3:]):
                break
    first_split = next(i for i, c in enumerate(split) if c)
    assert sum(reused[:first_split]) >= 2, (reused, split)  # reused under growing held memory first
    assert all(1 < c < 37 for c in split[first_split:]), split  # several chunks of a prime batch: ragged
    for x, y in zip(xs, kept):
        torch.testing.assert_close(y.cpu(), model(x))


def test_a_step_size_that_changes_every_step_does_not_stop_reuse():
    # AdamW's bias corrections give its div_.Scalar a new float scalar every step (a scheduler's
    # learning rate does the same). The workspace model keyed its observations on that value, so each
    # step learned a "new" key, moved the workspace generation (part of the plan's fingerprint) and
    # planned anew: this loop reused no plan in ten steps, the bench_split MLP never did either.
    def run(reuse):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))
        losses, reused = [], []
        with (contextlib.nullcontext() if reuse else no_plan_reuse()), simulated_device(2_000_000):
            lazy = copy.deepcopy(model).to("lazymem")
            opt = torch.optim.AdamW(lazy.parameters(), lr=1e-2)
            sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.9)
            torch.lazymem.synchronize()
            for step in range(10):
                g = torch.Generator().manual_seed(step)
                x, y = torch.randn(1024, 64, generator=g), torch.randint(0, 10, (1024,), generator=g)
                torch_lazymem.reset_stats()
                loss = F.cross_entropy(lazy(x.to("lazymem")), y.to("lazymem"))
                loss.backward()
                opt.step()
                opt.zero_grad()
                sched.step()
                losses.append(loss.item())
                st = torch_lazymem.stats()
                assert st["splits"] >= 1  # (a split plan: the case the workspace model is consulted in)
                reused.append(st["plans_reused"])
        return losses, reused

    losses, reused = run(True)
    assert all(r >= 1 for r in reused[-5:]), reused
    losses0, _ = run(False)
    assert losses == losses0  # the reused plan runs the same kernels on the same chunks
