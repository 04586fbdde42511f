"""What each rank runs in test_integrations_ddp.py (via dist_harness.run_ranks)."""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
import warnings
from collections.abc import Iterator

import torch
import torch.nn as nn
import torch.nn.functional as F

D = torch.float64
LZ = "lazymem"
TIME_STATS_WARNING = "Time stats are currently only collected for CPU and CUDA devices"


@contextlib.contextmanager
def captured_output() -> Iterator[list[str]]:
    """What the block writes to file descriptor 2 (c10's warnings and logs go there, not through
    sys.stderr) and its Python warnings: one string, appended to the yielded list at the end."""
    out: list[str] = []
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as f, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        os.dup2(f.fileno(), 2)
        try:
            yield out
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            f.seek(0)
            out.append(f.read().decode(errors="replace") + "".join(f"\n{w.category.__name__}: {w.message}"
                                                                      for w in caught))


def ddp_steps(rank: int, size: int, steps: int = 3) -> tuple[dict, list[torch.Tensor]]:
    """A DDP MLP on lazymem, `steps` SGD steps on this rank's rows; DDP's logging data and the
    parameters."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).to(D).to(LZ)
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(10 + rank)
    for _ in range(steps):  # DDP samples runtime stats from the 2nd forward on
        x, y = torch.randn(5, 6, dtype=D, generator=g), torch.randint(0, 3, (5,), generator=g)
        loss = F.cross_entropy(ddp(x.to(LZ)), y.to(LZ))
        opt.zero_grad()
        loss.backward()
        opt.step()
        loss.item()
    logging_data = ddp._get_ddp_logging_data()  # DDP's other logger calls still reach its logger
    assert logging_data["world_size"] == size and logging_data["rank"] == rank, logging_data
    return logging_data, [p.detach().cpu() for p in model.parameters()]


def ddp_time_stats(rank: int, size: int) -> dict:
    """DDP training steps on lazymem: what they printed or warned, DDP's logging data and the
    parameters."""
    with captured_output() as out:
        logging_data, params = ddp_steps(rank, size)
    return {"output": out[0], "logging": logging_data, "params": params}
