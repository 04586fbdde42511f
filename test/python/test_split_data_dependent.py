"""Data-dependent ops in the middle of a split step (batch_split_theory.md §3.8, rule 28): nonzero,
masked_select and boolean-mask indexing of a pending batch-sharded value run where the value is
computed, chunk by chunk, their pieces concatenated in row order (nonzero's leading index offset by
the chunk's first row); the rest of the step stays pending."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from splitting import B

import torch_lazymem
from torch_lazymem.testing import (
    fail_allocation,
    force_chunks,
    injected_failures,
    memory_cap,
    simulated_device,
)


def data(step: int = 0):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(B, 6, 5, generator=g, dtype=torch.float64)
    labels = torch.randint(-1, 4, (B, 6), generator=g)  # -1: ignored positions
    return x, labels


def encoder():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 4)).double()


# Each pattern: (model output h [B, 6, 4], labels [B, 6]) -> a tuple of results. Masks come from the
# integer labels, so the selected positions are exact whatever the chunking.
PATTERNS = {
    "nonzero": lambda h, y: ((y >= 0).nonzero(),),
    "nonzero_of_computed": lambda h, y: (((y * 2 + 1) > 2).int().nonzero(),),
    "argwhere": lambda h, y: (torch.argwhere(y > 1),),
    "nonzero_as_tuple": lambda h, y: torch.nonzero(y == 0, as_tuple=True),
    "masked_select": lambda h, y: (torch.masked_select(h, (y >= 0).unsqueeze(-1).expand_as(h)),),
    "bool_index_rows": lambda h, y: (h[y[:, 0] >= 0],),
    "bool_index_tokens": lambda h, y: (h[y >= 0],),
    "bool_index_flat_tokens": lambda h, y: (h.flatten(0, 1)[y.flatten() >= 0],),
    "select_then_loss": lambda h, y: (F.cross_entropy(h[y >= 0], y[y >= 0]),),
}


@pytest.mark.parametrize("chunks", [2, 3, 8])
@pytest.mark.parametrize("name", list(PATTERNS))
def test_data_dependent_ops_of_batch_sharded_values_run_chunk_by_chunk(name, chunks):
    fn = PATTERNS[name]
    x, labels = data()
    model = encoder()
    ref = fn(model(x), labels)
    lazy = encoder().to("lazymem")
    torch_lazymem.reset_stats()
    with force_chunks(chunks):
        got = fn(lazy(x.to("lazymem")), labels.to("lazymem"))
        got = [t.cpu() for t in got]
        stats = torch_lazymem.stats()
    assert stats["splits"] >= 1 and stats["barriers"] == 0
    for a, b in zip(got, ref):
        assert a.dtype == b.dtype and a.shape == b.shape
        if a.is_floating_point():
            torch.testing.assert_close(a, b.detach())
        else:
            assert torch.equal(a, b)


@pytest.mark.parametrize("chunks", [2, 3, 8])
def test_training_on_the_selected_positions(chunks):
    """Loss on the positions whose label is not ignored (h[mask], labels[mask]): the forward's
    selection runs chunk by chunk, the backward's scatter of gradients into the masked positions
    runs whole; five SGD steps equal eager's."""
    model = encoder()
    lazy = encoder().to("lazymem")
    opt_e = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    opt_l = torch.optim.SGD(lazy.parameters(), lr=0.1, momentum=0.9)

    def step(m, opt, x, y):
        opt.zero_grad()
        h = m(x)
        keep = y >= 0
        loss = F.cross_entropy(h[keep], y[keep])
        loss.backward()
        opt.step()
        return loss

    with force_chunks(chunks):
        for s in range(5):
            x, y = data(s)
            want = step(model, opt_e, x, y).item()
            torch_lazymem.reset_stats()
            got = step(lazy, opt_l, x.to("lazymem"), y.to("lazymem")).item()
            assert torch_lazymem.stats()["splits"] >= 1
            torch.testing.assert_close(got, want)
    for p, q in zip(model.parameters(), lazy.parameters()):
        torch.testing.assert_close(q.detach().cpu(), p.detach())


def test_training_on_selected_rows_fits_where_eager_runs_out():
    """A wide MLP over 4096 rows trained on the rows whose label is not ignored: eager holds the
    hidden activations (32 MiB in float64) and runs out of a 24 MiB device. lazymem computes the
    output chunk by chunk keeping each chunk's selected rows (the activations are never stored),
    scatters the gradient back into the masked rows lazily, and splits the backward: same loss and
    gradients, peak within the capacity, no barrier."""
    n = 4096
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(64, 1024), nn.ReLU(), nn.Linear(1024, 10)).double()
    x = torch.randn(n, 64, dtype=torch.float64)
    y = torch.randint(-1, 10, (n,))
    capacity = 24 << 20

    def step(m, x, y):
        h = m(x)
        keep = y >= 0
        loss = F.cross_entropy(h[keep], y[keep])
        loss.backward()
        return loss

    with memory_cap(capacity), pytest.raises(torch.OutOfMemoryError):
        step(mlp, x, y)
    mlp.zero_grad()
    want = step(mlp, x, y).item()
    lazy = nn.Sequential(nn.Linear(64, 1024), nn.ReLU(), nn.Linear(1024, 10)).double()
    lazy.load_state_dict(mlp.state_dict())
    lazy.to("lazymem")
    with simulated_device(capacity):
        torch.lazymem.reset_peak_memory_stats()
        torch_lazymem.reset_stats()
        got = step(lazy, x.to("lazymem"), y.to("lazymem")).item()
        grads = [p.grad.cpu() for p in lazy.parameters()]
        stats = torch_lazymem.stats()
        peak = torch.lazymem.max_memory_allocated()
    torch.testing.assert_close(got, want)
    for g, p in zip(grads, mlp.parameters()):
        torch.testing.assert_close(g, p.grad)
    assert stats["splits"] >= 2 and stats["chunks"] >= 2 and stats["barriers"] == 0
    assert peak <= capacity


def test_a_masked_write_mid_step_leaves_the_step_pending():
    """h[mask] = v (index_put_ with a boolean mask) reads the mask now and records the write with
    the long indices eager's kernel derives from it: the model's nodes stay pending until the loss
    is read, and the step (a read-modify-write through a mask too) equals eager's."""
    x, labels = data()
    model, lazy = encoder(), encoder().to("lazymem")

    def step(m, x, y, probe=None):
        h = m(x) * 1.0
        h[y < 0] = 0.0
        if probe is not None:
            probe.append(torch_lazymem.stats()["nodes_executed"])
        h[:, 0][y[:, 0] > 2] += 1.0  # reads h's values: runs what computes them
        return F.cross_entropy(h.flatten(0, 1), y.clamp(min=0).flatten())

    want = step(model, x, labels)
    want.backward()
    torch.lazymem.synchronize()
    torch_lazymem.reset_stats()
    probe: list[int] = []
    with force_chunks(3):
        loss = step(lazy, x.to("lazymem"), labels.to("lazymem"), probe)
        loss.backward()
        got = loss.item()
        stats = torch_lazymem.stats()
    torch.testing.assert_close(got, want.item())
    for p, q in zip(model.parameters(), lazy.parameters()):
        torch.testing.assert_close(q.grad.cpu(), p.grad)
    # After the masked write: the labels' upload, the mask and its nonzero ran (3 nodes in each of
    # the 3 chunks, and the written value's fill); none of the model's nodes did (4 more per chunk).
    assert probe[0] <= 10, probe
    assert stats["splits"] >= 1


def test_a_mask_over_inner_dims_and_a_masked_write_through_it():
    """x[:, mask] reads with the long indices of nonzero(mask) (eager's own expansion); the write
    y[:, mask] = v is recorded with them and stays pending until read."""
    x, labels = data()
    xl = x.to("lazymem") * 2.0
    mask = torch.tensor([True, False, True, True, False, True])
    got = xl[:, mask.to("lazymem")]
    assert torch.equal(got.cpu(), (x * 2.0)[:, mask])
    y = torch.zeros(B, 6, 5, dtype=torch.float64)
    yl = y.to("lazymem")
    yl[:, mask.to("lazymem")] = got
    ran = torch_lazymem.stats()["nodes_executed"]
    y[:, mask] = (x * 2.0)[:, mask]
    assert torch.equal(yl.cpu(), y)
    assert torch_lazymem.stats()["nodes_executed"] > ran  # the write was pending until read


def test_an_allocation_failure_in_any_chunk_keeps_the_pieces_in_order():
    """Fails each allocation of the materialization that runs h[mask] in turn: retried chunks
    replace the pieces a failed attempt left, so every row appears once, in order."""
    x, labels = data()
    lazy = encoder().to("lazymem")
    xl, yl = x.to("lazymem"), labels.to("lazymem")
    with force_chunks(3):
        want = lazy(xl)[yl >= 0].cpu()
        fired = 0
        for n in range(1, 60):
            before = injected_failures()
            fail_allocation(n)
            got = lazy(xl)[yl >= 0].cpu()
            fired += injected_failures() > before
            # (a retried chunk runs smaller: other kernels' rounding, so within float64 tolerance)
            torch.testing.assert_close(got, want)
    assert fired >= 10


def test_real_values_still_take_the_eager_path():
    x, labels = data()
    xl = x.to("lazymem") * 1.0
    torch.lazymem.synchronize()
    torch_lazymem.reset_stats()
    assert torch.equal(xl[labels.to("lazymem") >= 0].cpu(), x[labels >= 0]) is True
    assert torch.equal(torch.nonzero(xl > 0).cpu(), torch.nonzero(x > 0))


def test_transformers_attention_mask_checks_leave_the_step_pending():
    """BERT's mask handling reads the attention mask mid-forward (whether it masks anything): that
    sync runs what the mask check needs and keeps the batch-sharded embedding work pending, so the
    rest of the step still runs in one chunk loop with the loss."""
    pytest.importorskip("transformers")
    import test_split_models as sm

    @sm.quiet
    def run():
        torch.manual_seed(0)
        model = sm.bert().double()
        lazy = type(model)(model.config).double()
        lazy.load_state_dict(model.state_dict())
        lazy.to("lazymem")
        batch = sm.bert_batch(0)
        want = model(**batch).loss.item()
        torch_lazymem.reset_stats()
        with force_chunks(3):
            out = lazy(**{k: v.to("lazymem") for k, v in batch.items()})
            mid = torch_lazymem.stats()
            got = out.loss.item()
        return want, got, mid

    want, got, mid = run()
    assert mid["materializations"] >= 1  # the mask check
    assert mid["nodes_kept_pending"] > 0  # ...left the embeddings pending
    torch.testing.assert_close(got, want)


def test_an_empty_batch_gives_eagers_empty_results():
    x = torch.randn(0, 4, dtype=torch.float64)
    xl = x.to("lazymem") * 2.0
    assert torch.equal(xl.nonzero().cpu(), (x * 2.0).nonzero())
    got = xl[xl[:, 0] > 0].cpu()
    assert got.shape == (0, 4) and got.dtype == x.dtype
    assert torch.masked_select(xl, xl > 0).cpu().shape == (0,)


def test_a_channels_last_selection_keeps_the_kernels_layout():
    x = torch.randn(B, 3, 4, 5, dtype=torch.float64).contiguous(memory_format=torch.channels_last)
    keep = torch.arange(B) % 2 == 0
    want = (x * 2.0)[keep]
    for chunks in (None, 3):
        with force_chunks(chunks) if chunks else torch.no_grad():
            got = ((x.to("lazymem") * 2.0)[keep.to("lazymem")]).cpu()
        assert torch.equal(got, want)
