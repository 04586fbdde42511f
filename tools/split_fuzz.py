"""The placement-rule fuzzer as a report: every OpInfo sample of PyTorch's op database, split into
chunks along dim 0 and compared with eager CPU at assert_close defaults (see
torch_lazymem/testing/split_fuzz.py for what is run and how it is compared).

Prints, per mode, how many samples passed, how many of those actually split (the rest ran whole: no
rule for a batched input, a barrier, or a program too small to split), mismatches and errors (each
one is a bug: a wrong answer is never acceptable), and the ops that most often ran whole.

    PYTHONPATH=. python tools/split_fuzz.py [--mode forward|backward|both] [--chunks 3]
                                            [--max-samples 8] [op names...]

Exit status 1 if any sample mismatched or raised.
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
import warnings

from torch_lazymem.testing import opinfo, split_fuzz


def run(mode: str, names: list[str], chunks: int, max_samples: int) -> int:
    ops = [opinfo.find_op(n) for n in names] if names else list(opinfo.ops_by_name().values())
    t0 = time.perf_counter()
    counts: collections.Counter[str] = collections.Counter()
    whole: collections.Counter[str] = collections.Counter()
    bad: list[split_fuzz.SplitOutcome] = []
    for op in ops:
        for o in split_fuzz.seeded(op, max_samples=max_samples, chunks=chunks, mode=mode):
            counts[o.status] += 1
            if o.status == opinfo.PASS:
                counts["split" if o.split else "whole"] += 1
                if not o.split or o.barriers:
                    whole[o.op] += 1
            elif o.status in (opinfo.MISMATCH, opinfo.ERROR):
                bad.append(o)
    seconds = time.perf_counter() - t0
    checked = counts[opinfo.PASS] + counts[opinfo.MISMATCH] + counts[opinfo.ERROR]
    print(f"== {mode}: {len(ops)} ops, {checked} samples x seedings checked in {seconds:.0f} s, "
          f"{chunks} chunks")
    print(f"   pass {counts[opinfo.PASS]} (split {counts['split']}, ran whole or with barriers "
          f"{counts['whole']}), mismatch {counts[opinfo.MISMATCH]}, error {counts[opinfo.ERROR]}, "
          f"skipped {counts[opinfo.SKIP]}")
    if whole:
        top = ", ".join(f"{name} {n}" for name, n in whole.most_common(25))
        print(f"   most often whole: {top}")
    seen: set[tuple[str, str]] = set()
    for o in bad:
        if (o.op, o.status) in seen:
            continue
        seen.add((o.op, o.status))
        first = o.detail.splitlines()[0][:300] if o.detail else ""
        print(f"   {o.status.upper()} {o.op}[{o.index}] ({o.variant}): {first}")
    return len(bad)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=("forward", "backward", "both"), default="both")
    parser.add_argument("--chunks", type=int, default=3)
    parser.add_argument("--max-samples", type=int, default=8)
    parser.add_argument("ops", nargs="*")
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    modes = ("forward", "backward") if args.mode == "both" else (args.mode,)
    failures = sum(run(m, args.ops, args.chunks, args.max_samples) for m in modes)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
