"""Views, in-place ops and aliasing behave exactly as in eager (compared bitwise with CPU)."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_bitwise

import torch_lazymem


def both(make):
    torch.manual_seed(0)
    a = make()
    return a.clone(), a.to("lazymem")


def test_write_through_views_and_views_of_views():
    a, x = both(lambda: torch.arange(24.0).reshape(4, 6))
    for t in (a, x):
        v = t.t()[1:3]  # view of a view
        v.mul_(10)
        w = t[:, ::2]
        w.add_(1)
        t[0, :] = -1.0
        t[1:3, 2:4].zero_()
        t.view(-1)[5] = 42.0
        t.diagonal().fill_(7.0)
    assert_bitwise(x, a)


def test_inplace_on_aliasing_arguments():
    a, x = both(lambda: torch.randn(5))
    for t in (a, x):
        t.add_(t)
        t.mul_(t[0].clone())
        t[::2].sub_(t[1::2].sum())
    assert_bitwise(x, a)


def test_partial_overlap_is_rejected_at_the_call_like_eager():
    a, x = both(lambda: torch.randn(5))
    messages = []
    for t in (a, x):
        with pytest.raises(RuntimeError, match="refer to a single memory location") as e:
            t[1:].sub_(t[:-1])
        messages.append(str(e.value))
    assert messages[0] == messages[1]
    assert_bitwise(x, a)


@pytest.mark.parametrize(
    "view",
    [
        lambda t: t.view(3, 8),
        lambda t: t.reshape(2, 12).t(),
        lambda t: t.permute(2, 0, 1),
        lambda t: t[1].select(1, 2),
        lambda t: t.narrow(2, 1, 2),
        lambda t: t[:, None].expand(2, 5, 3, 4),
        lambda t: t.unsqueeze(1).squeeze(),
        lambda t: t.unfold(2, 2, 1),
        lambda t: t.as_strided((3, 3), (2, 5), 1),
        lambda t: t.flatten()[::3],
        lambda t: t.transpose(0, 2).contiguous(),
        lambda t: t.split(1, dim=0)[1],
        lambda t: t.chunk(2, dim=2)[1],
        lambda t: t.unbind(1)[2],
        lambda t: t.movedim(0, -1),
        lambda t: torch.view_as_real(t.to(torch.complex64)),
        lambda t: t.view(torch.int32),
    ],
)
def test_view_ops(view):
    a, x = both(lambda: torch.randn(2, 3, 4))
    assert_bitwise(view(x), view(a))


def test_inplace_view_ops_change_metadata_only():
    a, x = both(lambda: torch.randn(2, 1, 3))
    for t in (a, x):
        t.squeeze_(1)
        t.t_()
        t.unsqueeze_(0)
        t.transpose_(0, 2)
    assert x.shape == a.shape and x.stride() == a.stride()
    assert_bitwise(x, a)


def test_out_variants_and_resize():
    a, x = both(lambda: torch.randn(3, 4))
    out_a = torch.empty(0)
    out_x = torch.empty(0, device="lazymem")
    torch.mul(a, 2, out=out_a)
    torch.mul(x, 2, out=out_x)
    assert_bitwise(out_x, out_a)
    out_x.resize_(2, 2)
    out_a.resize_(2, 2)
    assert_bitwise(out_x, out_a)
    x.resize_(5, 5)  # growth keeps the old values in the first 12 elements
    a.resize_(5, 5)
    assert_bitwise(x.view(-1)[:12], a.view(-1)[:12])


def test_resize_after_materialization_keeps_data():
    a, x = both(lambda: torch.arange(6.0))
    x.cpu()  # materialize, then grow the buffer
    x.resize_(10)
    a.resize_(10)
    x[6:] = 1.0
    a[6:] = 1.0
    assert_bitwise(x, a)


def test_set_and_storage_aliasing():
    a, x = both(lambda: torch.arange(8.0))
    y = torch.empty(0, device="lazymem")
    y.set_(x.untyped_storage(), 2, (2, 3), (3, 1))
    b = torch.empty(0)
    b.set_(a.untyped_storage(), 2, (2, 3), (3, 1))
    y.add_(100)
    b.add_(100)
    assert_bitwise(x, a)
    z = torch.empty(0, device="lazymem").set_(x)
    assert z.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
    with pytest.raises(RuntimeError, match="lazymem: set_: the source storage is on cpu"):
        torch.empty(0, device="lazymem").set_(torch.arange(3.0).untyped_storage())


def test_data_detach_share_storage():
    a, x = both(lambda: torch.randn(4))
    for t in (a, x):
        d = t.detach()
        d.mul_(2)
        t.data.add_(1)
    assert_bitwise(x, a)


def test_views_survive_their_base():
    a, x = both(lambda: torch.randn(10))
    va, vx = a[2:5], x[2:5]
    del a, x
    vx.mul_(3)
    va.mul_(3)
    assert_bitwise(vx, va)


def test_writes_after_materialization_see_cached_data():
    a, x = both(lambda: torch.randn(6))
    first = x.cpu()
    assert torch.equal(first, a)
    torch_lazymem.reset_stats()
    x.add_(1)
    a.add_(1)
    assert_bitwise(x, a)
    # only the add ran: the source was not recomputed
    assert torch_lazymem.stats()["nodes_executed"] == 1


@pytest.mark.parametrize("sync_between", [False, True])
def test_in_place_metadata_ops_on_values_read_in_their_kernels_layout(sync_between):
    # A read in the layout its kernel returned takes the kernel's own output tensor (execute/bind.cpp,
    # LazyBuffer::real_impl); a node that writes the buffer never gets it, so an in-place op that
    # changes sizes or strides (unsqueeze_, t_, transpose_, squeeze_, as_strided_, resize_) leaves
    # every other read of the value in its layout.
    def prog(x: torch.Tensor, sync) -> list[torch.Tensor]:
        y = x * 2
        a = y + 1  # read in the kernel's layout
        y.unsqueeze_(0)
        b = y * 3
        sync()
        c = a - 1  # the same value, its original layout
        y.squeeze_(0).t_()
        d = y.contiguous() + 0
        e = a.transpose_(0, 1) * 2
        f = (x + 0).as_strided_((2, 3), (1, 2)) * 1
        g = x * 1
        g.resize_(4, 6)
        h = g.narrow(0, 0, 2) + 0  # (the rows resize_ kept)
        return [y, a, b, c, d, e, f, h]

    x = torch.randn(3, 4)
    expected = prog(x, lambda: None)
    got = prog(x.to("lazymem"), torch.lazymem.synchronize if sync_between else (lambda: None))
    for g_, e_ in zip(got, expected, strict=True):
        assert_bitwise(g_, e_)
