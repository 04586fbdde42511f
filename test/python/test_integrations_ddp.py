"""DDP on lazymem prints no "Time stats are currently only collected for CPU and CUDA devices" warning
at any rank, and keeps DDP's time statistics: lazymem registers DDP's timer for its device
(csrc/distributed/ddp_timer.cpp; torch registers CPU and CUDA only)."""

from __future__ import annotations

import dist_programs_integrations as P
import pytest
import torch
import torch.distributed as dist
from dist_harness import run_ranks

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo")


def test_ddp_step_prints_no_time_stats_warning_and_keeps_time_stats():
    results = run_ranks(P.ddp_time_stats, 2)
    for rank, r in enumerate(results):
        assert P.TIME_STATS_WARNING not in r["output"], f"rank {rank} printed:\n{r['output']}"
        assert r["logging"].get("avg_forward_compute_time", 0) > 0, r["logging"]
    # the gradients were all-reduced: every rank ends with the same parameters
    for p, q in zip(results[0]["params"], results[1]["params"]):
        assert torch.equal(p, q)
