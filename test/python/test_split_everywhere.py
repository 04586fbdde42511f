"""Ordinary programs split (issue 20): the batch solved for, kept across syncs, and no common idiom
that blocks a split. Each test is a program a user writes without thinking twice, run in float64:
split (force_chunks 2, 3 and 8 over a batch that leaves a ragged last chunk) equal to eager, and
under a simulated device at a fraction of eager's peak, eager out of memory while lazymem finishes
within the capacity with eager's results."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import torch_lazymem
from torch_lazymem.testing import force_chunks, memory_cap, simulated_device

D = torch.float64


def mlp(i: int, h: int, o: int) -> nn.Module:
    return nn.Sequential(nn.Linear(i, h), nn.ReLU(), nn.Linear(h, h), nn.ReLU(), nn.Linear(h, o)).double()


def results(values) -> list[torch.Tensor]:
    out = []
    for v in values:
        if isinstance(v, nn.Module):
            out += [p.detach().cpu() for p in v.parameters()]
            out += [b.cpu() for b in v.buffers()]
        elif isinstance(v, torch.Tensor):
            out.append(v.detach().cpu())
        else:
            out.append(torch.tensor(v, dtype=D))
    return out


def check_split(run, chunks=(2, 3, 8), expect_split=True) -> list[dict]:
    """run(dev) -> values (tensors, modules, floats); lazymem split in `chunks` equals eager."""
    torch.manual_seed(0)
    expected = results(run("cpu"))
    all_stats = []
    for n in chunks:
        torch.lazymem.synchronize()
        torch_lazymem.reset_stats()
        with force_chunks(n):
            torch.manual_seed(0)
            got = results(run("lazymem"))
            torch.lazymem.synchronize()
        stats = torch_lazymem.stats()
        all_stats.append(stats)
        for k, (g, e) in enumerate(zip(got, expected)):
            torch.testing.assert_close(g, e, msg=lambda m, k=k, n=n: f"value {k} at {n} chunks: {m}")
        if expect_split:
            assert stats["splits"] >= 1, (n, torch_lazymem.explain(print_it=False))
    return all_stats


def check_capped(run, cap: int) -> tuple[dict, str]:
    """Eager runs out of memory under `cap`; lazymem on a simulated device of `cap` finishes with
    eager's results (uncapped), its measured peak within the capacity."""
    with memory_cap(cap), pytest.raises(torch.OutOfMemoryError):
        torch.manual_seed(0)
        run("cpu")
    torch.manual_seed(0)
    expected = results(run("cpu"))
    torch.lazymem.synchronize()
    torch_lazymem.reset_stats()
    with simulated_device(cap):
        torch.lazymem.reset_peak_memory_stats()
        torch.manual_seed(0)
        got = results(run("lazymem"))
        torch.lazymem.synchronize()
        peak = torch.lazymem.max_memory_allocated()
    stats, text = torch_lazymem.stats(), torch_lazymem.explain(print_it=False)
    assert peak <= cap, (peak, cap, text)
    assert stats["splits"] >= 1, text
    for k, (g, e) in enumerate(zip(got, expected)):
        torch.testing.assert_close(g, e, msg=lambda m, k=k: f"value {k}: {m}")
    return stats, text


def sgd_step(models, loss_fn, lr=0.1):
    params = [p for m in models for p in m.parameters()]
    opt = torch.optim.SGD(params, lr=lr)
    loss = loss_fn()
    loss.backward()
    opt.step()
    return loss.item()


MiB = 1 << 20

# ---- 2. uploads that carry no batch ----


def class_weights_program(B, C, hidden=32):
    torch.manual_seed(1)
    x, y, w = torch.randn(B, 16, dtype=D), torch.randint(0, C, (B,)), torch.rand(C, dtype=D) + 0.5
    model = mlp(16, hidden, C)

    def run(dev):
        m = copy.deepcopy(model).to(dev)
        loss = sgd_step([m], lambda: F.cross_entropy(m(x.to(dev)), y.to(dev), weight=w.to(dev)))
        return [loss, m]
    return run


@pytest.mark.parametrize("C", [5, 10], ids=["5_classes", "as_many_classes_as_rows"])
def test_class_weights_end_unsharded(C):
    stats = check_split(class_weights_program(10, C))
    assert all(s["barriers"] == 0 for s in stats)
    text = torch_lazymem.explain(print_it=False)
    assert "not a batch" in text, text


def test_class_weights_under_a_cap():
    _, text = check_capped(class_weights_program(1500, 10, hidden=256), 3 * MiB)
    assert "not a batch" in text


def weight_matrix_program(B, k, n):
    torch.manual_seed(2)
    x, w = torch.randn(B, k, dtype=D), torch.randn(k, n, dtype=D)

    def run(dev):
        r = (x.to(dev) @ w.to(dev)).tanh()
        return [r.sum(), r[:3]]
    return run


def test_inference_with_an_uploaded_weight_matrix():
    check_split(weight_matrix_program(10, 12, 7))
    text = torch_lazymem.explain(print_it=False)
    assert "not a batch" in text and "barrier" not in text, text


def test_inference_whose_result_is_larger_than_the_device():
    check_capped(weight_matrix_program(3000, 128, 512), 4 * MiB)


def protonet_program(S, Q, ways=5, hidden=32):
    torch.manual_seed(3)
    support, query = torch.randn(S, 16, dtype=D), torch.randn(Q, 16, dtype=D)
    yq = torch.randint(0, ways, (Q,))
    model = mlp(16, hidden, 16)

    def run(dev):
        m = copy.deepcopy(model).to(dev)

        def loss_fn():
            zs, zq = m(support.to(dev)), m(query.to(dev))
            protos = zs.view(S // ways, ways, -1).mean(0)  # support rows are class-major: row i is class i % ways
            logits = -((zq[:, None, :] - protos[None]) ** 2).sum(-1)
            return F.cross_entropy(logits, yq.to(dev))
        return [sgd_step([m], loss_fn), m]
    return run


def test_prototypical_network_support_set_ends_unsharded():
    check_split(protonet_program(10, 12))


def test_prototypical_network_under_a_cap():
    check_capped(protonet_program(50, 3000, hidden=256), 5 * MiB)


def multitask_program(B1, B2, hidden=32):
    torch.manual_seed(4)
    x1, y1 = torch.randn(B1, 16, dtype=D), torch.randint(0, 4, (B1,))
    x2, y2 = torch.randn(B2, 16, dtype=D), torch.randn(B2, 1, dtype=D)
    trunk, h1, h2 = mlp(16, hidden, 16), nn.Linear(16, 4).double(), nn.Linear(16, 1).double()

    def run(dev):
        t, a, b = (copy.deepcopy(m).to(dev) for m in (trunk, h1, h2))
        loss = sgd_step([t, a, b], lambda: F.cross_entropy(a(t(x1.to(dev))), y1.to(dev)) +
                        F.mse_loss(b(t(x2.to(dev))), y2.to(dev)))
        return [loss, t, a, b]
    return run


def test_multitask_step_splits_each_batch_in_its_own_loop():
    check_split(multitask_program(10, 7))
    text = torch_lazymem.explain(print_it=False)
    assert "split along 2 batches" in text, text


def test_multitask_step_under_a_cap():
    _, text = check_capped(multitask_program(3000, 1000, hidden=256), 5 * MiB)
    assert "split along 2 batches" in text, text


# ---- 3. sequence-first layouts ----


def seq_first_transformer_program(T, B, d=16):
    torch.manual_seed(5)
    x, y = torch.randn(T, B, d, dtype=D), torch.randn(B, d, dtype=D)
    layer = nn.TransformerEncoderLayer(d, 2, 32, dropout=0.0).double()  # batch_first=False: (T, B, d)

    def run(dev):
        m = copy.deepcopy(layer).to(dev)
        loss = sgd_step([m], lambda: F.mse_loss(m(x.to(dev)).mean(0), y.to(dev)))
        return [loss, m]
    return run


@pytest.mark.parametrize("T,B", [(6, 10), (10, 10)], ids=["T6_B10", "T_equals_B"])
def test_sequence_first_transformer_splits_along_dim_1(T, B):
    stats = check_split(seq_first_transformer_program(T, B))
    text = torch_lazymem.explain(print_it=False)
    assert "on dim 1" in text, text
    # The only ops that run whole: layer norm's backward, whose CPU kernel reads its saved statistics
    # as contiguous rows (test_halves_of_the_batch_through_a_sequence_model_split_along_the_sequence).
    barriers = [line for line in text.splitlines() if "barrier" in line and "b" in line]
    assert all(s["barriers"] <= 2 for s in stats), stats
    assert all("layer norm" in line or "barriers" not in line for line in barriers), text


def test_sequence_first_transformer_under_a_cap():
    check_capped(seq_first_transformer_program(16, 256, d=32), 4 * MiB)


def lstm_program(T, B, hidden=8):
    torch.manual_seed(6)
    x, y = torch.randn(T, B, 4, dtype=D), torch.randint(0, 3, (B,))
    rnn, head = nn.LSTM(4, hidden).double(), nn.Linear(hidden, 3).double()

    def run(dev):
        r, h = copy.deepcopy(rnn).to(dev), copy.deepcopy(head).to(dev)
        loss = sgd_step([r, h], lambda: F.cross_entropy(h(r(x.to(dev))[0][-1]), y.to(dev)))
        return [loss, r, h]
    return run


@pytest.mark.parametrize("T,B", [(5, 10), (10, 10)], ids=["T5_B10", "T_equals_B"])
def test_lstm_sequence_first_splits_along_dim_1(T, B):
    check_split(lstm_program(T, B))
    text = torch_lazymem.explain(print_it=False)
    assert "on dim 1" in text, text


def test_lstm_under_a_cap():
    check_capped(lstm_program(20, 512, hidden=64), 6 * MiB)


# ---- 4. idioms between backward and step ----


def clip_program(B, hidden=32, clip="norm"):
    torch.manual_seed(7)
    x, y = torch.randn(B, 16, dtype=D), torch.randint(0, 4, (B,))
    model = mlp(16, hidden, 4)

    def run(dev):
        m = copy.deepcopy(model).to(dev)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
        out = []
        for _step in range(2):
            loss = F.cross_entropy(m(x.to(dev)), y.to(dev))
            loss.backward()
            if clip == "norm":
                out.append(torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5))
            elif clip == "value":
                torch.nn.utils.clip_grad_value_(m.parameters(), 0.01)
            elif clip == "logged":
                out.append(torch.stack([p.grad.norm() for p in m.parameters()]).norm().item())
            opt.step()
            opt.zero_grad()
            out.append(loss.item())
        return out + [m]
    return run


@pytest.mark.parametrize("clip", ["norm", "value", "logged"])
def test_gradient_clipping_runs_in_the_epilogue(clip):
    stats = check_split(clip_program(10, clip=clip))
    assert all(s["barriers"] == 0 for s in stats)


def test_clip_grad_norm_under_a_cap():
    check_capped(clip_program(1500, hidden=256), 4 * MiB)


def grad_scaler_program(B):
    torch.manual_seed(8)
    x, y = torch.randn(B, 16, dtype=D), torch.randint(0, 4, (B,))
    model = mlp(16, 32, 4)

    def run(dev):
        m = copy.deepcopy(model).to(dev)
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        scaler = torch.amp.GradScaler(dev, init_scale=1024.0)
        loss = F.cross_entropy(m(x.to(dev)), y.to(dev))
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        return [loss.item(), m]
    return run


def test_grad_scaler_unscale_runs_in_the_epilogue():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        check_split(grad_scaler_program(10))


# ---- gathers along the batch ----


def mixup_program(B, hidden=32):
    torch.manual_seed(9)
    x, y, perm = torch.randn(B, 16, dtype=D), torch.randint(0, 4, (B,)), torch.randperm(B)
    model = mlp(16, hidden, 4)

    def run(dev):
        m = copy.deepcopy(model).to(dev)
        xs, ys, p = x.to(dev), y.to(dev), perm.to(dev)

        def loss_fn():
            out = m(0.7 * xs + 0.3 * xs[p])
            return 0.7 * F.cross_entropy(out, ys) + 0.3 * F.cross_entropy(out, ys[p])
        return [sgd_step([m], loss_fn), m, ys[p]]
    return run


def test_mixup_gathers_read_a_source_stored_whole():
    stats = check_split(mixup_program(10))
    assert all(s["barriers"] == 0 for s in stats)


def test_mixup_under_a_cap():
    check_capped(mixup_program(2000, hidden=256), 4 * MiB)


@pytest.mark.parametrize("op", ["index_select", "gather", "take_along_dim"])
def test_gathers_with_batched_indices(op):
    torch.manual_seed(10)
    x, perm = torch.randn(10, 6, dtype=D), torch.randperm(10)

    def run(dev):
        xs, p = x.to(dev), perm.to(dev)
        h = (xs * 2).tanh()
        if op == "index_select":
            g = h.index_select(0, p)
        elif op == "gather":
            g = h.gather(0, p[:, None].expand(10, 6).contiguous())
        else:
            g = torch.take_along_dim(h, p[:, None], dim=0)
        return [(g * h).sum(1), g.sum()]
    stats = check_split(run)
    assert all(s["barriers"] == 0 for s in stats)


def test_an_index_read_after_a_split_reads_live_values():
    """Regression (a value the sync point read but the split plan did not touch was released before
    the eager read): y[perm] after a split plan that kept the forward pending."""
    torch.manual_seed(0)
    B = 12
    x, y, perm = torch.randn(B, 64, dtype=D), torch.randint(0, 10, (B,)), torch.randperm(B)
    m = nn.Linear(64, 10).double().to("lazymem")
    with force_chunks(3):
        xl, yl, pl = x.to("lazymem"), y.to("lazymem"), perm.to("lazymem")
        out = m(0.7 * xl + 0.3 * xl[pl])
        loss = F.cross_entropy(out, yl)
        assert torch.equal(yl[pl].cpu(), y[perm])
        loss.item()


# ---- row maps: slices of the batch ----


def towers_program(B, hidden=32):
    torch.manual_seed(11)
    x, y = torch.randn(B, 16, dtype=D), torch.randint(0, 4, (B,))
    t0, t1 = mlp(16, hidden, 4), mlp(16, hidden, 4)

    def run(dev):
        a, b = copy.deepcopy(t0).to(dev), copy.deepcopy(t1).to(dev)
        xs, h = x.to(dev), 2 * B // 5
        loss = sgd_step([a, b], lambda: F.cross_entropy(torch.cat([a(xs[:h]), b(xs[h:])]), y.to(dev)))
        return [loss, a, b]
    return run


def test_two_towers_over_slices_of_the_batch_then_cat():
    stats = check_split(towers_program(10))
    assert all(s["barriers"] == 0 for s in stats)


@pytest.mark.parametrize("h", [100, 192, 256, 300])
def test_batch_norm_statistics_over_a_slice_of_the_batch(h):
    """Regression (found by tools/program_fuzz.py, seed 9110): batch norm in training mode over x[:h]
    merged its chunks' moments with a count per row computed from the batch's 384 rows instead of the
    slice's h (0 by integer division): 0 / 0, NaN, whenever the slice spans chunks. The same for the
    moments behind var/std over a slice."""
    torch.manual_seed(3)
    x = torch.randn(384, 16, dtype=D)

    def run(dev):
        torch.manual_seed(3)
        bn = nn.BatchNorm1d(16).double().to(dev)
        xs = x.to(dev)
        out = bn(xs[:h])
        return [(out ** 2).mean(), xs[:h].var(0), bn.running_mean, bn.running_var]

    check_split(run)


def test_halves_of_the_batch_through_a_sequence_model_split_along_the_sequence():
    """Regression (found by tools/program_fuzz.py, seed 1601 and 12 others): two forward/backward
    calls over x[:24] and x[24:] of a (48, 10, 6) sequence batch, which the solver splits along the
    sequence (dim 1). LayerNorm's CPU backward reads its saved mean and rstd as contiguous: chunks
    narrowed along dim 1 read other rows' statistics, and the stem's and LayerNorm weight's gradients
    were wrong. The backward now runs whole when the batch is not its leading dim."""
    torch.manual_seed(0)
    x, y = torch.randn(48, 10, 6, dtype=D), torch.randint(0, 5, (48,))
    stem, ln, f, head = nn.Linear(6, 16), nn.LayerNorm(16), nn.Linear(16, 16), nn.Linear(16, 5)

    def run(dev):
        mods = [copy.deepcopy(m).double().to(dev) for m in (stem, ln, f, head)]
        xs, ys = x.to(dev), y.to(dev)
        for px, py in ((xs[:24], ys[:24]), (xs[24:], ys[24:])):
            h = F.silu(mods[2](mods[1](mods[0](px))))
            (F.cross_entropy(mods[3](h.mean(1)), py) / 2).backward()
        return [p.grad for m in mods for p in m.parameters()]

    check_split(run, chunks=(2,))


@pytest.mark.parametrize("B,T,E,heads", [(8, 3, 4, 1), (96, 10, 16, 4)], ids=["small", "fuzzer_size"])
def test_attention_over_half_the_batch_reads_only_that_half(B, T, E, heads):
    """Regression (tools/program_fuzz.py seeds 437, 550, 1195, 1254, 1773): MultiheadAttention
    (batch_first) over x[:B//2] makes its out-projection's gradient a time-major (T*B/2, E) flatten
    of a value holding half the batch. A chunk's rows of such a flatten were gathered by the chunk's
    batch rows, not the value's own rows: past the end of its storage (garbage, up to 1e302, in the
    out-projection bias's gradient) or other rows. Gathers and scatters of time-major flattens now
    use the value's row map; a view past the end of its storage is an internal error, not a read."""
    torch.manual_seed(0)
    x, y = torch.randint(1, 40, (B, T)), torch.randint(0, 5, (B,))
    emb, att, head = nn.Embedding(40, E), nn.MultiheadAttention(E, heads, batch_first=True), nn.Linear(E, 5)
    mask = torch.triu(torch.ones(T, T, dtype=torch.bool), 1)

    def run(dev):
        e, a, o = (copy.deepcopy(m).double().to(dev) for m in (emb, att, head))
        xs, ys, m = x.to(dev), y.to(dev), mask.to(dev)
        for part in (slice(0, B // 2), slice(B // 2, B)):
            h = e(xs[part])
            h = h + a(h, h, h, attn_mask=m, need_weights=False)[0]
            F.cross_entropy(o(h.mean(1)), ys[part]).backward()
        return [p.grad for mod in (e, a, o) for p in mod.parameters()]

    check_split(run, chunks=(1, 2, 3))


def test_dropout_over_a_time_major_value_draws_eager_mask_in_any_chunking():
    """Regression (tools/program_fuzz.py seed 1689, a GRU then dropout): a random fill of a value
    stored time-major ((T, B, F) storage of a (B, T, F) view) depended on the chunk count when its
    draws were keyed by rows. Its draws are now eager's: generated whole once, in the storage order
    eager's kernel fills, each chunk reading its rows (issue 27)."""
    B, T, W = 12, 3, 2
    x = torch.randn(B, T, W, dtype=D, generator=torch.Generator().manual_seed(0))
    w = torch.arange(B * T * W, dtype=D).reshape(B, T, W)

    def run(dev):
        torch.manual_seed(1)
        h = x.to(dev).transpose(0, 1).contiguous().transpose(0, 1)  # time-major storage
        y = F.dropout(h, 0.5)
        return (y * w.to(dev)).cpu(), torch.rand(2, device=dev).cpu()

    expected = run("cpu")
    for n in (1, 2, 3, 5):
        with force_chunks(n):
            got = run("lazymem")
        assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1]), n
        assert torch_lazymem.stats()["random_row_keyed"] == 0


def test_gradients_copied_through_a_flat_bucket_and_back():
    """Regression (DDP's reducer, issue 22): gradients still being summed over chunks are copied into
    views of one flat bucket (copy_ of partial values: partial), the bucket is scaled, the
    bucket is finished by an op that needs it whole (DDP's all-reduce), and the views are copied back
    over the gradients. copy_ into a partial destination from a whole value was taken for a partial
    copy (one copy per chunk summed); it now finishes the destination and overwrites it. (A first
    version of that fix also made the second gradient's copy into the bucket, a partial destination
    by then, partial: wrong bias entries.) Ten rows: 3 and 8 chunks leave a ragged last chunk."""
    torch.manual_seed(7)
    x, y = torch.randn(10, 8, dtype=D), torch.randint(0, 4, (10,))
    model = mlp(8, 16, 4)

    def run(dev):
        m = copy.deepcopy(model).to(dev)
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        F.cross_entropy(m(x.to(dev)), y.to(dev)).backward()
        params = list(m.parameters())
        bucket = torch.empty(sum(p.numel() for p in params), dtype=D, device=dev)
        views, at = [], 0
        for p in params:
            views.append(bucket[at:at + p.numel()].view_as(p))
            at += p.numel()
        for p, v in zip(params, views):
            v.copy_(p.grad)
        bucket.mul_(0.5)
        bucket.clamp_(-0.05, 0.05)  # an op on the finished bucket, as DDP's all-reduce: whole after it
        for p, v in zip(params, views):
            p.grad.copy_(v)
        opt.step()
        return [m, bucket]

    check_split(run)


def test_two_towers_under_a_cap():
    check_capped(towers_program(2000, hidden=256), 4 * MiB)


def hand_accumulation_program(B, hidden=32):
    torch.manual_seed(12)
    x, y = torch.randn(B, 16, dtype=D), torch.randint(0, 4, (B,))
    model = mlp(16, hidden, 4)

    def run(dev):
        m = copy.deepcopy(model).to(dev)
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        xs, ys, h = x.to(dev), y.to(dev), 2 * B // 5
        F.cross_entropy(m(xs[:h]), ys[:h]).backward()
        F.cross_entropy(m(xs[h:]), ys[h:]).backward()  # .grad accumulates over the two halves
        opt.step()
        return [m]
    return run


def test_gradient_accumulation_written_by_hand_over_two_halves():
    stats = check_split(hand_accumulation_program(10))
    assert all(s["barriers"] == 0 for s in stats)


def test_gradient_accumulation_by_hand_under_a_cap():
    check_capped(hand_accumulation_program(2000, hidden=256), 3 * MiB)


def row_writes_program(B, hidden=32):
    torch.manual_seed(13)
    x, y = torch.randn(B, 16, dtype=D), torch.randint(0, 4, (B,))
    model = mlp(16, hidden, 4)

    def run(dev):
        m = copy.deepcopy(model).to(dev)

        def loss_fn():
            h = m[0](x.to(dev)) * 1.5
            h[::2] += 1       # a strided row write
            h[-3:] = 0.5      # a tail row write
            return F.cross_entropy(m[4](m[3](m[2](m[1](h)))), y.to(dev))
        return [sgd_step([m], loss_fn), m]
    return run


def test_strided_and_tail_row_writes():
    stats = check_split(row_writes_program(10))
    assert all(s["barriers"] == 0 for s in stats)


def test_row_writes_under_a_cap():
    check_capped(row_writes_program(2000, hidden=256), 4 * MiB)


def test_split_chunk_and_cat_in_row_order():
    torch.manual_seed(14)
    x = torch.randn(10, 6, dtype=D)

    def run(dev):
        xs = x.to(dev)
        a, b = xs.split([3, 7])
        c = torch.cat([p * (i + 1) for i, p in enumerate(xs.chunk(3))])
        odd = xs[1::2].exp()
        return [torch.cat([a.tanh(), b.sigmoid()]).sum(0), (c * xs).sum(1), odd.sum(0), c[:3]]
    stats = check_split(run)
    assert all(s["barriers"] == 0 for s in stats)


# ---- the language-model loss written by hand, real vocabulary ----


def gpt2_shifted_loss_program(B, T, vocab=50257):
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    cfg = transformers.GPT2Config(vocab_size=vocab, n_positions=32, n_embd=16, n_layer=1, n_head=2,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(15)
    model = transformers.GPT2LMHeadModel(cfg).double()
    ids = torch.randint(0, vocab, (B, T))

    def run(dev):
        m = copy.deepcopy(model).to(dev)

        def loss_fn():
            i = ids.to(dev)
            logits = m(input_ids=i).logits
            V = logits.shape[-1]
            return F.cross_entropy(logits[:, :-1].reshape(-1, V), i[:, 1:].reshape(-1))
        return [sgd_step([m], loss_fn), m]
    return run


def test_gpt2_shifted_loss_written_by_hand():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        stats = check_split(gpt2_shifted_loss_program(5, 6, vocab=97))
    assert all(s["barriers"] == 0 for s in stats)


def test_gpt2_shifted_loss_with_the_real_vocabulary_under_a_cap():
    # Eager's peak is ~142 MiB: the logits and their gradients, 3 MiB per sequence each.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        stats, _ = check_capped(gpt2_shifted_loss_program(16, 8), 43 * MiB)
    assert stats["barriers"] == 0 and stats["chunks"] >= 2


# ---- the optimizer step in groups of parameters ----


def adamw_program(steps=3):
    torch.manual_seed(16)
    model = nn.Sequential(nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10)).double()
    x, y = torch.randn(8, 784, dtype=D), torch.randint(0, 10, (8,))

    def run(dev):
        m = copy.deepcopy(model).to(dev)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
        out = []
        for _ in range(steps):
            opt.zero_grad()  # (the gradients live through the step)
            loss = F.cross_entropy(m(x.to(dev)), y.to(dev))
            loss.backward()
            opt.step()
            out.append(loss.item())
        return out + [m] + [opt.state[p]["exp_avg_sq"] for p in m.parameters()]
    return run


def test_the_optimizer_step_runs_in_groups_of_parameters():
    """Parameters, gradients and AdamW's state (20.4 MiB) fit the device; with the step's per-tensor
    temporaries for every parameter at once (eager: 26.6 MiB) they do not, one parameter's at a time
    (23.5 MiB) they do. Nothing about the batch helps: 8 rows."""
    run = adamw_program()
    cap = 24 * MiB
    with memory_cap(cap), pytest.raises(torch.OutOfMemoryError):
        run("cpu")
    expected = results(run("cpu"))
    torch.lazymem.synchronize()
    with simulated_device(cap):
        torch.lazymem.reset_peak_memory_stats()
        got = results(run("lazymem"))
        torch.lazymem.synchronize()
        peak = torch.lazymem.max_memory_allocated()
    assert peak <= cap
    for k, (g, e) in enumerate(zip(got, expected)):
        assert torch.equal(g, e), k  # the same kernels in another order: bitwise equal
    text = torch_lazymem.explain(print_it=False)
    assert "per-tensor ops over 6 tensors runs in" in text, text


def test_a_step_that_fits_keeps_eager_order():
    run = adamw_program(steps=2)
    expected = results(run("cpu"))
    torch.lazymem.synchronize()
    got = results(run("lazymem"))
    for g, e in zip(got, expected):
        assert torch.equal(g, e)
    assert "groups of tensors" not in torch_lazymem.explain(print_it=False)


# ---- generation ----


def causal_lm(kind, vocab):
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    torch.manual_seed(17)
    if kind == "gpt2":
        cfg = transformers.GPT2Config(vocab_size=vocab, n_positions=64, n_embd=32, n_layer=2, n_head=2,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        return transformers.GPT2LMHeadModel(cfg).double().eval()
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return transformers.LlamaForCausalLM(cfg).double().eval()


def generate(model, ids, dev, sample=False, tokens=6):
    m = copy.deepcopy(model).to(dev)
    torch.manual_seed(1)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = m.generate(ids.to(dev), attention_mask=torch.ones_like(ids).to(dev), max_new_tokens=tokens,
                         do_sample=sample, top_k=5 if sample else None, pad_token_id=0)
    return out.cpu()


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_greedy_generation_splits_every_token(kind):
    """A batch of 256 prompts whose KV cache and logits do not fit eager under the cap: each token's
    program splits along the batch, the cache is kept batch-sharded between tokens (stored by one
    token's plan, read chunk by chunk by the next's), and the tokens are eager's."""
    model = causal_lm(kind, 1000)
    ids = torch.randint(1, 1000, (256, 8), generator=torch.Generator().manual_seed(18))
    cap = 4 * MiB if kind == "gpt2" else 2 * MiB
    with memory_cap(cap), pytest.raises(torch.OutOfMemoryError):
        generate(model, ids, "cpu")
    expected = generate(model, ids, "cpu")
    torch.lazymem.synchronize()
    torch_lazymem.reset_stats()
    with simulated_device(cap):
        torch.lazymem.reset_peak_memory_stats()
        got = generate(model, ids, "lazymem")
        peak = torch.lazymem.max_memory_allocated()
    stats = torch_lazymem.stats()
    assert torch.equal(got, expected)
    assert peak <= cap
    assert stats["splits"] >= 6 and stats["barriers"] == 0, stats


def test_sampled_generation_draws_from_each_rows_top_k():
    """Sampling in a split plan draws per row (not eager's stream): each drawn token must be among
    the top 5 of eager's logits for that row's prefix."""
    model = causal_lm("gpt2", 1000)
    ids = torch.randint(1, 1000, (256, 8), generator=torch.Generator().manual_seed(19))
    with simulated_device(4 * MiB):
        got = generate(model, ids, "lazymem", sample=True)
    assert torch.equal(got[:, :8], ids)
    with torch.no_grad():
        logits = model(got).logits
    top = logits[:, 7:-1].topk(5, dim=-1).indices
    assert (top == got[:, 8:, None]).any(-1).all()
    assert torch_lazymem.stats()["splits"] >= 6


# ---- what remains a barrier (the README's table): exact, and counted ----


def _perm_write(x):
    h = x.sin()
    h[torch.arange(x.shape[0] - 1, -1, -1, device=x.device)] = h.cos()
    return h.exp()


def _index_add(x):
    idx = torch.arange(x.shape[0], device=x.device) // 2
    return torch.zeros_like(x).index_add_(0, idx, x.sin()).exp()


def _scatter(x):
    idx = (torch.arange(x.shape[0], device=x.device) * 7 % x.shape[0])[:, None].expand_as(x)
    return x.cos().scatter(0, idx, x.sin()).exp()


BARRIERS = {
    "cumsum": lambda x: x.sin().cumsum(0).exp(),
    "prod": lambda x: x.sin().prod(0) + x,
    "median": lambda x: x.sin().median(0).values + x,
    "argmax": lambda x: x.sin().argmax(0) + x,
    "sort": lambda x: x.sin().sort(0).values.exp(),
    "topk": lambda x: x.sin().topk(3, 0).values.sum(0) + x,
    "index_add": _index_add,
    "scatter": _scatter,
    "perm_write": _perm_write,
}


def _marked_run(fn, x, chunks=3):
    torch_lazymem.reset_stats()
    with force_chunks(chunks):
        xl = x.to("lazymem")
        torch_lazymem.mark_batch(xl, 0)
        got = fn(xl).cpu()
    return got, torch_lazymem.stats()


@pytest.mark.parametrize("name", list(BARRIERS))
def test_a_documented_barrier_runs_whole_and_exactly(name):
    x = torch.randn(24, 6, dtype=D, generator=torch.Generator().manual_seed(20))
    got, stats = _marked_run(BARRIERS[name], x)
    torch.testing.assert_close(got, BARRIERS[name](x).to(D))
    assert stats["splits"] >= 1 and stats["barriers"] >= 1, stats


def test_unbind_along_the_batch_does_not_split_and_stays_exact():
    x = torch.randn(24, 6, dtype=D, generator=torch.Generator().manual_seed(21))

    def fn(t):
        return torch.stack([r.sin() * 2 for r in t.unbind(0)]).exp()
    got, stats = _marked_run(fn, x)
    torch.testing.assert_close(got, fn(x))
    assert stats["splits"] == 0


def test_scale_grad_by_freq_embedding_backward_is_a_barrier():
    ids = torch.randint(0, 10, (24, 5), generator=torch.Generator().manual_seed(22))
    emb = nn.Embedding(10, 4, scale_grad_by_freq=True).double()
    lazy = copy.deepcopy(emb).to("lazymem")
    emb(ids).sin().sum().backward()
    torch_lazymem.reset_stats()
    with force_chunks(3):
        lazy(ids.to("lazymem")).sin().sum().backward()
        grad = lazy.weight.grad.cpu()
    torch.testing.assert_close(grad, emb.weight.grad)
    assert torch_lazymem.stats()["barriers"] >= 1


# Idioms once listed as barriers that split now, with no op run whole.
NOT_BARRIERS = {
    "logsumexp": lambda x: torch.logsumexp(x.sin(), 0) + x.cos(),
    "select_a_row": lambda x: x.sin()[3] * x.cos(),
    "slices_into_a_fresh_value": lambda x: torch.cat([x[:10].sin(), x[10:].cos()]).exp(),
    "mask_over_columns": lambda x: x.sin()[:, torch.tensor([True, False, True, False, True, True], device=x.device)],
}


@pytest.mark.parametrize("name", list(NOT_BARRIERS))
def test_idioms_that_split_with_no_barrier(name):
    x = torch.randn(24, 6, dtype=D, generator=torch.Generator().manual_seed(23))
    got, stats = _marked_run(NOT_BARRIERS[name], x)
    torch.testing.assert_close(got, NOT_BARRIERS[name](x))
    assert stats["splits"] >= 1 and stats["barriers"] == 0, stats


def test_batch_norm_over_a_batch_that_is_not_dim_0_of_the_upload():
    x = torch.randn(6, 24, 5, dtype=D, generator=torch.Generator().manual_seed(24))
    bn = nn.BatchNorm1d(6).double()
    lazy = copy.deepcopy(bn).to("lazymem")
    expected = bn(x.transpose(0, 1)).sin().sum()
    torch_lazymem.reset_stats()
    with force_chunks(3):
        xl = x.to("lazymem")
        torch_lazymem.mark_batch(xl, 1)
        got = lazy(xl.transpose(0, 1)).sin().sum().cpu()
    torch.testing.assert_close(got, expected)
    stats = torch_lazymem.stats()
    assert stats["splits"] >= 1 and stats["barriers"] == 0, stats
