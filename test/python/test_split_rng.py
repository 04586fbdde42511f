"""Random ops under splitting (DESIGN.md §7 RNG). A split random op draws per block of batch rows
from a generator seeded by (one draw of the lazymem generator, block): values differ from the
unsplit run but follow the same distribution, the same rows get the same numbers however the batch is
chunked, and a random op left pending by a split (its output survives, e.g. saved for backward)
draws the same numbers again when it is recomputed — so the loss read before backward and the
gradients backward computes belong to one forward. Unsplit, random ops draw eager's stream exactly
(test_rng.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import torch_lazymem
from torch_lazymem.testing import force_chunks


def dropped(x, p, chunks, seed=0):
    torch.manual_seed(seed)
    with force_chunks(chunks):
        return F.dropout(x.to("lazymem"), p, training=True).cpu()


@pytest.mark.parametrize("features", [1000, 70000])  # blocks of several rows; blocks of one row
def test_the_same_rows_get_the_same_numbers_whatever_the_chunking(features):
    x = torch.ones(16, features)
    a = dropped(x, 0.5, 2)
    assert torch_lazymem.stats()["random_row_keyed"] > 0
    for chunks in (3, 4, 16):  # 3 cuts row blocks: those are drawn whole and sliced
        assert torch.equal(dropped(x, 0.5, chunks), a)
    assert not torch.equal(dropped(x, 0.5, 2, seed=1), a)  # another seed, other numbers


def test_split_dropout_keeps_the_distribution():
    x = torch.ones(512, 512)
    y = dropped(x, 0.3, 4)
    kept = (y != 0).double().mean().item()
    n = y.numel()
    assert abs(kept - 0.7) < 4 * (0.7 * 0.3 / n) ** 0.5, kept
    assert torch.equal(y[y != 0], torch.full_like(y[y != 0], 1 / 0.7))


def test_a_pending_random_op_draws_the_same_numbers_when_recomputed():
    torch.manual_seed(0)
    x = torch.randn(12, 64).to("lazymem")
    w = torch.randn(64, 64, device="lazymem", requires_grad=True)  # created on the device: not a data leaf
    with force_chunks(3):
        h = F.dropout(x @ w, 0.5, training=True)  # survives (h is held): left pending when split
        total = h.sum().item()
        assert torch_lazymem.stats()["nodes_kept_pending"] > 0
        recomputed = h.cpu()  # runs the pending forward again, split into other chunks
        (grad,) = torch.autograd.grad(h.sum(), w)
        grad = grad.cpu()
    torch.testing.assert_close(recomputed.sum().item(), total, rtol=1e-5, atol=1e-4)
    mask = (recomputed != 0).float() * 2.0  # the mask every run used, times 1 / (1 - p)
    torch.testing.assert_close(grad, x.cpu().t() @ mask, rtol=1e-4, atol=1e-4)


def test_the_same_plan_twice_gives_bitwise_equal_results():
    torch.manual_seed(3)
    x = torch.randn(32, 100)
    assert torch.equal(dropped(x, 0.2, 4, seed=7), dropped(x, 0.2, 4, seed=7))


def test_training_with_dropout_reading_the_loss_first():
    """The loss printed before backward and the gradients belong to the same dropout masks."""
    torch.manual_seed(0)
    x = torch.randn(24, 32)
    lin = torch.nn.Linear(32, 16).to("lazymem")
    with force_chunks(4):
        out = F.dropout(lin(x.to("lazymem")), 0.25, training=True)
        loss = out.square().sum()
        value = loss.item()
        loss.backward()
        masks = out.cpu()  # the same forward again
        grad = lin.weight.grad.cpu()
    torch.testing.assert_close(masks.square().sum().item(), value, rtol=1e-5, atol=1e-3)
    scale = (masks != 0).float() / 0.75  # d out / d lin(x): the mask times 1 / (1 - p)
    torch.testing.assert_close(grad, (2 * masks * scale).t() @ x, rtol=1e-4, atol=1e-4)
