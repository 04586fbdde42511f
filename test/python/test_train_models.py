"""Real models trained for several steps on lazymem: every loss and every parameter equals eager
CPU bitwise. The transformers models are built offline from tiny configs with random weights."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from training import to_lazy, train_twins

import torch_lazymem

STEPS = 5


def batch_of(*shape, classes=None):
    def make(step):
        g = torch.Generator().manual_seed(1000 + step)
        x = torch.randn(*shape, generator=g)
        y = torch.randint(0, classes, (shape[0],), generator=g)
        return x, y
    return make


def ce(model, b):
    return F.cross_entropy(model(b[0]), b[1])


def test_mlp():
    def make():
        return nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, 64), nn.GELU(),
                             nn.Linear(64, 5))

    train_twins(make, batch_of(16, 20, classes=5), ce, steps=STEPS)


class Block(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x):
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += x  # residual
        return self.relu(out)


class ResNetLike(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(16),
                                  nn.ReLU(inplace=True))
        self.blocks = nn.Sequential(Block(16), Block(16))
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(16, 10)

    def forward(self, x):
        return self.fc(torch.flatten(self.pool(self.blocks(self.stem(x))), 1))


def test_cnn_with_batchnorm_residuals_and_inplace_relu():
    eager, lazy = train_twins(ResNetLike, batch_of(8, 3, 16, 16, classes=10), ce, steps=STEPS,
                              make_opt=lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, weight_decay=1e-4))
    eager.eval(), lazy.eval()
    x = torch.randn(4, 3, 16, 16)
    with torch.no_grad():
        assert torch.equal(lazy(x.to("lazymem")).cpu(), eager(x))


def test_transformer_encoder():
    def make():
        layer = nn.TransformerEncoderLayer(32, 4, dim_feedforward=64, dropout=0.1, batch_first=True)
        return nn.Sequential(nn.TransformerEncoder(layer, 2, enable_nested_tensor=False), nn.Linear(32, 7))

    def loss(model, b):
        return F.cross_entropy(model(b[0]).mean(1), b[1])

    train_twins(make, batch_of(4, 10, 32, classes=7), loss, steps=STEPS,
                make_opt=lambda p: torch.optim.AdamW(p, lr=1e-3))


transformers = pytest.importorskip("transformers")


def tokens(vocab: int, batch: int = 2, seq: int = 16):
    def make(step):
        g = torch.Generator().manual_seed(2000 + step)
        return torch.randint(0, vocab, (batch, seq), generator=g)
    return make


def hf_loss(model, batch):
    return model(**batch).loss


def quiet(fn):
    def wrapped(*args, **kwargs):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            transformers.logging.set_verbosity_error()
            return fn(*args, **kwargs)
    return wrapped


def gpt2():
    cfg = transformers.GPT2Config(vocab_size=128, n_positions=32, n_embd=32, n_layer=2, n_head=2,
                                  bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(cfg)


@quiet
def test_gpt2_lm_with_tied_embeddings_and_labels():
    ids = tokens(128)
    eager, lazy = train_twins(gpt2, lambda s: {"input_ids": ids(s), "labels": ids(s)}, hf_loss, steps=STEPS,
                              make_opt=lambda p: torch.optim.AdamW(p, lr=1e-3))
    assert lazy.lm_head.weight is lazy.transformer.wte.weight


@quiet
def test_gpt2_generate_gives_the_same_tokens():
    torch.manual_seed(0)
    eager = gpt2().eval()
    lazy = gpt2().eval()
    lazy.load_state_dict(eager.state_dict())
    lazy.to("lazymem")
    prompt = tokens(128, seq=5)(0)
    greedy = eager.generate(prompt, max_new_tokens=10, do_sample=False, pad_token_id=0)
    assert torch.equal(lazy.generate(prompt.to("lazymem"), max_new_tokens=10, do_sample=False, pad_token_id=0).cpu(),
                       greedy)
    torch.manual_seed(3)
    sampled = eager.generate(prompt, max_new_tokens=6, do_sample=True, top_k=20, pad_token_id=0)
    torch.manual_seed(3)
    lazy_sampled = lazy.generate(prompt.to("lazymem"), max_new_tokens=6, do_sample=True, top_k=20, pad_token_id=0)
    assert torch.equal(lazy_sampled.cpu(), sampled)


@quiet
def test_bert_sequence_classification_with_attention_mask():
    cfg = transformers.BertConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                  intermediate_size=64, max_position_embeddings=32, num_labels=3)
    ids = tokens(128)

    def batch(step):
        mask = torch.ones(2, 16, dtype=torch.long)
        mask[1, 9 + step:] = 0
        return {"input_ids": ids(step), "attention_mask": mask, "labels": torch.tensor([step % 3, 2])}

    train_twins(lambda: transformers.BertForSequenceClassification(cfg), batch, hf_loss, steps=STEPS,
                make_opt=lambda p: torch.optim.AdamW(p, lr=1e-3))


@quiet
def test_llama_causal_lm():
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    ids = tokens(128)
    train_twins(lambda: transformers.LlamaForCausalLM(cfg), lambda s: {"input_ids": ids(s), "labels": ids(s)},
                hf_loss, steps=STEPS, make_opt=lambda p: torch.optim.AdamW(p, lr=1e-3))


@quiet
def test_convnext_depthwise_channels_last_layouts_match_eager():
    # ConvNeXt's depthwise convolution reads a permuted (channels-last) input, so the CPU backend
    # returns channels-last; the recorded layout is the kernel's, so nothing is copied into another
    # layout and later ops see eager's strides (bitwise equal after AdamW steps).
    cfg = transformers.ConvNextConfig(num_channels=3, hidden_sizes=[8, 16], depths=[1, 1], num_stages=2,
                                      patch_size=2, image_size=16, num_labels=4)
    torch_lazymem.reset_stats()

    def batch(step):
        g = torch.Generator().manual_seed(step)
        return {"pixel_values": torch.randn(2, 3, 16, 16, generator=g),
                "labels": torch.randint(0, 4, (2,), generator=g)}

    train_twins(lambda: transformers.ConvNextForImageClassification(cfg), batch, hf_loss, steps=3,
                make_opt=lambda p: torch.optim.AdamW(p, lr=1e-3))
    assert torch_lazymem.stats()["outputs_copied"] == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("dims", [1, 2, 3])
@pytest.mark.parametrize("groups", [1, 4])
def test_convolution_layouts_are_the_backends(dtype, dims, groups):
    torch.manual_seed(0)
    conv = [nn.Conv1d, nn.Conv2d, nn.Conv3d][dims - 1](4, 8, 3, padding=1, groups=groups).to(dtype)
    fmt = {2: torch.channels_last, 3: torch.channels_last_3d}.get(dims)
    for x in (torch.randn(2, 4, *([6] * dims), dtype=dtype, requires_grad=True),
              torch.randn(2, *([6] * dims), 4, dtype=dtype).movedim(-1, 1).requires_grad_()):
        if fmt is not None:
            conv = conv.to(memory_format=fmt)
        lazy_conv = copy.deepcopy(conv).to("lazymem")
        xl = x.detach().to("lazymem").requires_grad_()
        torch_lazymem.reset_stats()
        y, yl = conv(x), lazy_conv(xl)
        assert yl.stride() == y.stride()
        g = torch.randn_like(y)
        (gx,) = torch.autograd.grad(y, x, g)
        (gxl,) = torch.autograd.grad(yl, xl, g.to("lazymem"))
        assert gxl.stride() == gx.stride()
        assert torch.equal(yl.cpu(), y.detach()) and torch.equal(gxl.cpu(), gx)
        assert torch_lazymem.stats()["outputs_copied"] == 0


def test_training_loop_memory_returns_to_baseline():
    import gc

    gc.collect()
    base = torch.lazymem.memory_allocated()
    model = ResNetLike().to("lazymem")
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    make = batch_of(4, 3, 16, 16, classes=10)
    for step in range(3):
        opt.zero_grad()
        ce(model, to_lazy(make(step))).backward()
        opt.step()
        torch_lazymem.sync()
    assert torch.lazymem.memory_allocated() > base  # parameters and optimizer state are resident
    del model, opt
    gc.collect()
    assert torch.lazymem.memory_allocated() == base
