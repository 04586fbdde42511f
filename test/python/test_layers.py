"""Layers: forward outputs, input and parameter gradients and buffers equal eager CPU bitwise."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F


def run_layer(make, inputs, train=True, loss=None, same_inputs=False):
    torch.manual_seed(1)
    eager = make().train(train)
    lazy = copy.deepcopy(eager).to("lazymem").train(train)
    xs = [t.clone().requires_grad_(t.is_floating_point()) for t in inputs]
    if same_inputs:  # self-attention: the same tensor as query, key and value
        xs = [xs[0]] * len(xs)
    lazy_x0 = xs[0].detach().to("lazymem").requires_grad_(xs[0].requires_grad)
    ls = [lazy_x0] * len(xs) if same_inputs else [
        t.detach().to("lazymem").requires_grad_(t.requires_grad) for t in xs]
    outs = []
    for model, args in ((eager, xs), (lazy, ls)):
        torch.manual_seed(5)
        out = model(*args)
        out = out[0] if isinstance(out, tuple) else out
        (loss(out) if loss else out.float().square().sum()).backward()
        outs.append(out)
    assert torch.equal(outs[1].cpu(), outs[0]), "forward differs"
    for (n, p), (_, q) in zip(eager.named_parameters(), lazy.named_parameters()):
        assert torch.equal(q.grad.cpu(), p.grad), f"grad of {n} differs"
    for (n, b), (_, c) in zip(eager.named_buffers(), lazy.named_buffers()):
        assert torch.equal(c.cpu(), b), f"buffer {n} differs"
    uniq = [xs[0]] if same_inputs else xs
    lazy_uniq = [lazy_x0] if same_inputs else ls
    for x, y in zip(uniq, lazy_uniq):
        if x.grad is not None:
            assert torch.equal(y.grad.cpu(), x.grad), "input grad differs"


def img(*shape):
    return [torch.randn(*shape)]


LAYERS = {
    "linear": (lambda: nn.Linear(8, 5), img(4, 8)),
    "conv1d": (lambda: nn.Conv1d(3, 6, 3, stride=2, padding=1, dilation=2), img(2, 3, 20)),
    "conv2d": (lambda: nn.Conv2d(3, 8, 3, stride=2, padding=2, dilation=2), img(2, 3, 12, 12)),
    "conv2d-groups": (lambda: nn.Conv2d(4, 8, 3, groups=2, padding=1, bias=False), img(2, 4, 9, 9)),
    "conv-transpose2d": (lambda: nn.ConvTranspose2d(3, 4, 3, stride=2, padding=1, output_padding=1), img(2, 3, 6, 6)),
    "batchnorm1d": (lambda: nn.BatchNorm1d(8), img(6, 8)),
    "batchnorm2d": (lambda: nn.BatchNorm2d(3), img(4, 3, 5, 5)),
    "layernorm": (lambda: nn.LayerNorm(8), img(4, 3, 8)),
    "groupnorm": (lambda: nn.GroupNorm(2, 4), img(2, 4, 5, 5)),
    "rmsnorm": (lambda: nn.RMSNorm(8), img(4, 8)),
    "embedding": (lambda: nn.Embedding(10, 4, padding_idx=0), [torch.randint(0, 10, (3, 5))]),
    "dropout": (lambda: nn.Dropout(0.3), img(10, 10)),
    "dropout2d": (lambda: nn.Dropout2d(0.5), img(4, 3, 5, 5)),
    "maxpool2d": (lambda: nn.MaxPool2d(3, stride=2, padding=1), img(2, 3, 9, 9)),
    "avgpool2d": (lambda: nn.AvgPool2d(2, ceil_mode=True), img(2, 3, 7, 7)),
    "adaptive-avgpool2d": (lambda: nn.AdaptiveAvgPool2d((3, 2)), img(2, 3, 8, 7)),
    "relu": (lambda: nn.Sequential(nn.Linear(8, 8), nn.ReLU()), img(4, 8)),
    "relu-inplace": (lambda: nn.Sequential(nn.Linear(8, 8), nn.ReLU(inplace=True)), img(4, 8)),
    "gelu": (lambda: nn.Sequential(nn.Linear(8, 8), nn.GELU()), img(4, 8)),
    "gelu-tanh": (lambda: nn.Sequential(nn.Linear(8, 8), nn.GELU("tanh")), img(4, 8)),
    "silu-inplace": (lambda: nn.Sequential(nn.Linear(8, 8), nn.SiLU(inplace=True)), img(4, 8)),
    "tanh": (lambda: nn.Sequential(nn.Linear(8, 8), nn.Tanh()), img(4, 8)),
    "softmax": (lambda: nn.Sequential(nn.Linear(8, 8), nn.Softmax(-1)), img(4, 8)),
    "log-softmax": (lambda: nn.Sequential(nn.Linear(8, 8), nn.LogSoftmax(1)), img(4, 8)),
}


@pytest.mark.parametrize("name", list(LAYERS))
@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
def test_layer(name, train):
    make, inputs = LAYERS[name]
    run_layer(make, inputs, train=train)


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
def test_multihead_attention(train):
    run_layer(lambda: nn.MultiheadAttention(8, 2, batch_first=True, dropout=0.1), img(2, 5, 8) * 3,
              train=train, same_inputs=True)
    run_layer(lambda: nn.MultiheadAttention(8, 2), [torch.randn(5, 2, 8), torch.randn(4, 2, 8), torch.randn(4, 2, 8)],
              train=train)


class SDPA(nn.Module):
    def __init__(self, causal: bool, dropout: float) -> None:
        super().__init__()
        self.causal, self.dropout = causal, dropout

    def forward(self, q, k, v, mask=None):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=self.causal,
                                              dropout_p=self.dropout if self.training else 0.0)


@pytest.mark.parametrize("causal", [False, True])
def test_scaled_dot_product_attention(causal):
    q, k, v = (torch.randn(2, 2, 5, 8) for _ in range(3))
    run_layer(lambda: SDPA(causal, 0.0), [q, k, v])
    run_layer(lambda: SDPA(causal, 0.2), [q, k, v])
    if not causal:
        mask = torch.rand(5, 5) > 0.3
        run_layer(lambda: SDPA(False, 0.0), [q, k, v, mask])


TARGET = torch.tensor([0, 1, 4, 3, 4, 2])
LOSSES = {
    "cross-entropy": lambda o: F.cross_entropy(o, TARGET.to(o.device)),
    "cross-entropy-ignore-index": lambda o: F.cross_entropy(o, torch.tensor([0, 1, -100, 3, 4, -100]).to(o.device)),
    "cross-entropy-label-smoothing": lambda o: F.cross_entropy(o, TARGET.to(o.device), label_smoothing=0.1),
    "cross-entropy-probabilities": lambda o: F.cross_entropy(o, o.detach().softmax(-1) * 0.5 + 0.1),
    "nll": lambda o: F.nll_loss(o.log_softmax(-1), TARGET.to(o.device), reduction="sum"),
    "mse": lambda o: F.mse_loss(o, torch.ones_like(o)),
    "l1": lambda o: F.l1_loss(o, torch.ones_like(o)),
    "smooth-l1": lambda o: F.smooth_l1_loss(o, torch.ones_like(o), beta=0.5),
    "bce-with-logits": lambda o: F.binary_cross_entropy_with_logits(o, torch.full_like(o, 0.3), pos_weight=torch.ones(5).to(o.device)),
}


@pytest.mark.parametrize("name", list(LOSSES))
def test_loss(name):
    run_layer(lambda: nn.Linear(8, 5), img(6, 8), loss=LOSSES[name])


def test_dropout_takes_the_cpu_decomposition():
    from conftest import OpTrace

    x = torch.randn(8, 8, requires_grad=True)
    traces = []
    for t in (x, x.detach().to("lazymem").requires_grad_()):
        with OpTrace() as tr:
            F.dropout(t, 0.3).sum().backward()
        traces.append(tr.ops)
    assert traces[0] == traces[1]  # the same ops forward and backward, not native_dropout
    for p in [i / 37 for i in range(1, 37)]:
        torch.manual_seed(0)
        eager = F.dropout(x, p)
        torch.manual_seed(0)
        assert torch.equal(F.dropout(x.detach().to("lazymem"), p).cpu(), eager.detach()), p
