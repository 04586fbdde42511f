"""What each rank runs in test_distributed.py (via dist_harness.run_ranks): functions of
(rank, size, ...) that assert on their rank and return what the test compares across ranks."""

from __future__ import annotations

import copy
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

D = torch.float64
LZ = "lazymem"


def _same(got: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(got.cpu(), expected, rtol=0, atol=0, msg=lambda m: f"{what}: {m}")


# ---------------------------------------------------------------------------------------------------
# Collectives: each on lazymem tensors equals the same collective on CPU tensors (gloo).


def collectives(rank: int, size: int) -> dict:
    import torch_lazymem

    torch_lazymem.reset_stats()
    g = torch.Generator().manual_seed(rank)
    count = 0

    def both(fn, *tensors):
        """fn(*tensors) on CPU copies and on lazymem copies: the tensors they leave, CPU then lazymem."""
        cpu = [t.clone() for t in tensors]
        lazy = [t.to(LZ) for t in tensors]
        fn(*cpu)
        fn(*lazy)
        return cpu, lazy

    for op in (dist.ReduceOp.SUM, dist.ReduceOp.PRODUCT, dist.ReduceOp.MIN, dist.ReduceOp.MAX):
        cpu, lazy = both(lambda t, op=op: dist.all_reduce(t, op=op), torch.randn(5, 3, dtype=D, generator=g))
        _same(lazy[0], cpu[0], f"all_reduce {op}")
        count += 1
    for op in (dist.ReduceOp.BAND, dist.ReduceOp.BOR, dist.ReduceOp.BXOR):
        cpu, lazy = both(lambda t, op=op: dist.all_reduce(t, op=op), torch.randint(0, 1 << 20, (7,), generator=g))
        _same(lazy[0], cpu[0], f"all_reduce {op}")
        count += 1

    cpu, lazy = both(lambda t: dist.broadcast(t, src=size - 1), torch.randn(4, dtype=D, generator=g))
    _same(lazy[0], cpu[0], "broadcast")
    count += 1

    x = torch.randn(3, 2, dtype=D, generator=g)
    outs = [torch.zeros(3, 2, dtype=D).to(LZ) for _ in range(size)]
    dist.all_gather(outs, x.to(LZ))
    ref = [torch.zeros(3, 2, dtype=D) for _ in range(size)]
    dist.all_gather(ref, x)
    for k, (o, e) in enumerate(zip(outs, ref)):
        _same(o, e, f"all_gather[{k}]")
    count += 1

    cpu, lazy = both(lambda o, i: dist.all_gather_into_tensor(o, i), torch.zeros(size * 4, dtype=D), x.flatten()[:4])
    _same(lazy[0], cpu[0], "all_gather_into_tensor")
    count += 1

    big = torch.randn(size * 3, dtype=D, generator=g)
    cpu, lazy = both(lambda o, i: dist.reduce_scatter_tensor(o, i), torch.zeros(3, dtype=D), big)
    _same(lazy[0], cpu[0], "reduce_scatter_tensor")
    count += 1

    # Uneven splits: rank r sends r + 1 + k elements to rank k.
    in_splits = [rank + 1 + k for k in range(size)]
    out_splits = [k + 1 + rank for k in range(size)]
    src = torch.arange(sum(in_splits), dtype=D) + 100 * rank
    cpu, lazy = both(lambda o, i: dist.all_to_all_single(o, i, out_splits, in_splits), torch.zeros(sum(out_splits), dtype=D), src)
    _same(lazy[0], cpu[0], "all_to_all_single")
    count += 1

    # gather / scatter with the last rank as root.
    root = size - 1
    x = torch.randn(2, dtype=D, generator=g)
    ref = [torch.zeros(2, dtype=D) for _ in range(size)] if rank == root else None
    dist.gather(x, ref, dst=root)
    got = [torch.zeros(2, dtype=D).to(LZ) for _ in range(size)] if rank == root else None
    dist.gather(x.to(LZ), got, dst=root)
    if rank == root:
        for k, (o, e) in enumerate(zip(got, ref)):
            _same(o, e, f"gather[{k}]")
    count += 1
    pieces = [torch.full((3,), 10.0 * k, dtype=D) for k in range(size)] if rank == root else None
    ref_out, out = torch.zeros(3, dtype=D), torch.zeros(3, dtype=D).to(LZ)
    dist.scatter(ref_out, pieces, src=root)
    dist.scatter(out, [p.to(LZ) for p in pieces] if pieces else None, src=root)
    _same(out, ref_out, "scatter")
    count += 1

    # async_op: the Work's future resolves to the (lazy) outputs at once; wait() is a sync point.
    t = torch.full((3,), float(rank + 1), dtype=D).to(LZ)
    work = dist.all_reduce(t, async_op=True)
    fut = work.get_future()
    assert fut.done()
    value = fut.wait()[0]
    assert value.device.type == LZ
    before = torch_lazymem.stats()["collectives"]
    assert work.wait()
    assert torch_lazymem.stats()["collectives"] == before + 1, "wait() runs the collective"
    _same(t, torch.full((3,), float(size * (size + 1) // 2), dtype=D), "async all_reduce")
    count += 1

    # Coalesced: the fast path (no device) and the old style (a device).
    a, b = torch.ones(2, dtype=D).to(LZ), torch.full((3,), 2.0, dtype=D).to(LZ)
    with dist._coalescing_manager(async_ops=True) as cm:
        dist.all_reduce(a)
        dist.all_reduce(b)
    cm.wait()
    _same(a, torch.full((2,), float(size), dtype=D), "coalesced all_reduce")
    _same(b, torch.full((3,), 2.0 * size, dtype=D), "coalesced all_reduce")
    count += 1
    c = torch.ones(2, dtype=D).to(LZ)
    with dist._coalescing_manager(device=torch.device(LZ)):
        dist.all_reduce(c)
    _same(c, torch.full((2,), float(size), dtype=D), "coalesced all_reduce (device)")
    count += 1

    dist.barrier()  # (the group's CPU backend: torch picks the barrier's device from the accelerator)
    backend = dist.group.WORLD._get_backend(torch.device(LZ))
    assert backend.name() == "lazymem"
    backend.barrier().wait()  # the lazymem backend's own: after every collective recorded before it
    count += 1
    torch.lazymem.synchronize()
    stats = torch_lazymem.stats()
    assert stats["collectives"] == count, (stats["collectives"], count)
    assert stats["collective_bytes"] > 0
    return {"collectives": stats["collectives"]}


def collectives_then_errors(rank: int, size: int) -> tuple[dict, list[str]]:
    return collectives(rank, size), collective_errors(rank, size)


def collective_errors(rank: int, size: int) -> list[str]:
    """Each bad call raises a `lazymem:` error naming the collective, before anything is recorded;
    collectives after it still match across ranks."""
    messages = []
    cases = [
        lambda: dist.all_reduce(torch.ones(3).to(LZ), op=dist.ReduceOp.AVG),
        lambda: dist.all_reduce(torch.ones(4, 4).to(LZ).t()[0]),
        lambda: dist.send(torch.ones(2).to(LZ), dst=1 - rank) if rank < 2 else dist.send(torch.ones(2).to(LZ), dst=0),
        lambda: dist.all_gather_into_tensor(torch.zeros(3).to(LZ), torch.ones(2).to(LZ)),
    ]
    for case in cases:
        try:
            case()
        except Exception as e:  # noqa: BLE001 - the message is the result
            messages.append(str(e).splitlines()[0])
        else:
            messages.append("no error")
    t = torch.ones(2).to(LZ)
    dist.all_reduce(t)
    _same(t, torch.full((2,), float(size)), "all_reduce after errors")
    return messages


# ---------------------------------------------------------------------------------------------------
# DDP: per-rank shards of one batch; every parameter equals single-process eager on the whole batch.


def mlp(width: int = 32) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, width), nn.ReLU(), nn.Linear(width, width), nn.Tanh(), nn.Linear(width, 4)).double()


def batches(total_rows: int, steps: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(total_rows, 8, dtype=D, generator=g), torch.randint(0, 4, (total_rows,), generator=g))
            for _ in range(steps)]


def shard(rows: list[int], rank: int) -> slice:
    start = sum(rows[:rank])
    return slice(start, start + rows[rank])


def reference_training(model: nn.Module, data, rows: list[int]) -> nn.Module:
    """Single-process eager on the concatenated batch, each rank's mean loss weighted as DDP weighs it
    (gradients averaged over ranks: equal weights, whatever each rank's row count)."""
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for x, y in data:
        opt.zero_grad()
        loss = sum(F.cross_entropy(ref(x[shard(rows, r)]), y[shard(rows, r)]) for r in range(len(rows))) / len(rows)
        loss.backward()
        opt.step()
    return ref


def train_steps(model, opt, data, rows: list[int], rank: int, dev: str = LZ) -> list[float]:
    """One step per batch of `data` on this rank's shard: cross entropy, backward, step; the losses."""
    losses = []
    for x, y in data:
        s = shard(rows, rank)
        loss = F.cross_entropy(model(x[s].to(dev)), y[s].to(dev))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def ddp_training(rank: int, size: int, model: nn.Module, data, rows: list[int], dev: str = LZ, **ddp_kwargs):
    m = copy.deepcopy(model).to(dev)
    ddp = nn.parallel.DistributedDataParallel(m, **ddp_kwargs)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    return m, train_steps(ddp, opt, data, rows, rank, dev)


def check_params(got: nn.Module, expected: nn.Module, what: str) -> None:
    for (name, p), q in zip(got.named_parameters(), expected.parameters()):
        torch.testing.assert_close(p.detach().cpu(), q.detach(), msg=lambda m, name=name: f"{what}: {name}: {m}")


def ddp_exact(rank: int, size: int, rows: list[int], chunk_counts: tuple[int, ...]) -> list[dict]:
    import torch_lazymem
    from torch_lazymem.testing import force_chunks

    model, data = mlp(), batches(sum(rows), 3)
    expected = reference_training(model, data, rows)
    out = []
    for n in chunk_counts:
        torch.lazymem.synchronize()
        torch_lazymem.reset_stats()
        with force_chunks(n):
            got, _ = ddp_training(rank, size, model, data, rows)
        torch.lazymem.synchronize()
        stats = torch_lazymem.stats()
        check_params(got, expected, f"rank {rank}, {n} chunks")
        assert stats["splits"] >= 1, stats
        out.append({"chunks": n, "collectives": stats["collectives"], "max_chunks": stats["chunks"]})
    return out


def ddp_capped(rank: int, size: int, rows: list[int], cap: int, width: int) -> dict:
    """Eager DDP (CPU, same group) runs out of memory under `cap`; lazymem DDP on a simulated device
    of `cap` finishes with single-process eager's parameters, its measured peak within the cap."""
    import torch_lazymem
    from torch_lazymem.testing import memory_cap, simulated_device

    model, data = mlp(width), batches(sum(rows), 3)
    expected = reference_training(model, data, rows)
    eager_oom = False
    try:
        with memory_cap(cap):
            ddp_training(rank, size, model, data[:1], rows, dev="cpu")
    except torch.OutOfMemoryError:
        eager_oom = True
    # Every rank learns whether every rank ran out: one that did not would wait in its all-reduce.
    flag = torch.tensor([int(eager_oom)])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    assert flag.item() == 1, f"rank {rank}: eager DDP fits {cap} bytes (oom here: {eager_oom})"
    torch.lazymem.synchronize()
    torch_lazymem.reset_stats()
    with simulated_device(cap):
        torch.lazymem.reset_peak_memory_stats()
        got, _ = ddp_training(rank, size, model, data, rows)
        torch.lazymem.synchronize()
        peak = torch.lazymem.max_memory_allocated()
    check_params(got, expected, f"rank {rank} under a cap of {cap}")
    stats = torch_lazymem.stats()
    assert peak <= cap, (peak, cap)
    return {"peak": peak, "splits": stats["splits"], "chunks": stats["chunks"]}


class WithUnused(nn.Module):
    """A model with a layer its forward never uses (find_unused_parameters finds it each step)."""

    def __init__(self, body: nn.Module) -> None:
        super().__init__()
        self.body = body
        self.unused = nn.Linear(4, 4).double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def ddp_options(rank: int, size: int) -> dict:
    """no_sync accumulation, gradient_as_bucket_view, static_graph, find_unused_parameters and the
    fp16 compression hook: each equal to the same DDP on CPU tensors (gloo), split in 2 chunks."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    from torch_lazymem.testing import force_chunks

    rows = [6] * size
    model, data = mlp(), batches(sum(rows), 2)
    with_unused = WithUnused(copy.deepcopy(model))

    def run(dev, kwargs, hook=None, accumulate=False, unused=False):
        m = copy.deepcopy(with_unused if unused else model).to(dev)
        ddp = nn.parallel.DistributedDataParallel(m, **kwargs)
        if hook is not None:
            ddp.register_comm_hook(None, hook)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        for x, y in data:
            s = shard(rows, rank)
            xs, ys = x[s].to(dev), y[s].to(dev)
            opt.zero_grad()
            if accumulate:
                with ddp.no_sync():
                    F.cross_entropy(ddp(xs[:3]), ys[:3]).backward()
                F.cross_entropy(ddp(xs[3:]), ys[3:]).backward()
            else:
                F.cross_entropy(ddp(xs), ys).backward()
            opt.step()
        return [p.detach().cpu() for p in m.parameters()]

    cases = {
        "no_sync": ({}, None, True, False),
        "gradient_as_bucket_view": ({"gradient_as_bucket_view": True}, None, False, False),
        "static_graph": ({"static_graph": True}, None, False, False),
        "find_unused_parameters": ({"find_unused_parameters": True}, None, False, True),
        "fp16_compress_hook": ({}, default_hooks.fp16_compress_hook, False, False),
    }
    results = {}
    for name, (kwargs, hook, accumulate, unused) in cases.items():
        expected = run("cpu", kwargs, hook, accumulate, unused)
        # Unsplit (it fits): bitwise eager's, the all-reduces included.
        for k, (g, e) in enumerate(zip(run(LZ, kwargs, hook, accumulate, unused), expected)):
            torch.testing.assert_close(g, e, rtol=0, atol=0, msg=lambda m, name=name, k=k: f"{name} unsplit: parameter {k}: {m}")
        for chunks in (1, 2):
            with force_chunks(chunks):
                got = run(LZ, kwargs, hook, accumulate, unused)
            # The fp16 hook rounds each bucket to half precision: a split's float64 sums, exact to the
            # last bits but summed in another order, can round to the neighbouring half, so split in
            # 2 it is within the hook's own precision (one chunk sums in eager's order: float64 exact).
            tol = {"rtol": 2e-3, "atol": 1e-5} if hook is not None and chunks > 1 else {}
            for k, (g, e) in enumerate(zip(got, expected)):
                torch.testing.assert_close(
                    g, e, **tol, msg=lambda m, name=name, k=k, chunks=chunks: f"{name}, {chunks} chunks: parameter {k}: {m}")
        results[name] = "ok"
    return results


def ddp_mismatched_shapes(rank: int, size: int, dev: str) -> str:
    width = 16 if rank == 0 else 17
    m = nn.Linear(4, width).to(dev)
    try:
        nn.parallel.DistributedDataParallel(m)
    except Exception as e:  # noqa: BLE001 - the message is the result
        return f"{type(e).__name__}: {str(e).splitlines()[0]}"
    return "no error"


def rank_dies(rank: int, size: int) -> str:
    """Rank 1 exits without its collective; rank 0's all-reduce raises (a `lazymem:` error naming the
    collective and gloo's) within the group's timeout instead of hanging."""
    import os

    t = torch.ones(3).to(LZ)
    dist.all_reduce(t)
    torch.lazymem.synchronize()  # one collective every rank ran
    if rank == 1:
        os._exit(0)
    start = time.monotonic()
    t2 = torch.ones(3).to(LZ)
    try:
        dist.all_reduce(t2)  # (a synchronous collective waits for its Work: a sync point)
        t2.cpu()
    except Exception as e:  # noqa: BLE001 - the message is the result
        return f"{time.monotonic() - start:.1f} s: {str(e).splitlines()[0]}"
    return "no error"


def gpt2_ddp(rank: int, size: int, chunks: int) -> list[float]:
    """A small transformers GPT-2 under DDP, 3 AdamW steps, split in `chunks`: equal to
    single-process eager on the concatenated batch."""
    import transformers

    from torch_lazymem.testing import force_chunks

    transformers.logging.set_verbosity_error()
    config = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=64, n_positions=16,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).double()
    g = torch.Generator().manual_seed(5)
    rows = 4
    data = [torch.randint(0, 64, (rows * size, 12), generator=g) for _ in range(3)]

    ref = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    for ids in data:
        ref_opt.zero_grad()
        loss = sum(ref(ids[r * rows:(r + 1) * rows], labels=ids[r * rows:(r + 1) * rows]).loss for r in range(size)) / size
        loss.backward()
        ref_opt.step()

    m = copy.deepcopy(model).to(LZ)
    ddp = nn.parallel.DistributedDataParallel(m)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    losses = []
    with force_chunks(chunks):
        for ids in data:
            mine = ids[rank * rows:(rank + 1) * rows].to(LZ)
            loss = ddp(mine, labels=mine).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
    check_params(m, ref, f"GPT-2 rank {rank}")
    return losses


def ddp_explain(rank: int, size: int) -> str:
    """explain() of a split DDP step lists each bucket's all-reduce in a stage that runs once, after
    the chunk loop that accumulates the gradients."""
    import torch_lazymem
    from torch_lazymem.testing import force_chunks

    rows = [6] * size
    model, data = mlp(), batches(sum(rows), 2)
    m = copy.deepcopy(model).to(LZ)
    ddp = nn.parallel.DistributedDataParallel(m)
    with force_chunks(3):
        for x, y in data:
            s = shard(rows, rank)
            F.cross_entropy(ddp(x[s].to(LZ)), y[s].to(LZ)).backward()
            m[0].weight.grad.sum().item()  # the step's sync point
            text = torch_lazymem.explain(print_it=False)
            for p in m.parameters():
                p.grad = None
    return text


def oom_then_retry(rank: int, size: int) -> list[float]:
    """Rank 0 runs out of memory (a cap below its parameters' gradients): the error raises there,
    nothing is lost; the other ranks wait in their all-reduce; rank 0 reads the value again with the
    cap lifted, its pending collective runs in order, and every rank ends with single-process
    eager's parameters."""
    from torch_lazymem.testing import simulated_device

    rows = [6] * size
    model, data = mlp(), batches(sum(rows), 1)
    expected = reference_training(model, data, rows)
    m = copy.deepcopy(model).to(LZ)
    ddp = nn.parallel.DistributedDataParallel(m)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    x, y = data[0]
    s = shard(rows, rank)
    loss = F.cross_entropy(ddp(x[s].to(LZ)), y[s].to(LZ))
    loss.backward()
    opt.step()
    raised = False
    if rank == 0:
        try:
            with simulated_device(4 << 10):
                loss.item()
        except torch.OutOfMemoryError as e:
            raised = "lazymem" in str(e)
        assert raised, "rank 0 ran out of memory with a lazymem error"
    value = loss.item()
    check_params(m, expected, f"rank {rank} after an out-of-memory error on rank 0")
    return [value, float(raised)]


def fsdp2_exact(rank: int, size: int, chunks: int) -> list[float]:
    """FSDP2 (fully_shard on each layer and the root) on a lazymem device mesh, 3 AdamW steps split
    in `chunks`: every parameter (gathered) equals single-process eager on the concatenated batch."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from torch_lazymem.testing import force_chunks

    rows = [6] * size
    model, data = mlp(), batches(sum(rows), 3)
    expected = reference_training(model, data, rows)
    mesh = init_device_mesh(LZ, (size,))
    m = copy.deepcopy(model).to(LZ)
    for layer in m:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(m, mesh=mesh)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    with force_chunks(chunks):
        losses = train_steps(m, opt, data, rows, rank)
    for (name, p), q in zip(m.named_parameters(), expected.parameters()):
        torch.testing.assert_close(p.full_tensor().cpu(), q.detach(), msg=lambda msg, name=name: f"FSDP2 {name}: {msg}")
    return losses


def dtensor_ops(rank: int, size: int) -> list[float]:
    """DTensor on a lazymem mesh: distribute (scatter), a sharded matmul and reductions, redistribute
    (all-gather), equal to the same on whole tensors."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh(LZ, (size,))
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(4 * size, 5, dtype=D, generator=g), torch.randn(5, 3, dtype=D, generator=g)
    da = distribute_tensor(a.to(LZ), mesh, [Shard(0)])
    db = distribute_tensor(b.to(LZ), mesh, [Replicate()])
    prod = da @ db
    _same(prod.full_tensor(), a @ b, "sharded matmul")
    _same(prod.redistribute(mesh, [Replicate()]).to_local(), a @ b, "redistribute")
    total = prod.sum().full_tensor()
    torch.testing.assert_close(total.cpu(), (a @ b).sum())
    return [float(total.item())]


class BnNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(F.relu(self.bn(self.conv(x))).mean((2, 3)))


def sync_batch_norm(rank: int, size: int, chunks: int) -> list[float]:
    """SyncBatchNorm under DDP in training, split in `chunks`: statistics over all chunks of all
    ranks, so every parameter and running statistic equals single-process eager BatchNorm on the
    concatenated batch (3 SGD steps). Ranks hold 5, 7, ... rows: ragged last chunks, and unequal
    counts in the ranks' merge of statistics."""
    from torch_lazymem.testing import force_chunks

    rows = [5 + 2 * r for r in range(size)]
    g = torch.Generator().manual_seed(3)
    data = [(torch.randn(sum(rows), 3, 5, 5, dtype=D, generator=g), torch.randint(0, 4, (sum(rows),), generator=g))
            for _ in range(3)]
    model = BnNet().double()
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for x, y in data:
        ref_opt.zero_grad()
        # one BatchNorm over the whole batch; each rank's mean loss weighted equally (DDP's average)
        out = ref(x)
        sum(F.cross_entropy(out[shard(rows, r)], y[shard(rows, r)]) for r in range(size)).div(size).backward()
        ref_opt.step()
    m = nn.SyncBatchNorm.convert_sync_batchnorm(copy.deepcopy(model)).to(LZ)
    ddp = nn.parallel.DistributedDataParallel(m)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    import torch_lazymem

    torch_lazymem.reset_stats()
    with force_chunks(chunks):
        losses = train_steps(ddp, opt, data, rows, rank)
    assert torch_lazymem.stats()["splits"] > 0
    for (name, p), q in zip(m.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach().cpu(), q.detach(), msg=lambda msg, name=name: f"SyncBN {name}: {msg}")
    for (name, b), q in zip(m.named_buffers(), ref.buffers()):
        torch.testing.assert_close(b.cpu(), q, msg=lambda msg, name=name: f"SyncBN buffer {name}: {msg}")
    return losses


def rendezvous(rank: int, size: int) -> tuple[str, str | None]:
    """The store the ranks met through (under any prefix stores), and MASTER_PORT as the rank sees it."""
    import os

    store = dist.distributed_c10d._get_default_store()
    while hasattr(store, "underlying_store"):
        store = store.underlying_store
    return type(store).__name__, os.environ.get("MASTER_PORT")
