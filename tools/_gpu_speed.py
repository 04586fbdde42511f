"""gpu_check's speed checks (tools/gpu_check.py, checks 9 and 10): tiny pointwise ops, and issue 30's
GPT-2 step times, each eager and lazymem, unpipelined and pipelined; their items run in a worker of
either side, their judges in the parent."""

from __future__ import annotations

import statistics
import sys
import time
from typing import Any

import torch
from _gpu_programs import DEV, DEVICE, SPEED, Result, diff, finish, gpt2, lazy_stats, lm_loss, ok, token_ids
from torch import nn

TINY_OPS = 4000


def tiny_runs(device: str) -> tuple[float, torch.Tensor]:
    """x = x * 1.0001 + 0.0001, TINY_OPS ops in all, then a sync: 3 warm-ups (lazymem: a plan, its
    reuse, a CUDA graph's capture), then the median of 3."""
    times = []
    for _ in range(6):
        x = torch.zeros(1024, device=device)
        finish(device)
        t0 = time.perf_counter()
        for _ in range(TINY_OPS // 2):
            x = x * 1.0001 + 0.0001
        finish(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[3:]) / TINY_OPS * 1e6, x.cpu()


def item_tiny(side: str) -> Result:
    lazymem = sys.modules.get("torch_lazymem")
    if lazymem:  # first without pipelining (on by default on a GPU), then with it
        lazymem.set_pipeline(False)
    try:
        st0 = lazy_stats()
        us, value = tiny_runs(DEVICE[side])
        out: Result = {"us_per_op": us, "value": value, "graph_replays": lazy_stats().get("cuda_graph_replays", 0) - st0.get("cuda_graph_replays", 0)}
        if lazymem:
            lazymem.set_pipeline(True)
            out["pipelined_us_per_op"], out["pipelined_value"] = tiny_runs(DEVICE[side])
            out["pipelined_flushes"] = lazymem.stats()["pipelined_flushes"]
            lazymem.set_pipeline(False)
            lazymem.set_cuda_graphs(False)
            try:
                out["nographs_us_per_op"], _ = tiny_runs(DEVICE[side])
            finally:
                lazymem.set_cuda_graphs(True)
    finally:
        if lazymem:
            lazymem.set_pipeline(None)
    return out


def judge_tiny(eager: Result, lazy: Result) -> tuple[str, Result]:
    equal = torch.equal(eager["value"], lazy["value"]) and torch.equal(eager["value"], lazy["pipelined_value"])
    return ok(equal, {"eager us/op": eager["us_per_op"], "lazymem us/op": lazy["us_per_op"],
                      "lazymem/eager": lazy["us_per_op"] / eager["us_per_op"],
                      "pipelined us/op": lazy["pipelined_us_per_op"],
                      "pipelined/eager": lazy["pipelined_us_per_op"] / eager["us_per_op"],
                      "pipelined batches": lazy["pipelined_flushes"], "graph replays": lazy["graph_replays"],
                      "no graphs us/op": lazy["nographs_us_per_op"],
                      "no graphs/eager": lazy["nographs_us_per_op"] / eager["us_per_op"], "values equal": equal})


def speed_steps(model: nn.Module, opt: torch.optim.Optimizer, ids: torch.Tensor, steps: int) -> Result:
    """`steps` AdamW steps, loss.item() after each (as a user's loop reads its loss): each step's wall
    time, the time until its loss was read (lazymem: its recording), and the losses."""
    times, records, losses, starts = [], [], [], []
    for _ in range(steps):
        finish(ids.device.type)
        starts.append(time.monotonic_ns())  # (the pipeline timeline's clock)
        t0 = time.perf_counter()
        loss, _ = lm_loss(model, ids)
        loss.backward()
        opt.step()
        opt.zero_grad()
        t1 = time.perf_counter()
        losses.append(loss.item())
        finish(ids.device.type)
        times.append(time.perf_counter() - t0)
        records.append(t1 - t0)
    return {"times": times, "records": records, "losses": losses, "starts": starts}


def timeline(events: list[tuple[str, int, int]], start: int) -> str:
    """A pipelined step's timeline (torch_lazymem._C._pipeline_trace), in ms from its start: h<nodes>
    a batch handed, d<nodes> one due while the worker was busy, w the worker's runs, s a
    materialization on the recording thread (the read: waiting for the worker, then the tail)."""
    out, opened = [], {}
    for kind, t, nodes in sorted(events, key=lambda e: e[1]):
        if t < start:  # (the synchronize before the step)
            continue
        ms = (t - start) / 1e6
        if kind in ("handed", "due"):
            out.append(f"{kind[0]}{nodes} {ms:.2f}")
        elif kind.endswith("_start"):
            opened[kind[:-6]] = ms
        elif kind.endswith("_end") and kind[:-4] in opened:
            out.append(f"{kind[0]} {opened.pop(kind[:-4]):.2f}-{ms:.2f}")
    return ", ".join(out)


def item_speed(side: str) -> Result:
    """Issue 30's rows: per GPT-2, the first step, then 5 steps, then (lazymem) 5 pipelined steps;
    eager runs the same 11 steps, so all losses compare bitwise."""
    lazymem = sys.modules.get("torch_lazymem")
    rows: Result = {}
    for name, n_layer, config, batch, seq in SPEED:
        model = gpt2(n_layer, **config).to(DEVICE[side])
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        ids = token_ids(batch, seq).to(DEVICE[side])
        if lazymem:
            lazymem.set_pipeline(False)
        try:
            first = speed_steps(model, opt, ids, 1)
            st0 = lazy_stats()
            plain = speed_steps(model, opt, ids, 5)
            st1 = lazy_stats()
            if lazymem:
                lazymem.set_pipeline(True)
                before = lazymem.stats()["pipelined_flushes"]
                given_back = lazymem.stats()["pipeline_given_back"]
                worker_ns = lazymem.stats()["pipeline_worker_ns"]
            piped = speed_steps(model, opt, ids, 4)
            if lazymem:  # the last pipelined step's timeline
                lazymem._C._set_pipeline_trace(True)
            last = speed_steps(model, opt, ids, 1)
            events = lazymem._C._pipeline_trace() if lazymem else []
            if lazymem:
                lazymem._C._set_pipeline_trace(False)
            piped = {k: piped[k] + last[k] for k in piped}
            st2 = lazy_stats()
        finally:
            if lazymem:
                lazymem.set_pipeline(None)
        rows[name] = {"first_s": first["times"][0], "step_s": statistics.median(plain["times"][1:]),
                      "record_s": statistics.median(plain["records"][1:]),
                      "piped_step_s": statistics.median(piped["times"][1:]),
                      "piped_record_s": statistics.median(piped["records"][1:]),
                      "timeline": timeline(events, last["starts"][0]) if events else "",
                      "piped_last_s": last["times"][0],
                      "losses": torch.tensor(first["losses"] + plain["losses"] + piped["losses"], dtype=torch.float64),
                      "pipelined_flushes": lazymem.stats()["pipelined_flushes"] - before if lazymem else 0,
                      "given_back": lazymem.stats()["pipeline_given_back"] - given_back if lazymem else 0,
                      # the worker's busy time per pipelined step (planning and launching its batches)
                      "worker_s": (lazymem.stats()["pipeline_worker_ns"] - worker_ns) / 1e9 / 5 if lazymem else 0,
                      # what 5 unpipelined steps cost in lazymem's counters (plans, cache hits, flushes, ...)
                      "stats": {k: v - st0[k] for k, v in st1.items() if isinstance(v, (int, float))},
                      "piped_stats": {k: v - st1[k] for k, v in st2.items() if isinstance(v, (int, float))}}
        rows[name]["deterministic"] = deterministic_steps(side, n_layer, config, ids)
        if side == "eager":  # eager against itself: the same 11 steps from a fresh model, twice
            again = []
            for _ in range(2):
                del model, opt
                model = gpt2(n_layer, **config).to(DEVICE[side])
                opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
                again.append(torch.tensor(speed_steps(model, opt, ids, len(rows[name]["losses"]))["losses"],
                                          dtype=torch.float64))
            rows[name]["again"] = torch.stack(again)
        del model, opt, ids
        finish(DEVICE[side])
        if DEV == "cuda":
            torch.cuda.empty_cache()
    return rows


def deterministic_steps(side: str, n_layer: int, config: dict[str, Any], ids: torch.Tensor) -> Result:
    """The verdict's steps: a fresh model, 1 AdamW step then 3 (lazymem: pipelined, graphs on) under
    torch.use_deterministic_algorithms, so that kernels that add with atomics (memory-efficient
    attention's backward) take their deterministic forms on both sides and every loss and parameter
    compares bitwise. The timed steps'
    losses cannot: eager CUDA differs from itself at the last bit on the 64x256-token row in some runs
    (a stop-48 run: from step 4, parameters up to 1.8e-7 apart)."""
    lazymem = sys.modules.get("torch_lazymem")
    # (warn_only=False: memory-efficient attention's backward takes its deterministic form only then;
    # cuBLAS needs CUBLAS_WORKSPACE_CONFIG, set by _gpu_programs before CUDA starts)
    torch.use_deterministic_algorithms(True)
    try:
        model = gpt2(n_layer, **config).to(DEVICE[side])
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        losses = speed_steps(model, opt, ids, 1)["losses"]
        if lazymem:
            lazymem.set_pipeline(True)
        losses += speed_steps(model, opt, ids, 3)["losses"]
        return {"losses": torch.tensor(losses, dtype=torch.float64),
                "params": [p.detach().cpu() for p in model.parameters()]}
    except RuntimeError as e:  # an op without a deterministic form: the row says which
        return {"error": str(e).splitlines()[0][:300]}
    finally:
        if lazymem:
            lazymem.set_pipeline(None)
        torch.use_deterministic_algorithms(False)


def det_note(e: Result, z: Result) -> str:
    """Where the deterministic steps differ: the first loss, and how many parameters."""
    steps = (e["losses"] != z["losses"]).nonzero()
    params = sum(not torch.equal(a, b) for a, b in zip(e["params"], z["params"]))
    return (f" (losses from step {int(steps[0])}" if len(steps) else " (losses equal") + (
        f", {params} of {len(e['params'])} parameters, max {max(diff(a, b) for a, b in zip(e['params'], z['params'])):.3g})")


def graphs(stats: Result) -> str:
    return (f"{stats.get('cuda_graph_replays', 0)} replays of {stats.get('cuda_graph_nodes', 0)} nodes, "
            f"{stats.get('cuda_graph_plain_nodes', 0)} plain, {stats.get('cuda_graph_fallbacks', 0)} fallbacks")


def judge_speed(eager: Result, lazy: Result) -> tuple[str, Result]:
    figures: Result = {}
    equal = True
    for name, e in eager.items():
        z = lazy[name]
        same = torch.equal(e["losses"], z["losses"])
        # The verdict: the deterministic steps, bitwise. The timed steps' losses are reported: where
        # eager differs from itself run to run (kernels that add with atomics), with eager's spread.
        det_e, det_z = e["deterministic"], z["deterministic"]
        det_error = det_e.get("error") or det_z.get("error")
        det_same = not det_error and torch.equal(det_e["losses"], det_z["losses"]) and all(
            torch.equal(a, b) for a, b in zip(det_e["params"], det_z["params"]))
        equal &= det_same
        spread = max(diff(e["losses"], a) for a in e["again"])
        worst = diff(e["losses"], z["losses"])
        if not same:
            first_differing = int((e["losses"] != z["losses"]).nonzero()[0])
            own = (e["losses"] != e["again"]).any(0).nonzero()
            same_note = (f"losses differ from step {first_differing} (max {worst:.3g}; eager against itself "
                         f"{spread:.3g}" + (f", from step {int(own[0])}" if len(own) else "") + ")")
        figures[name] = (
            f"eager {e['step_s'] * 1e3:.1f} ms/step, lazymem {z['step_s'] * 1e3:.1f} ms "
            f"({e['step_s'] / z['step_s']:.2f}x eager; recording {z['record_s'] * 1e3:.1f} ms), pipelined "
            f"{z['piped_step_s'] * 1e3:.1f} ms ({e['step_s'] / z['piped_step_s']:.2f}x, {z['pipelined_flushes']} "
            f"batches on the worker, {z['given_back']} given back; recording {z['piped_record_s'] * 1e3:.1f} ms, "
            f"worker busy {z['worker_s'] * 1e3:.1f} ms); CUDA graphs (unpipelined / pipelined steps): "
            f"{graphs(z['stats'])} / {graphs(z['piped_stats'])}; first step {z['first_s'] * 1e3:.0f} ms vs eager's {e['first_s'] * 1e3:.0f}; "
            f"last pipelined step ({z['piped_last_s'] * 1e3:.1f} ms; ms from its start): {z['timeline']}; "
            + ("losses bitwise equal" if same else same_note)
            + ("; deterministic steps (1 plain, 3 pipelined) bitwise equal" if det_same
               else f"; deterministic steps raised: {det_error}" if det_error
               else "; deterministic steps (1 plain, 3 pipelined) DIFFER" + det_note(det_e, det_z)))
    numbers = {side: {name: {k: v for k, v in row.items() if k not in ("losses", "again", "deterministic")}
                      for name, row in rows.items()}
               for side, rows in (("eager", eager), ("lazy", lazy))}
    return ok(equal, {**figures, "losses equal": equal, "times": numbers})
