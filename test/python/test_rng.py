"""Random numbers: torch.manual_seed seeds lazymem; the CPU backing device reproduces CPU's stream."""

from __future__ import annotations

import torch
from conftest import assert_bitwise


def test_manual_seed_reproduces_cpu():
    torch.manual_seed(5)
    cpu = [torch.randn(4), torch.rand(3), torch.randint(0, 9, (5,))]
    torch.manual_seed(5)
    lazy = [torch.randn(4, device="lazymem"), torch.rand(3, device="lazymem"), torch.randint(0, 9, (5,), device="lazymem")]
    for x, a in zip(lazy, cpu):
        assert_bitwise(x, a)


def test_reseeding_between_pending_draws():
    torch.manual_seed(1)
    a = torch.randn(3, device="lazymem")
    torch.manual_seed(1)  # acts at this point in program order, although `a` is still pending
    b = torch.randn(3, device="lazymem")
    assert torch.equal(a.cpu(), b.cpu())


def test_rng_state_roundtrip():
    torch.lazymem.manual_seed(3)
    torch.randn(10, device="lazymem")  # pending draw: get_rng_state must account for it
    state = torch.lazymem.get_rng_state()
    x = torch.randn(4, device="lazymem")
    torch.lazymem.set_rng_state(state)
    y = torch.randn(4, device="lazymem")
    assert torch.equal(x.cpu(), y.cpu())
    assert torch.lazymem.initial_seed() == 3


def test_generators_are_independent_and_clonable():
    g1 = torch.Generator(device="lazymem").manual_seed(9)
    g2 = torch.Generator(device="lazymem").manual_seed(9)
    assert g1.device == torch.device("lazymem:0")
    a = torch.randn(5, device="lazymem", generator=g1)
    torch.randn(100, device="lazymem")  # the default generator does not disturb g2
    b = torch.randn(5, device="lazymem", generator=g2)
    assert torch.equal(a.cpu(), b.cpu())
    g3 = g1.clone_state() if hasattr(g1, "clone_state") else None
    if g3 is not None:
        assert torch.equal(torch.randn(3, device="lazymem", generator=g1).cpu(),
                           torch.randn(3, device="lazymem", generator=g3).cpu())


def test_random_nodes_run_even_when_dead():
    torch.manual_seed(2)
    torch.randn(7, device="lazymem")  # dead, but it advances the stream as in eager
    x = torch.randn(3, device="lazymem")
    torch.manual_seed(2)
    torch.randn(7)
    assert_bitwise(x, torch.randn(3))


def test_seed_and_get_state_shape():
    torch.lazymem.seed()
    assert torch.lazymem.get_rng_state().dtype == torch.uint8
    assert len(torch.lazymem.get_rng_state_all()) == 1
