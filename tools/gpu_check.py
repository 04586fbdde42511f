"""lazymem on one CUDA GPU against eager CUDA: correctness, memory and speed in under five minutes.

    PYTHONPATH=. python tools/gpu_check.py     # one NVIDIA GPU; with OUT set: $OUT/gpu_check.{md,json,log}
    PYTHONPATH=. python tools/gpu_check.py --only tiny,speed     # some of the checks (names below)
    PYTHONPATH=. python tools/gpu_check.py --only gpt2_split,cap --chunk-node-ns 8000   # chunks priced
    PYTHONPATH=. python tools/gpu_check.py --async-copy-out 1     # results copied out asynchronously

Prints a markdown table, one row per check (ok / FAIL / skip, and its figures):

1. mixing: eager CUDA autograd in a process that imported torch_lazymem, before and after a lazymem
   training step, and torch.accelerator still reporting lazymem (pytorch issue 161129).
2. first use: a fresh process's first lazymem op (lazymem initializes CUDA itself); the backing device.
3. MLP float32, 3 AdamW steps: losses, output and parameters bitwise equal to eager CUDA.
4. GPT-2 (transformers, SDPA) float32, 3 AdamW steps at the default budget (not split): losses,
   last logits and parameters bitwise equal to eager CUDA.
5. GPT-2 float64 under a budget that splits it: within assert_close's defaults of eager CUDA.
6. GPT-2 under bf16 autocast, 2 steps: parameters against eager CUDA's (FAIL beyond 1e-2).
7. OpInfo forward samples of 46 common ops (float32): bitwise equal to eager CUDA.
8. real cap: a GPT-2 under a 3 GiB per-process cap; eager's largest batch B_e, then lazymem at
   B_e, 4 B_e and 8 B_e (default budget): time per step, throughput per sample against eager,
   reserved memory against the cap, chunks and out-of-memory retries; then 4 B_e and 8 B_e with the
   planner pricing each node at 8 us per chunk (LAZYMEM_CHUNK_NODE_NS, off by default): the logits
   the loop keeps go to host memory where that saves chunks, copied out while the next chunk computes
   (LAZYMEM_ASYNC_COPY_OUT, off on a GPU by default) unless --async-copy-out 0.
9. tiny ops: time per op of 4,000 pointwise ops on 1,024 elements, eager CUDA and lazymem, then lazymem
   again with pipelined execution (torch_lazymem.set_pipeline(True)); all three values equal.
10. step time, issue 30's rows (GPT-2 4x256 at 16x128 and 64x256 tokens, GPT-2 small at 16x512):
   the first step, the median of 5 AdamW steps (loss.item() after each) and of 5 pipelined ones,
   eager's and lazymem's time per step and their ratio; the losses against eager's (eager CUDA's own
   differ run to run on some rows: the figures give that spread). The verdict: 4 more steps (1 plain,
   3 pipelined) from a fresh model under torch.use_deterministic_algorithms, losses and parameters
   bitwise equal to eager's. Also the last pipelined step's timeline: when each batch was handed to
   the worker, when the worker ran it, and when the read ran (waiting for the worker, then the tail).

Eager CUDA runs in worker processes that never import torch_lazymem (importing it may break eager
CUDA autograd in the same process: pytorch issue 161129), lazymem in others; both save their results
as CPU tensors (torch.save) and the parent, which initializes neither CUDA nor lazymem, compares them.
A worker runs its items in turn; an item that raises, crashes or outlives its time limit is reported
in its row and the remaining items run in a fresh worker.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import os
import sys
import tempfile
import time
import types
import unittest
from pathlib import Path
from typing import Any, Callable

import _workers
import torch
from _gpu_cap import item_cap as cap_item
from _gpu_cap import judge_cap
from _gpu_programs import (
    DEV,
    DEVICE,
    GPT_BF16,
    GPT_FP32,
    GPT_SPLIT,
    SMOKE,
    SPLIT_VOCAB,
    Result,
    Skip,
    bitwise,
    diff,
    first_line,
    gpt2,
    lm_loss,
    mlp,
    mlp_data,
    mlp_loss,
    ok,
    size,
    token_ids,
    train,
)
from _gpu_speed import item_speed, item_tiny, judge_speed, judge_tiny
from torch.utils._pytree import tree_flatten, tree_map

REPO = Path(__file__).resolve().parent.parent
MiB = 1 << 20


OPINFO_SAMPLES = size(6, 2)  # per op
OPINFO_OPS = [
    "add", "sub", "mul", "div.no_rounding_mode", "pow", "matmul", "mm", "bmm", "addmm", "baddbmm",
    "softmax", "log_softmax", "nn.functional.layer_norm", "nn.functional.gelu", "nn.functional.relu",
    "nn.functional.silu", "sum", "mean", "var", "cumsum", "cat", "stack", "gather", "index_select",
    "where", "clamp", "exp", "log", "sqrt", "rsqrt", "tanh", "sigmoid", "max.reduction_with_dim", "amax",
    "argmax", "topk", "sort", "nn.functional.conv2d", "nn.functional.embedding",
    "nn.functional.cross_entropy", "nn.functional.linear", "nn.functional.scaled_dot_product_attention",
    "masked_fill", "transpose", "abs", "neg",
]  # fmt: skip


def progress(msg: str) -> None:
    print(f"gpu_check: {msg}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------------------------------
# The checks: each one's item(side) runs in a worker ("eager" or "lazy") and returns what is saved for
# the parent; its judge(eager result, lazymem result) runs in the parent and gives the row.


def item_mixing(side: str) -> Result:
    def cuda_backward() -> None:
        x = torch.randn(4, 4, device="cuda", requires_grad=True)
        (x * 2).sum().backward()
        if x.grad is None or not torch.equal(x.grad.cpu(), torch.full((4, 4), 2.0)):
            raise AssertionError(f"x.grad is {x.grad}")

    def accelerator() -> None:
        if getattr(torch.accelerator.current_accelerator(), "type", None) != "lazymem":
            raise AssertionError(f"current_accelerator() is {torch.accelerator.current_accelerator()}")

    def lazymem_step() -> None:
        train(mlp(), "lazymem", mlp_data(), mlp_loss, 1)

    parts = {}
    for name, fn in [("cuda backward", cuda_backward), ("lazymem step", lazymem_step),
                     ("cuda backward after", cuda_backward), ("accelerator", accelerator)]:
        try:
            fn()
            parts[name] = "ok"
        except Exception as e:  # noqa: BLE001 - each part's outcome is a figure
            parts[name] = first_line(e)
    return parts


def judge_mixing(lazy: Result) -> tuple[str, Result]:
    return ok(all(v == "ok" for v in lazy.values()), lazy)


def item_first_use(side: str) -> Result:
    x = torch.randn(4, generator=torch.Generator().manual_seed(0)).mul(8).round().div(8)  # sums exactly in any order
    got = x.to("lazymem").sum().item()
    return {"sum": got, "cpu sum": x.sum().item(), "backing": str(sys.modules["torch_lazymem"].backing_device())}


def judge_first_use(lazy: Result) -> tuple[str, Result]:
    return ok(lazy["sum"] == lazy["cpu sum"] and lazy["backing"].startswith(DEV), lazy)


def item_mlp(side: str) -> Result:
    return train(mlp(), DEVICE[side], mlp_data(), mlp_loss, 3)


def item_gpt2(side: str) -> Result:
    n_layer, batch, seq = GPT_FP32
    return train(gpt2(n_layer), DEVICE[side], [token_ids(batch, seq)], lm_loss, 3)


def judge_bitwise(eager: Result, lazy: Result) -> tuple[str, Result]:
    params, max_diff, same = bitwise(eager["params"], lazy["params"])
    outputs, losses = torch.equal(eager["out"], lazy["out"]), torch.equal(eager["losses"], lazy["losses"])
    return ok(same and outputs and losses and not lazy["splits"], {
        "params equal": params, "max diff": max_diff, "losses equal": losses, "output equal": outputs,
        "output max diff": diff(eager["out"], lazy["out"]), "chunks": lazy["chunks"], "splits": lazy["splits"]})


def item_gpt2_split(side: str) -> Result:
    """float64. lazymem first runs an unsplit step for its peak and what stays held between steps,
    then trains under a budget of what is held + half the rest of that peak."""
    n_layer, batch, seq = GPT_SPLIT
    ids = [token_ids(batch, seq, SPLIT_VOCAB)]
    if side == "eager":
        return train(gpt2(n_layer, torch.float64, vocab_size=SPLIT_VOCAB), DEV, ids, lm_loss, 3)
    lazymem = sys.modules["torch_lazymem"]
    probe = train(gpt2(n_layer, torch.float64, vocab_size=SPLIT_VOCAB), "lazymem", ids, lm_loss, 1)
    if probe["peak"] <= probe["held"]:
        raise RuntimeError(f"stats()['peak_bytes'] {probe['peak']} is not above what is held, {probe['held']}")
    budget = int(probe["held"] + 0.5 * (probe["peak"] - probe["held"]))
    lazymem.set_memory_budget(budget)
    try:
        return {**train(gpt2(n_layer, torch.float64, vocab_size=SPLIT_VOCAB), "lazymem", ids, lm_loss, 3), "budget": budget,
                "unsplit peak": probe["peak"]}
    finally:
        lazymem.set_memory_budget(None)


def judge_split(eager: Result, lazy: Result) -> tuple[str, Result]:
    figures = {"max diff": max(map(diff, eager["params"], lazy["params"])),
               "output max diff": diff(eager["out"], lazy["out"]), "chunks": lazy["chunks"], "splits": lazy["splits"], "budget MiB": lazy["budget"] / MiB,
               "unsplit peak MiB": lazy["unsplit peak"] / MiB, "peak MiB": lazy["peak"] / MiB}
    try:
        torch.testing.assert_close([lazy["losses"], lazy["out"], *lazy["params"]],
                                   [eager["losses"], eager["out"], *eager["params"]])
    except AssertionError as e:
        return "FAIL", {**figures, "error": first_line(e)}
    return ok(lazy["splits"] > 0 and lazy["peak"] <= lazy["budget"], figures)


def item_bf16(side: str) -> Result:
    n_layer, batch, seq = GPT_BF16
    return train(gpt2(n_layer), DEVICE[side], [token_ids(batch, seq)], lm_loss, 2, autocast=DEVICE[side])


def judge_bf16(eager: Result, lazy: Result) -> tuple[str, Result]:
    params, max_diff, _ = bitwise(eager["params"], lazy["params"])
    losses = max(map(diff, eager["losses"], lazy["losses"]))
    return ok(max_diff <= 1e-2, {"params equal": params, "max diff": max_diff, "losses max diff": losses})


def opinfo_ops() -> dict[str, Any]:
    """op_db by full name. torch.testing._internal needs expecttest only for its TestCase base class:
    where it is missing (the GPU machines) a stand-in module serves."""
    try:
        import expecttest  # noqa: F401
    except ImportError:
        sys.modules["expecttest"] = types.ModuleType("expecttest")
        sys.modules["expecttest"].TestCase = unittest.TestCase  # type: ignore[attr-defined]
    try:
        from torch.testing._internal.common_methods_invocations import op_db
    except Exception as e:  # noqa: BLE001 - the row's reason
        raise Skip("torch.testing._internal: " + first_line(e)) from e
    return {op.name + ("." + op.variant_test_name if op.variant_test_name else ""): op for op in op_db}


def item_opinfo(side: str) -> Result:
    """The eager worker makes the samples on the CPU with a fixed seed and saves them; both sides run
    them, each sample's outputs flattened and on the CPU, or the first line of what it raised."""
    ops = opinfo_ops()
    path = Path(ARGS.dir) / "opinfo_samples.pt"
    if side == "eager":
        samples = []
        for name in filter(ops.__contains__, OPINFO_OPS):
            torch.manual_seed(0)
            for i, s in enumerate(itertools.islice(ops[name].sample_inputs("cpu", torch.float32), OPINFO_SAMPLES)):
                samples.append((name, i, s.input, s.args, s.kwargs))
        torch.save(samples, path)
    device, outputs = DEVICE[side], {}
    for name, i, *call in torch.load(path, weights_only=False):
        try:
            inp, args, kwargs = tree_map(lambda x: x.to(device) if isinstance(x, torch.Tensor) else x, call)
            torch.manual_seed(1234)
            flat = tree_flatten(ops[name](inp, *args, **kwargs))[0]
            outputs[f"{name}[{i}]"] = [x.cpu() if isinstance(x, torch.Tensor) else x for x in flat]
        except Exception as e:  # noqa: BLE001 - a finding (a sample eager rejects is left out)
            outputs[f"{name}[{i}]"] = first_line(e)
    return {"outputs": outputs, "missing": [n for n in OPINFO_OPS if n not in ops]}


def judge_opinfo(eager: Result, lazy: Result) -> tuple[str, Result]:
    total, equal, mismatches = 0, 0, {}
    for key, want in eager["outputs"].items():
        if isinstance(want, str):  # eager raised: not a sample for this device
            continue
        got, total = lazy["outputs"].get(key, "missing"), total + 1
        worst = math.inf if isinstance(got, str) or len(got) != len(want) else max(map(diff, want, got), default=0.0)
        if worst == 0.0:
            equal += 1
            continue
        entry = mismatches.setdefault(key.split("[")[0], {"samples": [], "max diff": 0.0})
        entry["samples"].append(key)
        entry["max diff"] = max(entry["max diff"], worst)
        if isinstance(got, str):
            entry["error"] = got
    return ok(equal == total, {"samples equal": f"{equal}/{total}", "ops": len(OPINFO_OPS) - len(eager["missing"]),
                               "mismatching ops": ", ".join(mismatches) or "none", "mismatches": mismatches,
                               "missing ops": eager["missing"]})


def item_cap(side: str) -> Result:
    return cap_item(side, Path(ARGS.dir), CHECKS["cap"].limit)


@dataclasses.dataclass
class Check:
    title: str
    item: Callable[[str], Result]
    judge: Callable[..., tuple[str, Result]]
    limit: float  # seconds, per side
    sides: tuple[str, ...] = ("eager", "lazy")
    cuda_only: bool = False


CHECKS = {
    "mixing": Check("1 mixing: eager CUDA autograd with lazymem", item_mixing, judge_mixing, 60, ("lazy",), True),
    "first_use": Check("2 first use", item_first_use, judge_first_use, 60, ("lazy",)),
    "mlp": Check("3 MLP fp32 = eager (bitwise)", item_mlp, judge_bitwise, 60),
    "gpt2": Check("4 GPT-2 fp32 = eager (bitwise)", item_gpt2, judge_bitwise, 90),
    "gpt2_split": Check("5 GPT-2 fp64 split ~ eager", item_gpt2_split, judge_split, 90),
    "bf16": Check("6 GPT-2 bf16 autocast ~ eager", item_bf16, judge_bf16, 60),
    "opinfo": Check("7 OpInfo forward = eager (bitwise)", item_opinfo, judge_opinfo, 120),
    "cap": Check("8 real cap: 3 GiB", item_cap, judge_cap, 100, cuda_only=True),
    "tiny": Check("9 tiny ops", item_tiny, judge_tiny, 60),
    "speed": Check("10 GPT-2 step time (issue 30's rows)", item_speed, judge_speed, 150),
}
ONLY = list(CHECKS)  # the checks to run (--only)
# Workers, in this order: a fresh process for the checks of a process's first moments (1, 2) and for
# the cap (8); the others share one worker per side. Eager runs first: lazymem's cap needs its batch.
SHARED = ["mlp", "gpt2", "gpt2_split", "bf16", "opinfo", "tiny", "speed"]
GROUPS = [("lazy", ["mixing"]), ("lazy", ["first_use"]), ("eager", SHARED), ("lazy", SHARED),
          ("eager", ["cap"]), ("lazy", ["cap"])]


# ----------------------------------------------------------------------------------------------------
# Workers (tools/_workers.py: a crash or a hang costs one worker, not the run).


def worker(side: str, items: list[str], out: str) -> None:
    """Runs `items` in turn, saving each result; stops after a failed item (it may have left state
    behind: the parent runs the rest in a fresh worker)."""
    with _workers.Emitter(out) as emit:
        if side == "lazy":
            import torch_lazymem

            if SMOKE:
                torch_lazymem.set_backing_device("cpu")
            elif "first_use" not in items:
                torch.zeros(1, device="cuda")  # CUDA initialized first: row 2 tests lazymem doing it
        emit.ready()
        for item in items:
            emit.start(item)
            try:
                result = CHECKS[item].item(side)
            except Skip as e:
                result = {"skip": str(e)}
            except Exception as e:  # noqa: BLE001 - reported in the item's row
                result = {"error": first_line(e)}
            if side == "eager" and "torch_lazymem" in sys.modules:  # eager's results must stay clean of it
                result = {"error": "torch_lazymem was imported in the eager worker"}
            torch.save(result, Path(ARGS.dir) / f"{side}_{item}.pt")
            emit.end(item)
            if "error" in result:
                return


def run_side(io: str, out: str | None, side: str, items: list[str]) -> dict[str, Result]:
    """Each item's result, running the items left in a fresh worker after one fails or dies. A worker
    that shows no progress for its slowest item's limit is killed."""
    timeout = max(CHECKS[i].limit for i in items)
    workdir = tempfile.mkdtemp(dir=io)  # (each Scheduler numbers its workers' files from 1)
    scheduler = _workers.Scheduler([sys.executable, __file__, "--worker", side, "--dir", io], workdir, timeout,
                                   startup_attempts=1)
    results: dict[str, Result] = {}
    while todo := [i for i in items if i not in results]:
        run = scheduler.run(_workers.Task(todo))
        for item in run.done:
            results[item] = torch.load(Path(io) / f"{side}_{item}.pt", weights_only=False)
            note = next((f"{k}: {results[item][k]}" for k in ("error", "skip") if k in results[item]), "done")
            progress(f"{side} {item} {note}")
        if run.died:
            current = next(iter(run.started), None) or next(i for i in todo if i not in results)
            results[current] = {"error": f"worker {run.how}: {crash_line(run.stderr)}"}
            progress(f"{side} {current} {results[current]['error']}")
        if out:
            with open(Path(out) / "gpu_check.log", "a") as f:
                f.write(f"==== {side} worker: {' '.join(todo)}\n{run.stderr.rstrip()}\n")
    return results


def crash_line(stderr: str) -> str:
    """The first line of stderr's tail that names an error (else its last line)."""
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()][-30:]
    hits = [ln for ln in lines if "error" in ln.lower() or "what():" in ln]
    return (hits[0] if hits else lines[-1] if lines else "no output")[:200]


# ----------------------------------------------------------------------------------------------------
# The report.


def verdict(name: str, results: dict[tuple[str, str], Result]) -> tuple[str, Result]:
    check = CHECKS[name]
    if check.cuda_only and SMOKE:
        return "skip", {"reason": "no CUDA"}
    sides = [results[(side, name)] for side in check.sides]
    for side, r in zip(check.sides, sides):
        if "skip" in r:
            return "skip", {"reason": r["skip"]}
        if "error" in r:
            return "FAIL", {"error": f"{'lazymem' if side == 'lazy' else 'eager'}: {r['error']}"}
    try:
        return check.judge(*sides)
    except Exception as e:  # noqa: BLE001 - a result without the expected fields
        return "FAIL", {"error": "comparing: " + first_line(e)}


def cell(figures: Result) -> str:
    """A row's figures: the scalars (dicts and lists go to the json only)."""
    def fmt(v: Any) -> str:
        return f"{v:.3g}" if isinstance(v, float) else str(v)

    text = "; ".join(fmt(v) if k in ("reason", "error") else f"{k} {fmt(v)}"
                     for k, v in figures.items() if not isinstance(v, (dict, list)))
    return text.replace("|", "\\|").replace("\n", " ")


def main() -> int:
    if not SMOKE and not torch.cuda.is_available():
        print("gpu_check: no CUDA device", file=sys.stderr)
        return 2
    start, out = time.monotonic(), os.environ.get("OUT")
    if out:
        os.makedirs(out, exist_ok=True)
        Path(out, "gpu_check.log").write_text("")
    results: dict[tuple[str, str], Result] = {}
    with tempfile.TemporaryDirectory(prefix="gpu_check.") as io:
        for side, items in GROUPS:
            items = [i for i in items if not (SMOKE and CHECKS[i].cuda_only) and i in ONLY]
            if items:
                results.update({(side, i): r for i, r in run_side(io, out, side, items).items()})
    rows = {name: (check.title, *verdict(name, results)) for name, check in CHECKS.items() if name in ONLY}
    device = "CPU (smoke mode)" if SMOKE else torch.cuda.get_device_name()
    head = f"gpu_check on {device}, torch {torch.__version__}, {time.monotonic() - start:.0f} s\n\n"
    table = "| check | result | figures |\n|---|---|---|\n" + "".join(
        f"| {title} | {result} | {cell(figures)} |\n" for title, result, figures in rows.values())
    print(head + table, end="")
    if out:
        Path(out, "gpu_check.md").write_text(head + table)
        report = {"device": device, "torch": torch.__version__, "python": sys.version.split()[0],
                  "elapsed_s": time.monotonic() - start,
                  "checks": {k: {"title": t, "result": r, "figures": f} for k, (t, r, f) in rows.items()}}
        Path(out, "gpu_check.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    return 1 if any(r == "FAIL" for _, r, _ in rows.values()) else 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worker", choices=["eager", "lazy"], help=argparse.SUPPRESS)
    parser.add_argument("--dir", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--items", help=argparse.SUPPRESS)
    parser.add_argument("--only", help="comma-separated checks to run (of: " + ", ".join(CHECKS) + "); all by default")
    parser.add_argument("--chunk-node-ns", type=int, help="lazymem's planner prices each node at this many ns per "
                        "chunk in every check (LAZYMEM_CHUNK_NODE_NS; off by default)")
    parser.add_argument("--async-copy-out", type=int, choices=[0, 1], help="copies of results into host memory "
                        "overlap the kernels after them (1) or not (0) in every check (LAZYMEM_ASYNC_COPY_OUT; off on "
                        "a GPU by default, on in check 8's priced rows)")
    ARGS = parser.parse_args()
    if ARGS.chunk_node_ns is not None:  # (the workers inherit it)
        os.environ["LAZYMEM_CHUNK_NODE_NS"] = str(ARGS.chunk_node_ns)
    if ARGS.async_copy_out is not None:
        os.environ["LAZYMEM_ASYNC_COPY_OUT"] = str(ARGS.async_copy_out)
    ONLY = ARGS.only.split(",") if ARGS.only else list(CHECKS)
    if unknown := [c for c in ONLY if c not in CHECKS]:
        parser.error(f"unknown checks {unknown}: expected some of {', '.join(CHECKS)}")
    sys.exit(worker(ARGS.worker, _workers.read_items(ARGS.items), ARGS.out) if ARGS.worker else main())
