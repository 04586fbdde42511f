"""DDP benchmark: lazymem vs eager DistributedDataParallel on 2 ranks of gloo, in one run.

Each rank is a process with one thread (the machine's two cores, one per rank) and its own device
of --capacity MiB: eager DDP runs on CPU tensors under ``memory_cap(capacity)`` (model, gradients,
DDP's buckets, AdamW state and the batch on the "device"); lazymem DDP runs the same unmodified step
(``model.to("lazymem")``, forward, cross-entropy, backward, AdamW step, ``zero_grad``, ``loss.item()``)
under ``simulated_device(capacity)``. The model: an MLP 256-1024-1024-10 in float32.

(a) Eager DDP's largest per-rank batch B_e that fits (every rank must fit: doubling, then bisection
    to 1/32); both run it, interleaved, median of --steps after warm-up; a step's time is the
    slowest rank's. Ratio: eager time / lazymem time (goal >= 0.95).
(b) lazymem at --factor x B_e per rank (eager runs out of memory there): per-sample throughput
    relative to eager DDP at B_e (goal >= 0.9), its chunks, its peak against the capacity.
(c) Collectives per step: lazymem's (stats()["collectives"] over a step) and eager's (a counting
    comm hook around the default all-reduce, in a separate step): equal.
(d) Losses of the first step: lazymem's and eager's on the same shards (float32, split sums
    reassociate: close, not bitwise).

    PYTHONPATH=. python tools/bench_ddp.py [--capacity 40] [--steps 5] [--factor 8]
"""

from __future__ import annotations

import argparse
import copy
import datetime
import gc
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F

MiB = 1 << 20


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))


def batch(rows: int, step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(rows, 256, generator=g), torch.randint(0, 10, (rows,), generator=g)


class Trainer:
    """One DDP replica on `dev` with its AdamW; step() runs one training step and reads the loss."""

    def __init__(self, base: nn.Module, dev: str, hook=None) -> None:
        self.dev = dev
        self.model = copy.deepcopy(base).to(dev)
        self.ddp = nn.parallel.DistributedDataParallel(self.model)
        if hook is not None:
            self.ddp.register_comm_hook(None, hook)
        self.opt = torch.optim.AdamW(self.ddp.parameters(), lr=1e-3)

    def step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        loss = F.cross_entropy(self.ddp(x.to(self.dev)), y.to(self.dev))
        loss.backward()
        self.opt.step()
        self.opt.zero_grad()
        return loss.item()


def all_ranks(flag: bool) -> bool:
    t = torch.tensor([int(flag)])
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())


def slowest(ms: float) -> float:
    t = torch.tensor([ms])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def eager_fits(base: nn.Module, rows: int, cap: int, rank: int) -> bool:
    from torch_lazymem.testing import memory_cap

    ok = True
    try:
        with memory_cap(cap):
            t = Trainer(base, "cpu")
            for s in range(2):
                t.step(*batch(rows, s, rank))
    except torch.OutOfMemoryError:
        ok = False
    return all_ranks(ok)


def largest_eager(base: nn.Module, cap: int, rank: int) -> int:
    lo, hi = 0, 16
    while eager_fits(base, hi, cap, rank):
        lo, hi = hi, hi * 2
    while hi - lo > max(1, lo // 32):
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if eager_fits(base, mid, cap, rank) else (lo, mid)
    return lo


def timed(trainer: Trainer, rows: int, step: int, rank: int, context) -> tuple[float, float]:
    x, y = batch(rows, step, rank)
    dist.barrier()
    with context():
        t0 = time.perf_counter()
        loss = trainer.step(x, y)
        if trainer.dev != "cpu":
            torch.lazymem.synchronize()
        ms = (time.perf_counter() - t0) * 1e3
    return slowest(ms), loss


def rank_main(rank: int, size: int, store: str, args, out: dict) -> None:
    import torch_lazymem
    from torch_lazymem.testing import memory_cap, simulated_device

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=size,
                            timeout=datetime.timedelta(seconds=600))
    cap = args.capacity * MiB
    base = mlp()
    b_e = largest_eager(base, cap, rank)

    def eager_ctx():
        return memory_cap(cap)

    def lazy_ctx():
        return simulated_device(cap)

    # (a) both at B_e, interleaved.
    with memory_cap(cap):
        eager = Trainer(base, "cpu")
    with simulated_device(cap):
        lazy = Trainer(base, "lazymem")
    e_ms, l_ms, losses = [], [], {}
    warm = 2
    for s in range(warm + args.steps):
        order = (eager, lazy) if s % 2 else (lazy, eager)
        for tr in order:
            ms, loss = timed(tr, b_e, s, rank, eager_ctx if tr is eager else lazy_ctx)
            if s == 0:
                losses[tr.dev] = loss
            if s >= warm:
                (e_ms if tr is eager else l_ms).append(ms)
    torch_lazymem.reset_stats()
    timed(lazy, b_e, 99, rank, lazy_ctx)
    lazy_collectives = torch_lazymem.stats()["collectives"]
    del eager, lazy, order, tr
    gc.collect()  # (DDP and its reducer hold each other: freed by the collector)
    torch.lazymem.synchronize()

    # (c) eager's collectives per step: a counting hook around the default all-reduce.
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    calls = [0]

    def counting(state, bucket):
        calls[0] += 1
        return default_hooks.allreduce_hook(state, bucket)

    counter = Trainer(base, "cpu")
    counter.ddp.register_comm_hook(None, counting)
    for s in range(3):
        calls[0] = 0
        counter.step(*batch(b_e, s, rank))
    eager_collectives = calls[0]
    del counter
    gc.collect()

    # (b) lazymem at factor x B_e.
    big = args.factor * b_e
    with simulated_device(cap):
        lazy = Trainer(base, "lazymem")
    big_ms, chunks, peak = [], 0, 0
    for s in range(warm + args.steps):
        torch_lazymem.reset_stats()
        with simulated_device(cap):
            torch.lazymem.reset_peak_memory_stats()
            ms, _ = timed(lazy, big, s, rank, lazy_ctx)
            peak = max(peak, torch.lazymem.max_memory_allocated())
        chunks = max(chunks, torch_lazymem.stats()["chunks"])
        if s >= warm:
            big_ms.append(ms)
    peak_t = torch.tensor([peak])
    dist.all_reduce(peak_t, op=dist.ReduceOp.MAX)
    if rank == 0:
        out.update(b_e=b_e, eager_ms=statistics.median(e_ms), lazy_ms=statistics.median(l_ms), big=big,
                   big_ms=statistics.median(big_ms), chunks=chunks, peak=int(peak_t.item()), cap=cap,
                   lazy_collectives=lazy_collectives, eager_collectives=eager_collectives,
                   eager_loss=losses["cpu"], lazy_loss=losses["lazymem"])
    dist.destroy_process_group()


def _entry(rank, size, store, args, queue):
    out: dict = {}
    rank_main(rank, size, store, args, out)
    if rank == 0:
        queue.put(out)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--capacity", type=int, default=40, help="MiB per rank")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--factor", type=int, default=8)
    args = p.parse_args()
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    # The ranks meet through a file store (no port to choose, so none to lose to another process).
    with tempfile.TemporaryDirectory() as d:
        procs = [ctx.Process(target=_entry, args=(r, 2, os.path.join(d, "store"), args, queue)) for r in range(2)]
        for pr in procs:
            pr.start()
        for pr in procs:
            pr.join()
    if any(pr.exitcode != 0 for pr in procs):
        print("a rank failed", file=sys.stderr)
        return 1
    r = queue.get()
    ratio = r["eager_ms"] / r["lazy_ms"]
    per_sample = (r["big"] / r["big_ms"]) / (r["b_e"] / r["eager_ms"])
    rows = [
        ("(a) batch per rank at eager DDP's largest", f"{r['b_e']}", ""),
        ("    eager DDP ms / step", f"{r['eager_ms']:.1f}", ""),
        ("    lazymem DDP ms / step", f"{r['lazy_ms']:.1f}", ""),
        ("    throughput lazymem / eager", f"{ratio:.2f}", "goal >= 0.95 " + ("ok" if ratio >= 0.95 else "MISSED")),
        (f"(b) lazymem batch per rank ({args.factor}x)", f"{r['big']}", f"{r['chunks']} chunks"),
        ("    lazymem DDP ms / step", f"{r['big_ms']:.1f}", ""),
        ("    per-sample throughput vs eager at its largest", f"{per_sample:.2f}",
         "goal >= 0.9 " + ("ok" if per_sample >= 0.9 else "MISSED")),
        ("    peak / capacity (MiB)", f"{r['peak'] / MiB:.2f} / {r['cap'] / MiB:.0f}",
         "ok" if r["peak"] <= r["cap"] else "OVER"),
        ("(c) collectives per step: lazymem / eager", f"{r['lazy_collectives']} / {r['eager_collectives']}",
         "equal" if r["lazy_collectives"] == r["eager_collectives"] else "DIFFER"),
        ("(d) first-step loss: lazymem / eager", f"{r['lazy_loss']:.6f} / {r['eager_loss']:.6f}", ""),
    ]
    w = max(len(a) for a, _, _ in rows)
    print(f"DDP, 2 ranks of gloo, MLP 256-1024-1024-10 float32, AdamW, {args.capacity} MiB per rank, "
          f"median of {args.steps} steps")
    for a, b, c in rows:
        print(f"  {a:<{w}}  {b:>16}  {c}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
