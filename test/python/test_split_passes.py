"""Plans with several passes over the batch (batch_split_theory.md §3.1, §5): batch norm in training
mode expanded into a statistics pass (per-chunk mean and variance merged with Chan's update), the
running statistics updated once, and the normalization per chunk; its backward into a pass for the
sums its gradient needs. Split vs unsplit in float64 at assert_close defaults, with force_chunks 2, 3,
8 (a batch of 10: ragged chunks) and under a simulated device; out-of-memory retries of chunks by
fault injection (torch_lazymem.testing.fail_allocation)."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from splitting import B, assert_state_close, batch_of, ce, sgd_step_where_eager_runs_out, train_split

import torch_lazymem
from torch_lazymem.testing import (
    fail_allocation,
    force_chunks,
    injected_failures,
    simulated_device,
)


def batch(*shape):
    return batch_of(*shape, classes=5)


NORMS = {
    "bn1d_features": (lambda: nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 5)), batch(6)),
    "bn1d_sequence": (lambda: nn.Sequential(nn.Conv1d(3, 4, 3), nn.BatchNorm1d(4), nn.Flatten(), nn.Linear(4 * 5, 5)),
                      batch(3, 7)),
    "bn2d_momentum_none": (lambda: nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4, momentum=None), nn.ReLU(),
                                                 nn.Flatten(), nn.Linear(4 * 4 * 4, 5)), batch(3, 6, 6)),
    "bn3d_no_affine": (lambda: nn.Sequential(nn.Conv3d(2, 3, 2), nn.BatchNorm3d(3, affine=False), nn.Flatten(),
                                             nn.Linear(3 * 8, 5)), batch(2, 3, 3, 3)),
    "bn_no_running_stats": (lambda: nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8, track_running_stats=False),
                                                  nn.Linear(8, 5)), batch(6)),
}


@pytest.mark.parametrize("chunks", [2, 3, 8])
@pytest.mark.parametrize("name", list(NORMS))
def test_training_batch_norm_splits_exactly(name, chunks):
    make, data = NORMS[name]
    stats = train_split(make, data, ce, chunks, steps=3)
    # every step split, in more than one pass, and batch norm was no barrier
    assert stats["splits"] >= 3 and stats["passes"] >= 2 and stats["barriers"] == 0


def reference_moments(x, dtype):
    """The split ops' statistics as the composition computes them (any backing device)."""
    dims = [0, *range(2, x.dim())]
    var, mean = torch.var_mean(x.to(dtype), dims, correction=0)
    return torch.stack([var, mean])


def reference_backward_sums(g, x, mean, invstd, dtype):
    dims = [0, *range(2, x.dim())]
    shape = [1, -1] + [1] * (x.dim() - 2)
    gd = g.to(dtype)
    return torch.stack([gd.sum(dims), (gd * (x.to(dtype) - mean.view(shape))).sum(dims) * invstd])


def batch_norm_input(layout, dtype, g):
    """A (6, 5, 4, 3) batch norm input (or its (6, 5) features) in `layout`, of `dtype`."""
    x = torch.randn(6, 5, 4, 3, generator=g, dtype=torch.float64) * 3 + 2
    if layout == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    elif layout == "strided":
        x = x[:, :, ::2]
    elif layout == "features":
        x = x[:, :, 0, 0]
    return x.to(dtype)


@pytest.mark.parametrize("layout", ["contiguous", "channels_last", "strided", "features"])
@pytest.mark.parametrize("dtype,stats_dtype", [(torch.float64, torch.float64), (torch.float32, torch.float32),
                                               (torch.bfloat16, torch.float32)])
def test_a_chunks_batch_norm_sums_are_eagers_own_on_the_cpu(layout, dtype, stats_dtype):
    """bn_moments and bn_backward_reduce (the statistics a split batch norm merges over chunks) run
    eager's CPU kernels where they take the operands as they are: the chunk's mean is bitwise the one
    native_batch_norm saves, and the gradient's sums are native_batch_norm_backward's grad_bias and
    grad_weight; the other cases (a bfloat16 chunk's backward sums) run the composition. Both equal
    the composition's formulas. bn_backward_elemt from one chunk's sums is eager's input gradient."""
    g = torch.Generator().manual_seed(0)
    x = batch_norm_input(layout, dtype, g)
    grad = torch.randn(x.shape, generator=g, dtype=torch.float64).to(dtype)
    moments = torch.ops.lazymem.bn_moments(x, stats_dtype)
    torch.testing.assert_close(moments, reference_moments(x, stats_dtype))
    xd = x.to(stats_dtype)
    _, save_mean, save_invstd = torch.native_batch_norm(xd, None, None, None, None, True, 0.0, 1e-5)
    assert torch.equal(moments[1], save_mean)
    sums = torch.ops.lazymem.bn_backward_reduce(grad, x, save_mean, save_invstd, stats_dtype)
    torch.testing.assert_close(sums, reference_backward_sums(grad, x, save_mean, save_invstd, stats_dtype))
    if dtype == stats_dtype:
        _, gw, gb = torch.ops.aten.native_batch_norm_backward(grad, x, None, None, None, save_mean, save_invstd,
                                                              True, 1e-5, [False, True, True])
        assert torch.equal(sums, torch.stack([gb, gw]))
    else:
        assert torch.equal(sums, reference_backward_sums(grad, x, save_mean, save_invstd, stats_dtype))
    # The input's gradient from the whole batch's sums (one chunk): eager's.
    w = torch.rand(x.shape[1], generator=g, dtype=torch.float64).to(stats_dtype) + 0.5
    dx = torch.ops.lazymem.bn_backward_elemt(grad, x, save_mean, save_invstd, w, sums, x.numel() // x.shape[1])
    expected, _, _ = torch.ops.aten.native_batch_norm_backward(grad.to(stats_dtype), xd, w, None, None, save_mean,
                                                               save_invstd, True, 1e-5, [True, False, False])
    assert dx.dtype == dtype and dx.shape == x.shape
    torch.testing.assert_close(dx, expected.to(dtype))


@pytest.mark.parametrize("layout", ["contiguous", "channels_last", "strided", "features"])
@pytest.mark.parametrize("dtype,stats_dtype", [(torch.float64, torch.float64), (torch.float32, torch.float32),
                                               (torch.bfloat16, torch.float32)])
def test_a_chunks_batch_norm_transform_is_eagers_in_every_layout(layout, dtype, stats_dtype):
    """bn_apply (a split batch norm's per-chunk normalization from the merged statistics) gives eager's
    training output from the same statistics, in every layout and dtype, laid out as its meta
    function predicts (not bitwise: eager's kernel may fuse x * alpha + beta where addcmul does not)."""
    g = torch.Generator().manual_seed(1)
    x = batch_norm_input(layout, dtype, g)
    w = (torch.rand(x.shape[1], generator=g, dtype=torch.float64) + 0.5).to(stats_dtype)
    b = torch.randn(x.shape[1], generator=g, dtype=torch.float64).to(stats_dtype)
    xd = x.to(stats_dtype)
    expected, mean, invstd = torch.native_batch_norm(xd, w, b, None, None, True, 0.0, 1e-5)
    y = torch.ops.lazymem.bn_apply(x, mean, invstd, w, b)
    meta = torch.ops.lazymem.bn_apply(x.to("meta"), mean.to("meta"), invstd.to("meta"), w.to("meta"), b.to("meta"))
    assert y.dtype == dtype and y.shape == x.shape and y.stride() == meta.stride()
    torch.testing.assert_close(y, expected.to(dtype))


def test_eval_after_split_training_uses_the_merged_running_statistics():
    make, data = NORMS["bn2d_momentum_none"]
    torch.manual_seed(0)
    eager = make().double()
    lazy = copy.deepcopy(eager).to("lazymem")
    for step in range(3):
        x, t = data(step)
        ce(eager, (x, t)).backward()
        with force_chunks(3):
            ce(lazy, (x.to("lazymem"), t.to("lazymem"))).backward()
    eager.eval()
    lazy.eval()
    x, _ = data(7)
    with force_chunks(3):
        torch.testing.assert_close(lazy(x.to("lazymem")).cpu(), eager(x))
    assert_state_close(eager, lazy)
    assert int(lazy[1].num_batches_tracked.item()) == 3


class BNNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                                  nn.Conv2d(16, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU())
        self.head = nn.Linear(16 * 16 * 16, 10)

    def forward(self, x):
        return self.head(self.body(x).flatten(1))


def test_batch_norm_training_fits_a_device_eager_runs_out_of():
    torch.manual_seed(0)
    model = BNNet().double()
    x, t = torch.randn(64, 3, 16, 16, dtype=torch.float64), torch.randint(0, 10, (64,))
    s, _ = sgd_step_where_eager_runs_out(model, x, t, "12MiB")
    assert s["splits"] >= 1 and s["passes"] >= 3 and s["barriers"] == 0


def one_step_after_failure(model, data, n):
    """One split AdamW step of a copy of `model` with the n-th allocation of its materialization
    failing. Returns (loss, state) and whether the failure fired."""
    lazy = copy.deepcopy(model).to("lazymem")
    opt = torch.optim.AdamW(lazy.parameters(), lr=1e-2)
    torch.lazymem.synchronize()
    before = injected_failures()
    with force_chunks(3):
        if n:
            fail_allocation(n)
        loss = ce(lazy, (data[0].to("lazymem"), data[1].to("lazymem")))
        loss.backward()
        opt.step()
        value = loss.item()
    state = {k: v.cpu() for k, v in lazy.state_dict().items()}
    state.update({f"exp_avg.{i}": opt.state[p]["exp_avg"].cpu() for i, p in enumerate(lazy.parameters())})
    return value, state, injected_failures() > before


def test_out_of_memory_at_every_allocation_of_a_split_step_is_retried():
    """Fails each allocation of a split BatchNorm + AdamW step in turn (every one until the step has
    no n-th allocation): the step completes with the losses, parameters, running statistics and
    optimizer state of the run without a failure, within float64 tolerance (bitwise when the failure
    was outside a chunk loop and the same kernels ran again; a retried chunk runs smaller)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(),
                          nn.Linear(4 * 6 * 6, 5)).double()
    data = (torch.randn(B, 3, 6, 6, dtype=torch.float64), torch.randint(0, 5, (B,)))
    ref_loss, ref_state, _ = one_step_after_failure(model, data, 0)
    torch_lazymem.reset_stats()
    fired = bitwise = 0
    for n in range(1, 1001):
        loss, state, hit = one_step_after_failure(model, data, n)
        if not hit:
            break
        fired += 1
        torch.testing.assert_close(loss, ref_loss, msg=lambda m, n=n: f"loss after failing allocation {n}: {m}")
        for k, v in state.items():
            torch.testing.assert_close(v, ref_state[k], msg=lambda m, n=n, k=k: f"{k} after failing allocation {n}: {m}")
        bitwise += loss == ref_loss and all(torch.equal(v, ref_state[k]) for k, v in state.items())
    assert fired > 50, "the step makes more allocations than that"
    # How many are bitwise equal (failures outside a chunk loop) is reported, not asserted: it
    # depends on where this machine's kernels allocate.
    print(f"{fired} failures injected, {bitwise} bitwise equal, the rest within float64 tolerance")
    assert torch_lazymem.stats()["oom_retries"] >= fired


def test_a_failure_in_a_chunk_of_one_row_plans_again():
    x = torch.randn(4, 8, dtype=torch.float64)
    w = torch.randn(8, 8, dtype=torch.float64)
    with force_chunks(4):
        y = (x.to("lazymem") @ w.to("lazymem")).relu().sum()
        fail_allocation(1)
        # a chunk of one row cannot shrink: the program is planned again from the start and completes
        assert y.item() == pytest.approx((x @ w).relu().sum().item())


def test_a_long_materialization_reports_its_chunks():
    calls = []
    previous = torch_lazymem._C._progress_after_seconds()
    torch_lazymem._C._set_progress_callback(lambda done, total, finished: calls.append((done, total, finished)))
    torch_lazymem._C._set_progress_after_seconds(0.0)  # every run counts as long
    try:
        x = torch.randn(8, 16, dtype=torch.float64)
        with force_chunks(4):
            (x.to("lazymem") * 2).relu().sum().item()
    finally:
        torch_lazymem._C._set_progress_after_seconds(previous)
        torch_lazymem._C._set_progress_callback(torch_lazymem._progress.report)
    assert calls[0] == (1, 4, False) and calls[-2:] == [(4, 4, False), (4, 4, True)]
    assert [c[0] for c in calls] == sorted(c[0] for c in calls)


class FakeTerminal:
    def __init__(self, tty: bool) -> None:
        self.tty, self.text = tty, ""

    def isatty(self) -> bool:
        return self.tty

    def write(self, s: str) -> int:
        self.text += s
        return len(s)

    def flush(self) -> None:
        pass


@pytest.mark.parametrize("tty,env,shown", [(True, None, True), (False, None, False), (True, "0", False)])
def test_the_progress_bar_shows_on_a_terminal_unless_disabled(monkeypatch, tty, env, shown):
    pytest.importorskip("tqdm")
    term = FakeTerminal(tty)
    monkeypatch.setattr("sys.stderr", term)
    if env is None:
        monkeypatch.delenv("LAZYMEM_PROGRESS", raising=False)
    else:
        monkeypatch.setenv("LAZYMEM_PROGRESS", env)
    report = torch_lazymem._progress.report
    report(1, 3, False)
    report(3, 3, False)
    report(3, 3, True)
    assert ("3/3" in term.text) == shown
    assert torch_lazymem._progress._bar is None


def test_out_of_memory_inside_a_foreach_optimizer_step_resumes_after_the_tensors_done():
    """AdamW(foreach=True) on lazymem runs _foreach_ ops over every parameter. On the CPU backing eager's
    kernel for them is a loop over the tensors; captured whole (as a CUDA build of torch 2.11 did), an
    allocation failure part way through one left the first tensors updated and the retry updated them
    again. On a CPU backing they are recorded as eager runs them, one node per tensor (sync/register.cpp
    foreach_fallback), each node run once: every injected failure gives the state of the run without
    one, and that run eager's, bitwise (nothing is split)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    x, t = torch.randn(4, 6, dtype=torch.float64), torch.randn(4, 3, dtype=torch.float64)

    def step(n, dev="lazymem"):
        lazy = copy.deepcopy(model).to(dev)
        opt = torch.optim.AdamW(lazy.parameters(), lr=1e-2, foreach=True)
        before = injected_failures()
        for _ in range(2):
            F.mse_loss(lazy(x.to(dev)), t.to(dev)).backward()
            torch.lazymem.synchronize()
            if n:
                fail_allocation(n)  # armed for the next materialization: the step's
            opt.step()
            opt.zero_grad()
            torch.lazymem.synchronize()
        hit = injected_failures() > before
        state = {k: v.cpu() for k, v in lazy.state_dict().items()}
        state.update({f"exp_avg_sq.{i}": opt.state[p]["exp_avg_sq"].cpu() for i, p in enumerate(lazy.parameters())})
        return state, hit

    ref, _ = step(0)
    eager, _ = step(0, "cpu")
    for k, v in ref.items():
        assert torch.equal(v, eager[k]), k
    fired = 0
    for n in range(1, 400):
        state, hit = step(n)
        if not hit:
            break
        fired += 1
        for k, v in state.items():
            assert torch.equal(v, ref[k]), f"{k} after failing allocation {n} of the step"
    assert fired >= 4, fired


def test_an_optimizer_step_in_blocks_of_a_parameters_rows_survives_out_of_memory():
    """A weight whose AdamW temporaries do not fit beside what is held, even one tensor at a time
    (issue 31, item 2): its element-wise chain runs in blocks of its rows (the third split axis),
    updating the weight and its moments in place under the loop's undo log. Every allocation failure
    injected into the step gives the state of the run without one, bitwise (the rows it updated are
    put back, then run again in smaller blocks, or planned again), and that state is eager's."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512), nn.Tanh(), nn.Linear(512, 4)).double()
    x, t = torch.randn(8, 256, dtype=torch.float64), torch.randn(8, 4, dtype=torch.float64)
    params = sum(p.numel() for p in model.parameters()) * 8
    cap = 4 * params + (256 << 10)  # the 512x256 weight's sqrt alone takes 1 MiB

    def step(n, dev="lazymem"):
        lazy = copy.deepcopy(model).to(dev)
        opt = torch.optim.AdamW(lazy.parameters(), lr=1e-2)
        before, texts = injected_failures(), []
        with simulated_device(cap) if dev == "lazymem" else contextlib.nullcontext():
            for _ in range(2):
                opt.zero_grad()  # (the gradients stay held through the step)
                F.mse_loss(lazy(x.to(dev)), t.to(dev)).backward()
                torch.lazymem.synchronize()
                if n:
                    fail_allocation(n)  # armed for the next materialization: the step's
                opt.step()
                torch.lazymem.synchronize()
                texts.append(torch_lazymem.explain(print_it=False))
            state = [p.detach().cpu() for p in lazy.parameters()]
            state += [opt.state[p][k].cpu() for p in lazy.parameters() for k in ("exp_avg", "exp_avg_sq")]
        return state, injected_failures() > before, texts

    ref, _, texts = step(0)
    assert any("of its tensors (element-wise)" in s for s in texts), texts
    eager, _, _ = step(0, "cpu")
    torch.testing.assert_close(ref, eager)
    fired = 0
    for n in range(1, 400):
        state, hit, _ = step(n)
        if not hit:
            break
        fired += 1
        for k, (got, want) in enumerate(zip(state, ref)):
            assert torch.equal(got, want), (f"value {k} after failing allocation {n} of the step",
                                            (got - want).abs().max().item(), (got != want).sum().item(), got.shape)
    assert fired >= 4, fired


def test_an_element_wise_run_in_blocks_of_rows_with_a_ragged_last_block_equals_unsplit():
    """The third split axis on its own, over 1,001 rows (blocks aligned to 8 rows: the last one is
    ragged): a value held on the device, an element-wise chain of temporaries over it, then an
    in-place update of it and a result that outlives the run. On a device that holds the value and
    a fraction of one temporary, the run goes in blocks of rows; the results equal the unsplit run
    and eager's."""
    torch.manual_seed(0)
    xh = torch.rand(1001, 512, dtype=torch.float64) + 0.5

    def run(dev):
        x = xh.to(dev, copy=True)  # (updated in place below)
        if dev == "lazymem":
            torch.lazymem.synchronize()  # x is held before the run
        y = (x.sqrt() * 2 + 1).log()
        x.mul_(0.5).add_(y)
        z = y.exp()
        return x.cpu(), z.cpu()

    want = run("cpu")
    with simulated_device("64MiB"):
        unsplit = run("lazymem")
        assert torch_lazymem.stats()["row_loops"] == 0
    x_bytes = xh.numel() * 8
    with simulated_device(x_bytes + x_bytes // 3):
        torch_lazymem.reset_stats()
        torch.lazymem.reset_peak_memory_stats()
        got = run("lazymem")
        text = torch_lazymem.explain(print_it=False)
        assert torch.lazymem.max_memory_allocated() <= x_bytes + x_bytes // 3
    assert torch_lazymem.stats()["row_loops"] >= 1, text
    chunk = int(text.split("pass over 1001 rows of its tensors (element-wise) in ", 1)[1].split(" chunks of ")[1].split(",")[0])
    assert 1001 % chunk != 0, text  # a ragged last block
    for g, u, e in zip(got, unsplit, want):
        assert torch.equal(u, e)  # unsplit: eager's kernels on the same device
        torch.testing.assert_close(g, u)
