"""Data-dependent ops run eagerly on materialized inputs and stay exact."""

from __future__ import annotations

import torch
from conftest import assert_bitwise

import torch_lazymem


def data():
    a = torch.tensor([[0.0, 1.5, -2.0], [3.0, 0.0, 1.5]])
    return a, (a.to("lazymem") * 1.0)


def test_nonzero_masked_select_argwhere():
    a, x = data()
    assert_bitwise(x.nonzero(), a.nonzero())
    assert_bitwise(torch.masked_select(x, x > 0), torch.masked_select(a, a > 0))
    assert_bitwise(torch.argwhere(x), torch.argwhere(a))
    assert torch_lazymem.stats()["ops_eager"] >= 3


def test_boolean_indexing_get_and_set():
    a, x = data()
    assert_bitwise(x[x > 0], a[a > 0])
    x[x < 0] = 10.0
    a[a < 0] = 10.0
    assert_bitwise(x, a)
    m = torch.tensor([True, False])
    x[m.to("lazymem")] = torch.tensor([7.0, 8.0, 9.0]).to("lazymem")
    a[m] = torch.tensor([7.0, 8.0, 9.0])
    assert_bitwise(x, a)


def test_unique_and_repeat_interleave():
    a, x = data()
    assert_bitwise(torch.unique(x), torch.unique(a))
    u, inv, cnt = torch.unique(x, return_inverse=True, return_counts=True)
    ua, inva, cnta = torch.unique(a, return_inverse=True, return_counts=True)
    assert_bitwise(u, ua)
    assert_bitwise(inv, inva)
    assert_bitwise(cnt, cnta)
    r = torch.tensor([1, 0, 3])
    assert_bitwise(torch.repeat_interleave(r.to("lazymem")), torch.repeat_interleave(r))
    assert_bitwise(x.repeat_interleave(r.to("lazymem"), dim=1), a.repeat_interleave(r, dim=1))


def test_results_feed_later_recorded_ops():
    a, x = data()
    idx = x.flatten().nonzero().squeeze(1)
    y = x.flatten().index_select(0, idx) * 2
    assert_bitwise(y, a.flatten().index_select(0, a.flatten().nonzero().squeeze(1)) * 2)


def test_pending_readers_run_before_an_eager_write():
    a, x = data()
    before = x * 1.0  # pending read of x
    x[x > 1] = 0.0  # eager write of x: the pending read must still see the old values
    a_before = a * 1.0
    a[a > 1] = 0.0
    assert_bitwise(before, a_before)
    assert_bitwise(x, a)
