"""Optimizers, gradient clipping and LR schedulers on lazymem equal eager CPU bitwise."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from training import train_twins

optim = torch.optim


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


def batch(step: int):
    g = torch.Generator().manual_seed(step)
    return torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)


def mse(model, b):
    return nn.functional.mse_loss(model(b[0]), b[1])


@pytest.mark.parametrize(
    "make_opt",
    [
        lambda p: optim.SGD(p, lr=0.1),
        lambda p: optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01),
        lambda p: optim.SGD(p, lr=0.1, momentum=0.9, foreach=False),
        lambda p: optim.Adam(p, lr=0.01),
        lambda p: optim.Adam(p, lr=0.01, foreach=False, amsgrad=True),
        lambda p: optim.AdamW(p, lr=0.01, weight_decay=0.1),
        lambda p: optim.AdamW(p, lr=0.01, foreach=False),
        lambda p: optim.RMSprop(p, lr=0.01, momentum=0.5, centered=True),
        lambda p: optim.RMSprop(p, lr=0.01, foreach=False),
        lambda p: optim.Adagrad(p, lr=0.05),
        lambda p: optim.Adagrad(p, lr=0.05, foreach=False),
    ],
    ids=["sgd", "sgd-nesterov-wd", "sgd-forloop", "adam", "adam-forloop-amsgrad", "adamw", "adamw-forloop",
         "rmsprop-centered", "rmsprop-forloop", "adagrad", "adagrad-forloop"],
)
def test_optimizers(make_opt):
    eager, lazy = train_twins(mlp, batch, mse, make_opt=make_opt, steps=4)


def test_optimizer_state_lives_on_lazymem():
    m = mlp().to("lazymem")
    opt = optim.Adam(m.parameters(), lr=0.01)
    mse(m, [t.to("lazymem") for t in batch(0)]).backward()
    opt.step()
    state = opt.state[m[0].weight]
    assert state["exp_avg"].device.type == "lazymem" and state["exp_avg_sq"].device.type == "lazymem"


def test_clip_grad_norm_and_schedulers():
    def make_opt(p):
        return optim.SGD(p, lr=0.2, momentum=0.5)

    eager, lazy = train_twins(mlp, batch, mse, make_opt=make_opt, steps=3, clip=0.05)
    # schedulers only touch Python floats; the twins see the same learning rates
    for lr_model in (eager, lazy):
        opt = make_opt(lr_model.parameters())
        sched = optim.lr_scheduler.OneCycleLR(opt, max_lr=0.5, total_steps=4)
        for _ in range(3):
            opt.step()
            sched.step()
    norm = torch.nn.utils.clip_grad_norm_(lazy.parameters(), 1.0)
    assert norm.device.type == "lazymem"


@pytest.mark.parametrize("set_to_none", [True, False])
def test_zero_grad(set_to_none):
    m = mlp().to("lazymem")
    opt = optim.SGD(m.parameters(), lr=0.1)
    mse(m, [t.to("lazymem") for t in batch(0)]).backward()
    opt.zero_grad(set_to_none=set_to_none)
    for p in m.parameters():
        if set_to_none:
            assert p.grad is None
        else:
            assert p.grad.device.type == "lazymem" and not p.grad.cpu().any()
