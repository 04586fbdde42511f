"""The whole-program fuzzer (tools/program_fuzz.py) on 120 fixed seeds, under a minute: random
training programs under random caps with injected allocation failures, each compared with eager in
float64. Any wrong result, peak over the cap, exception other than a justified out-of-memory error,
or crashed worker fails the test with the program's seed and text (replay it with
`python tools/program_fuzz.py --replay SEED`). The README records a long run."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


# Seeds whose result is still wrong (open bugs, listed in the README's Reliability section): none in
# this range since LayerNorm's backward no longer splits along a non-leading dim (seed 9094 was one).
KNOWN_WRONG: set[int] = set()


def test_fixed_seeds_run_exactly_within_the_cap():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "program_fuzz.py"), "--programs", "120",
                           "--seed", "9000", "--jobs", "1"], capture_output=True, text=True, env=env, timeout=900)
    report = proc.stdout + proc.stderr
    # Open findings, replayed by the README's long run: seeds whose result is still wrong.
    bugs = {int(m) for m in re.findall(r"^(?:WRONG|OVER|ERROR|CRASH) seed (\d+):", report, re.M)}
    assert bugs <= KNOWN_WRONG, report
    runs = dict(re.findall(r"^\s+(ok|out of memory|wrong|over|error|crash)\s+(\d+)", report, re.M))
    runs = {k: int(v) for k, v in runs.items()}
    assert runs["ok"] + runs["out of memory"] + runs["wrong"] == 120 and sum(runs.values()) == 120, report
    assert runs["ok"] >= 80, report  # most programs finish; the rest are justified OOMs
    assert "oom (other)" not in report, report


# Seeds of the long runs (`--programs 2000 --seed 0`, `--seed 100000`) that found a bug, replayed one
# by one: the wrong results (a time-major flatten over a slice of the batch: 437, 550, 1195, 1254,
# 1773; the row-keyed mask of a time-major value: 1689; a loop's finished partial added to again when
# a plan stopped by an out-of-memory error after a whole dropout is planned again from there, found
# once random programs were compared with eager: 101831) and the unexplained out-of-memory errors
# (an unsplit plan that ran out of memory part way left the rest no batch to split by: 1050, 1671).
REGRESSION_SEEDS = [437, 550, 1050, 1195, 1254, 1671, 1689, 1773, 101831]


@pytest.mark.parametrize("seed", REGRESSION_SEEDS)
def test_seeds_that_found_bugs(seed):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "program_fuzz.py"), "--replay", str(seed)],
                          capture_output=True, text=True, env=env, timeout=600)
    report = proc.stdout + proc.stderr
    status = re.search(r'"status": "(\w+)"', report)
    assert status and status.group(1) == "ok", report


# Findings that need an earlier program's state (the workspace and node times it taught): seeds run in
# one worker, in order, the last one checked. 9110 after 9042-9054 with values crossing passes held in
# host memory (LAZYMEM_RECOMPUTE=0), in the run that brought host memory behind explicit copies: a mean
# loss's backward whose gradient was written to host memory, then divided by the batch on a device
# copy that had not been read back (garbage copied over the stored rows).
SEQUENCES = [("0", list(range(9042, 9056, 2)) + [9110])]


@pytest.mark.parametrize(("recompute", "seeds"), SEQUENCES)
def test_sequences_that_found_bugs(recompute, seeds):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               LAZYMEM_RECOMPUTE=recompute)
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "program_fuzz.py"), "--worker",
                           ",".join(map(str, seeds))], capture_output=True, text=True, env=env, timeout=600)
    report = proc.stdout + proc.stderr
    last = re.findall(r'^\{"seed": (\d+).*"status": "(\w+)"', report, re.M)
    assert last and last[-1] == (str(seeds[-1]), "ok"), report
