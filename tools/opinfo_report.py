#!/usr/bin/env python
"""Coverage of PyTorch's op database (op_db) on lazymem: how many float32 OpInfo samples give the same
result on lazymem as on the CPU, and why the others do not.

    PYTHONPATH=. python tools/opinfo_report.py                       # every op, 2 worker processes
    PYTHONPATH=. python tools/opinfo_report.py --ops add,max --json out.json

The comparison itself is torch_lazymem.testing.opinfo (see its docstring). Ops run in child processes
(this script in --worker mode) in batches, so that a segfault or an abort costs one batch and not the
report: a batch that dies is rerun one op per process to find the op(s) that crash, and every sample of
a crashing op counts as a failure. Each worker streams its records (JSON lines) to a file as it goes,
so the ops a dead batch had finished keep their results.

To check the crash handling itself, OPINFO_REPORT_FAKE_CRASH=op1,op2 in the environment makes the
workers segfault when they reach those ops. The workers and their scheduler are tools/_workers.py's.

Modes: ``--mode`` picks an entry of opinfo.RUNNERS: "forward" (outputs) or "backward" (gradients).
Nothing else here depends on the mode.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import re
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if str(Path(__file__).resolve().parent) not in sys.path:  # tools/ is not a package: _workers is a sibling
    sys.path.insert(0, str(Path(__file__).resolve().parent))
import _workers  # noqa: E402
from _workers import REPO, Run, Scheduler, Task  # noqa: E402

MODES = ("forward", "backward")  # keys of torch_lazymem.testing.opinfo.RUNNERS
PASS, MISMATCH, ERROR, SKIP, CRASH = "pass", "mismatch", "error", "skip", "crash"
FAILURES = (MISMATCH, ERROR, CRASH)


# ----------------------------------------------------------------------------------------------------
# Worker side: runs in a child process, imports torch and lazymem, writes JSON lines to --out.


def _worker(args: argparse.Namespace) -> int:
    import faulthandler

    faulthandler.enable()  # a segfault leaves the Python stack in the worker's stderr
    sys.path.insert(0, str(REPO))
    import torch

    import torch_lazymem  # noqa: F401 - registers the lazymem device
    from torch_lazymem.testing import opinfo

    if args.threads:
        torch.set_num_threads(args.threads)
    with _workers.Emitter(args.out) as out:
        if args.list:
            out.emit("ops", ops=[[name, op.name] for name, op in opinfo.ops_by_name().items()])
            return 0
        names = _workers.read_items(args.items)
        out.ready()
        for name in names:
            op = opinfo.find_op(name)
            samples = None
            if args.count:
                torch.manual_seed(opinfo.SAMPLE_SEED)
                samples = opinfo.sample_count(op, args.mode, args.max_samples)
            out.start(name, samples=samples)
            if _workers.listed("OPINFO_REPORT_FAKE_CRASH", name):  # self-test of the crash handling
                _workers.segfault()
            for o in opinfo.seeded_outcomes(op, args.mode, args.max_samples):
                out.emit("outcome", **dataclasses.asdict(o))
            out.end(name)
    return 0


# ----------------------------------------------------------------------------------------------------
# Parent side: schedules workers (tools/_workers.py), finds crashes, aggregates.


@dataclasses.dataclass
class Crash:
    op: str
    how: str
    samples: int
    stderr: str


class Report:
    def __init__(self, mode: str):
        self.mode = mode
        self.outcomes: list[dict[str, Any]] = []
        self.crashes: list[Crash] = []
        self.batch_crashes: list[dict[str, Any]] = []

    def add_ops(self, done: dict[str, list[dict[str, Any]]]) -> None:
        for recs in done.values():
            self.outcomes.extend(recs)

    def add_crash(self, crash: Crash) -> None:
        self.crashes.append(crash)
        for i in range(crash.samples):
            self.outcomes.append(
                {
                    "op": crash.op,
                    "index": i,
                    "status": CRASH,
                    "detail": f"crash: {crash.how}",
                    "random": False,
                }
            )

    # -- output ------------------------------------------------------------------------------------

    def counts(self) -> collections.Counter[str]:
        return collections.Counter(o["status"] for o in self.outcomes)

    def summary(self) -> dict[str, Any]:
        c = self.counts()
        total = c[PASS] + c[MISMATCH] + c[ERROR] + c[CRASH]
        ops = collections.defaultdict(set)
        for o in self.outcomes:
            ops[o["status"]].add(o["op"])
        failing_ops = set().union(*(ops[s] for s in FAILURES))
        all_ops = {o["op"] for o in self.outcomes}
        return {
            "mode": self.mode,
            "passed": c[PASS],
            "total": total,
            "percent": 100.0 * c[PASS] / total if total else None,
            "mismatch": c[MISMATCH],
            "error": c[ERROR],
            "crash_samples": c[CRASH],
            "crashes": len(self.crashes),
            "skipped": c[SKIP],
            "ops": len(all_ops),
            "ops_failing": len(failing_ops),
        }

    def headline(self) -> str:
        s = self.summary()
        pct = f"{s['percent']:.2f}%" if s["percent"] is not None else "n/a"
        crashes = f"{s['crashes']} crash" + ("" if s["crashes"] == 1 else "es")
        line = f"{self.mode}: {s['passed']}/{s['total']} samples pass ({pct}), {crashes}"
        if self.batch_crashes:
            line += f" (+{len(self.batch_crashes)} batch crash(es) no op reproduces alone)"
        return line

    def print(self, file: Any = sys.stdout) -> None:
        s = self.summary()
        w = file.write
        w(f"== op_db {self.mode} conformance: {s['ops']} ops ==\n")
        failures = [o for o in self.outcomes if o["status"] in FAILURES]
        if failures:
            nops = s["ops_failing"]
            w(f"\nfailures by cause ({len(failures)} samples in {nops} op{'s' if nops != 1 else ''}):\n")
            _print_groups(failures, w)
        if self.crashes:
            w(f"\ncrashes ({len(self.crashes)} ops):\n")
            for cr in self.crashes:
                w(f"  {cr.op}: {cr.how}, {cr.samples} samples counted as failures\n")
                for line in cr.stderr.splitlines():
                    w(f"      | {line}\n")
        for bc in self.batch_crashes:
            where = f"while running {bc['op']}" if bc["op"] else "after finishing its ops"
            w(
                f"\nnote: a batch died ({bc['how']}) {where}, but none of the {len(bc['ops'])} ops it had not "
                "finished crashes when run alone (a crash that depends on what ran before?):\n"
            )
            for line in bc["stderr"].splitlines():
                w(f"      | {line}\n")
        skips = [o for o in self.outcomes if o["status"] == SKIP]
        if skips:
            w(f"\nskipped samples by reason ({len(skips)}, not in the total):\n")
            _print_groups(skips, w)
        w(
            f"\nmismatch {s['mismatch']}, error {s['error']}, crash {s['crash_samples']} samples; "
            f"{s['ops'] - s['ops_failing']}/{s['ops']} ops have no failing sample; {s['skipped']} skipped\n"
        )
        w(self.headline() + "\n")

    def dump(self, path: str) -> None:
        data = {
            "summary": self.summary(),
            "outcomes": self.outcomes,
            "crashes": [dataclasses.asdict(c) for c in self.crashes],
            "batch_crashes": self.batch_crashes,
        }
        Path(path).write_text(json.dumps(data, indent=1))


_OP_NUMBER = re.compile(r"\s*\(op #\d+ of the recorded program[^)]*\)")
_HEX = re.compile(r"0x[0-9a-fA-F]+")
# Numbers (sizes, diffs, indices) vary between samples of one cause; "output K" names which output.
_NUMBER = re.compile(r"(?<![\w.])(?<!output )[-+]?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?(?![\w])")


def cause(o: dict[str, Any]) -> str:
    """The normalised first line of an outcome's detail: samples that fail the same way share it."""
    lines = o["detail"].splitlines()
    head = lines[0].rstrip() if lines else ""
    # opinfo._short cuts messages at 200 characters; the traceback that follows has the whole line.
    if head:
        for line in reversed(lines[1:]):
            if line.startswith(head) and len(line) > len(head):
                head = line.rstrip()
                break
    text = _OP_NUMBER.sub("", head)
    text = _HEX.sub("0x…", text)
    text = _NUMBER.sub("N", text)
    prefix = "" if o["status"] in (CRASH, SKIP) else o["status"] + ": "
    return (prefix + text)[:300]


def _print_groups(outcomes: list[dict[str, Any]], w: Any) -> None:
    groups: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    example: dict[str, str] = {}
    for o in outcomes:
        c = cause(o)
        groups[c][o["op"]] += 1
        example.setdefault(c, f"{o['op']} sample {o['index']}" if o["index"] >= 0 else o["op"])
    for c, ops in sorted(groups.items(), key=lambda kv: (-sum(kv[1].values()), kv[0])):
        n = sum(ops.values())
        w(f"  {n:5d} sample{'s' if n != 1 else ''}, {len(ops)} op{'s' if len(ops) != 1 else ''}: {c}\n")
        listed = ", ".join(f"{name} ({k})" for name, k in sorted(ops.items(), key=lambda kv: (-kv[1], kv[0])))
        w(f"        {listed}; e.g. {example[c]}\n")


def _select(listing: list[list[str]], wanted: str | None) -> list[str]:
    names = [full for full, _ in listing]
    if not wanted:
        return names
    asked = [w.strip() for w in wanted.split(",") if w.strip()]
    unknown = [w for w in asked if not any(w in (full, base) for full, base in listing)]
    if unknown:
        raise SystemExit(f"opinfo_report: no float32 OpInfo named {', '.join(unknown)}")
    keep = set(asked)
    return [full for full, base in listing if full in keep or base in keep]


_progress = _workers.progress


def _schedule(sched: Scheduler, jobs: int, batches: list[list[str]], report: Report) -> bool:
    """Runs the batches, reruns the ops of a batch that dies one per process; False if a worker could
    not start at all (the environment, not an op, is broken)."""
    t0 = time.monotonic()
    suspects: dict[str, dict[str, Any]] = {}  # op rerun alone -> the batch death it was left in
    batch_deaths: list[dict[str, Any]] = []
    finished = 0

    def handle(run: Run) -> list[Task] | None:
        nonlocal finished
        if not run.ready:
            _progress(f"opinfo_report: a worker could not start ({run.how}):\n{run.stderr_tail()}")
            return None
        report.add_ops(run.done)
        if run.tag == "batch":
            finished += 1
            if not run.died:
                _progress(f"  batch {finished}/{len(batches)} done ({time.monotonic() - t0:.0f} s)")
                return []
            left = [n for n in run.items if n not in run.done]
            running = next(iter(run.started), None)
            _progress(
                f"  batch {finished}/{len(batches)} died ({run.how}) in {running or 'no op'}: "
                f"rerunning {len(left)} ops one per process"
            )
            death = {
                "op": running,
                "how": run.how,
                "stderr": run.stderr_tail(),
                "ops": left,
                "crashed": [],
            }
            batch_deaths.append(death)
            for name in left:
                suspects[name] = death
            return [Task([name], "single", ["--count"]) for name in left]
        name = run.items[0]
        death = suspects.pop(name)
        if run.died:
            samples = run.info.get(name, {}).get("samples")
            report.add_crash(Crash(name, run.how, samples or 1, run.stderr_tail()))
            death["crashed"].append(name)
            _progress(f"  {name}: crashes alone ({run.how})")
        return []

    ok = sched.map(jobs, [Task(b, "batch") for b in batches], handle)
    # A batch that died although none of its unfinished ops crashes alone: reported as a note.
    report.batch_crashes = [d for d in batch_deaths if not d["crashed"]]
    return ok


def main_parent(opts: argparse.Namespace) -> int:
    t0 = time.monotonic()
    # SIGTERM unwinds like Ctrl-C, so that the workers (in sessions of their own) are killed too.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    report = Report(opts.mode)
    threads = max(1, (os.cpu_count() or 1) // max(1, opts.jobs))
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", "--mode", opts.mode]
    command += ["--threads", str(threads)]
    if opts.max_samples:
        command += ["--max-samples", str(opts.max_samples)]
    with tempfile.TemporaryDirectory(prefix="opinfo_report_") as workdir:
        sched = Scheduler(command, workdir, opts.timeout)
        lst = sched.run(Task([], "list", ["--list"]))
        listing = lst.events.get("ops", {}).get("ops")
        if listing is None:
            _progress(f"opinfo_report: could not list op_db ({lst.how}):\n{lst.stderr_tail()}")
            return 2
        names = _select(listing, opts.ops)
        batches = [names[i : i + opts.batch_size] for i in range(0, len(names), opts.batch_size)]
        _progress(f"{len(names)} ops in {len(batches)} batches, {opts.jobs} jobs")
        if not _schedule(sched, opts.jobs, batches, report):
            return 2
    order = {name: i for i, name in enumerate(names)}
    report.outcomes.sort(key=lambda o: (order.get(o["op"], -1), o["index"]))
    sys.stderr.flush()
    report.print()
    _progress(f"({time.monotonic() - t0:.1f} s)")
    if opts.json:
        report.dump(opts.json)
    return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--mode", choices=MODES, default="forward", help="what to compare (default: forward)")
    p.add_argument(
        "--ops", help="comma-separated op names (full 'name.variant' or base name for all variants)"
    )
    p.add_argument("--jobs", type=int, default=2, help="worker processes at once (default 2)")
    p.add_argument("--json", metavar="OUT", help="write the raw outcomes and the summary to this JSON file")
    p.add_argument("--max-samples", type=int, default=None, metavar="K", help="at most K samples per op")
    p.add_argument("--batch-size", type=int, default=100, help="ops per worker process (default 100)")
    p.add_argument(
        "--timeout",
        type=float,
        default=300.0,
        help="seconds a worker may go without finishing a sample (default 300)",
    )
    # worker mode (internal)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--items", help=argparse.SUPPRESS)
    p.add_argument("--threads", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--count", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--list", action="store_true", help=argparse.SUPPRESS)
    opts = p.parse_args(argv)
    if opts.jobs < 1 or opts.batch_size < 1:
        p.error("--jobs and --batch-size must be at least 1")
    return opts


def main(argv: list[str] | None = None) -> int:
    opts = parse_args(argv)
    if opts.worker:
        return _worker(opts)
    try:
        return main_parent(opts)
    except KeyboardInterrupt:
        _progress("opinfo_report: interrupted")
        return 130


if __name__ == "__main__":
    sys.exit(main())
