"""The cases of tools/bench_split.py: models, inputs and training steps, each with the capacity of the
simulated device it runs on (see bench_split's docstring for what each exercises)."""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

MiB = 1 << 20


class TinyTransformer(nn.Module):
    def __init__(self, vocab: int = 512, seq: int = 64, d: int = 64, heads: int = 4, layers: int = 2,
                 classes: int = 10, dropout: float = 0.0) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(seq, d) * 0.02)
        layer = nn.TransformerEncoderLayer(d, heads, dim_feedforward=4 * d, dropout=dropout, batch_first=True,
                                           norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d, classes)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(ids) + self.pos).mean(1))


@dataclasses.dataclass
class Case:
    name: str
    model: Callable[[], nn.Module]
    inputs: Callable[[int, torch.Generator], torch.Tensor | tuple[torch.Tensor, ...]]
    capacity: int
    training: bool
    # The training loss of a batch (its tensors on the device); default: cross entropy of model(x), y.
    loss: Callable[[nn.Module, tuple[torch.Tensor, ...]], torch.Tensor] | None = None
    clip: float | None = None  # clip_grad_norm_ between backward and step
    # A whole training step of its own (several optimizers, indices drawn on the device): it does the
    # backward passes and optimizer steps and returns the loss to read; `optimizers` makes its
    # optimizers (default: one AdamW over the model).
    step: Callable[[nn.Module, list[torch.optim.Optimizer], tuple[torch.Tensor, ...]], torch.Tensor] | None = None
    optimizers: Callable[[nn.Module], list[torch.optim.Optimizer]] | None = None

    def batch(self, rows: int, seed: int) -> tuple[torch.Tensor, ...]:
        g = torch.Generator().manual_seed(seed)
        x = self.inputs(rows, g)
        if isinstance(x, tuple):
            return x
        return x, torch.randint(0, 10, (rows,), generator=g)


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))


def bn_cnn() -> nn.Module:
    """ResNet-style stem and two conv-BatchNorm-ReLU stages on 3x32x32 images (batch norm in
    training mode: statistics passes when split)."""
    def stage(cin: int, cout: int) -> list[nn.Module]:
        return [nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU()]
    return nn.Sequential(*stage(3, 32), nn.MaxPool2d(2), *stage(32, 64), nn.MaxPool2d(2), *stage(64, 64),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10))


def bert() -> nn.Module:
    import transformers
    transformers.logging.set_verbosity_error()
    cfg = transformers.BertConfig(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=256, max_position_embeddings=64, num_labels=10,
                                  hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return transformers.BertForSequenceClassification(cfg)


def bert_batch(n: int, g: torch.Generator) -> tuple[torch.Tensor, ...]:
    mask = torch.ones(n, 64, dtype=torch.long)
    mask[::3, 40:] = 0  # padded sequences: the mask is checked (a sync) inside the forward
    return torch.randint(0, 512, (n, 64), generator=g), mask, torch.randint(0, 10, (n,), generator=g)


def gpt2_real_vocab() -> nn.Module:
    import transformers
    transformers.logging.set_verbosity_error()
    cfg = transformers.GPT2Config(vocab_size=50257, n_positions=64, n_embd=32, n_layer=2, n_head=2,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(cfg)


def shifted_lm_loss(model: nn.Module, b: tuple[torch.Tensor, ...]) -> torch.Tensor:
    ids = b[0]
    logits = model(input_ids=ids).logits
    V = logits.shape[-1]
    return F.cross_entropy(logits[:, :-1].reshape(-1, V), ids[:, 1:].reshape(-1))


class GAN(nn.Module):
    """A generator (16 -> 512 -> 128) and a discriminator (128 -> 512 -> 1), leaky ReLUs."""

    def __init__(self) -> None:
        super().__init__()
        self.gen = nn.Sequential(nn.Linear(16, 512), nn.LeakyReLU(0.2), nn.Linear(512, 128))
        self.disc = nn.Sequential(nn.Linear(128, 512), nn.LeakyReLU(0.2), nn.Linear(512, 1))


def gan_optimizers(m: nn.Module) -> list[torch.optim.Optimizer]:
    return [torch.optim.Adam(m.disc.parameters(), lr=1e-4, betas=(0.5, 0.999)),
            torch.optim.Adam(m.gen.parameters(), lr=1e-4, betas=(0.5, 0.999))]


def gan_step(m: nn.Module, opts: list[torch.optim.Optimizer], b: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """D's step on real and fake.detach(), then G's through the updated D: two optimizer steps in one
    program (issue 31)."""
    real, z = b
    ones = torch.ones(real.shape[0], 1, device=real.device)
    fake = m.gen(z)
    bce = F.binary_cross_entropy_with_logits
    loss_d = bce(m.disc(real), ones) + bce(m.disc(fake.detach()), torch.zeros_like(ones))
    opts[0].zero_grad()
    loss_d.backward()
    opts[0].step()
    loss_g = bce(m.disc(fake), ones)
    opts[1].zero_grad()
    loss_g.backward()
    opts[1].step()
    return loss_d.detach() + loss_g.detach()


class SampledMLP(nn.Module):
    """An MLP (64-512-512-10) and its dataset (16,384 samples, 4 MiB) held on the device with sampling
    weights: each step draws its batch there (issue 31)."""

    def __init__(self, n: int = 16384) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))
        g = torch.Generator().manual_seed(7)
        self.register_buffer("x", torch.randn(n, 64, generator=g))
        self.register_buffer("y", torch.randint(0, 10, (n,), generator=g))
        self.register_buffer("w", torch.rand(n, generator=g))


def sampled_step(m: nn.Module, opts: list[torch.optim.Optimizer], b: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """idx = multinomial(w, B) drawn on the device, then the model on x[idx] against y[idx]."""
    idx = torch.multinomial(m.w, b[0].shape[0], replacement=True)
    loss = F.cross_entropy(m.net(m.x[idx]), m.y[idx])
    loss.backward()
    opts[0].step()
    opts[0].zero_grad()
    return loss


CASES = [
    Case("MLP inference", mlp, lambda n, g: torch.randn(n, 256, generator=g), 16 * MiB, False),
    Case("MLP training", mlp, lambda n, g: torch.randn(n, 256, generator=g), 32 * MiB, True),
    Case("transformer inference", TinyTransformer, lambda n, g: torch.randint(0, 512, (n, 64), generator=g),
         16 * MiB, False),
    Case("transformer training", TinyTransformer, lambda n, g: torch.randint(0, 512, (n, 64), generator=g),
         32 * MiB, True),
    Case("BatchNorm CNN training", bn_cnn, lambda n, g: torch.randn(n, 3, 32, 32, generator=g), 32 * MiB, True),
    Case("transformer training, clip_grad_norm_", TinyTransformer,
         lambda n, g: torch.randint(0, 512, (n, 64), generator=g), 32 * MiB, True, clip=1.0),
    Case("BERT training, attention mask", bert, bert_batch, 48 * MiB, True,
         loss=lambda m, b: m(input_ids=b[0], attention_mask=b[1], labels=b[2]).loss),
    Case("GPT-2 training, vocabulary 50,257, shifted loss by hand", gpt2_real_vocab,
         lambda n, g: (torch.randint(0, 50257, (n, 32), generator=g),), 96 * MiB, True, loss=shifted_lm_loss),
    # Eight dropouts per step (attention probabilities included): each split one draws eager's numbers
    # from a stream generated whole (issue 27).
    Case("transformer training, dropout 0.1", lambda: TinyTransformer(dropout=0.1),
         lambda n, g: torch.randint(0, 512, (n, 64), generator=g), 32 * MiB, True),
    # Two optimizer steps in one program; a batch drawn on the device from a dataset held there (the
    # uploaded tensor only gives the batch size).
    Case("GAN training, two optimizer steps", GAN,
         lambda n, g: (torch.randn(n, 128, generator=g), torch.randn(n, 16, generator=g)), 32 * MiB, True,
         step=gan_step, optimizers=gan_optimizers),
    Case("MLP training, batch sampled on the device", SampledMLP, lambda n, g: (torch.zeros(n, 1),), 32 * MiB,
         True, step=sampled_step),
]
