"""Ops that couple the rows of the batch, split exactly in passes (batch_split_theory.md §3, §5):
softmax and log-softmax over the batch and their backward (a log-sum-exp pass merged by logaddexp,
then the rows), variance / standard deviation over the batch (Chan-merged moments), p-norms over the
batch (merged as (a^p + b^p)^(1/p)), reductions over the batch used in the same step, contrastive
losses (`z @ z.T` gathers one operand; `arange(B)` targets), cat / stack along the batch (a dim of
blocks), slices along the batch (read gathered, whole). Each against eager CPU in float64 at
assert_close defaults, forward and gradients, force_chunks 2, 3 and 8 over a batch of 10 (ragged),
with the number of passes the plan used; and a contrastive step under a simulated device eager
cannot fit."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import torch_lazymem
from torch_lazymem.testing import force_chunks

B = 10


def contrastive(z):
    logits = z @ z.T
    return F.cross_entropy(logits, torch.arange(z.shape[0], device=z.device))


def clip_loss(z):
    a, b = F.normalize(z.sin(), dim=1), F.normalize(z.cos(), dim=1)
    logits = a @ b.T / 0.1
    labels = torch.arange(z.shape[0], device=z.device)
    return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels)) / 2


def simclr(z):
    """NT-Xent over two views concatenated along the batch, self-similarity masked."""
    n = z.shape[0]
    h = F.normalize(torch.cat([z.sin(), z.cos()], 0), dim=1)
    sim = (h @ h.T / 0.5).masked_fill(torch.eye(2 * n, dtype=torch.bool, device=z.device), -1e9)
    labels = torch.cat([torch.arange(n, 2 * n, device=z.device), torch.arange(0, n, device=z.device)])
    return F.cross_entropy(sim, labels)


# name: (fn, fewest passes a split plan needs)
CASES = {
    "softmax_over_batch": (lambda x: x.softmax(0) * x, 2),
    "log_softmax_over_batch": (lambda x: x.log_softmax(0).square(), 2),
    "softmax_over_batch_3d": (lambda x: x.view(B, 2, 3).softmax(0).sin(), 2),
    "center": (lambda x: x - x.mean(0), 2),
    "standardize": (lambda x: (x - x.mean(0)) / x.std(0), 2),
    "var_over_batch": (lambda x: x.var(0), 1),
    "var_unbiased_false_all_dims": (lambda x: x.var(correction=0).expand(3), 1),
    "std_keepdim_dims": (lambda x: x.view(B, 2, 3).std((0, 2), keepdim=True) * 2, 1),
    "var_mean": (lambda x: torch.stack(torch.var_mean(x, 0, correction=2)), 1),
    "std_mean": (lambda x: torch.stack(torch.std_mean(x, 0)), 1),
    "l2_normalize_over_batch": (lambda x: x / x.norm(dim=0), 2),
    "linf_over_batch": (lambda x: x / torch.linalg.vector_norm(x, float("inf"), dim=0), 2),
    "l3_over_all": (lambda x: x / torch.linalg.vector_norm(x, 3, dim=(0, 1), keepdim=True), 2),
    "l1_over_batch": (lambda x: torch.linalg.vector_norm(x, 1, dim=0), 1),
    "contrastive_z_zT": (contrastive, 1),  # z read whole by z.T either way: it is not a batch, arange is
    "clip_symmetric": (clip_loss, 2),
    "simclr_cat_views": (simclr, 2),
    "cat_along_batch": (lambda x: torch.cat([x, x * 2, x.exp()], 0).sin(), 1),
    "stack_along_new_dim": (lambda x: torch.stack([x, x * 2], 0).cos(), 1),
    "slice_of_rows": (lambda x: (x[2:7] * 2).sum(0) + x.sum(0), 1),
    "logsumexp_over_batch": (lambda x: x.logsumexp(0), 1),
    "minus_logsumexp_over_batch": (lambda x: x - x.logsumexp(0, keepdim=True), 2),
}


def run(fn, x, chunks):
    cpu = x.detach().clone().requires_grad_()
    out = fn(cpu)
    (grad,) = torch.autograd.grad(out.sum(), cpu)
    lazy = x.detach().to("lazymem").requires_grad_()
    torch_lazymem.reset_stats()
    with force_chunks(chunks):
        lout = fn(lazy)
        (lgrad,) = torch.autograd.grad(lout.sum(), lazy)
        got = lout.cpu()
        passes = torch_lazymem.stats()["passes"]  # of the plan that ran the forward (and what it could)
        lg = lgrad.cpu()
    return (out.detach(), grad), (got, lg), dict(torch_lazymem.stats(), passes=passes)


@pytest.mark.parametrize("chunks", [2, 3, 8])
@pytest.mark.parametrize("name", list(CASES))
def test_cross_batch_ops_split_exactly(name, chunks):
    fn, passes = CASES[name]
    x = torch.randn(B, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(chunks))
    (out, grad), (got, lgrad), stats = run(fn, x, chunks)
    torch.testing.assert_close(got, out)
    torch.testing.assert_close(lgrad, grad)
    assert stats["splits"] >= 1
    assert stats["passes"] >= passes
    if name not in ("clip_symmetric",):
        assert stats["barriers"] == 0, torch_lazymem.explain(print_it=False)


def test_explain_shows_the_passes_of_a_softmax_over_the_batch():
    x = torch.randn(B, 4, dtype=torch.float64)
    with force_chunks(3):
        y = x.to("lazymem").softmax(0).cpu()
    text = torch_lazymem.explain(print_it=False)
    torch.testing.assert_close(y, x.softmax(0))
    assert text.count("pass over 10 rows") == 2, text


def test_masked_softmax_over_the_batch_keeps_eagers_nan_and_zero():
    x = torch.randn(B, 3, dtype=torch.float64)
    x[:, 0] = float("-inf")  # a column with every row masked: NaN, as eager
    x[2:, 1] = float("-inf")  # rows masked in all but the first chunk
    expected = x.softmax(0)
    with force_chunks(3):
        got = x.to("lazymem").softmax(0).cpu()
    torch.testing.assert_close(got, expected, equal_nan=True)
    assert torch.isnan(got[:, 0]).all()


def test_variance_of_a_single_row_chunk_and_a_large_offset_is_stable():
    # Chan's merge over chunks of one row, values far from zero: a naive sum of squares loses it.
    x = torch.randn(B, 4, dtype=torch.float64) + 1e8
    with force_chunks(B):
        got = x.to("lazymem").var(0).cpu()
    torch.testing.assert_close(got, x.var(0))


def test_a_contrastive_step_fits_a_device_eager_runs_out_of():
    """A linear encoder and the contrastive loss under a capacity eager cannot hold: the similarity
    matrix is computed in row blocks, the embeddings stored whole between passes."""
    from torch_lazymem.testing import memory_cap, simulated_device

    n, d, e = 2048, 256, 64
    torch.manual_seed(0)
    enc = torch.nn.Linear(d, e).double()
    x = torch.randn(n, d, dtype=torch.float64)
    capacity = 24 << 20  # the [n, n] logits alone are 32 MiB in float64
    loss_ref = contrastive(enc(x))
    loss_ref.backward()
    with memory_cap(capacity), pytest.raises(torch.OutOfMemoryError):
        contrastive(enc(x)).backward()
    lazy = torch.nn.Linear(d, e).double()
    lazy.load_state_dict(enc.state_dict())
    lazy.to("lazymem")
    with simulated_device(capacity):
        loss = contrastive(lazy(x.to("lazymem")))
        loss.backward()
        value = loss.item()
        grad = lazy.weight.grad.cpu()
        stats = torch_lazymem.stats()
    torch.testing.assert_close(value, loss_ref.item())
    torch.testing.assert_close(grad, enc.weight.grad)
    assert stats["splits"] >= 1 and stats["peak_bytes"] <= capacity
