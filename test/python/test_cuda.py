"""lazymem beside the user's own CUDA (DESIGN.md §8): eager CUDA autograd keeps working after the
import, lazymem may be the first CUDA user, the default budget is the CUDA allocator's, and SDPA takes
eager's kernel. The CUDA tests skip without a GPU; the mechanisms they rely on are tested on the CPU
too."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch.autograd.variable import Variable

import torch_lazymem
from torch_lazymem import _C, _cuda

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
