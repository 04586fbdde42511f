"""Training-step benchmark for the lazymem device: time per step, lazymem vs eager CPU, in one run.

Three models, each trained on eager CPU and on lazymem (backed by the CPU) from the same initial
weights (``copy.deepcopy`` then ``.to("lazymem")``), with the same fixed batch resident on the device:

1. MLP, compute-bound: batch 256, 1024 -> 2048 -> 2048 -> 10, ReLU, cross-entropy, SGD + momentum.
   Goal: lazymem/eager <= 1.10x.
2. CNN: a small ResNet (BatchNorm, residual blocks, in-place ReLU) on 32x3x32x32 images,
   cross-entropy, SGD + momentum + weight decay. Goal: <= 1.10x.
3. GPT-2 tiny from ``transformers`` (random weights, built offline from a config), labels = input ids,
   AdamW. Its kernels are tiny, so per-op recording overhead dominates: reported without a goal.

A step is ``zero_grad`` + forward + loss + ``backward`` + ``optimizer.step`` + ``loss.item()``, so
both devices sync once per step. Optimizers use PyTorch's defaults for each device, as unmodified code
would (the single-tensor loop on CPU, the foreach kernels on lazymem). After untimed warm-up steps
(lazymem's first steps pay one-time meta inference), eager and lazymem steps are interleaved (their
order alternating) and the median (``--stat min``: minimum) ms/step is reported, with lazymem's step
split into recording (step start until just before ``.item()``) and replay (the ``.item()``). The
``.item()`` runs only what the loss needs, the forward: the backward and update stay pending and run in
the next step's replay, so in steady state each replay still does one step's work. Every
loss of every step and, at the end, every parameter and buffer must be bitwise equal to eager; a row
that differs is flagged. Per-step counters (``torch_lazymem.stats()``) and minor page faults are shown.

glibc malloc returns big freed blocks to the OS, so without tuning every step page-faults its
activations back in and the timings measure the kernel's page zeroing. To mimic a GPU caching
allocator on both sides, the script re-executes itself with MALLOC_MMAP_THRESHOLD_=4294967296 and
MALLOC_TRIM_THRESHOLD_=68719476736 unless they are set (``--no-malloc-tuning`` removes them instead).

    PYTHONPATH=. python tools/bench_train.py [--quick] [--stat {median,min}] [--no-malloc-tuning]
"""

from __future__ import annotations

import argparse
import copy
import os
import resource
import statistics
import sys
import time
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from _table import print_table  # tools/_table.py: the script's directory is on sys.path

import torch_lazymem

LAZY = "lazymem"
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "4294967296", "MALLOC_TRIM_THRESHOLD_": "68719476736"}
AGG: dict[str, Callable[[list[float]], float]] = {"median": statistics.median, "min": min}


def reexec_for_malloc(tuning: bool) -> None:
    """Re-executes this script with the malloc variables set (tuning) or removed; glibc reads them at start."""
    env = dict(os.environ)
    if tuning:
        if all(k in env for k in MALLOC_ENV):
            return
        env.update({k: v for k, v in MALLOC_ENV.items() if k not in env})
    else:
        if not any(k in env for k in MALLOC_ENV):
            return
        for k in MALLOC_ENV:
            env.pop(k, None)
    sys.stdout.flush()
    os.execve(sys.executable, [sys.executable, *sys.argv], env)


class Block(nn.Module):
    """ResNet basic block: conv-BN-ReLU-conv-BN + (projected) shortcut, in-place ReLU."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.short = nn.Sequential()
        if stride != 1 or cin != cout:
            self.short = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += self.short(x)
        return self.relu(out)


class ResNet(nn.Module):
    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 32, 3, 1, 1, bias=False), nn.BatchNorm2d(32), nn.ReLU(inplace=True))
        self.blocks = nn.Sequential(Block(32, 32, 1), Block(32, 64, 2), Block(64, 64, 1), Block(64, 64, 2))
        self.head = nn.Linear(64, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(F.adaptive_avg_pool2d(self.blocks(self.stem(x)), 1).flatten(1))


Case = tuple[nn.Module, Callable[[nn.Module], torch.optim.Optimizer], tuple[torch.Tensor, ...],
             Callable[[nn.Module, tuple[torch.Tensor, ...]], torch.Tensor], str]


def classifier_loss(model: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    return F.cross_entropy(model(batch[0]), batch[1])


def mlp_case() -> Case:
    model = nn.Sequential(nn.Linear(1024, 2048), nn.ReLU(), nn.Linear(2048, 2048), nn.ReLU(), nn.Linear(2048, 10))
    batch = (torch.randn(256, 1024), torch.randint(0, 10, (256,)))
    return (model, lambda m: torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9), batch, classifier_loss,
            "batch 256, 1024-2048-2048-10, SGD momentum")


def cnn_case() -> Case:
    model = ResNet()
    batch = (torch.randn(32, 3, 32, 32), torch.randint(0, 10, (32,)))
    return (model, lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4), batch,
            classifier_loss, "32x3x32x32, 4 res blocks 32-64ch, BN, SGD momentum")


def gpt2_case() -> Case:
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import transformers

    transformers.logging.set_verbosity_error()
    cfg = transformers.GPT2Config(vocab_size=1024, n_positions=128, n_embd=128, n_layer=2, n_head=4)
    model = transformers.GPT2LMHeadModel(cfg)
    batch = (torch.randint(0, cfg.vocab_size, (8, 64)),)

    def loss(m: nn.Module, b: tuple[torch.Tensor, ...]) -> torch.Tensor:
        return m(input_ids=b[0], labels=b[0]).loss

    return (model, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3), batch, loss,
            f"transformers {transformers.__version__}, 2 layers, d=128, dropout 0.1, batch 8x64, AdamW")


def train_step(model: nn.Module, opt: torch.optim.Optimizer, batch: tuple[torch.Tensor, ...],
               loss_fn: Callable[[nn.Module, tuple[torch.Tensor, ...]], torch.Tensor]) -> tuple[float, float, float]:
    """One step; returns (loss value, seconds until just before .item(), seconds of .item())."""
    t0 = time.perf_counter()
    opt.zero_grad()
    loss = loss_fn(model, batch)
    loss.backward()
    opt.step()
    t1 = time.perf_counter()
    value = loss.item()
    return value, t1 - t0, time.perf_counter() - t1


def faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def bench(case: Case, warmup: int, reps: int, agg: Callable[[list[float]], float]) -> dict:
    model, make_opt, batch, loss_fn, desc = case
    torch.manual_seed(0)
    lazy_model = copy.deepcopy(model).to(LAZY)
    lazy_batch = tuple(t.to(LAZY) for t in batch)
    opt, lazy_opt = make_opt(model), make_opt(lazy_model)
    losses: dict[str, list[float]] = {"eager": [], "lazy": []}
    t: dict[str, list[float]] = {"eager": [], "lazy": [], "record": [], "replay": []}
    flt = {"eager": 0, "lazy": 0}
    for i in range(warmup + reps):
        if i == warmup:
            torch_lazymem.reset_stats()
        for side in (("eager", "lazy") if i % 2 == 0 else ("lazy", "eager")):
            f0 = faults()
            if side == "eager":
                value, rec, rep = train_step(model, opt, batch, loss_fn)
            else:
                value, rec, rep = train_step(lazy_model, lazy_opt, lazy_batch, loss_fn)
            losses[side].append(value)
            if i >= warmup:
                flt[side] += faults() - f0
                t[side].append(rec + rep)
                if side == "lazy":
                    t["record"].append(rec)
                    t["replay"].append(rep)
    st = torch_lazymem.stats()
    eager_state = list(model.state_dict().values())
    lazy_state = [v.cpu() for v in lazy_model.state_dict().values()]
    equal = (losses["eager"] == losses["lazy"] and len(eager_state) == len(lazy_state)
             and all(torch.equal(a, b) for a, b in zip(eager_state, lazy_state)))
    return {"desc": desc, "equal": equal, "loss": (losses["eager"][-1], losses["lazy"][-1]),
            "faults": {k: v / reps for k, v in flt.items()},
            "stats": {k: v / reps for k, v in st.items() if k not in ("pending_nodes", "peak_bytes")},
            **{k: agg(v) for k, v in t.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer warm-up and timed steps")
    ap.add_argument("--stat", choices=sorted(AGG), default="median",
                    help="statistic over the timed steps (min is steadier on a busy machine)")
    ap.add_argument("--no-malloc-tuning", action="store_true",
                    help="run with glibc's default malloc (big blocks go back to the OS every step)")
    args = ap.parse_args()
    reexec_for_malloc(not args.no_malloc_tuning)
    warmup, reps = (3, 20) if args.quick else (5, 60)
    goals = {"MLP": 1.10, "CNN": 1.10, "GPT-2 tiny": None}
    builders = {"MLP": mlp_case, "CNN": cnn_case, "GPT-2 tiny": gpt2_case}

    malloc = ", ".join(f"{k}={os.environ[k]}" for k in MALLOC_ENV if k in os.environ)
    print(f"torch {torch.__version__} | threads {torch.get_num_threads()} | "
          f"backing device {torch_lazymem.backing_device()} | torch_lazymem {torch_lazymem.__version__} | "
          f"load average {os.getloadavg()[0]:.2f} (other processes make timings noisy)")
    print("malloc: " + (f"{malloc} (caching-allocator-like, for eager and lazymem alike)" if malloc
                        else "glibc defaults (freed big blocks return to the OS: page faults every step)"))
    print(f"{args.stat} of {reps} interleaved steps per side after {warmup} warm-up steps; a step is "
          f"zero_grad + forward + backward + optimizer.step + loss.item(){' | --quick' if args.quick else ''}")
    print("goal: lazymem/eager <= 1.10x for the compute-bound MLP and CNN; GPT-2 tiny is per-op-overhead "
          "bound (tiny kernels), reported without a goal")
    print()

    start = time.perf_counter()
    results = {}
    for name, build in builders.items():
        torch.manual_seed(0)
        results[name] = bench(build(), warmup, reps, AGG[args.stat])
    total = time.perf_counter() - start

    ms = 1e3
    rows, details, bad = [], [], []
    for name, r in results.items():
        ratio, goal = r["lazy"] / r["eager"], goals[name]
        ok = "-" if goal is None else ("yes" if ratio <= goal else "NO")
        if not r["equal"]:
            ok, bad = ok + " DIFFERS", [*bad, name]
        s = r["stats"]
        rows.append((name, f"{r['eager'] * ms:.1f}", f"{r['lazy'] * ms:.1f}", f"{ratio:.3f}x",
                     "-" if goal is None else f"<= {goal:.2f}x", ok,
                     f"{r['record'] * ms:.1f} / {r['replay'] * ms:.1f}", str(r["equal"])))
        details.append((name, f"{s['ops_recorded']:.0f}", f"{s['nodes_executed']:.0f}",
                        f"{s['nodes_eliminated']:.0f}", f"{s['meta_cache_hits']:.0f}/{s['meta_cache_misses']:.0f}",
                        f"{s['outputs_copied']:.0f}", f"{s['materializations']:.0f}",
                        f"{r['faults']['eager']:.0f} / {r['faults']['lazy']:.0f}",
                        f"{r['loss'][1]:.6f}", r["desc"]))
    print_table(("model", "eager ms", "lazymem ms", "ratio", "goal", "ok", "lazy record / replay ms",
                 "bitwise equal"), rows)
    print("(lazymem replay = the .item(): this step's forward plus the previous step's backward and update, "
          "which the loss does not need and which stay pending until then)")
    print()
    print("per lazymem step (timed steps):")
    print_table(("model", "ops recorded", "nodes run", "eliminated", "meta hit/miss", "outputs copied",
                 "syncs", "minor faults eager / lazy", "last loss", "setup"), details)
    print()
    print(f"total benchmark time {total:.1f} s")
    if bad:
        print(f"WARNING: lazymem results differ from eager for: {', '.join(bad)}")
        sys.exit(1)


if __name__ == "__main__":
    main()
