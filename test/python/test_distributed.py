"""torch.distributed on lazymem (issue 22): collectives recorded and run at materialization through
gloo, unmodified DDP whose ranks each split their own batch, exact against single-process eager
training on the concatenated batch. Every test spawns 2 or 3 ranks of a gloo group on this machine
(dist_harness.py); what each rank runs is in dist_programs.py."""

from __future__ import annotations

import dist_programs as P
import pytest
import torch.distributed as dist
from dist_harness import run_ranks

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo")

MiB = 1 << 20


def test_collectives_equal_gloo_on_cpu_tensors_and_bad_ones_raise_lazymem_errors():
    # all_reduce (every ReduceOp gloo supports), broadcast, all_gather, all_gather_into_tensor,
    # reduce_scatter_tensor, all_to_all_single (uneven), gather, scatter, async Work and its
    # future, coalesced forms, the backend's barrier; each counted once in stats()["collectives"].
    # Then bad calls: each raises a `lazymem:` error before anything is recorded, and a collective
    # after them still matches across ranks.
    results = run_ranks(P.collectives_then_errors, 2)
    for counted, messages in results:
        assert counted == {"collectives": 18}
        assert "dist.all_reduce with ReduceOp.AVG is not supported by the gloo backend" in messages[0]
        assert "dist.all_reduce expects contiguous tensors" in messages[1]
        assert "torch.distributed send is not supported on lazymem tensors" in messages[2]
        assert "all_gather_into_tensor with 2 ranks needs a tensor of 2 times" in messages[3]
        assert all(m.startswith("lazymem: ") for m in messages), messages


def test_ranks_meet_through_a_file_store_and_choose_no_port():
    """The harness chose a free port and the ranks bound it later: another process could take it in
    between (a flaky CI on a busy machine). They meet through a file store in a temporary directory
    instead, as PyTorch's MultiProcessTestCase does: no port is chosen at all."""
    for kind, port in run_ranks(P.rendezvous, 2):
        assert kind == "FileStore" and port is None, (kind, port)


def test_collectives_on_three_ranks():
    assert run_ranks(P.collectives, 3)[0] == {"collectives": 18}


@pytest.mark.parametrize("size", [2, 3])
def test_ddp_equals_single_process_training_split_in_1_2_3_chunks(size):
    # 3 AdamW steps, float64; each rank's shard split by force_chunks 1/2/3: every parameter equals
    # eager on the whole batch; the all-reduces are the same on every chunking.
    results = run_ranks(P.ddp_exact, size, [6] * size, (1, 2, 3))
    for per_rank in results:
        assert [r["max_chunks"] for r in per_rank] == [1, 2, 3]
        assert len({r["collectives"] for r in per_rank}) == 1, per_rank
    assert len({tuple(r["collectives"] for r in per_rank) for per_rank in results}) == 1


def test_ddp_with_a_ragged_batch_per_rank():
    # 5, 7 and 3 rows: each rank's plan differs, the collectives are the same, in the same order;
    # the gradients are averaged over ranks as DDP weighs them.
    results = run_ranks(P.ddp_exact, 3, [5, 7, 3], (2, 3))
    assert len({tuple(r["collectives"] for r in per_rank) for per_rank in results}) == 1


def test_ddp_under_a_cap_where_eager_ddp_runs_out_of_memory():
    results = run_ranks(P.ddp_capped, 2, [600, 600], 1 * MiB, 128)
    for r in results:
        assert r["peak"] <= MiB and r["chunks"] > 1, r


def test_ddp_options_and_the_fp16_compression_hook():
    # no_sync accumulation, gradient_as_bucket_view, static_graph, find_unused_parameters (its
    # pinned staging buffer), register_comm_hook(fp16_compress_hook): equal to DDP on CPU tensors.
    for r in run_ranks(P.ddp_options, 2):
        assert set(r.values()) == {"ok"}, r


def test_ddp_construction_with_mismatched_shapes_raises_what_cpu_ddp_raises():
    lazy = run_ranks(P.ddp_mismatched_shapes, 2, "lazymem")
    # DDP's own message on CPU and CUDA (the rank whose shapes differ from rank 0's):
    assert lazy[1] == ("RuntimeError: [1]: params[0] in this process with sizes [17, 4] appears not to match "
                       "sizes of the same param in process 0."), lazy[1]
    assert lazy[0] != "no error"  # the other rank's broadcast fails as the group breaks up


def test_a_rank_that_dies_makes_the_others_raise_instead_of_hanging():
    out = run_ranks(P.rank_dies, 2, timeout=120, pg_timeout=30, allow_errors=True)
    status, message = out[0]
    assert status == "ok", message
    assert message != "no error" and "lazymem::c10d_all_reduce_" in message, message
    assert float(message.split(" s:")[0]) < 30, message


def test_out_of_memory_on_one_rank_loses_nothing_and_keeps_the_collective_order():
    results = run_ranks(P.oom_then_retry, 2)
    assert results[0][1] == 1.0  # rank 0 raised, then finished with the cap lifted


def test_explain_shows_each_all_reduce_once_after_the_chunk_loop():
    text = run_ranks(P.ddp_explain, 2)[0]
    assert "split plan" in text and "3 chunks" in text, text
    lines = text.splitlines()
    at = [i for i, line in enumerate(lines) if "collective: all_reduce" in line]
    assert len(at) == 1 and lines[at[0]].endswith("once"), text
    stage = next(lines[i] for i in range(at[0], -1, -1) if lines[i].lstrip().startswith("stage "))
    assert "run once" in stage, text


def test_gpt2_with_ddp_split_in_2_chunks():
    pytest.importorskip("transformers")
    losses = run_ranks(P.gpt2_ddp, 2, 2, timeout=600)
    assert all(len(r) == 3 for r in losses)


@pytest.mark.parametrize("chunks", [1, 3])
def test_sync_batch_norm_statistics_over_all_chunks_of_all_ranks(chunks):
    losses = run_ranks(P.sync_batch_norm, 2, chunks)
    assert all(len(r) == 3 for r in losses)


def test_fsdp2_fully_shard_equals_single_process_training():
    losses = run_ranks(P.fsdp2_exact, 2, 2)
    assert all(len(r) == 3 for r in losses)


def test_dtensor_sharded_ops_equal_whole_tensors():
    results = run_ranks(P.dtensor_ops, 2)
    assert results[0] == results[1]
