"""Recording-overhead benchmark for the lazymem device, measured in one run.

Rows of the printed table:

1. Recording cost per op with a hot meta-inference cache: a chain of tiny elementwise ops
   (``y = y * 1.0001; y = y + 0.5`` on a 16-element tensor), timing only the Python loop that
   records them (the pending program is synchronized afterwards, untimed). The same loop on an
   eager CPU tensor is shown beside it: the Python + dispatcher cost both paths pay. Nothing is
   subtracted. Goal: <= 1 us/op (issue 30; an absolute time, so read it beside eager's op on the
   same machine: a loaded machine inflates both).
2. Recording cost per op when every op misses the meta cache (a never-seen shape each op), so
   the meta kernel really runs for each op.
3i. Issue 30's own loop: ``a = a * 1.0001 + 0.001`` 2,000 times on 1,024 floats, read once; with
   pointwise fusion (the default on the CPU backing) and without (``set_fusion(False)``). Goal: <= 1.0x.
3. End-to-end (a): 10,000 tiny elementwise ops, recorded and then materialized with ``.item()``,
   vs the same ops on eager CPU. Goal: lazymem/eager <= 2.0x. Then again with pipelined execution
   (``torch_lazymem.set_pipeline(True)``: batches of the recorded chain run on a worker thread while
   the rest is recorded). Goal: <= 1.0x (issue 30).
4. End-to-end (b): a 4-layer MLP forward (batch 512, 2048x2048 linear layers, ReLU) including
   ``.cpu()`` of the output, vs eager CPU. Goal: <= 1.05x. The output must be bitwise equal.

For (a) and (b) the lazymem time is also split into recording (the loop) and replay (the final
``torch.lazymem.synchronize()``). Every figure is the median over several timed repetitions
run after untimed warm-ups (``--stat min`` takes the minimum instead); ``torch.set_num_threads``
is left at its default.

    PYTHONPATH=. python tools/bench_record.py [--quick] [--stat {median,min}]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import torch
import torch.nn.functional as F
from _table import print_table  # tools/_table.py: the script's directory is on sys.path

import torch_lazymem

LAZY = "lazymem"
sync = torch.lazymem.synchronize
AGG: dict[str, Callable[[list[float]], float]] = {"median": statistics.median, "min": min}
agg = AGG["median"]  # set from --stat in main()


def median_time(fn: Callable[[], object], reps: int, warmup: int, after: Callable[[], object] = sync) -> float:
    """agg (median or min) seconds of fn() over `reps` runs after `warmup`; after() runs untimed after each."""
    times = []
    for i in range(warmup + reps):
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        after()
        if i >= warmup:
            times.append(t1 - t0)
    return agg(times)


def tiny_chain(y: torch.Tensor, n_ops: int) -> torch.Tensor:
    for _ in range(n_ops // 2):
        y = y * 1.0001
        y = y + 0.5
    return y


def bench_cached(n_ops: int, reps: int) -> tuple[float, float, dict]:
    """Row 1: us/op to record a chain whose (op, shapes, dtypes) are all in the meta cache."""
    lazy, cpu = torch.randn(16).to(LAZY), torch.randn(16)
    sync()
    torch_lazymem.reset_stats()
    t_lazy = median_time(lambda: tiny_chain(lazy, n_ops), reps, warmup=1)
    st = torch_lazymem.stats()
    t_eager = median_time(lambda: tiny_chain(cpu, n_ops), reps, warmup=1, after=lambda: None)
    return t_lazy / n_ops * 1e6, t_eager / n_ops * 1e6, st


def bench_uncached(n_ops: int, reps: int) -> tuple[float, dict]:
    """Row 2: us/op to record ops whose metadata was never seen.

    Each op runs on a view of a different shape (base[:a, :b]), so its cache key is new and the meta
    kernel runs: the same path an unseen shape takes in real code, with nothing else in the loop.
    The alternative, calling _C._clear_meta_cache() before each op, would add a Python->C++ call and
    a mutex round trip per op to the timed loop and keep the cache unrealistically empty. The views
    are made outside the timed loop and the cache is cleared (untimed) before each repetition, so
    every op of every repetition is a real miss; the stats printed show misses == ops."""
    side = int(n_ops**0.5) + 1
    base = torch.randn(side, side).to(LAZY)
    views = [base[:a, :b] for a in range(1, side + 1) for b in range(1, side + 1)][:n_ops]
    sync()

    def record() -> None:
        for v in views:
            v * 1.0001

    def before_rep() -> None:
        sync()
        torch_lazymem._C._clear_meta_cache()

    before_rep()
    torch_lazymem.reset_stats()
    t = median_time(record, reps, warmup=1, after=before_rep)
    st = torch_lazymem.stats()
    return t / n_ops * 1e6, st


def e2e(run_lazy: Callable[[], torch.Tensor], run_eager: Callable[[], torch.Tensor],
        read: Callable[[torch.Tensor], object], reps: int, warmup: int) -> dict:
    """agg of total (record + sync + read), record and replay times for lazymem, and of eager total."""
    rec, rep, tot, eag = [], [], [], []
    for i in range(warmup + reps):
        t0 = time.perf_counter()
        out = run_lazy()
        t1 = time.perf_counter()
        sync()
        t2 = time.perf_counter()
        lazy_val = read(out)
        t3 = time.perf_counter()
        eager_val = read(run_eager())
        t4 = time.perf_counter()
        if i >= warmup:
            rec.append(t1 - t0)
            rep.append(t2 - t1)
            tot.append(t3 - t0)
            eag.append(t4 - t3)
    return {"record": agg(rec), "replay": agg(rep), "lazy": agg(tot), "eager": agg(eag),
            "lazy_val": lazy_val, "eager_val": eager_val}


def bench_tiny(n_ops: int, reps: int) -> dict:
    """Row 3, end-to-end (a): n_ops tiny ops, then .item()."""
    x = torch.randn(16)
    xl = x.to(LAZY)
    sync()
    r = e2e(lambda: tiny_chain(xl, n_ops), lambda: tiny_chain(x, n_ops),
            lambda t: t.sum().item(), reps, warmup=2)
    r["equal"] = r["lazy_val"] == r["eager_val"]
    return r


def bench_issue_loop(reps: int) -> dict:
    """Row 3i, end-to-end: issue 30's own loop, `a = a * 1.0001 + 0.001` 2,000 times on 1,024 floats,
    read once; fused on the CPU backing (set_fusion), and again plainly."""

    def loop(a: torch.Tensor) -> torch.Tensor:
        for _ in range(2000):
            a = a * 1.0001 + 0.001
        return a

    x = torch.ones(1024)
    xl = x.to(LAZY)
    sync()
    r = e2e(lambda: loop(xl), lambda: loop(x), lambda t: t.sum().item(), reps, warmup=2)
    r["equal"] = r["lazy_val"] == r["eager_val"]
    torch_lazymem.set_fusion(False)
    try:
        plain = e2e(lambda: loop(xl), lambda: loop(x), lambda t: t.sum().item(), reps, warmup=2)
    finally:
        torch_lazymem.set_fusion(True)
    r["plain"], r["plain_eager"] = plain["lazy"], plain["eager"]
    return r


def bench_mlp(batch: int, width: int, layers: int, reps: int) -> dict:
    """Row 4, end-to-end (b): MLP forward, then .cpu() of the output."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(batch, width, generator=g)
    params = [(torch.randn(width, width, generator=g) / width**0.5, torch.randn(width, generator=g))
              for _ in range(layers)]
    xl = x.to(LAZY)
    params_l = [(w.to(LAZY), b.to(LAZY)) for w, b in params]
    sync()

    def mlp(h: torch.Tensor, ps: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        for w, b in ps:
            h = F.relu(F.linear(h, w, b))
        return h

    r = e2e(lambda: mlp(xl, params_l), lambda: mlp(x, params), lambda t: t.cpu(), reps, warmup=1)
    r["equal"] = torch.equal(r["lazy_val"], r["eager_val"])
    return r


def verdict(value: float, goal: float) -> str:
    return "yes" if value <= goal else "NO"


def meta(st: dict) -> str:
    return f"meta hits/misses {st['meta_cache_hits']}/{st['meta_cache_misses']} (incl. warm-up)"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer ops and repetitions")
    ap.add_argument("--stat", choices=sorted(AGG), default="median",
                    help="statistic over the timed repetitions (min is steadier on a busy machine)")
    args = ap.parse_args()
    global agg
    agg = AGG[args.stat]
    if args.quick:
        n_cached, n_uncached, n_tiny, reps, mlp_reps = 4000, 1000, 10_000, 3, 2
    else:
        n_cached, n_uncached, n_tiny, reps, mlp_reps = 20_000, 5000, 10_000, 7, 5
    batch, width, layers = 512, 2048, 4

    start = time.perf_counter()
    us_cached, us_eager, st1 = bench_cached(n_cached, reps)
    us_uncached, st2 = bench_uncached(n_uncached, reps)
    a = bench_tiny(n_tiny, reps)
    ai = bench_issue_loop(reps)
    torch_lazymem.set_pipeline(True)  # (a) again, executed on a worker while it is recorded
    try:
        torch_lazymem.reset_stats()
        ap = bench_tiny(n_tiny, reps)
        ap["batches"] = torch_lazymem.stats()["pipelined_flushes"]
    finally:
        torch_lazymem._C._pipeline_drain()
        torch_lazymem.set_pipeline(None)
    b = bench_mlp(batch, width, layers, mlp_reps)
    total = time.perf_counter() - start

    ra, rb, rap = a["lazy"] / a["eager"], b["lazy"] / b["eager"], ap["lazy"] / ap["eager"]
    ms = 1e3
    rows = [
        ("1. record, cached meta (us/op)", f"{us_cached:.2f}", f"{us_eager:.2f}",
         f"{us_cached / us_eager:.2f}x", "<= 1 us/op", verdict(us_cached, 1.0),
         f"{n_cached} ops; {meta(st1)}"),
        ("2. record, uncached meta (us/op)", f"{us_uncached:.2f}", "-", "-", "-", "",
         f"{n_uncached} ops; {meta(st2)}"),
        ("3. (a) tiny ops + .item() (ms)", f"{a['lazy'] * ms:.2f}", f"{a['eager'] * ms:.2f}",
         f"{ra:.2f}x", "<= 2.0x", verdict(ra, 2.0), f"{n_tiny} ops on 16 floats"),
        ("   (a) record / replay (ms)", f"{a['record'] * ms:.2f} / {a['replay'] * ms:.2f}", "", "", "", "",
         f"record {a['record'] / n_tiny * 1e6:.2f} us/op, replay {a['replay'] / n_tiny * 1e6:.2f} us/op"),
        ("3i. issue 30's loop (ms)", f"{ai['lazy'] * ms:.2f}", f"{ai['eager'] * ms:.2f}",
         f"{ai['lazy'] / ai['eager']:.2f}x", "<= 1.0x", verdict(ai['lazy'] / ai['eager'], 1.0),
         f"a = a * 1.0001 + 0.001, 2,000 times on 1,024 floats; equal to eager: {ai['equal']}"),
        ("   not fused (ms)", f"{ai['plain'] * ms:.2f}", f"{ai['plain_eager'] * ms:.2f}",
         f"{ai['plain'] / ai['plain_eager']:.2f}x", "", "", "torch_lazymem.set_fusion(False)"),
        ("3p. (a) pipelined (ms)", f"{ap['lazy'] * ms:.2f}", f"{ap['eager'] * ms:.2f}",
         f"{rap:.2f}x", "<= 1.0x", verdict(rap, 1.0),
         f"set_pipeline(True): {ap['batches']} batches on the worker; equal to eager: {ap['equal']}"),
        ("   (a) pipelined record / rest (ms)", f"{ap['record'] * ms:.2f} / {ap['replay'] * ms:.2f}", "", "", "", "",
         "recording while the worker runs / what is left at the sync"),
        ("4. (b) MLP forward + .cpu() (ms)", f"{b['lazy'] * ms:.1f}", f"{b['eager'] * ms:.1f}",
         f"{rb:.3f}x", "<= 1.05x", verdict(rb, 1.05),
         f"batch {batch}, {layers}x linear {width}x{width} + ReLU"),
        ("   (b) record / replay (ms)", f"{b['record'] * ms:.2f} / {b['replay'] * ms:.1f}", "", "", "", "",
         f"bitwise equal to eager: {b['equal']}"),
    ]
    head = ("measurement", "lazymem", "eager CPU", "ratio", "goal", "ok", "notes")
    print(f"torch {torch.__version__} | threads {torch.get_num_threads()} | "
          f"backing device {torch_lazymem.backing_device()} | torch_lazymem {torch_lazymem.__version__}")
    print(f"{args.stat} of {reps} reps ({mlp_reps} for the MLP) after warm-ups; time.perf_counter"
          f"{' | --quick' if args.quick else ''}")
    print()
    print_table(head, rows)
    print()
    print(f"(a) .item() equal to eager: {a['equal']}; total benchmark time {total:.1f} s")


if __name__ == "__main__":
    main()
