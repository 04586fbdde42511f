"""The whole-program fuzzer (tools/program_fuzz.py) on 120 fixed seeds, under a minute: random
training programs under random caps with injected allocation failures, each compared with eager in
float64. Any wrong result, peak over the cap, exception other than a justified out-of-memory error,
or crashed or hung worker fails the test with the program's seed (replay it with
`python tools/program_fuzz.py --replay SEED`). The README records a long run.

The programs run in the fuzzer's worker processes (program_fuzz.run_seeds), as in a fuzz run, and
the tests read their records: a crash costs a record, not the test session, and the programs leave
no learned state (workspace, node times) in this process for the tests after them."""

from __future__ import annotations

import pathlib
import sys
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
if str(ROOT / "tools") not in sys.path:
    sys.path.insert(0, str(ROOT / "tools"))

import program_fuzz  # noqa: E402

FIXED_SEEDS = list(range(9000, 9120))

# Seeds whose result is still wrong (open bugs, listed in the README's Reliability section): none in
# this range since LayerNorm's backward no longer splits along a non-leading dim (seed 9094 was one).
KNOWN_WRONG: set[int] = set()


def describe(r: dict) -> str:
    return f"{r['status']} {program_fuzz.draw(r['seed']).text()}\n  {r.get('detail', '')[:2000]}"


@pytest.fixture(scope="module")
def fixed_results() -> dict[int, dict]:
    # One worker, the seeds in order (each program after the ones before it, as in a fuzz run).
    return {r["seed"]: r for r in program_fuzz.run_seeds(FIXED_SEEDS, jobs=1)}


# One xdist worker takes them all (tools/test.sh runs --dist loadgroup): the module fixture runs the
# 120 seeds once, not once per worker (it took 185 s and 129 s on the two workers of a 2-core run).
@pytest.mark.xdist_group("fixed_seeds")
@pytest.mark.parametrize("seed", FIXED_SEEDS)
def test_fixed_seed_runs_exactly_within_the_cap(fixed_results, seed):
    r = fixed_results.get(seed)
    assert r is not None, f"no record for seed {seed}"
    # Open findings, replayed by the README's long run: seeds whose result is still wrong.
    assert r["status"] in ("ok", "oom") or (r["status"] == "WRONG" and seed in KNOWN_WRONG), describe(r)
    # Every out-of-memory error is one explain() justifies.
    assert r["status"] != "oom" or r["cause"] != "other", describe(r)


@pytest.mark.xdist_group("fixed_seeds")  # the same worker, so the fixture's 120 seeds run once
def test_most_fixed_seeds_finish(fixed_results):
    assert sorted(fixed_results) == FIXED_SEEDS  # one record per seed
    ok = [s for s, r in fixed_results.items() if r["status"] == "ok"]
    assert len(ok) >= 80, {s: r["status"] for s, r in fixed_results.items()}  # the rest: justified OOMs


# Seeds of the long runs (`--programs 2000 --seed 0`, `--seed 100000`) that found a bug, replayed one
# by one: the wrong results (a time-major flatten over a slice of the batch: 437, 550, 1195, 1254,
# 1773; the row-keyed mask of a time-major value: 1689; a loop's finished partial added to again when
# a plan stopped by an out-of-memory error after a whole dropout is planned again from there, found
# once random programs were compared with eager: 101831) and the unexplained out-of-memory errors
# (an unsplit plan that ran out of memory part way left the rest no batch to split by: 1050, 1671),
# and an allocation failure injected while finishing a split reduction that raised instead of retrying
# (100119 of `--seed 100000`, issue 31).
# (Not here: 400102 of `--seed 400000`, a plan within 30 bytes of its budget that runs out of memory in
# about one run in eight, cause not found: a flaky seed would fail CI at random. README, known limits.)
REGRESSION_SEEDS = [437, 550, 1050, 1195, 1254, 1671, 1689, 1773, 100119, 101831]


@pytest.mark.parametrize("seed", REGRESSION_SEEDS)
def test_seeds_that_found_bugs(seed):
    # Each in a fresh worker, as `--replay SEED` runs it, without the grammar's later features (the
    # codebook a quarter of seeds now draw): the program that found the bug.
    [r] = program_fuzz.run_seeds([seed], env={"PROGRAM_FUZZ_WITHOUT": "wide,arith,types"})
    assert r["status"] == "ok", describe(r)


def test_an_out_of_memory_error_after_retries_says_why_the_first_plan_did_not_fit():
    """Seed 813135 (a GRU at 8% of eager's peak): its plan does not fit (a gradient's cat must be held
    whatever the chunk size), runs, runs out of memory and is planned again from where it stopped, and
    what is left has no batch; the error said only that ("no data leaf", an unexplained `other` to the
    fuzzer). It quotes the first plan's reason now, and its per-tensor chains once each."""
    [r] = program_fuzz.run_seeds([813135], env={"PROGRAM_FUZZ_WITHOUT": "wide,arith,types"})
    assert r["status"] == "oom" and r["cause"] == "unsplittable", describe(r)
    assert "As first planned, before " in r["detail"] and "must be held whatever the chunk size" in r["detail"], r
    assert "chains of 2 per-tensor ops over 2 tensors each run in 2 groups" in r["detail"], r


def test_a_program_without_a_batch_whose_held_and_new_state_exceed_the_cap_is_unsplittable():
    """classify_oom: an optimizer step planned on its own (no data leaf) whose held values and new
    state exceed the cap, refused before it runs under a budget nothing enforces (no allocation was
    asked for: seed 816296 of `--budget-only`), or run until an allocation was refused."""
    held = ("does not fit unsplit: predicted peak 88.83 KiB at aten::zero_ exceeds the budget of 64.00 KiB, of "
            "which {} KiB is held before the program runs and 43.08 KiB by new values that outlive it. not "
            "split: no data leaf: nothing uploaded from the host feeds this program")
    cap = 64 * 1024
    assert program_fuzz.classify_oom(held.format("45.75") + ". Nothing ran", cap) == "unsplittable"
    assert program_fuzz.classify_oom(held.format("5.75") + ". Nothing ran", cap) == "other"
    asked = held.format("5.75") + ". Tried to allocate 16.00 KiB; capacity 64.00 KiB"
    assert program_fuzz.classify_oom(asked, cap) == "unsplittable"


# The cap as a memory budget only (`--budget-only`: on a device four times larger, so no allocator
# stops a plan at the budget): a plan must stay within it or raise. Before plans over a budget nothing
# enforces were refused, some ran over it (an OVER record here).
def run_without_bugs(seeds: list[int], env: dict[str, str]) -> list[dict]:
    """The seeds' records in one worker under `env` (a fuzzer mode); none of them a bug."""
    results = program_fuzz.run_seeds(seeds, jobs=1, env=env)
    assert [r["seed"] for r in results] == seeds
    bugs = [describe(r) for r in results if r["status"] in program_fuzz.BUGS]
    assert not bugs, "\n".join(bugs)
    return results


def test_budget_only_programs_stay_within_the_budget():
    results = run_without_bugs(list(range(9000, 9024)), {"PROGRAM_FUZZ_BUDGET_ONLY": "1"})
    assert sum(r["status"] == "ok" for r in results) >= len(results) // 2


# Reused plans replayed as CUDA graphs (`--graphs`, emulated on the CPU: execute/graphs.h): each
# program four times uncapped, the third run on in captured pieces with plain nodes between, every run
# equal to eager. (200 seeds from 1000 ran clean with 104,256 nodes replayed, in the run that added it.)
def test_programs_replayed_as_graphs_equal_eager_every_run():
    results = run_without_bugs(list(range(1000, 1012)), {"PROGRAM_FUZZ_GRAPHS": "1"})
    assert all(r["status"] == "ok" for r in results)
    assert sum(r["graph_nodes"] for r in results) > 1000  # the graphs did replay


# Findings that need an earlier program's state (the workspace and node times it taught): seeds run in
# one worker, in order, the last one checked. 9110 after 9042-9054 with values crossing passes held in
# host memory (LAZYMEM_RECOMPUTE=0), in the run that brought host memory behind explicit copies: a mean
# loss's backward whose gradient was written to host memory, then divided by the batch on a device
# copy that had not been read back (garbage copied over the stored rows).
# 811152 (a causal attention over a batch drawn on the device, under 85% of eager's peak) after 810858
# (an injected failure refused the storage a copy_ of an attention mask writes first): the refused
# bytes were learned as copy_'s workspace, and 811152's copy_ of a mask of the same shapes could not
# fit them at any chunk size (fuzz run 810000-811499; the fuzzer now reruns such a failure alone and
# reports it as HISTORY).
SEQUENCES = [("0", list(range(9042, 9056, 2)) + [9110]), ("auto", [810858, 811152])]


@pytest.mark.parametrize(("recompute", "seeds"), SEQUENCES)
def test_sequences_that_found_bugs(recompute, seeds):
    results = program_fuzz.run_seeds(seeds, env={"LAZYMEM_RECOMPUTE": recompute, "PROGRAM_FUZZ_WITHOUT": "arith,types"})
    assert [r["seed"] for r in results] == seeds
    # The sequence ran in one worker: a worker that died part way would run the rest without the state.
    died = [r for r in results if r["status"] in ("CRASH", "HANG")]
    assert not died, "\n".join(map(describe, died))
    assert results[-1]["status"] == "ok", describe(results[-1])


# Found by stop 52's run of --seed 830000: the grammar's arithmetic by hand (`arith`) with halves, an
# eval-mode batch norm and random ops, under a cap of half eager's peak, ended in an internal error:
# "aten::addmm ... reads rows of b11 that nothing wrote in this chunk" (execute/bind.cpp). The second
# step's plan laid x out as [2 halves][192 rows] (outer 2); the upload's host source is narrowed as
# one block, so the meta probe refused its chunk shapes and the upload became a barrier run whole.
# decide_storage() still treated it as an upload re-run in each loop (never crossing, never stored),
# so loops bound x chunk-local with nothing writing it. An upload run whole now stores its value.
def test_seed_830539_an_upload_that_runs_whole_as_a_barrier_stores_its_value():
    [r] = program_fuzz.run_seeds([830539])
    assert r["status"] == "ok", describe(r)


# Found by stop 53's run of --seed 840000 under torch 2.11 (and WRONG under 2.13 too): a group norm
# before a training batch norm, AdamW. The group norm's bias has a zero gradient in exact arithmetic
# (the batch norm removes each channel's mean); in float64 it is noise, ~1e-13, that the split's
# summation order changes, and AdamW's first step multiplies it by lr / eps (1e6 at eps 1e-8): 2e-7
# apart, over assert_close's 1e-7. Not lazymem's error: the gradients agree to 2e-13. The grammar's
# AdamW now uses eps 1e-6 (an amplification of 1e4).
def test_seed_840179_a_zero_gradient_amplified_by_adamw_is_not_a_finding():
    [r] = program_fuzz.run_seeds([840179])
    assert r["status"] == "ok", describe(r)
    assert r["split"], describe(r)


def test_an_unexplained_out_of_memory_that_fits_alone_is_a_history_bug(monkeypatch):
    """recheck_alone: an `oom` of cause `other` runs again alone; fitting there, it is a HISTORY bug
    naming the programs before it in its worker; failing there too, it stays an `oom`."""
    ran = []

    def alone(batches, jobs, timeout=program_fuzz.TIMEOUT, env=None):
        ran.extend(batches)
        return [{"seed": b[0], "status": "ok" if b[0] == 3 else "oom", "cause": "other", "detail": "again",
                 "peak": 10, "cap": 12} for b in batches]

    monkeypatch.setattr(program_fuzz, "run_batches", alone)
    results = [{"seed": 1, "status": "ok"}, {"seed": 3, "status": "oom", "cause": "other", "detail": "at X"},
               {"seed": 5, "status": "oom", "cause": "other", "detail": "at Y"},
               {"seed": 7, "status": "oom", "cause": "unsplittable", "detail": "at Z"}]
    out = {r["seed"]: r for r in program_fuzz.recheck_alone(results, [[1, 3, 5, 7]], jobs=1)}
    assert sorted(ran) == [[3], [5]]  # each alone; an explained out-of-memory is not rerun
    assert out[3]["status"] == "HISTORY" and "after 1 programs in its worker (the last: 1" in out[3]["detail"]
    assert "at X" in out[3]["detail"]
    assert out[5]["status"] == "oom" and out[7]["status"] == "oom" and out[1]["status"] == "ok"
    assert "HISTORY" in program_fuzz.BUGS


# The scheduler's own handling, through the fuzzer's self-test hooks (see program_fuzz's --help).


def test_a_worker_that_dies_is_a_crash_record_per_seed():
    """A worker that dies before its first line is rerun one seed per process, and the seed whose
    worker dies so alone is a CRASH, the others run; a worker that dies in a seed is a CRASH of that
    seed, and the seeds after it go on in a new worker."""
    env = {"PROGRAM_FUZZ_FAKE_STARTUP_CRASH": "6", "PROGRAM_FUZZ_FAKE_CRASH": "8",
           "PROGRAM_FUZZ_WITHOUT": "wide,arith,types"}  # (seeds 5 and 7 finish without the codebook)
    results = program_fuzz.run_batches([[5, 6], [8, 7]], jobs=3, env=env)
    by_seed = {r["seed"]: r for r in results}
    assert sorted(by_seed) == [5, 6, 7, 8] and len(results) == 4, results
    assert by_seed[6]["status"] == "CRASH", by_seed[6]
    assert "died before its first line: killed by SIGSEGV" in by_seed[6]["detail"], by_seed[6]
    assert by_seed[8]["status"] == "CRASH" and "killed by SIGSEGV" in by_seed[8]["detail"], by_seed[8]
    for s in (5, 7):
        assert by_seed[s]["status"] == "ok", describe(by_seed[s])


def test_a_hung_seed_is_a_hang_record():
    """A seed that writes nothing for --timeout seconds is a HANG, and its worker is killed."""
    t0 = time.monotonic()
    [r] = program_fuzz.run_batches([[10]], jobs=1, timeout=1.0, env={"PROGRAM_FUZZ_FAKE_HANG": "10"})
    assert r["seed"] == 10 and r["status"] == "HANG", r
    assert "timed out (1 s without progress)" in r["detail"], r
    assert time.monotonic() - t0 < 120  # killed, not waited for (the worker's startup is not timed out)
