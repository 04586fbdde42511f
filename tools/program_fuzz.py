"""Whole-program fuzzer: random training (and inference) programs from a small grammar, each run in
float64 by eager CPU and by lazymem on a simulated device capped at a random 5-100% of eager's
peak, with random allocation failures injected, and compared.

    python tools/program_fuzz.py [--programs 2000] [--seed 0] [--jobs 2] [--timeout 300]
    python tools/program_fuzz.py --replay SEED      # one program: its text, its outcome
    python tools/program_fuzz.py --graphs           # each program 4 times, CUDA graphs emulated
    python tools/program_fuzz.py --worker 9042,9110 # seeds in this process, in order: a JSON line each

The grammar (tools/program_grammar.py):
  inputs   vectors (B, F), images (B, C, H, W), tokens (B, T) through an embedding (in 40% of them, from a
           stream of their own, with BERT's token types: a constant buffer expanded to the batch and
           embedded), sequences (B, T, F)
  layers   linear, conv, batch norm (training or eval mode), layer norm, group norm, attention with
           a padding or causal mask, LSTM / GRU, embedding, dropout, residual blocks
  random   random ops after any layer (so over the layout it leaves: a linear's, a convolution's, a
           sequence model's, a transpose, a slice of the batch): *_like noise, a rand_like mask, a
           bernoulli mask with a tensor p, normal with tensor mean and std, functional dropout
  memory   values crossing passes held in host memory (set_recompute(False)) in a quarter of the
           programs, always recomputed in a tenth, priced in the rest; the simulated device checks that
           every kernel operand is in device memory (LAZYMEM_CHECK_BOUNDARY=1)
  acts     relu / gelu / tanh / silu, or in 40% of programs (a stream of their own) leaky_relu / elu /
           hardswish / softplus / hardtanh / mish / hardsigmoid / selu, some in place
  losses   cross entropy (class weights, label smoothing), MSE on a regression head
  loops    loss read before or after backward, two backwards over the halves of the batch before one
           step, clip_grad_norm_, GradScaler, a sync inside the forward, slices of the batch through
           two towers joined by cat, mixup's x[perm], SGD or AdamW, inference under no_grad; from a
           stream of their own (issue 31): the batch drawn on the device from a dataset held there
           (randint or multinomial, then x[idx], y[idx]), and a second optimizer step in the program
           (an auxiliary head trained on the output detached, then the loss through the updated head),
           and a codebook of 2,048 rows read by softmax over it before the head (a parameter whose
           optimizer temporaries may fit only in blocks of its rows)

Each program prints one of:
  ok        equal to eager (assert_close defaults), measured peak within the cap
  oom       torch.OutOfMemoryError, by cause: `unsplittable` (explain(): a value that must be held
            whatever the chunk size exceeds the cap, the message names one value larger than the
            cap, or a program with no batch needs more than the cap for what it holds before it runs,
            the new values that outlive it and one allocation), `barrier` (an op that runs whole),
            `torn` (a loop that updates an earlier value in place ran out of memory part way: the
            value is lost, not recomputed twice), `other`
  WRONG     a result differs from eager                         (a bug)
  OVER      the measured peak went over the cap                 (a bug)
  ERROR     any other exception                                 (a bug)
  CRASH     the worker process died                             (a bug)
  HANG      the program ran over --timeout seconds: its worker was killed    (a bug)
  HISTORY   ran out of memory (cause `other`) after the programs before it in its worker, and
            fits when run again alone in a new worker: what they taught lazymem (kernel workspace,
            node times, chunk sizes) made a program that fits run out of memory   (a bug)
A bug prints its seed and the program's minimal form (features removed while it still fails).
Exit status 1 on any bug. Programs with random ops are compared with eager like any other: with the
same seed, a split program draws eager's numbers (DESIGN.md §7 RNG).

PROGRAM_FUZZ_WITHOUT=wide,... draws each seed without those features: a seed that found a bug before
a feature joined the grammar replays the program that found it (test_program_fuzz.py does).

Programs run in worker processes (tools/_workers.py), --jobs at once, each worker taking every
jobs-th seed in order (a program runs after the ones before it in its worker, with what they taught
lazymem); each streams its records (JSON lines) to a file, so a worker that dies keeps what it
finished. A worker that dies in a program is a CRASH of that program (a HANG if it wrote nothing
for --timeout seconds: it is killed); its remaining seeds go on in a new worker. A worker that dies
before its first line (before any program) is rerun one seed per process, and a seed whose worker
dies so alone is a CRASH. Self-tests of that handling: PROGRAM_FUZZ_FAKE_CRASH=s1,s2 makes a worker
segfault when it reaches those seeds, PROGRAM_FUZZ_FAKE_HANG=... hang there, and
PROGRAM_FUZZ_FAKE_STARTUP_CRASH=... segfault before its first line when it holds one of them.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import json
import os
import re
import signal
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path

if str(Path(__file__).resolve().parent) not in sys.path:  # tools/ is not a package: _workers is a sibling
    sys.path.insert(0, str(Path(__file__).resolve().parent))
import _workers  # noqa: E402

# Kernels are handed device memory only: a value held in host memory reaching one is an internal error
# (the simulated device checks it under its cap anyway; this covers the uncapped runs too).
os.environ.setdefault("LAZYMEM_CHECK_BOUNDARY", "1")

import torch  # noqa: E402
from program_grammar import Spec, draw, run_program  # noqa: E402

# ---------------------------------------------------------------------------------------------------
# One program against eager.


_SIZE = re.compile(r"([0-9.]+) (bytes|KiB|MiB|GiB)")
_UNITS = {"bytes": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}


def named_sizes(message: str) -> list[int]:
    """The sizes of the single values an out-of-memory message names: the value being materialized
    ("while materializing ... (120.00 KiB)") and the refused allocation ("Tried to allocate ...")."""
    out = []
    first = message.split(". ", 1)[0]
    if "while materializing" in first:
        out += [int(float(n) * _UNITS[u]) for n, u in _SIZE.findall(first)]
    for m in re.finditer(r"Tried to allocate ([0-9.]+) (bytes|KiB|MiB|GiB)", message):
        out.append(int(float(m.group(1)) * _UNITS[m.group(2)]))
    return out


def classify_oom(message: str, cap: int) -> str:
    # Justified by the plan: a value held whatever the chunk size, or one single value larger than
    # the device (a parameter, a weight's gradient or optimizer state, a value that cannot split).
    if "was being updated in place chunk by chunk" in message:
        return "torn"  # a loop updating an earlier value in place ran out of memory part way (README)
    if "must be held whatever the chunk size" in message or "larger than the" in message:
        return "unsplittable"
    if any(size > cap for size in named_sizes(message)):
        return "unsplittable"
    # A program with no batch at all (an optimizer step planned on its own) whose whole run does not
    # fit: what is held before it runs, the new values that outlive it (the optimizer's state) and
    # one allocation it must make exceed the cap (a plan refused over a budget nothing enforces, as
    # --budget-only runs, made none: what is held and what outlives it exceed the cap alone).
    held = re.search(r"of which ([0-9.]+) (bytes|KiB|MiB|GiB) is held before the program runs and "
                     r"([0-9.]+) (bytes|KiB|MiB|GiB) by new values that outlive it", message)
    asked = re.search(r"Tried to allocate ([0-9.]+) (bytes|KiB|MiB|GiB)", message)
    if "no data leaf" in message and held:
        need = sum(float(held.group(i)) * _UNITS[held.group(i + 1)] for i in (1, 3))
        if need + (float(asked.group(1)) * _UNITS[asked.group(2)] if asked else 0) > cap:
            return "unsplittable"
    if "barrier" in message or "runs whole" in message or "run whole" in message:
        return "barrier"
    return "other"


def check_graphs(spec: Spec, expected: list[torch.Tensor]) -> dict:
    """--graphs: the program four times, uncapped, with CUDA graphs emulated (the third run on
    replays its plans' pieces): each run equal to eager."""
    import torch_lazymem
    from torch_lazymem.testing import emulated_cuda_graphs
    torch_lazymem.reset_stats()
    result: dict = {"seed": spec.seed, "cap": 0, "eager_peak": 0}
    try:
        with emulated_cuda_graphs():
            for run in range(4):
                got = run_program(spec, "lazymem")
                torch.lazymem.synchronize()
                assert len(got) == len(expected), (len(got), len(expected))
                for a, b in zip(got, expected):
                    torch.testing.assert_close(a, b, msg=lambda m, run=run: f"run {run + 1}: {m}")
    except AssertionError as e:
        return dict(result, status="WRONG", detail=str(e)[:600])
    except Exception as e:  # noqa: BLE001 - every exception is a finding
        return dict(result, status="ERROR", detail="".join(traceback.format_exception(e))[-1500:])
    stats = torch_lazymem.stats()
    return dict(result, status="ok", peak=0, split=False, retries=0, row_loops=False,
                graph_nodes=stats["cuda_graph_nodes"], plain_nodes=stats["cuda_graph_plain_nodes"])


def check(spec: Spec) -> dict:
    import torch_lazymem
    from torch_lazymem.testing import (
        eager_max_memory_allocated,
        fail_allocation,
        memory_cap,
        simulated_device,
    )
    with memory_cap(1 << 45):
        expected = run_program(spec, "cpu")
        peak = eager_max_memory_allocated()
    if os.environ.get("PROGRAM_FUZZ_GRAPHS") == "1":
        return check_graphs(spec, expected)
    cap = max(int(peak * spec.cap_fraction), 64 << 10)
    torch.lazymem.synchronize()
    torch_lazymem.reset_stats()
    result = {"seed": spec.seed, "cap": cap, "eager_peak": peak}
    previous = torch_lazymem.recompute()
    try:
        if spec.recompute is not None:  # (None: as configured, LAZYMEM_RECOMPUTE; priced by default)
            torch_lazymem.set_recompute(spec.recompute)
        # --budget-only: the cap is a memory budget on a device four times larger, which no allocator
        # enforces: the plan itself must stay within it, or raise (a plan the model put over its
        # budget once ran anyway).
        budget_only = os.environ.get("PROGRAM_FUZZ_BUDGET_ONLY") == "1"
        with simulated_device(4 * cap if budget_only else cap):
            if budget_only:
                torch_lazymem.set_memory_budget(cap)
            torch.lazymem.reset_peak_memory_stats()
            if spec.fail_at:
                fail_allocation(spec.fail_at)
            got = run_program(spec, "lazymem")
            torch.lazymem.synchronize()
            lazy_peak = torch.lazymem.max_memory_allocated()
    except torch.OutOfMemoryError as e:
        msg = str(e)
        cause = classify_oom(msg, cap)
        return dict(result, status="oom", cause=cause, detail=msg[:3000])
    except Exception as e:  # noqa: BLE001 - every other exception is a finding
        return dict(result, status="ERROR", detail="".join(traceback.format_exception(e))[-1500:])
    finally:
        with contextlib.suppress(Exception):
            torch.lazymem.synchronize()
        torch_lazymem.set_recompute(previous)
        torch_lazymem.set_memory_budget(None)
    stats = torch_lazymem.stats()
    result.update(peak=lazy_peak, split=stats["splits"] > 0, retries=stats["oom_retries"],
                  row_loops=stats["row_loops"] > 0, in_host=stats["values_in_host_memory"] > 0,
                  kept=stats["kept_reads"] > 0, behind=stats["d2h_behind"] > 0, fused=stats["fused_nodes"] > 0)
    if lazy_peak > cap:
        return dict(result, status="OVER", detail=f"measured {lazy_peak} > cap {cap}")
    try:
        assert len(got) == len(expected), (len(got), len(expected))
        for a, b in zip(got, expected):
            torch.testing.assert_close(a, b)
    except AssertionError as e:
        return dict(result, status="WRONG", detail=str(e)[:600])
    return dict(result, status="ok")


BUGS = ("WRONG", "OVER", "ERROR", "CRASH", "HANG", "HISTORY")


def minimize(spec: Spec) -> Spec:
    """Removes features, layers and the injected failure while the program still fails the same way."""
    status = check(spec)["status"]
    changed = True
    while changed:
        changed = False
        candidates = [dataclasses.replace(spec, **{f: False}) for f in Spec.FEATURES if getattr(spec, f)]
        candidates += [dataclasses.replace(spec, layers=spec.layers[:i] + spec.layers[i + 1:])
                       for i in range(len(spec.layers)) if len(spec.layers) > 1]
        if spec.fail_at:
            candidates.append(dataclasses.replace(spec, fail_at=0))
        if spec.steps > 1:
            candidates.append(dataclasses.replace(spec, steps=1))
        if spec.recompute is not None:
            candidates.append(dataclasses.replace(spec, recompute=None))
        candidates += [dataclasses.replace(spec, rand_ops=spec.rand_ops[:i] + spec.rand_ops[i + 1:])
                       for i in range(len(spec.rand_ops))]
        for c in candidates:
            if check(c)["status"] == status:
                spec, changed = c, True
                break
    return spec


# ---------------------------------------------------------------------------------------------------
# Workers (a crash costs one program, not the run) and the report.


TIMEOUT = 300.0  # seconds a program may run before its worker is killed (--timeout)
STARTUP_TIMEOUT = 300.0  # seconds a worker may take to import torch and lazymem, at least


def worker(seeds: list[int], out: str | None = None) -> None:
    """Runs the seeds in this process, in order. With `out`: the scheduler's protocol (tools/_workers.py),
    each seed's record after its "start" line; without: a {"start": seed} line and the seed's record per
    seed on stdout."""
    warnings.simplefilter("ignore")
    if any(_workers.listed("PROGRAM_FUZZ_FAKE_STARTUP_CRASH", s) for s in seeds):
        _workers.segfault()  # self-test: a worker that dies before its first line (see --help)
    import torch_lazymem  # noqa: F401 - before "ready": a worker that cannot import it dies starting

    with contextlib.ExitStack() as stack:
        em = stack.enter_context(_workers.Emitter(out)) if out else None
        if em:
            em.ready()
        for s in seeds:
            if em:
                em.start(s)
            else:
                print(json.dumps({"start": s}), flush=True)
            if _workers.listed("PROGRAM_FUZZ_FAKE_CRASH", s):
                _workers.segfault()
            if _workers.listed("PROGRAM_FUZZ_FAKE_HANG", s):
                _workers.hang()
            r = check(draw(s))
            if em:
                em.emit("result", **r)
                em.end(s)
            else:
                print(json.dumps(r), flush=True)


def _died(seed: int, run: _workers.Run, before: str = "") -> dict:
    status = "HANG" if run.timed_out else "CRASH"
    tail = run.stderr_tail()
    return {"seed": seed, "status": status, "detail": f"worker {before}{run.how}" + (f"\n{tail}" if tail else "")}


def run_batches(batches: list[list[int]], jobs: int, timeout: float = TIMEOUT,
                env: dict[str, str] | None = None) -> list[dict]:
    """Runs each batch of seeds in a worker process, in order, `jobs` workers at once, and returns one
    record per seed (check()'s, or a CRASH / HANG one), in no particular order. `env`: added to the
    workers' environment."""
    results: list[dict] = []

    def handle(run: _workers.Run) -> list[_workers.Task]:
        for recs in run.done.values():
            results.extend(recs)
        left = [s for s in run.items if s not in run.done]
        if not left:
            if run.died:
                _workers.progress(f"program_fuzz: a worker died ({run.how}) after finishing its seeds:\n"
                                  f"{run.stderr_tail()}")
            return []
        if run.started:  # it died in a program: that program's doing; the rest go on in a new worker
            seed = next(iter(run.started))
            results.append(_died(seed, run))
            _workers.progress(f"program_fuzz: seed {seed}: worker {run.how}")
            rest = left[left.index(seed) + 1:]
            return [_workers.Task(rest, "batch")] if rest else []
        if len(run.items) > 1:  # it died before its first program: which seed's doing?
            _workers.progress(f"program_fuzz: a worker died before its first line ({run.how}): rerunning its "
                              f"{len(left)} seeds one per process")
            return [_workers.Task([s], "single") for s in left]
        results.append(_died(left[0], run, "died before its first line: "))
        _workers.progress(f"program_fuzz: seed {left[0]}: worker died before its first line ({run.how})")
        return []

    command = [sys.executable, str(Path(__file__).resolve()), "--worker"]
    with tempfile.TemporaryDirectory(prefix="program_fuzz_") as workdir:
        sched = _workers.Scheduler(command, workdir, timeout, startup_timeout=max(timeout, STARTUP_TIMEOUT),
                                   startup_attempts=1, env=env)
        sched.map(jobs, [_workers.Task(b, "batch") for b in batches if b], handle)
    return results


def run_seeds(seeds: list[int], jobs: int = 1, timeout: float = TIMEOUT,
              env: dict[str, str] | None = None) -> list[dict]:
    """The seeds' records, sorted by seed: worker j runs seeds[j::jobs] in order (see run_batches).
    A program that ran out of memory for no cause the plan explains is run again alone (see
    recheck_alone)."""
    batches = [seeds[j::jobs] for j in range(jobs)]
    results = recheck_alone(run_batches(batches, jobs, timeout, env), batches, jobs, timeout, env)
    return sorted(results, key=lambda r: r["seed"])


def recheck_alone(results: list[dict], batches: list[list[int]], jobs: int, timeout: float = TIMEOUT,
                  env: dict[str, str] | None = None) -> list[dict]:
    """Each `oom` of cause `other` run again in a worker of its own: one that fits alone failed because
    of what the programs before it in its worker taught lazymem, and becomes a HISTORY record naming
    them (program_fuzz seeds 810858 then 811152: a bound of copy_'s "workspace" learned from an
    injected failure of its destination's allocation)."""
    other = {r["seed"]: r for r in results if r["status"] == "oom" and r.get("cause") == "other"}
    if not other:
        return results
    alone = {r["seed"]: r for r in run_batches([[s] for s in other], jobs, timeout, env)}
    out = []
    for r in results:
        a = alone.get(r["seed"])
        if a is not None and a["status"] == "ok":
            before = next((b[:b.index(r["seed"])] for b in batches if r["seed"] in b), [])
            shown = ",".join(map(str, before[-3:]))
            r = dict(r, status="HISTORY", detail=f"fits alone (peak {a.get('peak')} of {a.get('cap')}); ran out of "
                     f"memory after {len(before)} programs in its worker (the last: {shown}; replay: "
                     f"--worker <those seeds>,{r['seed']}):\n  {r['detail']}")
        out.append(r)
    return out


def report(results: list[dict], seconds: float) -> int:
    counts = collections.Counter(r["status"] for r in results)
    causes = collections.Counter(r.get("cause") for r in results if r["status"] == "oom")
    split = sum(1 for r in results if r.get("split"))
    retried = sum(1 for r in results if r.get("retries"))
    rows = sum(1 for r in results if r.get("row_loops"))
    print(f"programs run      {len(results)}  ({seconds:.0f} s)")
    print(f"  ok              {counts['ok']}  (split {split}, with an out-of-memory retry {retried}, "
          f"in blocks of a tensor's rows {rows})")
    print(f"  in host memory  {sum(1 for r in results if r.get('in_host'))}  (rows read again from the device "
          f"{sum(1 for r in results if r.get('kept'))}, copies out not waited for "
          f"{sum(1 for r in results if r.get('behind'))})")
    print(f"  fused chains in {sum(1 for r in results if r.get('fused'))}  (pointwise nodes run as one loop)")
    print(f"  out of memory   {counts['oom']}  (unsplittable {causes['unsplittable']}, barrier {causes['barrier']}, "
          f"torn in-place update {causes['torn']}, other {causes['other']})")
    for b in BUGS:
        print(f"  {b.lower():15s} {counts[b]}")
    if any("graph_nodes" in r for r in results):
        print(f"  graphs          {sum(r.get('graph_nodes', 0) for r in results)} nodes replayed in graphs, "
              f"{sum(r.get('plain_nodes', 0) for r in results)} plain between them")
    bugs = [r for r in results if r["status"] in BUGS]
    for r in bugs:
        print(f"\n{r['status']} {draw(r['seed']).text()}\n  {r.get('detail', '')[:800]}")
    for r in results:
        if r["status"] == "oom" and r["cause"] == "other":
            print(f"\noom (other) {draw(r['seed']).text()}\n  {r['detail'][:400]}")
    return 1 if bugs else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--programs", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0, help="first seed")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=TIMEOUT,
                        help=f"seconds a program may run before it counts as a HANG (default {TIMEOUT:g})")
    parser.add_argument("--replay", type=int, help="run one program, print it, minimize it if it fails")
    parser.add_argument("--budget-only", action="store_true",
                        help="the cap as a memory budget on a device 4x larger (nothing enforces it)")
    # --worker SEEDS: these seeds in this process (see the docstring); the scheduler's workers are
    # started with --worker --out FILE --items FILE (tools/_workers.py).
    parser.add_argument("--graphs", action="store_true",
                        help="each program four times uncapped with CUDA graphs emulated (execute/graphs.h), "
                             "every run against eager")
    parser.add_argument("--worker", nargs="?", const="", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--items", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.budget_only:
        os.environ["PROGRAM_FUZZ_BUDGET_ONLY"] = "1"  # (the workers inherit it)
    if args.graphs:
        os.environ["PROGRAM_FUZZ_GRAPHS"] = "1"
    if args.worker is not None:
        seeds = _workers.read_items(args.items) if args.items else [int(s) for s in args.worker.split(",") if s]
        worker(seeds, args.out)
        return 0
    if args.replay is not None:
        warnings.simplefilter("ignore")
        spec = draw(args.replay)
        print(spec.text())
        r = check(spec)
        print(json.dumps(r, indent=1))
        if r["status"] in BUGS:
            print("minimal:", minimize(spec).text())
        return 1 if r["status"] in BUGS else 0
    if args.jobs < 1:
        parser.error("--jobs must be at least 1")
    # SIGTERM unwinds like Ctrl-C, so that the workers (in sessions of their own) are killed too.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    seeds = list(range(args.seed, args.seed + args.programs))
    t0 = time.perf_counter()
    try:
        results = run_seeds(seeds, args.jobs, args.timeout)
    except KeyboardInterrupt:  # the workers are killed (Scheduler.map)
        _workers.progress("program_fuzz: interrupted")
        return 130
    return report(results, time.perf_counter() - t0)


if __name__ == "__main__":
    sys.exit(main())
