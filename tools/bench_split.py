"""Batch-splitting benchmark: lazymem vs eager on the simulated memory-capped device, in one run.

Models in float32 — an MLP (256-1024-1024-10), a small transformer classifier (token embedding, two
pre-norm nn.TransformerEncoderLayer, mean pooling, linear head; 64 tokens of width 64) and a
BatchNorm CNN (training only) — the first two in inference (``torch.no_grad()``, logits read with
``.cpu()``) and training (forward, cross-entropy, ``backward``, AdamW ``step``, ``zero_grad``,
``loss.item()``); the transformer again with ``clip_grad_norm_`` between backward and step; a
transformers BERT classifier with an attention mask (padded sequences: the mask is checked inside the
forward, a sync); a GPT-2 with the real 50,257-token vocabulary and the language-model loss written
by hand (``cross_entropy(logits[:, :-1].reshape(-1, V), ids[:, 1:].reshape(-1))``); a GAN whose step
takes two optimizer steps (the discriminator's, then the generator's through the updated
discriminator); an MLP whose batch is drawn on the device each step (``multinomial`` over sampling
weights, then ``x[idx]``, ``y[idx]`` from a dataset held there). Eager runs under
``memory_cap(capacity)`` with its model, optimizer state and batch on the "device"; lazymem runs the
same unmodified step under ``simulated_device(capacity)`` with the batch uploaded from host memory.

(a) Eager's largest fitting batch B_e is found (doubling, then bisection to 1/32); both run it and
    the ratio eager time / lazymem time per step is the throughput ratio (goals: >= 0.97 inference,
    >= 0.95 training).
(b) lazymem runs batches of 2, 4, ... up to --max-factor times B_e (a batch that fails ends the search);
    the largest it completes, and its throughput per sample relative to eager's at B_e (goals:
    >= 32x the batch, >= 0.9 of the throughput).
(c) For every lazymem step timed: the memory model's predicted peak vs the measured peak, and the
    measured peak vs the capacity (goal: within +-2%; never above the capacity).
(d) Planning time per node (torch_lazymem.stats() plan_ns / nodes_planned) over the timed steps.
(e) Plan reuse: per training case at lazymem's largest batch, planning time of the first step, the
    warm-up steps until a plan is first reused (each new chunk size run teaches the workspace model,
    and plans made before it learned are not reused), the later steps (their programs have the
    first's structure: the plan cache instantiates the stored plan; median and max, goal <= 10 us +
    0.1 us per node) and a later step with the cache off.
(f) Values crossing passes that do not fit the device (the BatchNorm CNN's activations at its
    largest batch): time per step when they are recomputed chunk by chunk (the default) and when
    they are held in host memory (set_recompute(False)).

A lazymem loss that differs from eager's beyond float32 tolerance (split results equal unsplit up to
reassociation) is flagged. Steps are timed after warm-up (lazymem's first steps pay meta inference
and learn kernel workspace), interleaved with eager's, median of --steps. Like bench_train.py, the
script re-executes itself with glibc's malloc thresholds raised (a caching allocator on both sides).

    PYTHONPATH=. python tools/bench_split.py [--quick] [--steps 5] [--max-factor 64]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import os
import statistics
import subprocess
import sys
import time
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _split_cases import CASES, Case, MiB  # noqa: E402
from bench_train import reexec_for_malloc  # noqa: E402

import torch_lazymem  # noqa: E402
from torch_lazymem.testing import eager_max_memory_allocated, memory_cap, no_plan_reuse, simulated_device  # noqa: E402


class Runner:
    """One side (eager or lazymem) of a case: its model and optimizer live on the capped device."""

    def __init__(self, case: Case, base: nn.Module, lazy: bool) -> None:
        self.case, self.lazy = case, lazy
        with self.cap():
            # (Eager's copy is cloned: memory_cap cannot count the storages a deep copy gives buffers.)
            self.model = copy.deepcopy(base).to("lazymem") if lazy else copy.deepcopy(base)._apply(torch.clone)
            if not case.training:
                self.opts: list[torch.optim.Optimizer] = []
            elif case.optimizers:
                self.opts = case.optimizers(self.model)
            else:
                self.opts = [torch.optim.AdamW(self.model.parameters(), lr=1e-3)]
            if lazy:
                torch.lazymem.synchronize()
        self.model.train(case.training)

    def cap(self) -> contextlib.AbstractContextManager[None]:
        return simulated_device(self.case.capacity) if self.lazy else memory_cap(self.case.capacity)

    def step(self, batch: tuple[torch.Tensor, ...], seed: int = 0) -> float:
        """One step under the cap; returns the loss (training) or the logits' sum (inference). The
        device's generator is seeded first: eager and lazymem draw the same dropout masks."""
        torch.manual_seed(seed)
        with self.cap():
            b = tuple(t.to("lazymem") for t in batch) if self.lazy else tuple(t.clone() for t in batch)
            if not self.case.training:
                with torch.no_grad():
                    return float(self.model(b[0]).cpu().double().sum())
            if self.case.step:
                return self.case.step(self.model, self.opts, b).item()
            loss = self.case.loss(self.model, b) if self.case.loss else F.cross_entropy(self.model(b[0]), b[1])
            loss.backward()
            if self.case.clip is not None:
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.case.clip)
            self.opts[0].step()
            self.opts[0].zero_grad()
            return loss.item()

    def peak(self) -> int:
        return torch.lazymem.max_memory_allocated() if self.lazy else eager_max_memory_allocated()

    def reset_peak(self) -> None:
        if self.lazy:
            torch.lazymem.reset_peak_memory_stats()


def completes(case: Case, base: nn.Module, rows: int, lazy: bool) -> bool:
    """True if two steps of `rows` (the second with the optimizer state resident) fit the capacity."""
    try:
        r = Runner(case, base, lazy)
        for s in range(2 if case.training else 1):
            r.step(case.batch(rows, s), s)
        if lazy and r.peak() > case.capacity:
            raise AssertionError(f"lazymem peak {r.peak()} above the capacity {case.capacity}")
        return True
    except torch.OutOfMemoryError:
        return False
    finally:
        torch.lazymem.synchronize()


def largest_eager(case: Case, base: nn.Module) -> int:
    lo, hi = 0, 16
    while completes(case, base, hi, lazy=False):
        lo, hi = hi, hi * 2
    while hi - lo > max(1, lo // 32):
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if completes(case, base, mid, lazy=False) else (lo, mid)
    return lo


@dataclasses.dataclass
class Timing:
    eager_ms: float | None
    lazy_ms: float
    chunks: int
    predicted_vs_measured: list[float]   # per timed lazymem step: predicted / measured peak
    peak_vs_capacity: float               # highest measured / capacity
    plan_us_per_node: float
    loss_close: bool


def time_steps(case: Case, base: nn.Module, rows: int, steps: int, with_eager: bool) -> Timing:
    lazy = Runner(case, base, lazy=True)
    eager = Runner(case, base, lazy=False) if with_eager else None
    warm = 2
    e_ms: list[float] = []
    l_ms: list[float] = []
    ratios: list[float] = []
    worst_peak = 0
    chunks = 0
    loss_close = True
    plan_ns = nodes = 0
    for s in range(warm + steps):
        batch = case.batch(rows, s)
        order = (True, False) if s % 2 else (False, True)
        for is_lazy in order:
            if not is_lazy and eager is None:
                continue
            r = lazy if is_lazy else eager
            assert r is not None
            r.reset_peak()
            torch_lazymem.reset_stats()
            t0 = time.perf_counter()
            value = r.step(batch, s)
            if is_lazy:
                torch.lazymem.synchronize()
            ms = (time.perf_counter() - t0) * 1e3
            if s < warm:
                if is_lazy:
                    lazy_value = value
                else:
                    eager_value = value
                continue
            if is_lazy:
                st = torch_lazymem.stats()
                l_ms.append(ms)
                ratios.append(st["predicted_peak_bytes"] / max(1, st["peak_bytes"]))
                worst_peak = max(worst_peak, r.peak())
                chunks = max(chunks, st["chunks"] if st["splits"] else 1)
                plan_ns += st["plan_ns"]
                nodes += st["nodes_planned"]
            else:
                e_ms.append(ms)
        if s == 0 and eager is not None:
            loss_close = abs(lazy_value - eager_value) <= 1e-4 * abs(eager_value) + 1e-4
    return Timing(statistics.median(e_ms) if e_ms else None, statistics.median(l_ms), chunks, ratios,
                  worst_peak / case.capacity, plan_ns / 1e3 / max(1, nodes), loss_close)


def plan_reuse(case: Case, base: nn.Module, rows: int, steps: int) -> str:
    """Planning time of the first step, of later steps once plans are reused (median of `steps`) and of
    a later step planned anew. The steps between the first and the first reused plan are warm-up: each
    ran a new chunk size and taught the workspace model something the plans before were made without
    (the workspace generation is part of the plan's key), so each planned afresh."""
    r = Runner(case, base, lazy=True)

    def run(s: int) -> dict[str, int]:
        torch_lazymem.reset_stats()
        with r.cap():
            r.step(case.batch(rows, s), s)
            torch.lazymem.synchronize()
        return torch_lazymem.stats()

    with no_plan_reuse():
        pass  # (turning the cache off empties it: the first step plans, whatever ran before in this process)
    first = run(0)["plan_ns"] / 1e3
    s = 1
    while s <= 8 and not run(s)["plans_reused"]:
        s += 1
    warm = s  # steps before the first reused plan, the first included (at most 9)
    later, nodes, reused = [], 0, 0
    for k in range(steps):
        st = run(s + 1 + k)
        later.append(st["plan_ns"] / 1e3)
        nodes = st["nodes_planned"]
        reused += st["plans_reused"]
    med = statistics.median(later)
    with r.cap(), no_plan_reuse():
        torch_lazymem.reset_stats()
        r.step(case.batch(rows, s + 1 + steps), s + 1 + steps)
        torch.lazymem.synchronize()
    anew = torch_lazymem.stats()["plan_ns"] / 1e3
    goal = 10 + 0.1 * nodes
    return (f"| {case.name} | {rows} | {nodes} | {first:.0f} | {warm} | {med:.1f}{'' if med <= goal else ' (miss)'} "
            f"| {goal:.1f} | {max(later):.0f} | {anew:.0f} | {reused}/{steps} |")


def cross_pass(case: Case, base: nn.Module, rows: int, steps: int) -> str | None:
    """Values crossing passes that do not fit the device: recomputed (set_recompute(True)), held in host
    memory (False), and the planner's priced choice (None, the default), median ms per step of each
    (None if the plan has no such value), with the bytes the host variant copies."""
    results = {}
    for mode in (True, False, None):
        torch_lazymem.set_recompute(mode)
        try:
            r = Runner(case, base, lazy=True)
            ms: list[float] = []
            counts = (0, 0)
            moved = copy_ms = wait_ms = 0.0
            for s in range(steps + 2):
                torch_lazymem.reset_stats()
                t0 = time.perf_counter()
                r.step(case.batch(rows, s), s)
                torch.lazymem.synchronize()
                if s >= 2:
                    ms.append((time.perf_counter() - t0) * 1e3)
                st = torch_lazymem.stats()
                counts = (st["values_recomputed"], st["values_in_host_memory"])
                moved = (st["h2d_bytes"] + st["d2h_bytes"]) / MiB
                copy_ms = (st["h2d_ns"] + st["d2h_ns"]) / 1e6
                wait_ms = st["copy_wait_ns"] / 1e6
            results[mode] = (statistics.median(ms), counts, moved, (copy_ms, wait_ms))
        finally:
            torch_lazymem.set_recompute(None)
    rec_ms, (rec_n, _), _, _ = results[True]
    host_ms, (_, host_n), moved, (copy_ms, wait_ms) = results[False]
    auto_ms, (auto_rec, auto_host), _, _ = results[None]
    if rec_n == 0 and host_n == 0:
        return None
    chose = "recompute" if auto_rec and not auto_host else "host memory" if auto_host and not auto_rec else "both"
    best = min(rec_ms, host_ms)
    return (f"| {case.name} | {rows} | {rec_n} | {rec_ms:.0f} | {host_n} | {moved:.0f} | {copy_ms:.0f} ({wait_ms:.0f}) | {host_ms:.0f} "
            f"| {chose} | {auto_ms:.0f} | {fmt_ratio(auto_ms / best, 1.1, lower=True)} |")


def fmt_ratio(x: float, goal: float, lower: bool = False) -> str:
    """`x` to two places, marked when it misses `goal` (at least it; at most with `lower`)."""
    ok = x <= goal if lower else x >= goal
    return f"{x:.2f}{'' if ok else ' (miss)'}"


def step_seconds(r: Runner, rows: int, steps: range) -> list[float]:
    """Wall time of each of `steps` (its seed and batch) on `r`."""
    times = []
    for k in steps:
        t0 = time.perf_counter()
        r.step(r.case.batch(rows, k), k)
        times.append(time.perf_counter() - t0)
    return times


def eager_first_step(case: Case, base: nn.Module, rows: int) -> str:
    """Eager's first step and the fastest of 3 later ones (ms) in this fresh process, for (g)."""
    times = step_seconds(Runner(case, base, lazy=False), rows, range(4))
    return f"{times[0] * 1e3:.0f} / {min(times[1:]) * 1e3:.0f}"


def first_step(case: Case, base: nn.Module, rows: int) -> str:
    """One lazymem step of `rows` in this (fresh) process: the memory model has seen none of its
    kernels; predicted / measured peak of every plan of the step, and the out-of-memory retries. Then
    its wall time against the fastest of 3 later steps (issue 30 item 5's goal: at most 2x a later
    step, or 50 ms more), and how much of it was torch's one-time import of torch._dynamo (the first
    Python meta kernel's: README, Known limits)."""
    r = Runner(case, base, lazy=True)
    torch_lazymem.reset_stats()
    r.reset_peak()
    had_dynamo = "torch._dynamo" in sys.modules
    (first,) = step_seconds(r, rows, range(1))
    st = torch_lazymem.stats()
    ratio = st["predicted_peak_bytes"] / max(1, st["peak_bytes"])
    best = min(step_seconds(r, rows, range(1, 4)))
    goal = max(2 * best, best + 0.05)
    dynamo = "no" if had_dynamo or "torch._dynamo" not in sys.modules else "yes"
    return (f"| {case.name} | {rows} | {st['predicted_peak_bytes'] / MiB:.2f} | {st['peak_bytes'] / MiB:.2f} "
            f"| {fmt_ratio(ratio, 0.98)} | {st['oom_retries']} | {r.peak() / case.capacity:.3f} "
            f"| {first * 1e3:.0f} | {best * 1e3:.0f} | {'ok' if first <= goal else 'miss'} | {dynamo} |")


def last_line(p: subprocess.CompletedProcess[str], n: int) -> str:
    """The first `n` characters of a failed run's last stderr line (its exception)."""
    return (p.stderr.strip().splitlines() or ["?"])[-1][:n]


def selected(case: Case, words: list[str]) -> bool:
    """Whether --cases picks `case` (its name holds one of `words`; every case when empty)."""
    return not words or any(w in case.name for w in words)


def first_steps(factor: int, words: list[str]) -> int:
    """(g): each case's first step (those whose name holds one of `words`, all when empty) in a fresh
    process, at eager's largest batch times `factor`."""
    print(f"(g) the first step of each case in a fresh process at {factor}x eager's largest batch: predicted and "
          "measured peak (MiB) of the step's last plan (backward and the optimizer step), their ratio (goal 0.98-1.02), out-of-memory retries "
          "(goal 0), measured peak / capacity; the first step's wall time (ms) against the fastest of 3 later steps "
          "(goal: at most 2x, or 50 ms more), whether it imported torch._dynamo (the first Python meta kernel's "
          "one-time import); eager's first and fastest later step (ms) at its own largest batch, in a fresh process "
          "of its own\n")
    print("| case | batch | predicted | measured | ratio | retries | peak / capacity | first ms | later ms | item 5 "
          "| imported dynamo | eager first / later ms |\n|---|---|---|---|---|---|---|---|---|---|---|---|")
    for i, case in enumerate(CASES):
        if not selected(case, words):
            continue
        torch.manual_seed(0)
        b_e = largest_eager(case, case.model())
        cmd = [sys.executable, __file__, "--first-step-case", str(i)]
        # (Eager runs its own largest batch: FACTOR times it does not fit eager's capacity.)
        out, eager = (subprocess.run(cmd + extra, capture_output=True, text=True)
                      for extra in (["--rows", str(b_e * factor)], ["--rows", str(b_e), "--eager"]))
        eager_cell = (f"{eager.stdout.strip()} at {b_e}" if eager.returncode == 0 else
                      f"failed at {b_e}: {last_line(eager, 120)}")
        print(f"{out.stdout.strip()} {eager_cell} |" if out.returncode == 0 else f"| {case.name} | {b_e * factor} | failed: "
              f"{last_line(out, 200)} |", flush=True)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--first-step", type=int, metavar="FACTOR",
                        help="only table (g): each case's first step in a fresh process at FACTOR x eager's largest")
    parser.add_argument("--first-step-case", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--rows", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--eager", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true", help="fewer steps, max factor 8")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--max-factor", type=int, default=64)
    parser.add_argument("--no-malloc-tuning", action="store_true")
    parser.add_argument("--cases", help="run only the cases whose name contains one of these comma-separated words")
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    if args.first_step_case is not None:
        torch.manual_seed(0)
        case = CASES[args.first_step_case]
        print((eager_first_step if args.eager else first_step)(case, case.model(), args.rows))
        return 0
    words = [w.strip() for w in args.cases.split(",")] if args.cases else []
    if args.first_step:
        return first_steps(args.first_step, words)
    reexec_for_malloc(not args.no_malloc_tuning)
    steps = 3 if args.quick else args.steps
    max_factor = 8 if args.quick else args.max_factor
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, float32, simulated device; "
          f"median of {steps} steps after 2 warm-up steps\n")
    rows_a, rows_b, rows_c, rows_e, rows_f = [], [], [], [], []
    for case in CASES:
        if not selected(case, words):
            continue
        torch.manual_seed(0)
        base = case.model()
        b_e = largest_eager(case, base)
        a = time_steps(case, base, b_e, steps, with_eager=True)
        assert a.eager_ms is not None
        ratio_a = a.eager_ms / a.lazy_ms
        rows_a.append(f"| {case.name} | {case.capacity // MiB} MiB | {b_e} | {a.eager_ms:.1f} | {a.lazy_ms:.1f} "
                      f"| {a.chunks} | {fmt_ratio(ratio_a, 0.95 if case.training else 0.97)} "
                      f"| {'yes' if a.loss_close else 'NO'} |")
        best, factor = None, 2
        while factor <= max_factor and completes(case, base, b_e * factor, lazy=True):
            best, factor = factor, factor * 2
        if best is None:
            rows_b.append(f"| {case.name} | {b_e} | - | - | - | - | - |")
            timings = [a]
        else:
            b = time_steps(case, base, b_e * best, steps, with_eager=False)
            per_sample = (a.eager_ms / b_e) / (b.lazy_ms / (b_e * best))
            limit = " (the bench's limit)" if best * 2 > max_factor else ""
            rows_b.append(f"| {case.name} | {b_e} | {b_e * best}{limit} | {fmt_ratio(best, 32)}x | {b.chunks} "
                          f"| {b.lazy_ms:.0f} | {fmt_ratio(per_sample, 0.9)} |")
            timings = [a, b]
            if case.training:
                rows_e.append(plan_reuse(case, base, b_e * best, max(steps, 9)))
                row_f = cross_pass(case, base, b_e * best, steps)
                if row_f:
                    rows_f.append(row_f)
        for label, t in zip(("eager's largest", "lazymem's largest"), timings):
            r = t.predicted_vs_measured
            rows_c.append(f"| {case.name}, {label} | {len(r)} | {min(r):.3f} | {statistics.median(r):.3f} | "
                          f"{max(r):.3f} | {t.peak_vs_capacity:.3f} | {t.plan_us_per_node:.2f} |")
        sys.stdout.write(".")
        sys.stdout.flush()
    print("\n\n(a) at eager's largest fitting batch: time per step, throughput ratio eager ms / lazymem ms "
          "(goals >= 0.97 inference, >= 0.95 training)\n")
    print("| case | capacity | batch | eager ms | lazymem ms | chunks | ratio | loss close |\n|---|---|---|---|---|---|---|---|")
    print("\n".join(rows_a))
    print(f"\n(b) largest batch under the same capacity (lazymem tried up to {max_factor}x eager's), throughput "
          "per sample at each side's largest (goals >= 32x, >= 0.9)\n")
    print("| case | eager largest | lazymem largest | batch ratio | chunks | lazymem ms per step "
          "| per-sample throughput ratio |\n|---|---|---|---|---|---|---|")
    print("\n".join(rows_b))
    print("\n(c) predicted / measured peak per timed lazymem step (goal 0.98-1.02), highest measured peak / "
          "capacity (must be <= 1), and (d) planning time per node\n")
    print("| run | steps | min | median | max | peak / capacity | planning us/node |\n|---|---|---|---|---|---|---|")
    print("\n".join(rows_c))
    print("\n(e) plan reuse at lazymem's largest batch: planning time (us) of the first step, steps until a plan "
          f"is first reused, the {max(steps, 9)} later steps (median; goal <= 10 us + 0.1 us per node; and max) and "
          "a later step with the plan cache off\n")
    print("| case | batch | nodes | first step us | warm-up steps | later steps us | goal us | max us | cache off us "
          "| plans reused / later steps |\n|---|---|---|---|---|---|---|---|---|---|")
    print("\n".join(rows_e))
    print("\n(f) values crossing passes that do not fit the device, at lazymem's largest batch: recomputed chunk by "
          "chunk (set_recompute(True)), held in host memory (False) across the simulated device's modeled 25 GB/s "
          "link, and the planner's priced choice (the default); median ms per step, MiB the host variant copies "
          "each way together and its copies' ms (last step; in parentheses the ms the executor waited for copies started a "
          "chunk ahead — the rest overlapped computing), and the choice's ms / the faster one's (goal <= 1.1)\n")
    print("| case | batch | values recomputed | recompute ms | values in host memory | MiB copied | copy ms (waited) | host ms "
          "| planner's choice | its ms | / faster |\n|---|---|---|---|---|---|---|---|---|---|---|")
    print("\n".join(rows_f) if rows_f else "| (no case had values crossing passes that did not fit) |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
