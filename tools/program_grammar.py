"""The program fuzzer's grammar (tools/program_fuzz.py): a program is a Spec, every choice drawn from
one seed, built into a model, its data and a training or inference loop, and run on a device."""

from __future__ import annotations

import copy
import dataclasses
import os
import random

import torch
import torch.nn as nn
import torch.nn.functional as F

D = torch.float64
MiB = 1 << 20


# ---------------------------------------------------------------------------------------------------
# The grammar: a program is a Spec (all choices drawn from one seed), built into a model and a loop.


@dataclasses.dataclass
class Spec:
    seed: int
    kind: str                 # vec | img | tok | seq
    batch: int
    width: int
    layers: list[str]
    act: str
    inplace: bool
    loss: str                 # ce | ce_weighted | ce_smooth | mse
    training: bool
    steps: int
    optim: str                # sgd | adamw
    read_before: bool         # loss.item() before backward
    halves: bool              # two backwards over the halves of the batch, one step
    clip: bool
    scaler: bool
    mid_sync: bool            # a value read inside the forward
    towers: bool              # slices of the batch through two towers, cat
    mixup: bool               # x[perm]
    cap_fraction: float
    fail_at: int              # 0: no injected failure; else the n-th allocation of the first sync
    rand_ops: list = dataclasses.field(default_factory=list)  # (after layer i, random op) pairs
    # set_recompute for the lazymem run: None (priced, the default), True, or False (values crossing
    # passes held in host memory: every read of them crosses the boundary).
    recompute: bool | None = None
    # Issue 31's idioms, from a stream of their own: the batch drawn on the device from a dataset of
    # twice its rows held there (x[idx], y[idx], idx = randint or multinomial); a second optimizer step
    # in the same program (a GAN's shape: an auxiliary head trained on the output detached, then the
    # loss through the updated head into the model, whose step follows).
    sampled: bool = False
    two_steps: bool = False
    # A codebook of 2,048 rows (h + softmax(h E^T) E before the head): a parameter that dominates what
    # the step holds, whose optimizer temporaries may fit only in blocks of its rows (issue 31 item 2).
    wide: bool = False
    # Arithmetic by hand after the stem (mul, add, sub, div, rsub, neg by Python numbers): on small
    # activations a chain the CPU backing runs as one loop (csrc/execute/fuse.h), forward and backward.
    arith: bool = False
    # Token programs: BERT's token types without token_type_ids, a constant buffer of zeros expanded
    # to the batch and embedded (a replicated value of the batch's size, read row by row).
    types: bool = False

    FEATURES = ("read_before", "halves", "clip", "scaler", "mid_sync", "towers", "mixup", "inplace", "sampled",
                "two_steps", "wide", "arith", "types")

    def text(self) -> str:
        flags = [f for f in self.FEATURES if getattr(self, f)]
        mode = f"train {self.steps} x {self.optim}" if self.training else "inference"
        rand = f" random={[f'{i}:{op}' for i, op in self.rand_ops]}" if self.rand_ops else ""
        rand += f" recompute={self.recompute}" if self.recompute is not None else ""
        return (f"seed {self.seed}: {self.kind} B={self.batch} width={self.width} layers={self.layers} "
                f"act={self.act} loss={self.loss} {mode} {' '.join(flags)} cap={self.cap_fraction:.2f} "
                f"fail_at={self.fail_at}{rand}")


LAYERS = {
    "vec": ["linear", "layernorm", "batchnorm", "batchnorm_eval", "dropout", "residual"],
    "img": ["conv", "batchnorm2d", "batchnorm2d_eval", "groupnorm", "conv_residual", "dropout"],
    "tok": ["attention_pad", "attention_causal", "lstm", "gru", "layernorm", "linear", "dropout"],
    "seq": ["attention_pad", "attention_causal", "lstm", "gru", "layernorm", "linear", "residual"],
}


OTHER_ACTS = ["leaky_relu", "elu", "hardswish", "softplus", "hardtanh", "mish", "hardsigmoid", "selu"]

RANDOM_OPS = ["randn_like", "rand_like_mask", "bernoulli_p", "normal_tt", "noise_transposed", "noise_slice",
              "dropout_fn"]


def pick(drawn: str, other: str | None) -> str:
    """The activation: `other` where its stream chose one, else the one drawn from the main stream
    (drawn either way, so that the main stream's later draws are what they were)."""
    return other or drawn


def draw(seed: int) -> Spec:
    # Random ops come from a stream of their own: the rest of a seed's program is what it was before
    # they joined the grammar (the regression seeds replay the programs that found their bugs).
    q = random.Random(seed ^ 0x5EED)
    rand_ops = sorted((q.randint(0, 4), q.choice(RANDOM_OPS)) for _ in range(q.choice([0, 0, 1, 1, 2, 3])))
    # So does the choice of a less common activation (whose gradients ATen does not tag pointwise).
    acts = random.Random(seed ^ 0xAC75)
    other_act = acts.choice(OTHER_ACTS) if acts.random() < 0.4 else None
    # So do issue 31's idioms (a batch drawn on the device, two optimizer steps in one program).
    idioms = random.Random(seed ^ 0x31D1)
    sampled, two_steps = idioms.random() < 0.2, idioms.random() < 0.2
    wide = idioms.random() < 0.25
    # So does arithmetic by hand after the stem.
    arith = random.Random(seed ^ 0xA817).random() < 0.3
    # So do token types (tokens only).
    types = random.Random(seed ^ 0x7E7E).random() < 0.4
    # So does the recompute setting (host memory for values crossing passes in a quarter of programs).
    h = random.Random(seed ^ 0x4057).random()
    recompute = False if h < 0.25 else True if h < 0.35 else None
    r = random.Random(seed)
    kind = r.choice(list(LAYERS))
    training = r.random() < 0.8
    layers = [r.choice(LAYERS[kind]) for _ in range(r.randint(1, 4))]
    halves = training and r.random() < 0.2
    spec = Spec(
        seed=seed, kind=kind, batch=r.choice([24, 48, 96, 200, 384]) if kind != "img" else r.choice([16, 32, 64]),
        width=r.choice([8, 16, 32]), layers=layers, act=pick(r.choice(["relu", "gelu", "tanh", "silu"]), other_act),
        inplace=r.random() < 0.3, loss=r.choice(["ce", "ce_weighted", "ce_smooth", "mse"]), training=training,
        steps=r.choice([1, 2]), optim=r.choice(["sgd", "adamw"]), read_before=r.random() < 0.3, halves=halves,
        clip=training and r.random() < 0.3, scaler=training and not halves and r.random() < 0.15,
        mid_sync=r.random() < 0.2, towers=r.random() < 0.2, mixup=r.random() < 0.2,
        cap_fraction=r.uniform(0.05, 1.0), fail_at=r.randint(1, 40) if r.random() < 0.3 else 0,
        rand_ops=[(min(i, len(layers)), op) for i, op in rand_ops], recompute=recompute, sampled=sampled,
        two_steps=two_steps and training and not halves, wide=wide, arith=arith,
        types=types and kind == "tok")
    # Features a replay leaves out (PROGRAM_FUZZ_WITHOUT=wide,...): a seed that found a bug before a
    # feature joined the grammar replays the program that found it.
    for feature in filter(None, os.environ.get("PROGRAM_FUZZ_WITHOUT", "").split(",")):
        setattr(spec, feature, False)
    return spec


def random_op(name: str, h: torch.Tensor) -> torch.Tensor:
    """A random op over h, whatever its layout (elementwise: any shape with the batch at dim 0)."""
    if name == "randn_like":
        return h + 0.1 * torch.randn_like(h)
    if name == "rand_like_mask":
        return h * (torch.rand_like(h) < 0.8)
    if name == "bernoulli_p":
        return h * torch.bernoulli(torch.sigmoid(h.detach()))
    if name == "normal_tt":
        return h + torch.normal(torch.zeros_like(h), 0.05 + 0.1 * h.detach().abs())
    if name == "noise_transposed":  # drawn over a transposed view: eager fills it in storage order
        return h + 0.1 * torch.randn_like(h.transpose(0, -1)).transpose(0, -1)
    if name == "noise_slice":  # noise on a slice of the batch only
        k = max(h.shape[0] // 3, 1)
        return torch.cat([h[:k] + 0.1 * torch.randn_like(h[:k]), h[k:]])
    if name == "dropout_fn":
        return F.dropout(h, 0.15)
    raise ValueError(name)


def activation(spec: Spec, h: torch.Tensor) -> torch.Tensor:
    if spec.inplace and spec.act in ("relu", "tanh", "silu", "leaky_relu", "hardtanh", "hardswish", "elu"):
        return {"relu": F.relu_, "tanh": torch.tanh_, "silu": lambda t: F.silu(t, inplace=True),
                "leaky_relu": lambda t: F.leaky_relu_(t, 0.2), "hardtanh": F.hardtanh_,
                "hardswish": lambda t: F.hardswish(t, inplace=True), "elu": F.elu_}[spec.act](h)
    return {"relu": F.relu, "gelu": F.gelu, "tanh": torch.tanh, "silu": F.silu,
            "leaky_relu": lambda t: F.leaky_relu(t, 0.2), "elu": F.elu, "hardswish": F.hardswish,
            "softplus": F.softplus, "hardtanh": F.hardtanh, "mish": F.mish, "hardsigmoid": F.hardsigmoid,
            "selu": F.selu}[spec.act](h)


class Block(nn.Module):
    def __init__(self, spec: Spec, name: str, w: int) -> None:
        super().__init__()
        self.name, self.spec = name, spec
        if name in ("linear", "residual"):
            self.f = nn.Linear(w, w)
        elif name == "layernorm":
            self.f = nn.LayerNorm(w)
        elif name.startswith("batchnorm2d"):
            self.f = nn.BatchNorm2d(w)
        elif name.startswith("batchnorm"):
            self.f = nn.BatchNorm1d(w)
        elif name == "groupnorm":
            self.f = nn.GroupNorm(4, w)
        elif name in ("conv", "conv_residual"):
            self.f = nn.Conv2d(w, w, 3, padding=1)
        elif name == "dropout":
            self.f = nn.Dropout(0.2)
        elif name.startswith("attention"):
            self.f = nn.MultiheadAttention(w, 4 if w % 4 == 0 else 1, batch_first=True)
        elif name == "lstm":
            self.f = nn.LSTM(w, w, batch_first=True)
        elif name == "gru":
            self.f = nn.GRU(w, w, batch_first=True)

    def forward(self, h: torch.Tensor, pad: torch.Tensor | None) -> torch.Tensor:
        n = self.name
        if n.endswith("_eval"):
            self.f.eval()
        if n in ("linear", "conv"):
            return activation(self.spec, self.f(h))
        if n in ("residual", "conv_residual"):
            return h + activation(self.spec, self.f(h))
        if n.startswith("batchnorm") and self.spec.kind in ("tok", "seq"):
            return self.f(h.transpose(1, 2)).transpose(1, 2)
        if n.startswith("attention"):
            T = h.shape[1]
            if n == "attention_causal" or pad is None:
                mask = torch.triu(torch.ones(T, T, dtype=torch.bool, device=h.device), 1)
                return h + self.f(h, h, h, attn_mask=mask, need_weights=False)[0]
            return h + self.f(h, h, h, key_padding_mask=pad, need_weights=False)[0]
        if n in ("lstm", "gru"):
            return self.f(h)[0]
        return self.f(h)


class Net(nn.Module):
    def __init__(self, spec: Spec) -> None:
        super().__init__()
        self.spec = spec
        w = spec.width
        classes = 5
        self.vocab = 40
        if spec.kind == "vec":
            self.stem = nn.Linear(12, w)
        elif spec.kind == "img":
            self.stem = nn.Conv2d(3, w, 3, padding=1)
        elif spec.kind == "tok":
            self.stem = nn.Embedding(self.vocab, w, padding_idx=0)
        else:
            self.stem = nn.Linear(6, w)
        self.blocks = nn.ModuleList(Block(spec, name, w) for name in spec.layers)
        self.tower = nn.Linear(w, w) if spec.towers else None
        self.codebook = nn.Parameter(torch.randn(2048, w) * 0.1) if spec.wide else None
        self.head = nn.Linear(w, 1 if spec.loss == "mse" else classes)
        # (Made last: the other parameters draw what they drew before token types joined the grammar.)
        self.types = nn.Embedding(2, w) if spec.types else None
        if spec.types:
            self.register_buffer("type_ids", torch.zeros(1, 64, dtype=torch.long), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pad = (x == 0) if self.spec.kind == "tok" else None
        if pad is not None:
            pad = pad & ~pad.all(1, keepdim=True)  # a row of padding only would give NaN attention
        h = self.stem(x)
        if self.types is not None:  # BertEmbeddings' token types: its buffer, sliced and expanded
            h = h + self.types(self.type_ids[:, : x.shape[1]].expand(x.shape[0], x.shape[1]))
        if self.spec.kind == "img":
            h = activation(self.spec, h)
        if self.spec.arith:  # h + 0.5, in nine ops, then four in place
            h = torch.maximum((1 - ((h * 0.75 + 0.125) - h / 4.0) * 2).neg() + 1.25, h - 1).clamp(-1e6, 1e6)
            h = (h * 2.0).mul_(0.5).add_(0.25).sub_(0.25)
        for i, b in enumerate(self.blocks):
            for _, op in (r for r in self.spec.rand_ops if r[0] == i):
                h = random_op(op, h)
            h = b(h, pad)
            if i == 0 and self.spec.mid_sync and bool((h.abs() > 1e6).any()):
                h = h.clamp(-1e6, 1e6)
        for _, op in (r for r in self.spec.rand_ops if r[0] >= len(self.blocks)):
            h = random_op(op, h)
        if self.spec.kind == "img":
            h = F.avg_pool2d(h, 2).mean((2, 3))
        elif self.spec.kind in ("tok", "seq"):
            h = h.mean(1)
        if self.tower is not None:
            k = h.shape[0] // 3
            h = torch.cat([self.tower(h[:k]).tanh(), h[k:] * 0.5])
        if self.codebook is not None:
            h = h + torch.softmax(h @ self.codebook.t(), -1) @ self.codebook
        return self.head(h)


def data(spec: Spec, rows: int, g: torch.Generator) -> tuple[torch.Tensor, ...]:
    if spec.kind == "vec":
        x = torch.randn(rows, 12, generator=g, dtype=D)
    elif spec.kind == "img":
        x = torch.randn(rows, 3, 8, 8, generator=g, dtype=D)
    elif spec.kind == "tok":
        x = torch.randint(1, 40, (rows, 10), generator=g)
        x[:, 7:] *= torch.rand(rows, 3, generator=g) < 0.5  # padding at the end of some rows
    else:
        x = torch.randn(rows, 10, 6, generator=g, dtype=D)
    y = torch.randn(rows, 1, generator=g, dtype=D) if spec.loss == "mse" else torch.randint(0, 5, (rows,), generator=g)
    perm = torch.randperm(rows, generator=g)
    return x, y, perm


def loss_of(spec: Spec, out: torch.Tensor, y: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    if spec.loss == "mse":
        return F.mse_loss(out, y)
    if spec.loss == "ce_weighted":
        return F.cross_entropy(out, y, weight=weights)
    if spec.loss == "ce_smooth":
        return F.cross_entropy(out, y, label_smoothing=0.1)
    return F.cross_entropy(out, y)


def run_program(spec: Spec, dev: str) -> list[torch.Tensor]:
    """The program on `dev`: returns what it read (losses, outputs) and the final parameters."""
    torch.manual_seed(spec.seed)
    base = Net(spec).double()
    model = copy.deepcopy(base).to(dev)
    classes = base.head.out_features
    aux = nn.Linear(classes, classes).double().to(dev) if spec.two_steps else None
    torch.manual_seed(spec.seed + 1)  # the device's draws: the same stream on the CPU and lazymem
    model.train(spec.training)
    # AdamW's eps 1e-6, not 1e-8: a parameter whose gradient is zero in exact arithmetic (a group
    # norm's bias before a training batch norm, which removes every channel's mean) gets one of float
    # noise, ~1e-13, that a split's other summation order changes; its first update lr * g / (|g| + eps)
    # multiplies that by lr / eps: 1e6 at 1e-8, over assert_close's tolerance (seed 840179), 1e4 here.
    opt = (torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-6) if spec.optim == "adamw"
           else torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    scaler = torch.amp.GradScaler(dev, init_scale=256.0) if spec.scaler else None
    aux_opt = torch.optim.SGD(aux.parameters(), lr=0.1) if aux is not None else None
    weights = torch.linspace(0.5, 1.5, 5, dtype=D).to(dev)
    g = torch.Generator().manual_seed(spec.seed)
    read: list[torch.Tensor] = []
    if spec.sampled:  # the dataset, held on the device; the draws below come from the device's stream
        x_all, y_all, _ = (t.to(dev) for t in data(spec, 2 * spec.batch, g))
        w_all = torch.linspace(0.5, 1.0, 2 * spec.batch, dtype=D).to(dev)
    for step in range(spec.steps if spec.training else 1):
        x, y, perm = (t.to(dev) for t in data(spec, spec.batch, g))
        if spec.sampled:
            idx = (torch.randint(0, 2 * spec.batch, (spec.batch,), device=dev) if step % 2 == 0
                   else torch.multinomial(w_all, spec.batch, replacement=True))
            x, y = x_all[idx], y_all[idx]
        if spec.mixup and spec.kind in ("vec", "img", "seq"):
            x = 0.7 * x + 0.3 * x[perm]
        if not spec.training:
            with torch.no_grad():
                read.append(model(x).cpu())
            continue
        parts = [(x, y)]
        if spec.halves:
            h = spec.batch // 2
            parts = [(x[:h], y[:h]), (x[h:], y[h:])]
        for px, py in parts:
            if aux is not None:  # the head's step on the output detached, then the loss through it
                out = model(px)
                aux_loss = loss_of(spec, aux(out.detach()), py, weights)
                aux_opt.zero_grad()
                aux_loss.backward()
                aux_opt.step()
                read.append(aux_loss.detach().cpu())
                loss = loss_of(spec, aux(out), py, weights) / len(parts)
            else:
                loss = loss_of(spec, model(px), py, weights) / len(parts)
            if spec.read_before:
                read.append(loss.detach().cpu())
            (scaler.scale(loss) if scaler else loss).backward()
            if not spec.read_before:
                read.append(loss.detach().cpu())
        if scaler:
            scaler.unscale_(opt)
        if spec.clip:
            read.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).detach().cpu())
        if scaler:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        opt.zero_grad()
    read += [p.detach().cpu() for p in model.parameters()]
    read += [b.detach().cpu() for b in model.buffers()]
    if aux is not None:
        read += [p.detach().cpu() for p in aux.parameters()]
    return read
