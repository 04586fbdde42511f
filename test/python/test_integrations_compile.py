"""torch.compile on lazymem with the default backend (torch_lazymem/integrations/compile.py): a graph
with lazymem inputs compiles through AOT autograd with no-op compilers (no Inductor code generation)
and its ops are recorded onto lazymem. Training steps (forward, backward, optimizer step) equal the
same with backend="aot_eager" bitwise and eager CPU at assert_close defaults; a split run (forced
chunks on a simulated device) equals eager in float64."""

from __future__ import annotations

import copy
import subprocess
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import torch_lazymem
from torch_lazymem import integrations
from torch_lazymem.integrations.compile import on_lazymem
from torch_lazymem.testing import force_chunks, simulated_device

D = torch.float64
LZ = "lazymem"
DEFAULT = "default"  # torch.compile(model) with no backend argument: Inductor


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test compiles from scratch (no graph of another test reused) and leaves nothing cached."""
    import torch._dynamo

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    yield
    torch._dynamo.reset()
    integrations.enable()


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 5))


class Block(nn.Module):
    """A pre-norm transformer block: causal multi-head self-attention (the mask built inside the graph,
    on the input's device), a GELU MLP, residuals; a linear head."""

    def __init__(self, d: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
        self.head = nn.Linear(d, 7)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        mask = torch.triu(torch.ones(t, t, dtype=torch.bool, device=x.device), 1)
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        x = x + self.mlp(self.ln2(x))
        return self.head(x)


def mlp_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(9, 12, generator=g, dtype=D), torch.randint(0, 5, (9,), generator=g)


def block_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(6, 5, 16, generator=g, dtype=D), torch.randint(0, 7, (6, 5), generator=g)


def mlp_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out, y)


def block_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.flatten(0, 1), y.flatten())


CASES = {
    "mlp_sgd": (mlp, mlp_batch, mlp_loss, lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)),
    "block_adamw": (Block, block_batch, block_loss, lambda p: torch.optim.AdamW(p, lr=1e-2)),
}


def train(model: nn.Module, batch, loss_fn, make_opt, backend: str | None, dev: str, steps: int = 3):
    """`steps` training steps of a copy of `model` on `dev`, its forward compiled with `backend`
    (DEFAULT: torch.compile's default) or eager (None). Returns the losses, the trained model and its
    optimizer."""
    model = copy.deepcopy(model).to(dev)
    if backend is None:
        run = model
    elif backend == DEFAULT:
        run = torch.compile(model)
    else:
        run = torch.compile(model, backend=backend)
    opt = make_opt(model.parameters())
    losses = []
    for step in range(steps):
        x, y = batch(step)
        loss = loss_fn(run(x.to(dev)), y.to(dev))
        assert loss.device.type == dev
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())  # a sync point each step, as a training loop that logs its loss
    return torch.tensor(losses, dtype=D), model, opt


def state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every parameter, gradient and tensor of optimizer state, on the CPU."""
    out = {}
    for name, p in model.named_parameters():
        out[name] = p.detach().cpu()
        out[name + ".grad"] = p.grad.cpu()
        for key, v in opt.state[p].items():
            if isinstance(v, torch.Tensor):
                out[f"{name}.{key}"] = v.cpu()
    return out


def assert_bitwise_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), f"{k} differs"


@pytest.mark.parametrize("name", list(CASES))
def test_default_backend_equals_aot_eager_and_eager(name):
    make, batch, loss_fn, make_opt = CASES[name]
    torch.manual_seed(0)
    model = make().to(D)
    counters = torch._dynamo.utils.counters

    losses, m, opt = train(model, batch, loss_fn, make_opt, DEFAULT, LZ)
    # compiled (frames captured, AOT autograd ran), but Inductor never compiled a graph
    assert counters["stats"]["unique_graphs"] >= 1 and counters["aot_autograd"]["ok"] >= 1
    assert not counters["inductor"], dict(counters["inductor"])
    assert all(p.device.type == LZ for p in m.parameters())
    default = state(m, opt)

    torch._dynamo.reset()
    losses_aot, m_aot, opt_aot = train(model, batch, loss_fn, make_opt, "aot_eager", LZ)
    assert torch.equal(losses, losses_aot), (losses, losses_aot)
    assert_bitwise_equal(default, state(m_aot, opt_aot))

    losses_eager, m_eager, opt_eager = train(model, batch, loss_fn, make_opt, None, "cpu")
    torch.testing.assert_close(losses, losses_eager)
    eager = state(m_eager, opt_eager)
    for k in eager:
        torch.testing.assert_close(default[k], eager[k], msg=lambda msg, k=k: f"{k}: {msg}")


def test_split_run_equals_eager():
    """The compiled block under a simulated device with every materialization split in 3 chunks."""
    make, batch, loss_fn, make_opt = CASES["block_adamw"]
    torch.manual_seed(0)
    model = make().to(D)
    losses_eager, m_eager, opt_eager = train(model, batch, loss_fn, make_opt, None, "cpu")
    torch_lazymem.reset_stats()
    with simulated_device("64MiB"), force_chunks(3):
        losses, m, opt = train(model, batch, loss_fn, make_opt, DEFAULT, LZ)
        split = state(m, opt)
    stats = torch_lazymem.stats()
    assert stats["splits"] >= 3 and stats["chunks"] == 3, stats  # each step's materialization split
    torch.testing.assert_close(losses, losses_eager)
    eager = state(m_eager, opt_eager)
    for k in eager:
        torch.testing.assert_close(split[k], eager[k], msg=lambda msg, k=k: f"{k}: {msg}")


def test_factory_only_graph_is_recorded():
    """A graph without lazymem inputs that creates lazymem tensors also goes to AOT autograd."""
    f = torch.compile(lambda n: torch.arange(n * 2, device=LZ, dtype=D).view(2, n).cumsum(1) * 2)
    out = f(3)
    assert out.device.type == LZ
    assert torch.equal(out.cpu(), torch.arange(6, dtype=D).view(2, 3).cumsum(1) * 2)
    assert not torch._dynamo.utils.counters["inductor"]


def test_graph_routing():
    """on_lazymem() sends graphs that touch lazymem to AOT autograd, any other graph to Inductor."""
    seen = []

    def record(gm, example_inputs):
        seen.append(on_lazymem(gm, example_inputs))
        return gm.forward

    f = torch.compile(lambda x: (x * 2).sin(), backend=record)
    x = torch.randn(4, dtype=D)
    f(x)
    f(x.to(LZ))
    assert seen == [False, True]


def test_disabled_integrations_leave_inductor_alone():
    """With the integrations off the default backend is Inductor's as in torch: it has no code
    generation for lazymem and fails naming the device. In a fresh process: Inductor's failure leaves
    torch._dynamo's PEP 523 frame evaluator installed, and with it CPython 3.11 keeps a call's
    arguments alive until the call returns (a tensor passed to a function and rebound there is no
    longer freed), which changed the memory of later tests in the worker."""
    code = """
import pytest, torch, torch_lazymem
from torch_lazymem import integrations
D, LZ = torch.float64, "lazymem"
integrations.disable()
f = torch.compile(lambda x: x * 2 + 1)
with pytest.raises(Exception, match="lazymem"):
    f(torch.ones(3, dtype=D, device=LZ))
integrations.enable()
torch._dynamo.reset()
assert torch.equal(f(torch.ones(3, dtype=D, device=LZ)).cpu(), torch.full((3,), 3.0, dtype=D))
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]
