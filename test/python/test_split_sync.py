"""Sync points when the program is split (DESIGN.md §7): a value that is needed runs with everything
recorded so far, in one plan; batch-sharded values that survive but are not needed (activations held
for backward) stay pending and are recomputed chunk by chunk when needed, instead of being stored at
full batch; GradScaler's found_inf check between backward and step, and auto-flush, cut a step
without storing them either. explain(), stats() and LAZYMEM_DEBUG describe every split."""

from __future__ import annotations

import copy
import os
import subprocess
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

import torch_lazymem
from torch_lazymem.testing import force_chunks, simulated_device

MiB = 1024 * 1024


def mlp(h=1024):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(128, h), nn.ReLU(), nn.Linear(h, h), nn.ReLU(), nn.Linear(h, 10)).double()


def batch(b=2048, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, 128, generator=g, dtype=torch.float64), torch.randint(0, 10, (b,), generator=g)


def test_reading_the_loss_before_backward_stores_no_activation():
    model = mlp()
    eager = copy.deepcopy(model)
    lazy = copy.deepcopy(model).to("lazymem")
    opt_e, opt_l = torch.optim.SGD(eager.parameters(), lr=0.1), torch.optim.SGD(lazy.parameters(), lr=0.1)
    params = sum(p.numel() * 8 for p in model.parameters())
    cap = params * 2 + 10 * MiB  # one layer's activations at full batch: 16 MiB
    for s in range(2):
        x, y = batch(seed=s)
        loss_e = F.cross_entropy(eager(x), y)
        loss_e.backward()
        opt_e.step()
        opt_e.zero_grad()
        with simulated_device(cap):
            loss = F.cross_entropy(lazy(x.to("lazymem")), y.to("lazymem"))
            value = loss.item()  # split; the activations autograd holds stay pending
            assert torch_lazymem.stats()["nodes_kept_pending"] > 0
            assert torch.lazymem.memory_allocated() < params * 2 + MiB  # parameters, grads: no activation
            loss.backward()
            opt_l.step()
            opt_l.zero_grad()
            torch_lazymem.sync()
            assert torch_lazymem.stats()["peak_bytes"] <= cap
        torch.testing.assert_close(value, loss_e.item())
    for p, q in zip(eager.parameters(), lazy.parameters()):
        torch.testing.assert_close(q.cpu(), p.detach())


def test_the_common_loop_runs_a_step_in_one_materialization():
    lazy = mlp(64).to("lazymem")
    opt = torch.optim.AdamW(lazy.parameters())
    x, y = batch(64)
    torch.lazymem.synchronize()
    torch_lazymem.reset_stats()
    xl, yl = x.to("lazymem"), y.to("lazymem")
    with force_chunks(4):
        loss = F.cross_entropy(lazy(xl), yl)
        loss.backward()
        opt.step()
        opt.zero_grad()
        loss.item()
    stats = torch_lazymem.stats()
    assert stats["materializations"] == 1 and stats["splits"] == 1
    # only the batch's two uploads stay pending (xl and yl are still held): every activation was
    # computed chunk by chunk and freed, none stored
    assert stats["pending_nodes"] == 2 and stats["nodes_kept_pending"] == 2


def test_grad_scaler_found_inf_check_between_backward_and_step():
    model = mlp(64)
    eager = copy.deepcopy(model)
    lazy = copy.deepcopy(model).to("lazymem")
    opt_e, opt_l = torch.optim.SGD(eager.parameters(), lr=0.1), torch.optim.SGD(lazy.parameters(), lr=0.1)
    sc_e, sc_l = torch.amp.GradScaler("cpu", init_scale=2.0**10), torch.amp.GradScaler("lazymem", init_scale=2.0**10)
    for s in range(3):
        x, y = batch(40, seed=s)
        for net, opt, scaler, dev in ((eager, opt_e, sc_e, "cpu"), (lazy, opt_l, sc_l, "lazymem")):
            with force_chunks(3 if dev == "lazymem" else 1):
                loss = F.cross_entropy(net(x.to(dev)), y.to(dev))
                scaler.scale(loss).backward()
                scaler.step(opt)  # reads found_inf: a sync between backward and step
                scaler.update()
                opt.zero_grad()
        assert torch_lazymem.stats()["splits"] >= s + 1
    with force_chunks(3):
        for p, q in zip(eager.parameters(), lazy.parameters()):
            torch.testing.assert_close(q.cpu(), p.detach())
        assert sc_l.get_scale() == sc_e.get_scale()


def test_auto_flush_inside_a_split_step_keeps_batched_values_pending():
    model = mlp(64)
    eager = copy.deepcopy(model)
    lazy = copy.deepcopy(model).to("lazymem")
    x, y = batch(40)
    F.cross_entropy(eager(x), y).backward()
    before = torch_lazymem.stats()["auto_flushes"]
    torch_lazymem.set_flush_threshold(nodes=6)
    try:
        with force_chunks(3):
            loss = F.cross_entropy(lazy(x.to("lazymem")), y.to("lazymem"))  # flushed mid-forward
            loss.backward()
            assert torch_lazymem.stats()["auto_flushes"] > before
            for p, q in zip(eager.parameters(), lazy.parameters()):
                torch.testing.assert_close(q.grad.cpu(), p.grad)
    finally:
        torch_lazymem.set_flush_threshold(nodes=50000)


def test_explain_and_stats_describe_the_split():
    lazy = mlp(64).to("lazymem")
    x, y = batch(40)
    with force_chunks(3):
        loss = F.cross_entropy(lazy(x.to("lazymem")), y.to("lazymem"))
        loss.backward()
        loss.item()
    text = torch_lazymem.explain(print_it=False)
    for part in ("split plan", "split along a batch of 40 rows", "pass over 40 rows in 3 chunks of 14",
                 "chunk-local", "partials accumulated", "then divided by", "predicted peak", "measured peak"):
        assert part in text, (part, text)
    stats = torch_lazymem.stats()
    for key in ("splits", "chunks", "passes", "predicted_peak_bytes", "barriers"):
        assert key in stats
    assert stats["chunks"] == 3 and stats["passes"] == 2  # the targets' total weight, then the step


def parse_bytes(text: str) -> float:
    value, unit = text.split()
    return float(value) * {"bytes": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}[unit]


def test_explain_says_what_bounds_each_loops_chunk():
    """Under a budget, each pass the budget chunks names the node where the fewest rows fit, what is
    held there whatever the chunk size and what a row adds: the chunk fits there, and one chunk fewer
    would not (to the printed figures' rounding)."""
    torch.manual_seed(0)
    xh = torch.randn(2048, 1024, dtype=torch.float64)
    budget = 6 << 20
    with simulated_device("6MiB"):
        y = xh.to("lazymem")
        got = (y * 2).exp().sin().sum().item()
        text = torch_lazymem.explain(print_it=False)
    torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), (xh * 2).exp().sin().sum())
    lines = text.splitlines()
    bounded = [i for i, line in enumerate(lines) if "chunk rows bounded at #" in line]
    assert bounded, text
    for i in bounded:
        head = lines[i - 1]  # the pass's own line
        assert "pass over 2048 rows in " in head, (head, text)
        chunks, chunk = (int(v) for v in head.split(" rows in ")[1].split(",")[0].split(" chunks of "))
        held_text, rest = lines[i].split(": ", 1)[1].split(" held there whatever the chunk size, ")
        held, per_row = parse_bytes(held_text), parse_bytes(rest.split(" more a row")[0])
        assert held < budget and per_row > 0, lines[i]
        assert held + chunk * per_row <= budget * 1.01, (lines[i], head)
        assert chunks > 1 and held + -(-2048 // (chunks - 1)) * per_row > budget * 0.99, (lines[i], head)


def test_debug_mode_prints_the_split_summary():
    code = (
        "import torch, torch_lazymem\n"
        "from torch_lazymem.testing import force_chunks\n"
        "x = torch.randn(8, 4).to('lazymem')\n"
        "with force_chunks(2):\n"
        "    (x * 2).sum().item()\n"
    )
    env = dict(os.environ, LAZYMEM_DEBUG="1")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "[lazymem] split plan" in out.stderr and "split along a batch of 8 rows" in out.stderr
