"""lazymem beside the user's own CUDA (DESIGN.md §8): eager CUDA autograd keeps working after the
import, lazymem may be the first CUDA user, the default budget is the CUDA allocator's, and SDPA takes
eager's kernel. The CUDA tests skip without a GPU; the mechanisms they rely on are tested on the CPU
too."""

from __future__ import annotations

import contextlib
import copy
import gc
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from conftest import BACKING
from torch.autograd.variable import Variable

import torch_lazymem
from torch_lazymem import _C, _cuda
from torch_lazymem.testing import force_chunks

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _fresh(code: str) -> str:
    """Runs `code` in a new process (nothing initialized yet) and returns its stdout."""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


# --- hiding the registration from the autograd engine (pytorch issue 161129) -------------------------


def test_the_engine_sees_torchs_own_accelerator_while_the_registration_is_hidden():
    assert _cuda.guard_available()
    accel, name = _C._run_hiding_registration(
        lambda: (torch.accelerator.current_accelerator(), torch._C._get_privateuse1_backend_name())
    )
    assert name == "privateuseone"
    assert accel is None or accel.type != "lazymem"
    # Restored afterwards, also after an exception and after nesting.
    with pytest.raises(ValueError, match="inner"):
        _C._run_hiding_registration(lambda: _C._run_hiding_registration(lambda: (_ for _ in ()).throw(ValueError("inner"))))
    assert torch.accelerator.current_accelerator().type == "lazymem"
    assert torch.device("lazymem").type == "lazymem"


def test_backward_devices_walks_the_graph():
    w = torch.randn(3, requires_grad=True)
    assert _C._backward_devices([(w * 2).sum()]) == "other"
    lw = torch.randn(3).to("lazymem").requires_grad_()
    assert _C._backward_devices([(lw * 2).sum()]) == "other"


def test_the_wrapped_engine_runs_cpu_and_lazymem_backwards_unchanged(monkeypatch):
    engine = Variable._execution_engine
    if not getattr(engine, "_lazymem", False):  # a CPU-only torch: the package leaves it alone
        monkeypatch.setattr(Variable, "_execution_engine", _cuda._Engine(engine))
    w = torch.randn(4, requires_grad=True)
    (w * w).sum().backward()
    assert torch.equal(w.grad, 2 * w.detach())
    lw = w.detach().to("lazymem").requires_grad_()
    (lw * lw).sum().backward()
    assert torch.equal(lw.grad.cpu(), 2 * w.detach())
    (g,) = torch.autograd.grad((lw * 3).sum(), [lw])
    assert torch.equal(g.cpu(), torch.full((4,), 3.0))


def test_memory_fraction_is_checked():
    with pytest.raises(ValueError, match="lazymem: set_device_memory_fraction"):
        _C._set_device_memory_fraction(0, 1.5)


# --- on a GPU -------------------------------------------------------------------------------------------


@cuda
def test_eager_cuda_backward_after_the_import():
    # The repro, in a fresh process as a user would run it, and alternating with lazymem.
    out = _fresh(
        "import torch, torch_lazymem\n"
        "x = torch.randn(4, 4, device='cuda', requires_grad=True)\n"
        "(x * 2).sum().backward()\n"
        "assert torch.equal(x.grad, torch.full((4, 4), 2.0, device='cuda'))\n"
        "w = torch.randn(8, 8).to('lazymem').requires_grad_()\n"
        "(w @ w).sum().backward()\n"
        "x.grad = None\n"
        "(x * 3).sum().backward()\n"
        "assert torch.equal(x.grad, torch.full((4, 4), 3.0, device='cuda'))\n"
        "print(torch.accelerator.current_accelerator().type, w.grad.device.type)\n"
    )
    assert out.split() == ["lazymem", "lazymem"]


@cuda
def test_eager_cuda_training_in_the_same_process_as_lazymem():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 1)).cuda()
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randn(8, 16, device="cuda")
    for _ in range(2):
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
    assert all(p.grad is not None and p.grad.is_cuda for p in model.parameters())


@cuda
@pytest.mark.parametrize("side_stream", [False, True])
def test_pipelined_training_is_on_by_default_and_equals_eager_cuda(side_stream):
    """On a GPU the pipeline's worker launches the step's kernels while the rest is recorded (issue
    30), on the stream the recording thread has current; every step equals eager CUDA bitwise."""
    assert torch_lazymem.pipeline()  # the default (set_pipeline(None)) on a CUDA backing
    torch_lazymem._C._set_pipeline_batch(16)
    stream = torch.cuda.Stream() if side_stream else torch.cuda.current_stream()
    try:
        torch.manual_seed(0)
        ref = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 10))
        model = copy.deepcopy(ref).to("lazymem")
        ref.cuda()
        opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ref, model)]
        x, y = torch.randn(32, 64), torch.arange(32) % 10
        torch_lazymem.reset_stats()
        with torch.cuda.stream(stream):
            for step in range(6):
                losses = []
                for m, opt, dev in ((ref, opts[0], "cuda"), (model, opts[1], "lazymem")):
                    loss = F.cross_entropy(m(x.to(dev)), y.to(dev))
                    loss.backward()
                    opt.step()
                    opt.zero_grad()
                    losses.append(loss.item())
                assert losses[0] == losses[1], step
        assert torch_lazymem.stats()["pipelined_flushes"] > 0
        for p, r in zip(model.parameters(), ref.parameters()):
            assert torch.equal(p.cpu(), r.cpu())
    finally:
        _C._pipeline_drain()
        torch_lazymem._C._set_pipeline_batch(0)


@cuda
def test_a_capped_step_over_half_the_budget_is_pipelined_and_equals_eager_cuda():
    """Under the user's memory fraction, a step whose peak is over half lazymem's budget: once its
    batches repeat, the worker runs them (the recording thread holds the allocator's cap for them),
    the user's fraction is theirs after every read, the process reserves within the budget, and every
    step equals eager CUDA bitwise (issue 30)."""
    torch_lazymem._C._set_pipeline_batch(8)
    total = torch.cuda.get_device_properties(0).total_memory
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.GELU(), torch.nn.Linear(4096, 1024))
    model = copy.deepcopy(ref).to("lazymem")
    ref.cuda()
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (ref, model)]
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8192, 1024, generator=g), torch.randn(8192, 1024, generator=g)
    try:
        flushes = []
        for step in range(8):
            if step == 1:  # a budget of about 1.6 times the first step's peak (memory_budget())
                peak = torch_lazymem.stats()["peak_bytes"]
                others = torch.cuda.memory_allocated() - torch.lazymem.memory_allocated()
                fraction = (others + 1.6 * peak + (96 << 20)) / total
                torch.cuda.set_per_process_memory_fraction(fraction)
                torch.cuda.reset_peak_memory_stats()
            losses = []
            before = torch_lazymem.stats()["pipelined_flushes"]
            for m, opt, dev in ((ref, opts[0], "cuda"), (model, opts[1], "lazymem")):
                loss = F.mse_loss(m(x.to(dev)), y.to(dev))
                loss.backward()
                opt.step()
                opt.zero_grad()
                if dev == "lazymem":
                    _C._pipeline_drain()
                losses.append(loss.item())
            flushes.append(torch_lazymem.stats()["pipelined_flushes"] - before)
            assert losses[0] == losses[1], step
            if step >= 1:
                # (the allocator keeps the fraction as whole bytes of the device's memory)
                assert abs(torch.cuda.get_per_process_memory_fraction() - fraction) < 1e-9, step
        budget = torch_lazymem.memory_budget()
        assert budget / 2 < torch_lazymem.stats()["peak_bytes"] <= budget
        assert max(flushes[5:]) > 0, flushes
        for p, r in zip(model.parameters(), ref.parameters()):
            assert torch.equal(p.cpu(), r.cpu())
    finally:
        _C._pipeline_drain()
        torch_lazymem._C._set_pipeline_batch(0)
        torch.cuda.set_per_process_memory_fraction(1.0)
        del model, ref, opts  # (an optimizer's step wrappers make a cycle: collected now, not later)
        gc.collect()


@cuda
def test_a_backward_through_cuda_and_lazymem_is_a_clear_error():
    w = torch.randn(4).to("lazymem").requires_grad_()
    loss = (w * 2).to("cuda").sum()
    with pytest.raises(RuntimeError, match="lazymem: this backward runs through both CUDA and lazymem"):
        loss.backward()


@cuda
def test_lazymem_as_the_first_cuda_user():
    out = _fresh(
        "import torch, torch_lazymem\n"
        "v = torch.randn(4).mul(8).round().div(8)\n"  # eighths: the sum is exact in any order
        "got = v.to('lazymem').sum().item()\n"
        "assert got == v.sum().item(), (got, v.sum().item())\n"
        "print(torch_lazymem.backing_device().type)\n"
    )
    assert out.strip() == "cuda"


@cuda
def test_the_default_budget_is_what_the_cuda_allocator_can_give():
    torch_lazymem.set_memory_budget(None)
    _, total = torch.cuda.mem_get_info()
    before = torch.cuda.get_per_process_memory_fraction()
    try:
        torch.cuda.set_per_process_memory_fraction(0.05)
        budget = torch_lazymem.memory_budget()
        assert 0 < budget <= 0.05 * total
    finally:
        torch.cuda.set_per_process_memory_fraction(before)
    assert torch_lazymem.memory_budget() > 0.05 * total


@cuda
def test_the_caching_allocator_holds_a_run_to_the_budget():
    """What the caching allocator reserves while lazymem runs stays within the process's other tensors
    plus the budget (its fraction is lowered for each run), on every step, the first included; the
    user's fraction is theirs again after; the split training equals eager CUDA."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(256, 2048), torch.nn.GELU(), torch.nn.Linear(2048, 2048),
                              torch.nn.GELU(), torch.nn.Linear(2048, 10)).double()
    x, y = torch.randn(4096, 256, dtype=torch.float64), torch.randint(0, 10, (4096,))

    def train(device, steps=2):
        model = copy.deepcopy(net).to(device)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        xs, ys = x.to(device), y.to(device)
        losses = []
        for _ in range(steps):
            loss = F.cross_entropy(model(xs), ys)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return losses, [p.detach().cpu() for p in model.parameters()]

    # Workspaces earlier tests left (cuBLAS keeps 32 MiB per handle and stream: a side stream's, the
    # graph capture stream's, the pipeline worker's) count in lazymem's budget while they are held
    # (stop 48's first H200 run: 96 MiB of them, and this step did not fit). Freed here, with the
    # graphs that were captured with them; lazymem's count follows at once.
    graphs = torch_lazymem.cuda_graphs()
    torch_lazymem.set_cuda_graphs(False)
    torch.cuda.synchronize()
    torch._C._cuda_clearCublasWorkspaces()
    torch_lazymem.set_cuda_graphs(graphs)
    values = torch.lazymem.memory_allocated()  # (first: it drops what nothing can read)
    library = torch_lazymem._C._device_bytes_held() - values
    assert 0 <= library <= torch.cuda.memory_allocated() - values
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    want = train("cuda")
    eager_peak = torch.cuda.max_memory_allocated() - base  # about 400 MiB
    torch.cuda.empty_cache()
    user_fraction = torch.cuda.get_per_process_memory_fraction()
    others = torch.cuda.memory_allocated()
    budget = int(0.6 * eager_peak)
    torch_lazymem.set_memory_budget(budget)
    torch_lazymem.reset_stats()
    torch.cuda.reset_peak_memory_stats()
    try:
        got = train("lazymem")
        assert torch.cuda.max_memory_reserved() <= others + budget
        stats = torch_lazymem.stats()
    finally:
        torch_lazymem.set_memory_budget(None)
    assert stats["splits"] > 0 and stats["allocator_caps"] > 0
    assert torch.cuda.get_per_process_memory_fraction() == user_fraction
    torch.testing.assert_close(got, want)


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_takes_eagers_kernel_and_matches_it_bitwise(dtype):
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 64, 40, dtype=dtype) for _ in range(3))  # head dim 40: flash pads it to 48

    def run(device):
        leaves = [t.to(device).requires_grad_() for t in (q, k, v)]
        out = F.scaled_dot_product_attention(*leaves, is_causal=True)
        out.square().sum().backward()
        return [t.cpu() for t in (out.detach(), *(x.grad for x in leaves))]

    for got, want in zip(run("lazymem"), run("cuda")):
        assert torch.equal(got, want)


@pytest.fixture
def cuda_attention_kernels():
    """CUDA's fused attention ops (flash, memory-efficient). On the CPU backing, CPU kernels stand in
    for them (CPU flash attention's arithmetic, the CUDA ops' outputs: their log-sum-exp padding, RNG
    state and empty placeholders), so that the planner's handling of the CUDA ops (their split rules)
    runs without a GPU."""
    if torch_lazymem.backing_device().type == "cuda":
        yield
        return
    lib = torch.library.Library("aten", "IMPL")
    cpu_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    cpu_flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
    seed = torch.zeros((), dtype=torch.int64)

    def flash(q, k, v, dropout_p=0.0, is_causal=False, return_debug_mask=False, *, scale=None):
        out, lse = cpu_flash(q, k, v, dropout_p, is_causal, scale=scale)
        rng = torch.zeros(2, dtype=torch.uint64)
        return out, lse, None, None, q.size(2), k.size(2), rng, rng[0].clone(), q.new_empty(0)

    def flash_backward(g, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, dropout_p, is_causal, seed_, offset, *,
                       scale=None):
        return cpu_flash_backward(g, q, k, v, out, lse, dropout_p, is_causal, scale=scale)

    def efficient(q, k, v, bias, compute_lse, dropout_p=0.0, is_causal=False, *, scale=None):
        out, lse = cpu_flash(q, k, v, dropout_p, is_causal, attn_mask=bias, scale=scale)
        padded = (q.size(2) + 31) // 32 * 32  # the CUDA kernel's log-sum-exp rows
        return out, F.pad(lse, (0, padded - q.size(2))), seed.clone(), seed.clone()

    def efficient_backward(g, q, k, v, bias, out, lse, seed_, offset, dropout_p, mask, is_causal=False, *, scale=None):
        gq, gk, gv = cpu_flash_backward(g, q, k, v, out, lse[..., : q.size(2)].contiguous(), dropout_p, is_causal,
                                        attn_mask=bias, scale=scale)
        return gq, gk, gv, None

    lib.impl("_scaled_dot_product_flash_attention", flash, "CPU")
    lib.impl("_scaled_dot_product_flash_attention_backward", flash_backward, "CPU")
    lib.impl("_scaled_dot_product_efficient_attention", efficient, "CPU")
    lib.impl("_scaled_dot_product_efficient_attention_backward", efficient_backward, "CPU")
    try:
        yield
    finally:
        lib._destroy()


def _flash(q, k, v, mask):
    return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True, False, scale=0.125)[0]


def _flash_padded(q, k, v, mask):
    """As lazymem's SDPA calls CUDA's flash kernel for a head dim that is not a multiple of 8."""
    d = q.size(-1)
    return _flash(*(F.pad(t, (0, 8 - d % 8)) for t in (q, k, v)), mask)[..., :d]


def _efficient(q, k, v, mask):
    return torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, mask, True, 0.0, mask is None,
                                                                  scale=0.125)[0]


def _sdpa(q, k, v, mask):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)


@pytest.mark.parametrize("kernel, dtype, head_dim, masked", [
    (_flash, torch.bfloat16, 40, False),
    (_flash_padded, torch.bfloat16, 36, False),
    (_efficient, torch.float32, 40, False),
    (_efficient, torch.float32, 40, True),
    (_sdpa, torch.bfloat16, 36, False),  # CUDA: flash, the head dim padded to 40 around it
    (_sdpa, torch.float32, 36, True),  # CUDA: memory-efficient with a per-sample mask
])
def test_fused_attention_split_along_the_batch_equals_unsplit(cuda_attention_kernels, kernel, dtype, head_dim, masked):
    """CUDA's fused attention kernels split along the batch in ragged chunks (7 rows in 3) give the
    unsplit results: each batch row's attention is its own. Their RNG state outputs (unread without
    dropout) are every chunk's alike."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(7, 4, 64, head_dim, dtype=dtype) for _ in range(3))
    # (the memory-efficient kernel takes a bias with every head: SDPA expands a mask before calling it)
    mask = torch.randn(7, 1, 64, 64, dtype=dtype).expand(7, 4, 64, 64) if masked else None

    def run(chunks):
        leaves = [t.to("lazymem").requires_grad_() for t in (q, k, v)]
        m = mask.to("lazymem") if masked else None
        torch_lazymem.reset_stats()
        with force_chunks(chunks) if chunks else contextlib.nullcontext():
            out = kernel(*leaves, m)
            out.square().sum().backward()
            got = [t.cpu() for t in (out.detach(), *(x.grad for x in leaves))]
        return got, torch_lazymem.stats(), torch_lazymem.explain(print_it=False)

    whole, s1, _ = run(None)
    split, s3, text = run(3)
    assert s1["splits"] == 0 and s3["splits"] >= 1 and "runs whole" not in text, text
    for got, want in zip(split, whole):
        torch.testing.assert_close(got, want)


# --- batch norm takes cuDNN's kernel where eager CUDA does ------------------------------------------


@pytest.fixture
def cudnn_batch_norm():
    """The cuDNN batch norm ops. On the CPU backing, CPU kernels stand in for them (native batch norm's
    arithmetic, cuDNN's empty reserve space and empty eval-mode statistics), so that the planner's
    handling of the cuDNN ops (split rules, the training expansion) runs without a GPU."""
    if torch_lazymem.backing_device().type == "cuda":
        yield
        return
    lib = torch.library.Library("aten", "IMPL")

    def forward(x, w, b, rm, rv, training, momentum, eps):
        out, mean, invstd = torch.ops.aten.native_batch_norm(x, w, b, rm, rv, training, momentum, eps)
        if not training:
            mean, invstd = w.new_empty(0), w.new_empty(0)
        return out, mean, invstd, x.new_empty(0, dtype=torch.uint8)

    def backward(x, g, w, rm, rv, mean, invstd, eps, reserve):
        return torch.ops.aten.native_batch_norm_backward(g, x, w, rm, rv, mean, invstd, True, eps, [True] * 3)

    lib.impl("cudnn_batch_norm", forward, "CPU")
    lib.impl("cudnn_batch_norm_backward", backward, "CPU")
    try:
        yield
    finally:
        lib._destroy()


def _bn_step(device, training, chunks=None, item_between=False, dtype=torch.float64):
    """A batch norm forward and backward through aten.cudnn_batch_norm on `device`: output, the
    gradients and the running statistics, on the CPU."""
    torch.manual_seed(0)
    x, g = torch.randn(7, 3, 5, 5, dtype=dtype), torch.randn(7, 3, 5, 5, dtype=dtype)
    w, b = torch.rand(3, dtype=dtype) + 0.5, torch.rand(3, dtype=dtype)
    rm, rv = torch.rand(3, dtype=dtype), torch.rand(3, dtype=dtype) + 1
    x, w, b = (t.to(device).requires_grad_() for t in (x, w, b))
    g, rm, rv = (t.to(device) for t in (g, rm, rv))
    with force_chunks(chunks) if chunks else contextlib.nullcontext():
        out = torch.ops.aten.cudnn_batch_norm(x, w, b, rm, rv, training, 0.1, 1e-5)[0]
        if item_between:
            out.sum().item()  # the forward materializes alone; its reserve space is held for the backward
        (out * g).sum().backward()
        return [t.detach().cpu() for t in (out, x.grad, w.grad, b.grad, rm, rv)]


@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("item_between", [False, True])
def test_cudnn_batch_norm_splits_along_the_batch(cudnn_batch_norm, training, item_between):
    whole = _bn_step("lazymem", training)
    for want, got in zip(_bn_step(BACKING, training), whole):
        assert torch.equal(got, want)
    torch_lazymem.reset_stats()
    split = _bn_step("lazymem", training, chunks=3, item_between=item_between)
    assert torch_lazymem.stats()["splits"] >= 1
    for want, got in zip(whole, split):
        torch.testing.assert_close(got, want)


@cuda
@pytest.mark.parametrize("memory_format", [torch.contiguous_format, torch.channels_last])
def test_batch_norm_takes_cudnns_kernel_and_matches_eager_bitwise(memory_format):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
                                torch.nn.InstanceNorm2d(8, affine=True))
    x = torch.randn(16, 3, 20, 20).contiguous(memory_format=memory_format)

    def run(device):
        m = copy.deepcopy(model).to(device).to(memory_format=memory_format)
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        for _ in range(2):
            out = m(x.to(device))
            out.square().mean().backward()
            opt.step()
            opt.zero_grad()
        m.eval()
        return [out.detach().cpu(), m(x.to(device)).detach().cpu(), *(t.detach().cpu() for t in m.state_dict().values())]

    for got, want in zip(run("lazymem"), run("cuda")):
        assert torch.equal(got, want)


# --- host and device memory on the backing device ---------------------------------------------------


@pytest.mark.parametrize("async_out", [0, 1])
def test_a_value_held_in_host_memory_crosses_both_ways_on_the_backing_device(async_out):
    """Under a 6 MiB budget a 16 MiB result the user holds, read by a second program, is assembled in
    host memory (pinned on CUDA: device-to-host copies; with async_out, on the copy stream after the
    compute stream's event, not waited for until the run ends) and a third program reads it chunk by
    chunk, each chunk's rows copied to the device while the chunk before computes (on CUDA: a copy
    stream, the compute stream waiting on the copy's event). Eager's values on the backing device. On
    CUDA eight times both (a plan there leaves 22 MiB of its budget to the caching allocator's segments)."""
    torch.manual_seed(0)
    scale = 8 if BACKING == "cuda" else 1
    xh = torch.randn(2048 * scale, 1024, dtype=torch.float64)
    want_first = xh.to(BACKING).tanh().cos().sum(0).cpu()
    want = (xh.to(BACKING).tanh() * 2).exp().sin().sum().cpu()
    # (beyond what lazymem holds already: on CUDA, cuBLAS's workspaces of the threads that ran its
    # matmuls, the pipeline's worker included)
    budget = (6 << 20) * scale + _C._device_bytes_held()
    torch_lazymem.set_memory_budget(budget)
    _C._set_async_copy_out(async_out)
    try:
        y = xh.to("lazymem").tanh()
        y.sum().item()  # y stays pending (recomputed per chunk when read)
        torch_lazymem.reset_stats()
        first = y.cos().sum(0).cpu()  # y is assembled
        s1 = torch_lazymem.stats()
        torch_lazymem.reset_stats()
        got = (y * 2).exp().sin().sum().cpu()
        s2, text = torch_lazymem.stats(), torch_lazymem.explain(print_it=False)
    finally:
        torch_lazymem.set_memory_budget(None)
        _C._set_async_copy_out(-1)
    torch.testing.assert_close(first, want_first)
    torch.testing.assert_close(got, want)
    assert s1["values_in_host_memory"] >= 1 and s1["d2h_bytes"] >= xh.nbytes, s1
    assert s1["d2h_behind"] == (s1["d2h_copies"] if async_out else 0), s1
    assert s2["h2d_bytes"] == xh.nbytes and s2["chunks"] >= 3 and s2["h2d_ahead"] == s2["chunks"], (s2, text)
    assert s2["peak_bytes"] <= budget, s2
