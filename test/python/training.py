"""Helpers for training-equivalence tests: run the same model on eager CPU and on lazymem and
compare every loss, gradient and parameter bitwise."""

from __future__ import annotations

import copy
from typing import Any, Callable

import torch
from conftest import to_lazy  # test_train_models imports it from here too


def train_twins(
    make_model: Callable[[], torch.nn.Module],
    make_batch: Callable[[int], Any],
    loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor],
    make_opt: Callable[[Any], torch.optim.Optimizer] = lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
    steps: int = 5,
    clip: float | None = None,
) -> tuple[torch.nn.Module, torch.nn.Module]:
    """Trains twin models; asserts every loss, every parameter and every buffer equal after each step."""
    torch.manual_seed(0)
    eager = make_model()
    lazy = copy.deepcopy(eager).to("lazymem")
    opt_e, opt_l = make_opt(eager.parameters()), make_opt(lazy.parameters())
    for step in range(steps):
        batch = make_batch(step)
        losses = []
        for model, opt, b in ((eager, opt_e, batch), (lazy, opt_l, to_lazy(batch))):
            torch.manual_seed(100 + step)  # same dropout masks on both
            opt.zero_grad()
            loss = loss_fn(model, b)
            loss.backward()
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            opt.step()
            losses.append(loss)
        assert losses[1].device.type == "lazymem"
        assert losses[0].item() == losses[1].item(), (step, losses[0].item(), losses[1].item())
        assert_same_state(eager, lazy)
    return eager, lazy


def assert_same_state(eager: torch.nn.Module, lazy: torch.nn.Module) -> None:
    for (name, p), (_, q) in zip(eager.named_parameters(), lazy.named_parameters()):
        assert q.device.type == "lazymem", name
        assert torch.equal(p.detach(), q.detach().cpu()), f"parameter {name} differs"
        if p.grad is not None:
            assert torch.equal(p.grad, q.grad.cpu()), f"gradient of {name} differs"
    for (name, b), (_, c) in zip(eager.named_buffers(), lazy.named_buffers()):
        assert torch.equal(b, c.cpu()), f"buffer {name} differs"
