"""Modules on lazymem: parameter identity, tied weights, buffers, state dicts, deepcopy, moving back."""

from __future__ import annotations

import copy
import io

import torch
import torch.nn as nn


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.bn = nn.BatchNorm1d(4)
        self.out = nn.Linear(4, 10, bias=False)
        self.out.weight = self.emb.weight  # tied input/output embedding

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(self.bn(self.emb(ids)))


def test_to_lazymem_keeps_parameter_identity_and_ties():
    m = Tied()
    params = list(m.parameters())
    m.to("lazymem")
    assert list(m.parameters()) == params and all(type(p) is nn.Parameter for p in params)
    assert m.out.weight is m.emb.weight
    assert all(p.device.type == "lazymem" for p in m.parameters())
    assert all(b.device.type == "lazymem" for b in m.buffers())
    m.lazymem()
    m.to(device="lazymem", dtype=torch.float64)
    assert m.emb.weight.dtype == torch.float64 and m.out.weight is m.emb.weight


def test_to_cpu_brings_everything_back():
    torch.manual_seed(0)
    ref = Tied()
    m = copy.deepcopy(ref).to("lazymem")
    with torch.no_grad():
        m.emb.weight.mul_(2)
        ref.emb.weight.mul_(2)
    m.to("cpu")
    assert all(p.device.type == "cpu" for p in m.parameters())
    for p, q in zip(ref.parameters(), m.parameters()):
        assert torch.equal(p, q)


def test_optimizer_built_before_to_keeps_working():
    torch.manual_seed(0)
    m = nn.Linear(4, 2)
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    m.to("lazymem")
    loss = m(torch.randn(3, 4, device="lazymem")).sum()
    loss.backward()
    opt.step()
    assert opt.param_groups[0]["params"][0] is m.weight
    assert opt.state[m.weight]["momentum_buffer"].device.type == "lazymem"


def test_state_dict_save_load_and_deepcopy():
    torch.manual_seed(0)
    m = Tied().to("lazymem")
    m(torch.randint(0, 10, (6,), device="lazymem")).sum().backward()  # BN running stats change
    f = io.BytesIO()
    torch.save(m.state_dict(), f)
    f.seek(0)
    sd = torch.load(f, map_location="lazymem")
    m2 = Tied().to("lazymem")
    m2.load_state_dict(sd)
    m3 = copy.deepcopy(m)
    assert m3.out.weight is m3.emb.weight and m3.emb.weight is not m.emb.weight
    for other in (m2, m3):
        for (k, v), (k2, v2) in zip(m.state_dict().items(), other.state_dict().items()):
            assert k == k2 and v2.device.type == "lazymem" and torch.equal(v.cpu(), v2.cpu())
    cpu = Tied()
    cpu.load_state_dict({k: v.cpu() for k, v in m.state_dict().items()})
    m4 = Tied()
    m4.load_state_dict(torch.load(io.BytesIO(f.getvalue()), map_location="cpu"))
    for v, w in zip(cpu.state_dict().values(), m4.state_dict().values()):
        assert torch.equal(v, w)
