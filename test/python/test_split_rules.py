"""Placement rules. The fuzzer (torch_lazymem.testing.split_fuzz) runs op_db samples with dim 0 of
their tensors as the batch, split into 3 chunks, in float64, forward and backward, against eager CPU
at assert_close defaults: the CI subset here, every op in tools/split_fuzz.py. Then the exact
combines the fuzzer's random samples rarely reach: losses with ignored targets, class weights and
label smoothing (a chunk whose targets are all ignored; all targets ignored is NaN as in eager), mean
losses over a ragged last chunk, reductions over the batch, weight gradients as partial sums, index
ops with batched indices, factories that carry the batch, barriers that run whole."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import torch_lazymem
from torch_lazymem.testing import force_chunks, opinfo, split_fuzz

STRIDE = 6
IMPORTANT = ["add", "mul", "div.no_rounding_mode", "where", "masked_fill", "sum", "mean", "amax", "amin", "mm", "bmm",
             "addmm", "baddbmm", "matmul", "einsum", "softmax", "log_softmax", "cumsum", "sort", "topk", "cat",
             "stack", "index_select", "gather", "scatter_add", "take", "nn.functional.linear",
             "nn.functional.conv2d", "nn.functional.layer_norm", "nn.functional.group_norm",
             "nn.functional.embedding", "nn.functional.cross_entropy", "nn.functional.nll_loss",
             "nn.functional.mse_loss", "nn.functional.l1_loss", "nn.functional.smooth_l1_loss",
             "nn.functional.binary_cross_entropy", "nn.functional.binary_cross_entropy_with_logits",
             "nn.functional.kl_div", "nn.functional.scaled_dot_product_attention", "nn.functional.max_pool2d",
             "nn.functional.dropout", "nn.functional.gelu", "nn.functional.silu", "nn.functional.pad.constant",
             "nn.functional.interpolate.nearest", "tril", "repeat", "flip", "roll", "var", "std", "any", "all",
             "linalg.vector_norm", "native_batch_norm",
             # Random ops: split, they draw eager's numbers (compared in full, issue 27).
             "bernoulli", "normal", "normal.number_mean", "uniform", "multinomial", "rand_like", "randn_like",
             "randint_like", "nn.functional.alpha_dropout", "nn.functional.dropout2d", "nn.functional.rrelu"]


def _subset():
    names = sorted(opinfo.ops_by_name())
    known = set(names)
    return sorted(set(names[::STRIDE]) | {n for n in IMPORTANT if n in known})


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("mode", ["forward", "backward"])
@pytest.mark.parametrize("name", _subset())
def test_rule_fuzzer(name, mode):
    outcomes = list(split_fuzz.seeded(opinfo.find_op(name), max_samples=6, mode=mode))
    bad = [o for o in outcomes if o.status in (opinfo.MISMATCH, opinfo.ERROR)]
    assert not bad, "\n".join(f"sample {o.index} ({o.variant}): {o.status}: {o.detail.splitlines()[0]}" for o in bad)


def test_the_fuzzer_splits_most_samples_of_the_core_ops():
    split = total = 0
    for name in ["add", "mul", "sum", "mm", "nn.functional.linear", "nn.functional.cross_entropy", "softmax"]:
        for o in split_fuzz.seeded(opinfo.find_op(name), max_samples=6):
            if o.status == opinfo.PASS:
                total += 1
                split += o.split
    assert split >= total // 2, (split, total)


def split_and_eager(fn, *tensors, chunks=3, grad=(0,)):
    """fn's output and the gradients of its sum w.r.t. the tensors at positions `grad` (the first:
    the batch input), split on lazymem and on eager CPU (float64)."""
    cpu = [(t.double() if t.is_floating_point() else t).detach().requires_grad_(i in grad and t.is_floating_point())
           for i, t in enumerate(tensors)]
    out = fn(*cpu)
    differentiable = out.requires_grad
    grads = torch.autograd.grad(out.sum(), [t for t in cpu if t.requires_grad]) if differentiable else []
    lazy = [t.detach().to("lazymem").requires_grad_(t.requires_grad) for t in cpu]
    torch_lazymem.reset_stats()
    with force_chunks(chunks):
        lout = fn(*lazy)
        lgrads = torch.autograd.grad(lout.sum(), [t for t in lazy if t.requires_grad]) if differentiable else []
        got = lout.cpu(), [g.cpu() for g in lgrads]
    return (out.detach(), list(grads)), got, torch_lazymem.stats()


def assert_same(expected, got, nan=False):
    torch.testing.assert_close(got[0], expected[0], equal_nan=nan)
    for g, e in zip(got[1], expected[1]):
        if e is not None:
            torch.testing.assert_close(g, e, equal_nan=nan)


B = 10


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("kind", ["plain", "ignore_index", "weights", "label_smoothing", "weights_and_ignore"])
def test_cross_entropy_is_exact(kind, reduction):
    torch.manual_seed(0)
    x = torch.randn(B, 5)
    t = torch.randint(0, 5, (B,))
    w = torch.rand(5, dtype=torch.float64) + 0.5
    kwargs = {}
    if "ignore" in kind:
        t[:4] = -100  # the first chunk's targets are all ignored
    if kind == "label_smoothing":
        kwargs["label_smoothing"] = 0.1
    weighted = "weights" in kind
    expected, got, stats = split_and_eager(
        lambda a, b, c: F.cross_entropy(a, b, weight=c if weighted else None, reduction=reduction, **kwargs), x, t, w)
    assert_same(expected, got)
    assert stats["splits"] >= 1 and stats["barriers"] == 0


def test_cross_entropy_with_every_target_ignored_is_nan_as_in_eager():
    x = torch.randn(B, 5)
    t = torch.full((B,), -100)
    expected, got, _ = split_and_eager(lambda a, b: F.cross_entropy(a, b), x, t)
    assert torch.isnan(expected[0]) and torch.isnan(got[0])
    assert_same(expected, got, nan=True)


@pytest.mark.parametrize("loss", ["mse", "l1", "smooth_l1", "huber", "bce", "bce_with_logits", "kl_div_batchmean",
                                  "soft_margin"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_losses_are_exact_over_a_ragged_last_chunk(loss, reduction):
    torch.manual_seed(1)
    x = torch.randn(B, 4)
    y = torch.rand(B, 4)
    fns = {
        "mse": lambda a, b: F.mse_loss(a, b, reduction=reduction),
        "l1": lambda a, b: F.l1_loss(a, b, reduction=reduction),
        "smooth_l1": lambda a, b: F.smooth_l1_loss(a, b, reduction=reduction, beta=0.5),
        "huber": lambda a, b: F.huber_loss(a, b, reduction=reduction, delta=0.7),
        "bce": lambda a, b: F.binary_cross_entropy(a.sigmoid(), b, reduction=reduction),
        "bce_with_logits": lambda a, b: F.binary_cross_entropy_with_logits(
            a, b, reduction=reduction, pos_weight=torch.full((4,), 2.0, dtype=a.dtype, device=a.device)),
        "kl_div_batchmean": lambda a, b: F.kl_div(a.log_softmax(-1), b.softmax(-1),
                                                  reduction="batchmean" if reduction == "mean" else reduction),
        "soft_margin": lambda a, b: F.soft_margin_loss(a, b * 2 - 1, reduction=reduction),
    }
    expected, got, stats = split_and_eager(fns[loss], x, y, chunks=3)  # chunks of 4, 4, 2
    assert_same(expected, got)
    # soft_margin_loss reuses its per-element output to hold the reduced value: that write runs whole
    assert stats["splits"] >= 1 and (stats["barriers"] == 0 or (loss == "soft_margin" and reduction != "none"))


@pytest.mark.parametrize("fn", [
    lambda x: x.sum(0), lambda x: x.mean(0), lambda x: x.mean(), lambda x: x.amax(0), lambda x: x.amin(0),
    lambda x: x.sum(), lambda x: x.t() @ x, lambda x: x.sum(1, keepdim=True) * x, lambda x: (x > 0).all(0),
    lambda x: (x > 1).any(), lambda x: x.softmax(1), lambda x: x.log_softmax(-1), lambda x: x.mean(0) * 2,
    lambda x: (x.mean(0) * 2 + 1).sum() + x.sum(),
], ids=["sum0", "mean0", "mean", "amax0", "amin0", "sum", "gram", "rowsum", "all0", "any", "softmax1", "logsoftmax",
        "mean_scaled", "mean_in_sum"])
def test_reductions_and_contractions_over_the_batch(fn):
    x = torch.randn(B, 6)
    expected, got, stats = split_and_eager(fn, x)
    assert_same(expected, got)
    assert stats["splits"] >= 1 and stats["barriers"] == 0


# Elementwise activations, functional and in place: each splits with no barrier, whichever torch
# (ATen tags leaky_relu and the in-place celu_, elu_, hardsigmoid_, hardtanh_, selu_ pointwise only from
# 2.13; under 2.11 they ran whole, and a leaky-ReLU GAN's forward did not fit its cap).
ACTIVATIONS = {
    "leaky_relu": lambda x: F.leaky_relu(x, 0.2),
    "leaky_relu_": lambda x: F.leaky_relu(x * 1.0, 0.2, inplace=True),
    "celu_": lambda x: F.celu(x * 1.0, inplace=True),
    "elu_": lambda x: F.elu(x * 1.0, inplace=True),
    "hardsigmoid_": lambda x: F.hardsigmoid(x * 1.0, inplace=True),
    "hardtanh_": lambda x: F.hardtanh(x * 1.0, inplace=True),
    "selu_": lambda x: F.selu(x * 1.0, inplace=True),
    "relu6": lambda x: F.relu6(x),
    "silu_": lambda x: F.silu(x * 1.0, inplace=True),
    "mish": lambda x: F.mish(x),
    "softplus": lambda x: F.softplus(x),
}


@pytest.mark.parametrize("name", list(ACTIVATIONS))
def test_elementwise_activations_split_without_barriers(name):
    x = torch.randn(B, 6)
    expected, got, stats = split_and_eager(ACTIVATIONS[name], x)
    assert_same(expected, got)
    assert stats["splits"] >= 1 and stats["barriers"] == 0


def test_index_ops_with_batched_indices_into_a_replicated_table():
    torch.manual_seed(2)
    table = torch.randn(7, 4, dtype=torch.float64).to("lazymem").requires_grad_()
    idx = torch.randint(0, 7, (B, 3))
    ref_table = table.detach().cpu().requires_grad_()
    for fn in (lambda t, i: F.embedding(i, t), lambda t, i: t.index_select(0, i.flatten()).view(B, 3, 4),
               lambda t, i: t[i], lambda t, i: torch.gather(t.expand(B, 7, 4), 1, i.unsqueeze(-1).expand(B, 3, 4))):
        expected = fn(ref_table, idx)
        (g_ref,) = torch.autograd.grad(expected.square().sum(), ref_table)
        with force_chunks(3):
            out = fn(table, idx.to("lazymem"))
            (g,) = torch.autograd.grad(out.square().sum(), table)
            torch.testing.assert_close(out.cpu(), expected)
            torch.testing.assert_close(g.cpu(), g_ref)
        assert torch_lazymem.stats()["splits"] >= 1


def test_replicated_indices_expanded_to_the_batch_select_rows_per_chunk():
    """BERT's token types: a constant index buffer expanded to the batch, through embedding and
    index_select, added to batched rows. The selection, read only row by row, runs per chunk on the
    chunk's rows of the replicated indices (index_select), its gradient beside the gradient's rows
    (embedding_dense_backward); results equal eager's."""
    torch.manual_seed(3)
    table = torch.randn(5, 4, dtype=torch.float64).to("lazymem").requires_grad_()
    const = torch.tensor([[1, 0, 3]]).to("lazymem")
    x = torch.randn(B, 3, 4, dtype=torch.float64)
    ref_table, ref_const = table.detach().cpu().requires_grad_(), const.cpu()
    for fn in (lambda t, i: F.embedding(i.expand(B, 3), t),
               lambda t, i: t.index_select(0, i.expand(B, 3).reshape(-1)).view(B, 3, 4)):
        xr = x.clone().requires_grad_()
        expected = (xr * fn(ref_table, ref_const)).tanh()
        g_ref = torch.autograd.grad(expected.square().sum(), (ref_table, xr))
        with force_chunks(3):
            xl = x.to("lazymem").requires_grad_()
            out = (xl * fn(table, const)).tanh()
            g = torch.autograd.grad(out.square().sum(), (table, xl))
            torch.testing.assert_close(out.cpu(), expected)
            for a, b in zip(g, g_ref):
                torch.testing.assert_close(a.cpu(), b)
        assert torch_lazymem.stats()["splits"] >= 1


EXPANDED_TYPES = {
    "a slice of the batch": lambda W, c, x: (x[:5] * F.embedding(c.expand(5, 3), W)).tanh().sum(),
    "every third row": lambda W, c, x: (x[::3] + F.embedding(c.expand(x[::3].shape[0], 3), W)).square().sum(),
    "joined halves": lambda W, c, x: torch.cat([x[:4] + F.embedding(c.expand(4, 3), W), x[4:] * 2]).sin().sum(),
    "a mean over the batch": lambda W, c, x: (x + F.embedding(c.expand(B, 3), W)).mean(0).square().sum(),
}


@pytest.mark.parametrize("name", list(EXPANDED_TYPES))
def test_replicated_indices_expanded_to_rows_of_a_slice_of_the_batch(name):
    """The embedding of a constant expanded to a slice of the batch (row maps), or read by a mean
    over it: eager's values and gradients under forced chunks."""
    fn = EXPANDED_TYPES[name]
    torch.manual_seed(4)
    w = torch.randn(5, 4, dtype=torch.float64)
    const = torch.tensor([[1, 0, 3]])
    x = torch.randn(B, 3, 4, dtype=torch.float64)
    wr, xr = w.clone().requires_grad_(), x.clone().requires_grad_()
    expected = fn(wr, const, xr)
    g_ref = torch.autograd.grad(expected, (wr, xr))
    with force_chunks(3):
        wl, xl = w.to("lazymem").requires_grad_(), x.to("lazymem").requires_grad_()
        out = fn(wl, const.to("lazymem"), xl)
        g = torch.autograd.grad(out, (wl, xl))
        torch.testing.assert_close(out.cpu(), expected)
        for a, b in zip(g, g_ref):
            torch.testing.assert_close(a.cpu(), b)
    assert torch_lazymem.stats()["splits"] >= 1


def test_factories_that_carry_the_batch():
    x = torch.randn(B, 4, dtype=torch.float64)
    def fn(a):
        z = torch.zeros_like(a) + 1
        r = torch.arange(a.shape[0], device=a.device).unsqueeze(1) * a
        return z * a + r + torch.ones(a.shape[0], 1, dtype=a.dtype, device=a.device)
    expected = fn(x)
    with force_chunks(3):
        got = fn(x.to("lazymem")).cpu()
    torch.testing.assert_close(got, expected)
    text = torch_lazymem.explain(print_it=False)
    assert "split along a batch of 10 rows" in text


@pytest.mark.parametrize("fn", [
    lambda x: torch.cat([x, x * 2], 0).sum(1),                    # joins along the batch (blocks)
    lambda x: x[1:] - x[:-1],                                     # slices along the batch (whole)
    lambda x: x.sort(0).values,                                   # sorts across the batch (whole)
    lambda x: x.cumsum(0),                                        # scans across the batch (whole)
    lambda x: x.var(0),                                           # moments pass (test_split_cross_batch)
    lambda x: F.batch_norm(x, None, None, training=True),        # statistics pass (test_split_passes)
], ids=["cat_batch", "slice_batch", "sort_batch", "cumsum_batch", "var_batch", "batchnorm_train"])
def test_ops_that_mix_rows_stay_exact(fn):
    x = torch.randn(B, 4)
    expected, got, stats = split_and_eager(fn, x)
    assert_same(expected, got)


def test_views_of_the_batch_localize():
    x = torch.randn(B, 3, 4, dtype=torch.float64)
    w = torch.randn(4, 5, dtype=torch.float64)
    def fn(a, w_):
        flat = a.reshape(-1, 4) @ w_                       # (B*3, 4): the batch is the major factor
        back = flat.view(a.shape[0], 3, 5).transpose(0, 1)   # (3, B, 5): the batch in dim 1
        return back.exp().sum(0) + a.sum(-1, keepdim=True)[:, :1]
    expected = fn(x, w)
    with force_chunks(3):
        got = fn(x.to("lazymem"), w.to("lazymem")).cpu()
    torch.testing.assert_close(got, expected)


@pytest.mark.parametrize("mask", ["none", "key_padding", "causal"])
def test_fused_inference_paths_of_attention_modules_split(mask):
    """nn.MultiheadAttention and nn.TransformerEncoder in eval under no_grad take fused kernels
    (_native_multi_head_attention, _transformer_encoder_layer_fwd): split per sample, the key-padding
    mask with them, a causal mask shared."""
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, dropout=0.0, batch_first=True)
    encoder = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).double().eval()
    mha = torch.nn.MultiheadAttention(16, 4, batch_first=True).double().eval()
    x = torch.randn(B, 6, 16, dtype=torch.float64)
    pad = torch.rand(B, 6) > 0.6
    pad[:, 0] = False
    kwargs = {"none": {}, "key_padding": {"src_key_padding_mask": pad},
              "causal": {"mask": torch.nn.Transformer.generate_square_subsequent_mask(6, dtype=torch.float64),
                         "is_causal": True}}[mask]
    mha_mask = pad if mask == "key_padding" else None
    with torch.no_grad():
        expected = [encoder(x, **kwargs), *mha(x, x, x, key_padding_mask=mha_mask)]
        expected_no_weights = mha(x, x, x, key_padding_mask=mha_mask, need_weights=False)[0]
        encoder.to("lazymem")
        mha.to("lazymem")
        lx = x.to("lazymem")
        lkw = {k: v.to("lazymem") if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
        lmask = None if mha_mask is None else mha_mask.to("lazymem")
        torch_lazymem.reset_stats()
        with force_chunks(3):
            got = [encoder(lx, **lkw).cpu(), *[t.cpu() for t in mha(lx, lx, lx, key_padding_mask=lmask)]]
            got_no_weights = mha(lx, lx, lx, key_padding_mask=lmask, need_weights=False)[0].cpu()
    stats = torch_lazymem.stats()
    for e, g in zip(expected, got):
        torch.testing.assert_close(g, e)
    torch.testing.assert_close(got_no_weights, expected_no_weights)
    assert stats["splits"] >= 2 and stats["barriers"] == 0
