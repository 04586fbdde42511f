"""Autograd through lazymem: backward ops are recorded like any other op."""

from __future__ import annotations

import torch
from conftest import assert_bitwise, run_in_threads

import torch_lazymem


def pair(*shape):
    torch.manual_seed(0)
    a = torch.randn(*shape, requires_grad=True)
    return a, a.detach().to("lazymem").requires_grad_()


def test_backward_is_recorded_and_leaf_grads_are_lazymem():
    a, x = pair(4, 3)
    (a.sin() * a).sum().backward()
    before = torch_lazymem.stats()["nodes_executed"]
    (x.sin() * x).sum().backward()
    assert torch_lazymem.stats()["nodes_executed"] == before  # backward ran nothing
    assert x.grad.device.type == "lazymem" and x.grad.requires_grad is False
    assert_bitwise(x.grad, a.grad)


def test_autograd_grad_retain_graph_and_accumulation():
    a, x = pair(5)
    for t in (a, x):
        y = (t.exp() * 3).sum()
        y.backward(retain_graph=True)
        y.backward()
    assert_bitwise(x.grad, a.grad)
    ga, = torch.autograd.grad((a ** 2).mean(), a)
    gx, = torch.autograd.grad((x ** 2).mean(), x)
    assert_bitwise(gx, ga)


def test_higher_order_gradients():
    a, x = pair(3)
    def second(t):
        g, = torch.autograd.grad((t ** 3).sum(), t, create_graph=True)
        return torch.autograd.grad(g.sum(), t)[0]
    assert_bitwise(second(x), second(a))


def test_hooks_may_read_values_during_backward():
    a, x = pair(3)
    seen = {}
    for name, t in (("cpu", a), ("lazy", x)):
        t.register_hook(lambda g, name=name: seen.__setitem__(name, g.sum().item()) or g * 2)
        (t * 3).sum().backward()
    assert seen["cpu"] == seen["lazy"] == 9.0
    assert_bitwise(x.grad, a.grad)


def test_module_hooks_and_non_scalar_backward():
    m = torch.nn.Linear(3, 2).to("lazymem")
    calls = []
    m.register_full_backward_hook(lambda mod, gi, go: calls.append(go[0].norm().item()))
    inp = torch.randn(4, 3, device="lazymem", requires_grad=True)
    out = m(inp)
    out.backward(torch.ones_like(out))
    assert len(calls) == 1 and inp.grad.shape == (4, 3)


def test_requires_grad_detach_no_grad_inference_mode():
    _, x = pair(3)
    with torch.no_grad():
        y = x * 2
    assert not y.requires_grad
    with torch.inference_mode():
        z = x * 2
    assert z.is_inference() and not z.requires_grad
    d = x.detach()
    assert not d.requires_grad and d.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
    w = torch.zeros(2, device="lazymem").requires_grad_()
    (w * 5).sum().backward()
    assert w.grad.tolist() == [5.0, 5.0]


def test_backward_from_several_threads():
    def run(seed):
        g = torch.Generator().manual_seed(seed)
        a = torch.randn(16, 16, generator=g, requires_grad=True)
        x = a.detach().to("lazymem").requires_grad_()
        for t in (a, x):
            (t @ t.t()).tanh().sum().backward()
        assert torch.equal(x.grad.cpu(), a.grad)

    run_in_threads(run, 4)
