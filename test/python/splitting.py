"""Helpers for split-vs-eager tests: train the same model on eager CPU and on lazymem with every
materialization split (torch_lazymem.testing.force_chunks) or under a simulated device, in float64,
and compare losses, parameters, gradients, buffers and optimizer state at assert_close defaults
(split results equal unsplit up to floating-point reassociation; a wrong rule shows at 1e-3)."""

from __future__ import annotations

import contextlib
import copy
from typing import Any, Callable

import pytest
import torch
from conftest import to_lazy

import torch_lazymem
from torch_lazymem.testing import (
    eager_max_memory_allocated,
    force_chunks,
    memory_cap,
    parse_bytes,
    simulated_device,
)

ORDERS = ("step_then_item", "item_first")
B = 10  # the tests' batch: chunks of 2, 3 and 8 leave a ragged last chunk


def batch_of(*shape: int, classes: int) -> Callable[[int], tuple[torch.Tensor, torch.Tensor]]:
    """Per step, a float64 batch of B samples of `shape` and class targets, seeded by the step."""
    def make(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(step)
        return torch.randn(B, *shape, generator=g, dtype=torch.float64), torch.randint(0, classes, (B,), generator=g)
    return make


def ce(model: torch.nn.Module, b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(model(b[0]), b[1])


def assert_state_close(eager: torch.nn.Module, lazy: torch.nn.Module, opt_e=None, opt_l=None) -> None:
    for (name, p), (_, q) in zip(eager.named_parameters(), lazy.named_parameters()):
        torch.testing.assert_close(q.detach().cpu(), p.detach(), msg=lambda m, n=name: f"parameter {n}: {m}")
    for (name, b), (_, c) in zip(eager.named_buffers(), lazy.named_buffers()):
        torch.testing.assert_close(c.cpu(), b, msg=lambda m, n=name: f"buffer {n}: {m}")
    if opt_e is not None:
        for pe, pl in zip(eager.parameters(), lazy.parameters()):
            for key, ve in opt_e.state[pe].items():
                vl = opt_l.state[pl][key]
                if isinstance(ve, torch.Tensor):
                    torch.testing.assert_close(vl.cpu(), ve, msg=lambda m, k=key: f"optimizer state {k}: {m}")


def train_split(
    make_model: Callable[[], torch.nn.Module],
    make_batch: Callable[[int], Any],
    loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor],
    chunks: int | None = None,
    steps: int = 5,
    order: str = "step_then_item",
    make_opt: Callable[[Any], torch.optim.Optimizer] = lambda p: torch.optim.AdamW(p, lr=1e-2),
    context: Callable[[], Any] = contextlib.nullcontext,
) -> dict[str, int]:
    """Trains float64 twins: eager unsplit and lazymem split. Returns lazymem's stats."""
    torch.manual_seed(0)
    eager = make_model().double()
    lazy = copy.deepcopy(eager).to("lazymem")
    opt_e, opt_l = make_opt(eager.parameters()), make_opt(lazy.parameters())
    torch.lazymem.synchronize()
    torch_lazymem.reset_stats()
    def split():
        return force_chunks(chunks) if chunks else contextlib.nullcontext()

    for step in range(steps):
        batch = make_batch(step)
        loss_e = loss_fn(eager, batch)
        loss_e.backward()
        opt_e.step()
        opt_e.zero_grad()
        with split(), context():
            lb = to_lazy(batch)
            if order == "item_first":
                loss = loss_fn(lazy, lb)
                value = loss.item()
                loss.backward()
                opt_l.step()
                opt_l.zero_grad()
            else:
                loss = loss_fn(lazy, lb)
                loss.backward()
                opt_l.step()
                opt_l.zero_grad()
                value = loss.item()
        # (transformers computes its LM loss in float32 whatever the model's dtype: eager's dtype decides)
        torch.testing.assert_close(torch.tensor(value, dtype=loss_e.dtype), loss_e.detach(),
                                   msg=lambda m, s=step: f"loss at step {s}: {m}")
    with split(), context():
        assert_state_close(eager, lazy, opt_e, opt_l)
    return torch_lazymem.stats()


def sgd_step_where_eager_runs_out(
    model: torch.nn.Module, x: torch.Tensor, t: torch.Tensor, cap: str,
    context: Callable[[], Any] = contextlib.nullcontext,
) -> tuple[dict[str, int], str]:
    """Checks that eager runs out of memory under `cap` for a cross-entropy step of `model`, then takes
    one SGD step on lazymem under a simulated device of `cap` (inside `context`): peak within the
    capacity, parameters and buffers equal to an uncapped eager step. Returns lazymem's stats and
    explain() text."""
    with memory_cap(cap), pytest.raises(torch.OutOfMemoryError):
        ce(copy.deepcopy(model), (x, t)).backward()
    ref = copy.deepcopy(model)
    opt_r = torch.optim.SGD(ref.parameters(), lr=0.1)
    ce(ref, (x, t)).backward()
    opt_r.step()
    with context(), simulated_device(cap):
        lazy = copy.deepcopy(model).to("lazymem")
        opt = torch.optim.SGD(lazy.parameters(), lr=0.1)
        torch_lazymem.reset_stats()
        loss = ce(lazy, (x.to("lazymem"), t.to("lazymem")))
        loss.backward()
        opt.step()
        loss.item()
        stats, text = torch_lazymem.stats(), torch_lazymem.explain(print_it=False)
        assert stats["peak_bytes"] <= parse_bytes(cap)
        assert_state_close(ref, lazy)
    return stats, text


def check_steps(steps_fn: Callable[[str], list], fraction: float = 0.25,
                cap_of: Callable[[int], int] | None = None, min_splits: int = 1) -> str:
    """`steps_fn(dev)` (a list of its losses, parameters and buffers, "cpu" or "lazymem") under a cap of
    `fraction` of its eager peak (or `cap_of(peak)`): eager runs out of memory under it; lazymem, on a
    simulated device of that capacity, splits (at least `min_splits` split plans) within it, with
    eager's results at assert_close defaults. Returns explain()."""
    with memory_cap(1 << 45):
        expected = steps_fn("cpu")
        peak = eager_max_memory_allocated()
    cap = cap_of(peak) if cap_of else int(peak * fraction)
    with memory_cap(cap), pytest.raises(torch.OutOfMemoryError):
        steps_fn("cpu")
    torch.lazymem.synchronize()
    torch_lazymem.reset_stats()
    with simulated_device(cap):
        torch.lazymem.reset_peak_memory_stats()
        got = steps_fn("lazymem")
        lazy_peak = torch.lazymem.max_memory_allocated()
    text = torch_lazymem.explain(print_it=False)
    assert lazy_peak <= cap, (lazy_peak, cap, text)
    assert torch_lazymem.stats()["splits"] >= min_splits, text
    assert len(got) == len(expected)
    for k, (g, e) in enumerate(zip(got, expected)):
        torch.testing.assert_close(g, e, msg=lambda m, k=k: f"value {k} (0: the losses): {m}")
    return text
