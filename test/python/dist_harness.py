"""Runs a function on N ranks of a gloo process group, each a fresh process (torch.multiprocessing's
spawn context), and returns what each rank returned. A rank that raises fails the caller with its
traceback; ranks still running after `timeout` seconds are killed and fail it too (a hang is a bug).

Used by test_distributed.py; the functions it runs live in dist_programs.py (importable by name in
the spawned processes)."""

from __future__ import annotations

import datetime
import os
import socket
import tempfile
import traceback

import torch
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(fn, rank: int, size: int, port: int, out_dir: str, args: tuple, pg_timeout: float) -> None:
    result: object
    try:
        import torch.distributed as dist

        import torch_lazymem  # noqa: F401 - registers the lazymem device and its c10d backend

        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=size, timeout=datetime.timedelta(seconds=pg_timeout))
        try:
            result = ("ok", fn(rank, size, *args))
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported to the parent
        result = ("error", traceback.format_exc())
    torch.save(result, os.path.join(out_dir, f"{rank}.pt"))


def run_ranks(fn, size: int, *args, timeout: float = 240.0, pg_timeout: float = 60.0, allow_errors: bool = False):
    """fn(rank, size, *args) on `size` ranks; returns the list of their results. With allow_errors,
    returns ("ok", value) / ("error", traceback) / ("missing", None) per rank instead of raising."""
    ctx = mp.get_context("spawn")
    port = free_port()
    with tempfile.TemporaryDirectory() as d:
        procs = [ctx.Process(target=_entry, args=(fn, r, size, port, d, args, pg_timeout)) for r in range(size)]
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
