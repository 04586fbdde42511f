"""Device registration: the lazymem device, the torch.lazymem module, generated methods, guard."""

from __future__ import annotations

import pytest
import torch

import torch_lazymem


def test_backend_is_named_lazymem():
    assert torch._C._get_privateuse1_backend_name() == "lazymem"
    assert torch.device("lazymem").type == "lazymem"
    assert torch.device("lazymem:0").index == 0


def test_device_module_api():
    m = torch.lazymem
    assert m.is_available()
    assert m.device_count() == 1
    assert m.current_device() == 0
    m.set_device(0)
    m.set_device("lazymem:0")
    with m.device(0):
        x = torch.ones(2, device="lazymem")
    assert x.device == torch.device("lazymem:0")
    m.synchronize()
    assert isinstance(m.memory_allocated(), int)
    assert m.max_memory_allocated() >= m.memory_allocated()
    m.reset_peak_memory_stats()
    assert m.max_memory_allocated() == m.memory_allocated()
    free, total = m.mem_get_info()
    assert 0 < free <= total


def test_device_index_out_of_range():
    with pytest.raises(ValueError, match="lazymem: device index 1 is out of range"):
        torch.lazymem.set_device(1)
    with pytest.raises(RuntimeError, match="lazymem"):
        torch.empty(2, device="lazymem:1")


def test_generated_methods():
    x = torch.arange(4.0)
    y = x.lazymem()
    assert y.is_lazymem and not x.is_lazymem
    assert torch.equal(y.cpu(), x)
    m = torch.nn.Linear(3, 2).lazymem()
    assert m.weight.is_lazymem and m.bias.is_lazymem
    s = torch.UntypedStorage(8).lazymem()
    assert s.device.type == "lazymem" and s.nbytes() == 8
    assert hasattr(torch.TypedStorage, "lazymem")


def test_accelerator_and_device_count():
    assert torch.accelerator.current_accelerator().type == "lazymem"
    assert torch.accelerator.device_count() == 1
    torch.accelerator.synchronize()


def test_guard_streams_and_events():
    s = torch.Stream(device="lazymem")
    e = torch.Event(device="lazymem")
    e.record(s)
    assert e.query()
    s.synchronize()
    e.synchronize()


def test_data_ptrs_are_unique_and_not_null():
    a = torch.empty(4, device="lazymem")
    b = torch.empty(4, device="lazymem")
    assert a.data_ptr() != 0 and b.data_ptr() != 0
    assert a.data_ptr() != b.data_ptr()
    assert a[1:].data_ptr() == a.data_ptr() + 4  # views keep offsets like any device


def test_storages_copy_through_the_program():
    x = torch.arange(4.0).to("lazymem")
    c = x.untyped_storage().clone()
    assert c.device.type == "lazymem"
    assert torch.equal(torch.empty(0, device="lazymem").set_(c).cpu().view(-1)[:0], torch.empty(0))
    assert bytes(c.cpu()) == bytes(torch.arange(4.0).untyped_storage())


def test_registration_is_idempotent():
    from torch_lazymem import _registration

    _registration.register()
    _registration.register()
    assert torch.lazymem is not None
    assert torch_lazymem.backing_device() == torch.device("cpu")


def test_composites_with_one_device_types_kernel_are_captured_only_while_it_backs_lazymem():
    """_fused_rms_norm in a CUDA build: CUDA kernels for it and its backward, a decomposition elsewhere.
    Captured on PrivateUse1 only while CUDA backs lazymem; on the CPU backing it decomposes above
    autograd as CPU eager does (captured there, its backward had no CPU kernel to replay: torch 2.11's
    CUDA wheel without a GPU failed every RMSNorm training step). Then RMSNorm trains as eager does."""
    op = "aten::_fused_rms_norm"
    if not torch._C._dispatch_has_kernel(op):
        pytest.skip("this torch has no _fused_rms_norm")
    cuda_kernel = torch._C._dispatch_has_kernel_for_dispatch_key(op, "CUDA")
    captured = torch._C._dispatch_has_kernel_for_dispatch_key(op, "PrivateUse1")
    assert captured == (cuda_kernel and torch_lazymem.backing_device().type == "cuda")
    torch.manual_seed(0)
    x = torch.randn(4, 6, dtype=torch.float64)
    norm = torch.nn.RMSNorm(6, dtype=torch.float64)
    lazy = torch.nn.RMSNorm(6, dtype=torch.float64).to("lazymem")
    lx = x.to("lazymem").requires_grad_()
    xe = x.clone().requires_grad_()
    (norm(xe) * torch.arange(6.0, dtype=torch.float64)).sum().backward()
    (lazy(lx) * torch.arange(6.0, dtype=torch.float64).to("lazymem")).sum().backward()
    if torch_lazymem.backing_device().type == "cpu":
        assert torch.equal(lx.grad.cpu(), xe.grad) and torch.equal(lazy.weight.grad.cpu(), norm.weight.grad)
    else:
        torch.testing.assert_close(lx.grad.cpu(), xe.grad)
