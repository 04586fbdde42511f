"""Every sync point materializes what it needs, once; materialized values are cached."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import assert_bitwise

import torch_lazymem


def pair():
    torch.manual_seed(0)
    a = torch.randn(4, 5)
    ref = (a @ a.t()).relu_().sum(1)
    x = a.to("lazymem")
    return ref, (x @ x.t()).relu_().sum(1)


def test_item_float_int_bool():
    ref, z = pair()
    assert z[0].item() == ref[0].item()
    assert float(z[1]) == float(ref[1])
    assert int(z[2]) == int(ref[2])
    assert bool(z.sum() > 0) == bool(ref.sum() > 0)
    if z[0] > -1:  # __bool__ in control flow
        pass
    assert z.sum().item() == ref.sum().item()


def test_cpu_to_tolist_numpy():
    ref, z = pair()
    assert torch.equal(z.cpu(), ref)
    assert torch.equal(z.to("cpu"), ref)
    assert torch.equal(z.to("cpu", torch.float64), ref.double())
    assert torch.equal(z.to(device="cpu", dtype=torch.float16), ref.half())
    assert z.tolist() == ref.tolist()
    assert np.array_equal(z.cpu().numpy(), ref.numpy())
    with pytest.raises(TypeError, match="lazymem"):
        z.numpy()  # as for CUDA: numpy needs .cpu() first
    assert np.array_equal(z.numpy(force=True), ref.numpy())
    assert z.cpu(memory_format=torch.contiguous_format).is_contiguous()


def test_non_contiguous_and_offset_downloads():
    a = torch.arange(60.0).reshape(3, 4, 5)
    x = a.to("lazymem")
    for view in (lambda t: t.transpose(0, 2), lambda t: t[1:, ::2, 3], lambda t: t.expand(2, 3, 4, 5)):
        assert torch.equal(view(x).cpu(), view(a))


def test_synchronize_runs_everything():
    x = torch.randn(10, device="lazymem")
    y = x * 2
    assert torch_lazymem.stats()["pending_nodes"] == 2
    torch.lazymem.synchronize()
    assert torch_lazymem.stats()["pending_nodes"] == 0
    assert torch_lazymem.buffer_info(y)["has_real"]
    torch_lazymem.sync()


def test_materialized_values_are_cached():
    ref, z = pair()
    z.cpu()
    torch_lazymem.reset_stats()
    z.cpu()
    z.tolist()
    float(z[0])
    assert torch_lazymem.stats()["nodes_executed"] == 0
    assert torch_lazymem.stats()["materializations"] == 0


def test_sync_sees_the_whole_program():
    # DESIGN.md §7: a sync point plans everything recorded so far (the rest of a training step runs
    # in the same plan, split into the same chunk loop, instead of storing what it reads).
    x = torch.randn(8, device="lazymem")
    a = x + 1
    b = a * 3  # recorded after a: runs in the same materialization
    a.cpu()
    assert torch_lazymem.stats()["pending_nodes"] == 0
    assert torch_lazymem.stats()["materializations"] == 1
    assert torch_lazymem.buffer_info(b)["has_real"]
    assert_bitwise(b, (a.cpu() * 3))


def test_a_failing_op_recorded_later_does_not_fail_an_unrelated_read():
    x = torch.arange(4.0, device="lazymem")
    a = x * 2
    bad = x.index_select(0, torch.tensor([10]).to("lazymem"))  # out of range: fails when it runs
    assert a.tolist() == [0.0, 2.0, 4.0, 6.0]  # runs the whole program; only `bad` is poisoned
    with pytest.raises(IndexError, match="lazymem: aten::index_select"):
        bad.cpu()


def test_later_ops_read_cached_data():
    torch.manual_seed(1)
    a = torch.randn(6)
    x = a.to("lazymem")
    y = x.exp()
    y.cpu()
    torch_lazymem.reset_stats()
    z = y + 1
    assert_bitwise(z, a.exp() + 1)
    assert torch_lazymem.stats()["nodes_executed"] == 1


def test_to_other_device_types_and_back():
    ref, z = pair()
    back = z.cpu().to("lazymem")
    assert_bitwise(back, ref)
    assert_bitwise(z.to("lazymem", torch.float64), ref.double())
