"""torch.save / torch.load round trips through the storage path."""

from __future__ import annotations

import io

import torch
from conftest import assert_bitwise


def roundtrip(obj, **kw):
    f = io.BytesIO()
    torch.save(obj, f)
    f.seek(0)
    return torch.load(f, **kw)


def test_save_load_lazymem_tensors():
    torch.manual_seed(0)
    a = torch.randn(3, 4)
    z = a.to("lazymem") * 2
    d = roundtrip({"z": z, "n": 3}, map_location="lazymem")
    assert d["n"] == 3
    assert_bitwise(d["z"], a * 2)
    cpu = roundtrip({"z": z})  # saved from lazymem: loads back onto lazymem by default
    assert cpu["z"].device.type == "lazymem"
    plain = roundtrip({"z": z}, map_location="cpu")
    assert plain["z"].device.type == "cpu" and torch.equal(plain["z"], a * 2)


def test_load_cpu_checkpoint_onto_lazymem():
    a = torch.arange(12.0).reshape(3, 4)
    d = roundtrip({"w": a}, map_location="lazymem")
    assert_bitwise(d["w"], a)


def test_views_keep_sharing_their_storage():
    a = torch.arange(10.0)
    x = a.to("lazymem")
    d = roundtrip({"base": x, "view": x[2:5]}, map_location="lazymem")
    d["view"].fill_(-1)
    a[2:5] = -1
    assert_bitwise(d["base"], a)


def test_module_state_dict_roundtrip():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3)).to("lazymem")
    sd = roundtrip(m.state_dict(), map_location="lazymem")
    m2 = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3)).to("lazymem")
    m2.load_state_dict(sd)
    for (k, v), (k2, v2) in zip(m.state_dict().items(), m2.state_dict().items()):
        assert k == k2 and torch.equal(v.cpu(), v2.cpu())
