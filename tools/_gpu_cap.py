"""tools/gpu_check.py's check 8, the real cap: a GPT-2 under a 3 GiB per-process cap; eager's largest
batch B_e, then lazymem at B_e, 4 B_e and 8 B_e (default budget), then 4 B_e and 8 B_e with chunks
priced (and copies out not waited for): time per step, throughput per sample against eager, reserved
memory against the cap, chunks, out-of-memory retries and copies across the boundary."""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

import torch
from _gpu_programs import DEVICE, Result, Skip, first_line, gpt2, ok, token_ids
from _gpu_speed import speed_steps
from torch import nn

GiB = 1 << 30
CAP = 3 * GiB
# Check 8's priced rows: what a node costs per chunk on an H200 (lazymem's tiny ops ran at 8-9 us each).
PRICED_NODE_NS = 8000


def timed_step(model: nn.Module, opt: torch.optim.Optimizer, ids: torch.Tensor) -> float:
    return speed_steps(model, opt, ids, 1)["times"][0]


def item_cap(side: str, out_dir: Path, limit: float) -> Result:
    torch.cuda.set_per_process_memory_fraction(CAP / torch.cuda.get_device_properties(0).total_memory)
    model = gpt2(6, n_embd=512, n_head=8).to(DEVICE[side])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return eager_cap(model, opt) if side == "eager" else lazy_cap(model, opt, out_dir, limit)


def eager_cap(model: nn.Module, opt: torch.optim.Optimizer) -> Result:
    """Eager's largest batch of 256 tokens under the cap (doubling, then at most 4 bisections), and
    its time per step (a warm-up, then the mean of 3)."""
    def fits(batch: int) -> bool:
        try:
            timed_step(model, opt, token_ids(batch, 256).cuda())
            return True
        except torch.OutOfMemoryError:
            return False
        finally:
            opt.zero_grad()
            torch.cuda.empty_cache()

    good, bad = 0, None
    for batch in (1, 2, 4, 8, 16, 32, 64, 128):
        if not fits(batch):
            bad = batch
            break
        good = batch
    for _ in range(4):
        if bad is None or bad - good <= 1:
            break
        mid = (good + bad) // 2
        good, bad = (mid, bad) if fits(mid) else (good, mid)
    if not good:
        raise RuntimeError("eager runs out of memory at batch 1")
    ids = token_ids(good, 256).cuda()
    timed_step(model, opt, ids)
    torch.cuda.reset_peak_memory_stats()
    before = allocator_counts()
    return {"batch": good, "step_s": statistics.mean(timed_step(model, opt, ids) for _ in range(3)),
            "reserved": torch.cuda.max_memory_reserved(), "allocated": torch.cuda.max_memory_allocated(),
            "allocator": allocator_counts(before)}


def allocator_counts(since: dict[str, int] | None = None) -> dict[str, int]:
    """The caching allocator's cudaMalloc/cudaFree calls and its out-of-memory retries (since `since`):
    a step that frees and allocates segments again waits for the GPU each time."""
    st = torch.cuda.memory_stats()
    now = {k: int(st.get(k, 0)) for k in ("num_alloc_retries", "num_device_alloc", "num_device_free", "num_ooms")}
    return {k: v - (since or {}).get(k, 0) for k, v in now.items()}


def lazy_cap(model: nn.Module, opt: torch.optim.Optimizer, out_dir: Path, limit: float) -> Result:
    """lazymem at 1, 4 and 8 times eager's batch (then 4 and 8 priced): the first step, two more (the second step is the
    first with the optimizer's state, a new program), then the mean of 3 as eager's; memory, chunks,
    out-of-memory retries and pipelined batches (torch_lazymem.stats()); stops at a step that raises,
    or when the check's time is mostly spent (the item's results are lost if it is killed)."""
    lazymem = sys.modules["torch_lazymem"]
    path = out_dir / "eager_cap.pt"
    b_e = (torch.load(path) if path.exists() else {}).get("batch")
    if not b_e:
        raise Skip("no batch from eager")
    runs: Result = {}
    start = time.monotonic()
    # Then 4x and 8x again with the planner pricing each node at PRICED_NODE_NS per chunk (off by
    # default: LAZYMEM_CHUNK_NODE_NS): the logits the loop keeps go to host memory where that saves
    # chunks (issue 30 item 4), measured here until a GPU run shows it right.
    priced = [(m, PRICED_NODE_NS) for m in (4, 8)] if int(os.environ.get("LAZYMEM_CHUNK_NODE_NS") or 0) <= 0 else []
    for mult, node_ns in [(1, 0), (4, 0), (8, 0), *priced]:
        name = f"{mult}x" + (f" priced {node_ns} ns" if node_ns else "")
        if time.monotonic() - start > 0.6 * limit:
            runs[name] = {"batch": mult * b_e, "error": "not run: the check's time is up"}
            break
        if node_ns:
            lazymem._C._set_chunk_node_ns(node_ns)
            if not os.environ.get("LAZYMEM_ASYNC_COPY_OUT"):
                lazymem._C._set_async_copy_out(1)
        ids = token_ids(mult * b_e, 256).to("lazymem")
        torch.cuda.reset_peak_memory_stats()
        lazymem.reset_stats()
        times, chunks, peak, predicted, first_retries = [], 0, 0, 0, 0
        counts = allocator_counts()
        try:
            for i in range(6):
                if i == 3:
                    counts = allocator_counts()  # the timed steps
                    st0 = lazymem.stats()
                times.append(timed_step(model, opt, ids))
                st = lazymem.stats()
                chunks, peak = max(chunks, st["chunks"]), max(peak, st["peak_bytes"])
                predicted = max(predicted, st["predicted_peak_bytes"])
                first_retries = first_retries if len(times) > 1 else st["oom_retries"]
        except Exception as e:  # noqa: BLE001 - a step that raised is the finding
            runs[name] = {"batch": mult * b_e, "error": first_line(e)}
            break
        finally:
            if node_ns:
                lazymem._C._set_chunk_node_ns(-1)
                if not os.environ.get("LAZYMEM_ASYNC_COPY_OUT"):
                    lazymem._C._set_async_copy_out(-1)
        st1 = lazymem.stats()
        runs[name] = {"batch": mult * b_e, "first_s": times[0], "step_s": statistics.mean(times[3:]),
                            "warm_s": times[1:3],
                            "timed": {k: st1[k] - st0[k] for k in ("pipelined_flushes", "pipeline_given_back",
                                                                    "plans_reused", "materializations", "plan_ns")},
                            "reserved": torch.cuda.max_memory_reserved(),
                            "allocated": torch.cuda.max_memory_allocated(), "predicted": predicted,
                            "budget": lazymem.memory_budget(), "peak": peak, "chunks": chunks,
                            "oom_retries": lazymem.stats()["oom_retries"], "first_retries": first_retries,
                            "caps": lazymem.stats()["allocator_caps"], "allocator": allocator_counts(counts),
                            "in_host": st1["values_in_host_memory"] - st0["values_in_host_memory"],
                            # (what the planner prices copies at, learned from the copies so far, and
                            # the timed steps' copies out of the device)
                            "copy_gbps": GiB / lazymem._C._predicted_copy_seconds(GiB) / 1e9,
                            "d2h": {k: st1[k] - st0[k] for k in ("d2h_bytes", "d2h_copies", "d2h_ns", "d2h_behind",
                                                                  "copy_out_wait_ns")},
                            "plan_ms": lazymem.stats()["plan_ns"] / 1e6,
                            "fraction_after": torch.cuda.get_per_process_memory_fraction()}
    return runs


def judge_cap(eager: Result, lazy: Result) -> tuple[str, Result]:
    figures: Result = {"eager batch": eager["batch"], "eager s/step": eager["step_s"],
                       "eager reserved GiB": eager["reserved"] / GiB,
                       "eager allocated GiB": eager.get("allocated", 0) / GiB, "eager allocator": eager.get("allocator"),
                       "lazymem": lazy}
    for mult, run in lazy.items():
        per_sample = (run["batch"] / run["step_s"]) / (eager["batch"] / eager["step_s"]) if "step_s" in run else 0
        figures[f"{mult} (B={run['batch']})"] = run.get("error") or (
            f"{run['step_s']:.3g} s/step (first {run['first_s']:.3g} s), {per_sample:.2f}x eager per sample, "
            f"reserved {run['reserved'] / GiB:.2f} of {CAP / GiB:g} GiB (budget {run['budget'] / GiB:.2f}), "
            f"allocated {run['allocated'] / GiB:.2f} GiB vs predicted {run['predicted'] / GiB:.2f}, "
            f"{run['chunks']} chunks, {run['oom_retries']} retries ({run['first_retries']} in the first step), "
            f"{run['in_host']} values in host memory ({run['d2h']['d2h_bytes'] / GiB:.2f} GiB out in "
            f"{run['d2h']['d2h_ns'] / 1e6:.1f} ms, {run['d2h']['d2h_behind']} of {run['d2h']['d2h_copies']} copies "
            f"not waited for, {run['d2h']['copy_out_wait_ns'] / 1e6:.1f} ms waited for them at the ends of runs; "
            f"copies priced at {run['copy_gbps']:.1f} GB/s), "
            f"allocator capped for {run['caps']} runs; timed steps: {run['timed']['pipelined_flushes']} batches "
            f"pipelined, {run['timed']['pipeline_given_back']} given back, {run['timed']['plan_ns'] / 1e6:.1f} ms planning")
    # The goal: what the caching allocator reserves stays within the budget at every step, and
    # the user's fraction is theirs again after each run.
    fraction = CAP / torch.cuda.get_device_properties(0).total_memory
    within = all(r.get("reserved", 0) <= r.get("budget", 0) and abs(r.get("fraction_after", 0) - fraction) < 1e-9
                 for r in lazy.values() if "error" not in r)
    return ok(len(lazy) >= 3 and not any("error" in r for r in lazy.values()) and within, figures)
