"""Random ops under splitting draw exactly eager's numbers (DESIGN.md §7 RNG, issue 27): with the same
seed, a split program gives the unsplit program's results, so they never depend on the memory
budget. A random op whose values a chunk cannot draw by itself has its draw (eager's kernel on the
whole geometry eager gives it) generated once, in program order, in host memory; each chunk,
recomputation and retry reads its rows. Ops whose draws depend on their inputs' values (rejection
samplers, rrelu in training, multinomial with replacement) run whole. Every case is float64, checked
unsplit and under force_chunks 2/3/8 over 37 rows (ragged last chunks) against eager CPU — the values
a program computes from its draws (bitwise unsplit; split, at float64's assert_close tolerance, as a
chunk's matmul may take another BLAS path) and the generator's state after the program (the next
draw, bitwise) — and under a simulated device where eager runs out of memory."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from splitting import check_steps

import torch_lazymem
from torch_lazymem.testing import fail_allocation, force_chunks, memory_cap, simulated_device

D = torch.float64
B = 37  # 2, 3 and 8 chunks all leave a ragged last chunk
CHUNKS = (1, 2, 3, 8)


torch.manual_seed(11)
STEM = nn.Linear(12, 10).double()
GRU = nn.GRU(2, 3, batch_first=True).double()


def stem() -> nn.Module:
    return copy.deepcopy(STEM)


def data(*shape, seed=0, rand=False):
    """Host data from a generator of its own: the programs' device draws see the seeded stream."""
    g = torch.Generator().manual_seed(seed)
    return torch.rand(*shape, dtype=D, generator=g) if rand else torch.randn(*shape, dtype=D, generator=g)


# ---- layouts of the value a random op meets: (batch rows of x) -> h, the batch along h's dim 0 ----


def linear(x, m):
    return m(x)


def transposed(x, m):  # column-major storage (a transpose made contiguous, transposed back)
    return m(x).t().contiguous().t()


def sliced(x, m):  # a slice along the batch
    return m(x)[3:30]


def strided(x, m):  # every other row
    return m(x)[::2]


def conv(x, m):  # (B, C, H, W) through a convolution
    return F.conv2d(m(x).view(x.shape[0], 2, 5, 1).expand(-1, 2, 5, 3), torch.ones(3, 2, 2, 2, dtype=D, device=x.device))


def channels_last(x, m):
    y = m(x).view(x.shape[0], 2, 5, 1).expand(-1, 2, 5, 3).contiguous(memory_format=torch.channels_last)
    return y * 1  # pointwise on a channels-last input keeps it


def sequence(x, m):  # a GRU over (B, T, F): batch_first output
    return copy.deepcopy(GRU).to(x.device)(m(x).view(x.shape[0], 5, 2))[0]


LAYOUTS = {f.__name__: f for f in (linear, transposed, sliced, strided, conv, channels_last, sequence)}

# ---- random ops: h -> a value computed row by row from h and the draws ----

OPS = {
    "randn_like": lambda h: h + torch.randn_like(h),
    "rand_like": lambda h: h * torch.rand_like(h),
    "randint_like": lambda h: h + torch.randint_like(h, 7),
    "randn(B, ...)": lambda h: h + torch.randn(h.shape, dtype=D, device=h.device),
    "rand(B, ...)": lambda h: h * torch.rand(h.shape, dtype=D, device=h.device),
    "randint(B, ...)": lambda h: h + torch.randint(0, 9, h.shape, device=h.device),
    "bernoulli(p)": lambda h: h * torch.bernoulli(h.sigmoid()),
    "bernoulli(p float32)": lambda h: h * torch.bernoulli(h.sigmoid().float()),
    "bernoulli(x, 0.3)": lambda h: h * torch.bernoulli(h, 0.3),
    "bernoulli_(0.3)": lambda h: h * torch.empty_like(h).bernoulli_(0.3),
    "bernoulli_(p)": lambda h: h * torch.empty_like(h).bernoulli_(h.sigmoid()),
    "bernoulli_(p broadcast)": lambda h: h * torch.empty_like(h).bernoulli_(torch.full(h.shape[1:], 0.4, dtype=D, device=h.device)),
    "normal(mean, 0.5)": lambda h: h * torch.normal(h, 0.5),
    "normal(0.5, std)": lambda h: h * torch.normal(0.5, h.abs()),
    "normal(mean, std)": lambda h: h * torch.normal(h, h.abs() + 0.1),
    "uniform_": lambda h: h * h.clone().uniform_(-2, 3),
    "normal_": lambda h: h * h.clone().normal_(1, 2),
    "exponential_": lambda h: h * h.clone().exponential_(),
    "geometric_": lambda h: h * h.clone().geometric_(0.3),
    "log_normal_": lambda h: h * h.clone().log_normal_(),
    "cauchy_": lambda h: h * h.clone().cauchy_(),
    "random_": lambda h: h * h.clone().random_(0, 10),
    "normal_ of a column": lambda h: h * torch.zeros_like(h).select(1, 1).normal_().unsqueeze(1),
    "dropout": lambda h: F.dropout(h, 0.3) * h,
    "alpha_dropout": lambda h: F.alpha_dropout(h, 0.3, True) * h,
    "native_dropout": lambda h: torch.native_dropout(h, 0.3, True)[0] * torch.native_dropout(h, 0.6, True)[1],
    "dropout p=1": lambda h: F.dropout(h, 1.0) + h,
    "multinomial": lambda h: torch.multinomial(h.flatten(1).softmax(-1), 1).to(D) + h.flatten(1)[:, :1],
    "multinomial 3": lambda h: torch.multinomial(h.flatten(1).softmax(-1), 3).to(D) * h.flatten(1)[:, :1],
    # Their draws depend on their inputs' values: they run whole.
    "multinomial with replacement": lambda h: torch.multinomial(h.flatten(1).softmax(-1), 4, replacement=True).to(D)
    + h.flatten(1)[:, :1],
    "rrelu": lambda h: F.rrelu(h, training=True) * 2,
    "poisson": lambda h: torch.poisson(h.abs()) + h,
}
WHOLE = {"multinomial with replacement", "rrelu", "poisson"}
NO_DRAWS = {"dropout p=1"}  # x * 0: nothing drawn


def program(op, layout, dev, grad):
    """The op over the layout's value, then the next draw of the generator (it saw the same draws).
    With grad, autograd saves some draws for backward: those values outlive the plan and are
    computed whole; without, every draw read only row by row is drawn in the chunk loop."""
    x = data(B, 12, seed=5)
    with torch.set_grad_enabled(grad):
        h = layout(x.to(dev), stem().to(dev))
        torch.manual_seed(5)
        y = op(h)
    after = torch.rand(4, dtype=D, device=dev)
    return y.detach().cpu(), after.cpu()


def check_eager(op_name, layout_name, chunks=CHUNKS, grad=True):
    op, layout = OPS[op_name], LAYOUTS[layout_name]
    expected = program(op, layout, "cpu", grad)
    for n in chunks:
        torch.lazymem.synchronize()
        torch_lazymem.reset_stats()
        with force_chunks(n):
            got = program(op, layout, "lazymem", grad)
        stats, text = torch_lazymem.stats(), torch_lazymem.explain(print_it=False)
        assert stats["random_row_keyed"] == 0, text
        if n > 1:
            assert stats["splits"] >= 1, text
        for g, e, what in zip(got, expected, ("values", "next draw")):
            assert g.dtype == e.dtype and g.shape == e.shape, (what, n, g.shape, e.shape)
            msg = f"{op_name} over {layout_name}, {n} chunks: {what} differ\n{text}"
            if n == 1 or what == "next draw":
                assert torch.equal(g, e), msg
            else:
                # The stem's matmul over a chunk's rows may take another BLAS path than over all 37
                # (MKL's float64 kernels for a 2-row ragged chunk differ from eager's in the last bit on
                # some machines): split values are eager's at assert_close's float64 tolerance, which a
                # single draw that differed would break by orders of magnitude.
                torch.testing.assert_close(g, e, msg=msg)
    return stats


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
@pytest.mark.parametrize("op_name", list(OPS))
def test_every_random_op_draws_eager_numbers_in_any_chunking(op_name, grad):
    stats = check_eager(op_name, "linear", grad=grad)
    if op_name in WHOLE:
        assert stats["barriers"] >= 1 and stats["random_streams"] == 0
    elif not grad and op_name not in NO_DRAWS:
        assert stats["random_streams"] >= 1  # drawn whole once, read by rows in the chunk loop


LAYOUT_OPS = ["randn_like", "bernoulli(p)", "bernoulli_(p)", "normal(mean, std)", "uniform_", "dropout",
              "native_dropout", "multinomial", "rrelu"]


@pytest.mark.parametrize("layout_name", [n for n in LAYOUTS if n != "linear"])
@pytest.mark.parametrize("op_name", LAYOUT_OPS)
def test_random_ops_over_every_layout(op_name, layout_name):
    if op_name.startswith("multinomial") and layout_name == "sequence":
        pytest.skip("multinomial reads (rows, categories): a flatten of the sequence is the same as linear's")
    check_eager(op_name, layout_name, chunks=(1, 3))


def test_the_issue_repro_gives_eager_numbers_whatever_the_budget():
    """Issue 27's report: mu + randn_like(mu), squared and summed, split in 3 and 8 chunks."""
    torch.manual_seed(0)
    x = torch.randn(4096, 32, dtype=D)
    lin = torch.nn.Linear(32, 16).double()

    def f(dev):
        torch.manual_seed(7)
        mu = lin.to(dev)(x.to(dev))
        z = mu + torch.randn_like(mu)
        return z.pow(2).sum().item()

    expected = f("cpu")
    assert f("lazymem") == expected
    for n in (3, 8):
        with force_chunks(n):
            assert f("lazymem") == pytest.approx(expected, rel=1e-13)
        assert torch_lazymem.stats()["random_streams"] >= 1


def vae_step(dev, model, opt, step):
    """A VAE's reparameterization and dropout in the decoder: every draw inside the chunk loop."""
    x = data(96, 20, seed=step, rand=True).to(dev)
    enc, dec = model
    mu, logvar = enc(x).chunk(2, dim=1)
    z = mu + torch.randn_like(mu) * (0.5 * logvar).exp()
    recon = torch.sigmoid(dec(F.dropout(z, 0.2)))
    loss = F.binary_cross_entropy(recon, x, reduction="sum") - 0.5 * (1 + logvar - mu.pow(2) - logvar.exp()).sum()
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss


def vae(dev):
    torch.manual_seed(3)
    model = (nn.Linear(20, 16).double().to(dev), nn.Linear(8, 20).double().to(dev))
    opt = torch.optim.Adam([p for m in model for p in m.parameters()], lr=1e-2)
    torch.manual_seed(4)
    losses = [vae_step(dev, model, opt, step).item() for step in range(3)]
    return losses, [p.detach().cpu() for m in model for p in m.parameters()]


def test_vae_training_steps_equal_eager_in_any_chunking_and_each_step_reuses_its_plan():
    expected_losses, expected_params = vae("cpu")
    for n in (2, 3, 8):
        torch_lazymem.reset_stats()
        with force_chunks(n):
            losses, params = vae("lazymem")
        torch.testing.assert_close(losses, expected_losses, rtol=1e-12, atol=0)
        for g, e in zip(params, expected_params):
            torch.testing.assert_close(g, e)
        assert torch_lazymem.stats()["random_streams"] >= 6


def diffusion_step(dev, net, opt, x0):
    """A denoising step: timesteps and noise drawn per sample, the noise predicted."""
    t = torch.randint(0, 50, (x0.shape[0],), device=dev)
    noise = torch.randn_like(x0)
    alpha = (1 - t.to(D) / 50).view(-1, 1)
    xt = alpha.sqrt() * x0 + (1 - alpha).sqrt() * noise
    loss = F.mse_loss(net(torch.cat([xt, alpha], dim=1)), noise)
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss  # read once the step's locals are gone: the draws are then read only row by row


def test_diffusion_training_under_a_cap_where_eager_runs_out_of_memory():
    rows, width = 3000, 64

    def run(dev):
        torch.manual_seed(1)
        net = nn.Sequential(nn.Linear(width + 1, 256), nn.SiLU(), nn.Linear(256, width)).double().to(dev)
        opt = torch.optim.SGD(net.parameters(), lr=0.05)
        x0 = torch.randn(rows, width, dtype=D).to(dev)
        torch.manual_seed(2)
        losses = [diffusion_step(dev, net, opt, x0).item() for _ in range(2)]
        return [losses, *(p.detach().cpu() for p in net.parameters())]

    check_steps(run, cap_of=lambda peak: 6 << 20)
    assert torch_lazymem.stats()["random_streams"] >= 2


def dropout_net(dev, p=0.3):
    torch.manual_seed(21)
    model = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Dropout(p), nn.Linear(128, 128), nn.ReLU(),
                          nn.Dropout(p), nn.Linear(128, 10)).double().to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    torch.manual_seed(22)
    x, y = data(1500, 32).to(dev), torch.randint(0, 10, (1500,), generator=torch.Generator().manual_seed(1)).to(dev)
    losses = []
    for _ in range(2):
        loss = F.cross_entropy(model(x), y)
        losses.append(loss.item())  # read before backward: the forward runs again with the backward
        opt.zero_grad()
        loss.backward()
        opt.step()
    return losses, [p.detach().cpu() for p in model.parameters()]


def test_dropout_training_under_a_cap_equals_eager_and_the_loss_read_first_belongs_to_the_same_masks():
    cap = 4 << 20
    with memory_cap(cap), pytest.raises(torch.OutOfMemoryError):
        dropout_net("cpu")
    expected = dropout_net("cpu")
    with simulated_device(cap):
        torch.lazymem.reset_peak_memory_stats()
        got = dropout_net("lazymem")
        assert torch.lazymem.max_memory_allocated() <= cap
    torch.testing.assert_close(got[0], expected[0])
    for g, e in zip(got[1], expected[1]):
        torch.testing.assert_close(g, e)


def test_a_pending_random_op_reads_the_same_draws_when_recomputed_in_a_later_plan():
    torch.manual_seed(0)
    x = torch.randn(12, 64, dtype=D)
    w = torch.randn(64, 64, dtype=D)

    def run(dev, chunks):
        torch.manual_seed(9)
        wl = w.to(dev).requires_grad_()
        torch_lazymem.mark_batch(wl, None) if dev == "lazymem" else None
        with force_chunks(chunks):
            h = F.dropout(x.to(dev) @ wl, 0.5)  # survives: left pending when split
            total = h.sum().item()
            later = torch.rand(3, dtype=D, device=dev)  # drawn after h's mask
            again = h.cpu()  # h's forward runs again (another plan, other chunks)
            (grad,) = torch.autograd.grad(h.sum(), wl)
        return total, again, later.cpu(), grad.cpu()

    expected = run("cpu", 1)
    for n in (3, 4):
        torch_lazymem.reset_stats()
        got = run("lazymem", n)
        assert torch_lazymem.stats()["nodes_kept_pending"] > 0
        assert got[0] == pytest.approx(expected[0], rel=1e-12)
        for g, e in zip(got[1:], expected[1:]):
            torch.testing.assert_close(g, e, rtol=1e-12, atol=1e-12)


def test_random_ops_run_whole_between_split_ones_keep_program_order():
    """A random op on a replicated value (drawn whole) between two drawn in the chunk loop."""

    def run(dev):
        h = stem().to(dev)(data(B, 12).to(dev))
        torch.manual_seed(31)
        a = torch.randn_like(h) * h
        scale = torch.rand(10, dtype=D, device=dev)  # replicated: runs whole, in its turn
        b = F.dropout(a, 0.5) * scale
        c = torch.bernoulli(b.sigmoid()) + torch.randn(3, dtype=D, device=dev).sum()
        return [v.cpu() for v in (a, b, c, torch.rand(2, dtype=D, device=dev))]

    expected = run("cpu")
    for n in (2, 3, 8):
        with force_chunks(n):
            got = run("lazymem")
        for g, e in zip(got[:3], expected[:3]):  # (a chunk's matmul: another BLAS path, see check_eager)
            torch.testing.assert_close(g, e, msg=f"{n} chunks")
        assert torch.equal(got[3], expected[3]), n  # the next draw


def test_an_out_of_memory_retry_reads_the_same_draws():
    """Every allocation of a split dropout step failed in turn: each run retries and gives eager's."""

    def run(dev):
        torch.manual_seed(41)
        lin = nn.Linear(16, 16).double().to(dev)
        x = data(64, 16).to(dev)
        torch.manual_seed(42)
        y = F.dropout(lin(x), 0.4) + torch.randn(64, 16, dtype=D, device=dev)
        loss = y.square().sum()
        loss.backward()
        return [loss.detach().cpu(), lin.weight.grad.cpu(), torch.rand(2, dtype=D, device=dev).cpu()]

    expected = run("cpu")
    fired = 0
    for k in range(1, 40, 3):
        torch.lazymem.synchronize()
        with force_chunks(4):
            fail_allocation(k)
            got = run("lazymem")
            fired += torch_lazymem.testing.injected_failures()
        for g, e in zip(got, expected):
            torch.testing.assert_close(g, e)
    assert fired > 0


def test_a_seeded_generator_argument_draws_its_own_stream_in_order():
    def run(dev):
        g = torch.Generator(device=dev).manual_seed(77)
        h = stem().to(dev)(data(B, 12).to(dev))
        torch.manual_seed(1)
        a = h + torch.randn(h.shape, generator=g, dtype=D, device=dev)
        b = a * torch.rand_like(a)  # the default generator
        c = b + torch.empty_like(b).normal_(generator=g)
        return [v.cpu() for v in (a, b, c)]

    expected = run("cpu")
    with force_chunks(3):
        got = run("lazymem")
    for g, e in zip(got, expected):
        assert torch.equal(g, e)


def test_explain_says_where_the_draws_come_from():
    with force_chunks(3):
        h = stem().to("lazymem")(data(B, 12).to("lazymem"))
        (h * torch.bernoulli(h.sigmoid())).sum().item()
    text = torch_lazymem.explain(print_it=False)
    assert "random ops in loops drawing eager's numbers: 1" in text, text
    stats = torch_lazymem.stats()
    assert stats["random_streams"] == 1 and stats["random_stream_bytes"] == B * 10 * 8, stats


def test_a_random_op_left_pending_has_drawn_before_a_later_manual_seed():
    """A split that leaves a dropout pending (its output survives, recomputed when read) takes its
    draws when the plan runs, as eager took them when it was called: reseeding afterwards, or drawing
    again, does not change its mask, and the later draws are eager's."""

    def run(dev):
        h = stem().to(dev)(data(B, 12).to(dev))
        torch.manual_seed(8)
        d = F.dropout(h, 0.5)
        total = (d * 2).sum().item()
        torch.manual_seed(3)
        r = torch.rand(5, dtype=D, device=dev)
        return total, d.detach().cpu(), r.cpu()

    expected = run("cpu")
    for n in (2, 3):
        torch_lazymem.reset_stats()
        with force_chunks(n):
            got = run("lazymem")
        assert torch_lazymem.stats()["nodes_kept_pending"] > 0
        assert got[0] == pytest.approx(expected[0], rel=1e-12)
        assert torch.equal(got[1], expected[1]) and torch.equal(got[2], expected[2])


CAPPED_OPS = ["randn_like", "bernoulli(p)", "bernoulli_(0.3)", "normal(mean, std)", "uniform_", "dropout",
              "native_dropout", "multinomial", "multinomial 3", "poisson"]


@pytest.mark.parametrize("op_name", CAPPED_OPS)
def test_under_a_cap_where_eager_runs_out_of_memory_the_draws_are_eager(op_name):
    """4,000 rows of 64 features in float64 under 3 MiB: eager holds the input, its activation, the
    draws and their result at once and runs out of memory; lazymem splits, and each row's result is
    bitwise the uncapped eager run's (the row sums are per row: no reassociation)."""
    rows, width = 4000, 64
    lin = nn.Linear(width, width).double()
    w = data(width, seed=3)

    def rows_out(dev):  # (its intermediates die with it: only the row sums are read)
        with torch.no_grad():
            y = OPS[op_name](copy.deepcopy(lin).to(dev)(data(rows, width, seed=4).to(dev)))
            return (y * w.to(dev)[: y.shape[1]]).sum(1)

    def run(dev):
        torch.manual_seed(6)
        out = rows_out(dev)
        return out.cpu(), torch.rand(3, dtype=D, device=dev).cpu()

    cap = (5 if op_name in WHOLE else 3) << 20  # (poisson runs whole: its input and result held at once)
    with memory_cap(cap), pytest.raises(torch.OutOfMemoryError):
        run("cpu")
    expected = run("cpu")
    torch.lazymem.synchronize()
    torch_lazymem.reset_stats()
    with simulated_device(cap):
        torch.lazymem.reset_peak_memory_stats()
        got = run("lazymem")
        peak = torch.lazymem.max_memory_allocated()
    stats = torch_lazymem.stats()
    assert peak <= cap and stats["splits"] >= 1, (peak, torch_lazymem.explain(print_it=False))
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
