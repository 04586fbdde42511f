"""Where a GPT-2 training step of tools/gpu_check.py's check 10 spends its time on a GPU: eager's step,
lazymem's unpipelined and pipelined steps by CUDA graphs on/off and batch size, then one step each of
eager and lazymem (pipelined, graphs on and off) under torch.profiler: when the GPU was busy in each
phase (forward, backward, optimizer, the loss's read), its idle gaps, its top kernels.

    PYTHONPATH=. python tools/gpu_profile_step.py                 # check 10's first row
    ROW=2 SWEEP=0 PYTHONPATH=. python tools/gpu_profile_step.py   # its third row, no sweep
    LAZYMEM_GPU_CHECK_DEVICE=cpu PYTHONPATH=. python tools/gpu_profile_step.py   # the CPU, tiny sizes
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _gpu_programs import SPEED, gpt2, lm_loss, token_ids  # noqa: E402

import torch_lazymem as lm  # noqa: E402
from torch_lazymem import _C  # noqa: E402

NAME, LAYERS, CONFIG, BATCH, SEQ = SPEED[int(os.environ.get("ROW", 0))]
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def sync() -> None:
    if DEV == "cuda":
        torch.cuda.synchronize()


def make(device: str) -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.Tensor]:
    model = gpt2(LAYERS, **CONFIG).to(device)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4), token_ids(BATCH, SEQ).to(device)


def step(model: torch.nn.Module, opt: torch.optim.Optimizer, ids: torch.Tensor) -> float:
    """One AdamW step, its loss read at the end; returns when recording (eager: dispatch) ended."""
    loss, _ = lm_loss(model, ids)
    loss.backward()
    opt.step()
    opt.zero_grad()
    recorded = time.perf_counter()
    loss.item()
    return recorded


def timed(model: torch.nn.Module, opt: torch.optim.Optimizer, ids: torch.Tensor, n: int = 6) -> tuple[float, float]:
    """The median step time and recording time in ms over n steps (the first left out)."""
    steps, records = [], []
    for _ in range(n):
        sync()
        t0 = time.perf_counter()
        recorded = step(model, opt, ids)
        sync()
        steps.append(time.perf_counter() - t0)
        records.append(recorded - t0)
    return statistics.median(steps[1:]) * 1e3, statistics.median(records[1:]) * 1e3


def profiled(model: torch.nn.Module, opt: torch.optim.Optimizer, ids: torch.Tensor, tag: str) -> None:
    sync()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        with record_function("#forward"):
            loss, _ = lm_loss(model, ids)
        with record_function("#backward"):
            loss.backward()
        with record_function("#optimizer"):
            opt.step()
            opt.zero_grad()
        with record_function("#read"):
            loss.item()
        sync()
        wall = (time.perf_counter() - t0) * 1e3
    path = tempfile.mktemp(suffix=".json")
    prof.export_chrome_trace(path)
    with open(path) as f:
        events: list[dict[str, Any]] = json.load(f)["traceEvents"]
    os.unlink(path)
    gpu = sorted((e["ts"], e["ts"] + e.get("dur", 0)) for e in events
                 if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"))
    marks = {e["name"]: (e["ts"], e["ts"] + e["dur"]) for e in events if e.get("name", "").startswith("#") and "dur" in e}
    start = marks["#forward"][0]

    def busy(a: float, b: float) -> float:
        return sum(max(0, min(e, b) - max(s, a)) for s, e in gpu) / 1e3

    if not gpu:
        print(f"{tag}: wall {wall:.2f} ms (profiled); no GPU events", flush=True)
    else:
        print(f"{tag}: wall {wall:.2f} ms (profiled); {len(gpu)} GPU ops, {busy(0, 1e30):.2f} ms busy; first at "
              f"{(gpu[0][0] - start) / 1e3:.2f} ms, last ends at {(gpu[-1][1] - start) / 1e3:.2f} ms", flush=True)
    for name, (a, b) in sorted(marks.items(), key=lambda kv: kv[1][0]):
        print(f"   {name:12s} {(a - start) / 1e3:7.2f} .. {(b - start) / 1e3:7.2f} ms: GPU busy {busy(a, b):.2f} ms")
    gaps, last = [], None
    for s, e in gpu:
        if last is not None and s - last > 50:
            gaps.append((round((last - start) / 1e3, 2), round((s - last) / 1e3, 2)))
        last = e if last is None else max(last, e)
    print("   GPU idle over 50 us (at ms, for ms):", gaps[:25])
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=10, max_name_column_width=50), flush=True)


def main() -> None:
    model, opt, ids = make(DEV)
    timed(model, opt, ids, 3)
    print(f"{NAME}: eager step {timed(model, opt, ids)[0]:.2f} ms", flush=True)
    profiled(model, opt, ids, "eager")
    del model, opt, ids
    if DEV == "cuda":
        torch.cuda.empty_cache()
    model, opt, ids = make("lazymem")
    lm.set_pipeline(False)
    timed(model, opt, ids, 3)
    for graphs in (True, False) if os.environ.get("SWEEP", "1") == "1" else ():
        lm.set_cuda_graphs(graphs)
        lm.set_pipeline(False)
        print(f"graphs {graphs} unpipelined step/record ms", [round(v, 2) for v in timed(model, opt, ids)], flush=True)
        for batch in (32, 64, 128, 256):
            _C._set_pipeline_batch(batch)
            lm.set_pipeline(True)
            s0 = lm.stats()
            step_ms, record_ms = timed(model, opt, ids)
            s1 = lm.stats()

            def per_step(key: str, scale: float = 1.0) -> float:
                return (s1[key] - s0[key]) / 6 / scale  # noqa: B023 - read at once

            print(f"graphs {graphs} batch {batch}: step {step_ms:.2f} ms, recording {record_ms:.2f} ms; per step: "
                  f"batches {per_step('pipelined_flushes'):.1f}, worker {per_step('pipeline_worker_ns', 1e6):.2f} ms, "
                  f"replays {per_step('cuda_graph_replays'):.1f}, plain {per_step('cuda_graph_plain_nodes'):.1f}, "
                  f"late {per_step('pipeline_handed_late'):.1f}", flush=True)
    _C._set_pipeline_batch(0)
    lm.set_pipeline(True)
    for graphs in (True, False):
        lm.set_cuda_graphs(graphs)
        timed(model, opt, ids, 3)
        profiled(model, opt, ids, f"lazymem pipelined, graphs {graphs}")
    lm.set_cuda_graphs(True)
    lm.set_pipeline(None)


if __name__ == "__main__":
    main()
