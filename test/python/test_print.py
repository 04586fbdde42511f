"""print/repr: one transfer, CPU formatting, device='lazymem:0' in the header."""

from __future__ import annotations

import pytest
import torch

import torch_lazymem


def squash(text: str) -> str:
    return "".join(text.split())


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.randn(3, 4),
        lambda: torch.arange(10),
        lambda: torch.tensor([True, False]),
        lambda: torch.randn(2, 3).half(),
        lambda: torch.randn(2, 3).to(torch.bfloat16),
        lambda: torch.randn(3, dtype=torch.complex64),
        lambda: torch.tensor(3.5),
        lambda: torch.empty(0, 3),
        lambda: torch.randn(2000),
        lambda: torch.tensor([float("nan"), float("inf"), 1e-8, 1e8]),
    ],
)
def test_repr_matches_cpu_with_device(make):
    torch.manual_seed(0)
    a = make()
    x = a.to("lazymem")
    text = repr(x)
    # CPU formatting of the same values; the suffix adds device='lazymem:0' as CUDA adds device='cuda:0'
    # (which may move the closing suffix onto its own line, exactly as for CUDA tensors)
    assert "device='lazymem:0'" in text
    assert squash(text).replace(",device='lazymem:0'", "") == squash(repr(a))
    assert str(x) == text


def test_print_is_one_materialization_and_then_cached(capsys):
    x = torch.randn(50, 50, device="lazymem")
    y = (x @ x).tanh()
    torch_lazymem.reset_stats()
    print(y)
    s = torch_lazymem.stats()
    assert s["materializations"] == 1 and s["nodes_executed"] == 3
    print(y)
    assert torch_lazymem.stats()["nodes_executed"] == 3  # the second print ran nothing
    assert "device='lazymem:0'" in capsys.readouterr().out


def test_repr_with_autograd():
    w = torch.randn(3, device="lazymem", requires_grad=True)
    y = w * 2
    assert "grad_fn=<MulBackward0>" in repr(y)
    assert "requires_grad=True" in repr(w)
    assert "device='lazymem:0'" in repr(y)


def test_format_of_a_scalar():
    x = torch.tensor(2.5).to("lazymem")
    assert f"{x:.2f}" == "2.50"
    assert f"{x}" == f"{torch.tensor(2.5)}" == "2.5"


def test_a_fake_tensor_standing_for_a_lazymem_one_prints_as_torch_prints_fakes():
    """FakeTensorMode's stand-in reports device lazymem but has no values: printed as PyTorch prints
    fakes (torch 2.11's AOT autograd prints its graph metadata under the fake mode: reading values
    there raised DynamicOutputShapeException on masked_select, so torch.compile fell back to eager)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    real = torch.arange(6.0).reshape(2, 3).to("lazymem")
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = mode.from_tensor(real)
        text = repr(fake)
    assert fake.device.type == "lazymem"
    assert "FakeTensor" in text and "size=(2, 3)" in text
    assert "tensor([[0., 1., 2.]" in repr(real)
