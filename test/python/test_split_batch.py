"""The batch is solved for, never matched by size (DESIGN.md §7): sources are tensors copied to
lazymem that are neither module state nor values that require grad (dim 0 a hint), values an earlier
plan stored with a batch fact, and tensors marked with torch_lazymem.mark_batch(t, dim) (a hard
constraint; mark_batch(t, None) excludes). A batch size equal to the hidden size or the sequence
length changes nothing. Sources of different sizes that each drive batch-sharded work are separate
batches, each split in its own loops; a source whose batch would only conflict (class weights) ends
unsharded, and explain() says so."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import torch_lazymem
from torch_lazymem.testing import force_chunks


def split_run(fn, *lazy):
    torch_lazymem.reset_stats()
    with force_chunks(3):
        out = fn(*lazy).cpu()
    return out, torch_lazymem.stats(), torch_lazymem.explain(print_it=False)


def test_batch_equal_to_hidden_size_and_sequence_length():
    torch.manual_seed(0)
    n = 12  # batch = sequence length = hidden size = heads * head dim
    x = torch.randn(n, n, n, dtype=torch.float64)
    attn = nn.MultiheadAttention(n, 3, batch_first=True).double()
    expected = attn(x, x, x)[0]
    lazy_attn = attn.to("lazymem")
    out, stats, text = split_run(lambda t: lazy_attn(t, t, t)[0], x.to("lazymem"))
    torch.testing.assert_close(out, expected.detach())
    assert stats["splits"] == 1 and stats["barriers"] == 0
    assert "split along a batch of 12 rows" in text


def test_tensors_created_on_the_device_are_not_data_unless_marked():
    x = torch.randn(10, 4, device="lazymem")
    out, stats, text = split_run(lambda t: (t * 2).sum(1), x)
    assert stats["splits"] == 0 and "no data leaf" in text
    torch_lazymem.mark_batch(x, 0)
    out2, stats, _ = split_run(lambda t: (t * 2).sum(1), x)
    assert stats["splits"] == 1
    torch.testing.assert_close(out2, out)


def test_mark_batch_along_another_dim():
    x = torch.randn(7, 10, 4, dtype=torch.float64)  # (time, batch, features)
    w = torch.randn(4, dtype=torch.float64)
    lx, lw = x.to("lazymem"), w.to("lazymem")
    torch_lazymem.mark_batch(lx, 1)
    torch_lazymem.mark_batch(lw, None)
    def fn(a, b):
        return (a * b).tanh().sum(0) + a.transpose(0, 1).mean(1)  # the batch at dim 1, then dim 0
    out, stats, text = split_run(fn, lx, lw)
    torch.testing.assert_close(out, fn(x, w))
    assert stats["splits"] == 1 and stats["barriers"] == 0 and "split along a batch of 10 rows" in text


def test_sources_of_different_sizes_are_separate_batches():
    x, z = torch.randn(10, 4), torch.randn(6, 4)
    out, stats, text = split_run(lambda a, b: a.exp().sum() + b.exp().sum(), x.to("lazymem"), z.to("lazymem"))
    torch.testing.assert_close(out, x.exp().sum() + z.exp().sum())
    assert stats["splits"] == 1 and stats["barriers"] == 0
    assert "split along 2 batches" in text and "10 rows" in text and "6 rows" in text, text
    # marking one of them as not data leaves one batch
    lz = z.to("lazymem")
    torch_lazymem.mark_batch(lz, None)
    _, stats, text = split_run(lambda a, b: a.exp().sum() + b.exp().sum(), x.to("lazymem"), lz)
    assert stats["splits"] == 1 and "split along a batch of 10 rows" in text


def test_a_leaf_that_only_feeds_replicated_operands_does_not_conflict():
    torch.manual_seed(1)
    x, t = torch.randn(10, 5, dtype=torch.float64), torch.randint(0, 5, (10,))
    w = torch.rand(5, dtype=torch.float64) + 0.5  # class weights: 5 rows, only ever an NLL weight
    out, stats, _ = split_run(lambda a, b, c: F.cross_entropy(a, b, weight=c), x.to("lazymem"), t.to("lazymem"),
                              w.to("lazymem"))
    torch.testing.assert_close(out, F.cross_entropy(x, t, weight=w))
    assert stats["splits"] == 1 and stats["barriers"] == 0


def test_module_state_is_not_data():
    torch.manual_seed(2)
    # BatchNorm in eval mode: its running statistics have 10 entries, like the batch
    model = nn.Sequential(nn.Linear(4, 10), nn.BatchNorm1d(10), nn.Linear(10, 10)).double().eval()
    x = torch.randn(10, 4, dtype=torch.float64)
    expected = model(x)
    lazy = model.to("lazymem")
    lazy.load_state_dict({k: v.cpu() for k, v in lazy.state_dict().items()})  # uploads of module state
    out, stats, text = split_run(lambda a: lazy(a), x.to("lazymem"))
    torch.testing.assert_close(out, expected.detach())
    assert stats["splits"] == 1 and stats["batch_conflicts"] == 0 and stats["barriers"] == 0


def test_a_value_that_requires_grad_when_uploaded_is_not_data():
    y = torch.randn(10, 4, dtype=torch.float64, requires_grad=True)
    _, stats, text = split_run(lambda a: a * 2, y.to("lazymem"))
    assert stats["splits"] == 0 and "no data leaf" in text


def test_mark_batch_errors():
    with pytest.raises(TypeError, match="lazymem: mark_batch expects a lazymem tensor"):
        torch_lazymem.mark_batch(torch.ones(3), 0)
    t = torch.ones(4, 1, device="lazymem")
    with pytest.raises(ValueError, match="lazymem: mark_batch: dim 5 is out of range"):
        torch_lazymem.mark_batch(t, 5)
    with pytest.raises(ValueError, match="has size 1"):
        torch_lazymem.mark_batch(t, 1)
    with pytest.raises(ValueError, match="does not cover its storage"):
        torch_lazymem.mark_batch(torch.ones(6, 4, device="lazymem")[:3], 0)


@pytest.mark.parametrize("act", [
    lambda t: F.leaky_relu(t, 0.2), F.hardtanh, F.elu, F.softplus, F.hardswish, F.mish, F.hardsigmoid,
    F.softshrink, F.hardshrink, lambda t: F.rrelu(t, training=False), lambda t: F.hardswish(t.clone(), inplace=True),
], ids=["leaky_relu", "hardtanh", "elu", "softplus", "hardswish", "mish", "hardsigmoid", "softshrink", "hardshrink",
        "rrelu_eval", "hardswish_"])
def test_activations_without_the_pointwise_tag_split_with_their_gradients(act):
    """Activations and gradients ATen does not tag pointwise (leaky_relu_backward, hardswish, ...) split
    along the batch (7 rows in 3 chunks, the last ragged) with no barrier; eager's values and gradients."""
    torch.manual_seed(0)
    x, w = torch.randn(7, 5, dtype=torch.float64) * 3, torch.randn(7, 5, dtype=torch.float64)

    def run(t, weight):
        t = t.requires_grad_()
        out = act(t * 1.0)
        (out * weight).sum().backward()
        return out.detach().cpu(), t.grad.cpu()

    want = run(x.clone(), w)
    torch_lazymem.reset_stats()
    with force_chunks(3):
        got = run(x.to("lazymem"), w.to("lazymem"))
    stats, text = torch_lazymem.stats(), torch_lazymem.explain(print_it=False)
    # (rrelu's forward in eval mode is a barrier of its own: README's barrier table; its gradient splits)
    barriers = [line for line in text.splitlines() if "barrier:" in line and "rrelu_with_noise " not in line]
    assert stats["splits"] >= 1 and not barriers, text
    for g, e in zip(got, want):
        torch.testing.assert_close(g, e)
