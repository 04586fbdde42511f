"""Runs a function on N ranks of a gloo process group, each a fresh process (torch.multiprocessing's
forkserver context), and returns what each rank returned. A rank that raises fails the caller with its
traceback; ranks still running after `timeout` seconds are killed and fail it too (a hang is a bug).
The ranks meet through a file store in a temporary directory (init_method="file://..."), as PyTorch's
own MultiProcessTestCase does: no port is chosen, so none can be taken by another process between
choosing it and binding it.

Used by test_distributed.py; the functions it runs live in dist_programs.py (importable by name in
the spawned processes)."""

from __future__ import annotations

import datetime
import os
import tempfile
import traceback

import torch
import torch.multiprocessing as mp


def _entry(fn, rank: int, size: int, store: str, out_dir: str, args: tuple, pg_timeout: float) -> None:
    result: object
    try:
        import torch.distributed as dist

        import torch_lazymem  # noqa: F401 - registers the lazymem device and its c10d backend

        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=size,
                                timeout=datetime.timedelta(seconds=pg_timeout))
        try:
            result = ("ok", fn(rank, size, *args))
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported to the parent
        result = ("error", traceback.format_exc())
    torch.save(result, os.path.join(out_dir, f"{rank}.pt"))


# Each rank forks from a server that has imported torch and torch_lazymem once (a spawned rank spent
# most of a test's time importing them: test_distributed.py and test_integrations_ddp.py took 137 s,
# now 73 s). The server runs no op before it forks, as a DataLoader's forked workers; a rank reads its
# settings from the environment the server started with: no test sets any for its ranks.
mp.set_forkserver_preload(["torch", "torch_lazymem", "dist_programs"])


def run_ranks(fn, size: int, *args, timeout: float = 240.0, pg_timeout: float = 60.0, allow_errors: bool = False):
    """fn(rank, size, *args) on `size` ranks; returns the list of their results. With allow_errors,
    returns ("ok", value) / ("error", traceback) / ("missing", None) per rank instead of raising."""
    ctx = mp.get_context("forkserver")
    with tempfile.TemporaryDirectory() as d:
        store = os.path.join(d, "store")  # (created by the first rank; results go beside it)
        procs = [ctx.Process(target=_entry, args=(fn, r, size, store, d, args, pg_timeout)) for r in range(size)]
        for p in procs:
            p.start()
        deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout)
        for p in procs:
            p.join(max(0.0, (deadline - datetime.datetime.now()).total_seconds()))
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        out = []
        for r in range(size):
            path = os.path.join(d, f"{r}.pt")
            out.append(torch.load(path, weights_only=False) if os.path.exists(path) else ("missing", None))
    if allow_errors:
        return out
    assert not hung, f"ranks {hung} still running after {timeout} s"
    for r, (status, value) in enumerate(out):
        assert status == "ok", f"rank {r}: {status}\n{value}"
    return [value for _, value in out]
