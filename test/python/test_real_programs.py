"""Real programs under a cap of 30% of eager's peak (issue 20): each model of the test suite trains 3
AdamW steps, unchanged, in float64, on a simulated device whose capacity is 30% of the peak eager
needs for the same steps (measured in this run). Eager runs out of memory under that cap; lazymem
finishes with its measured peak within it and with eager's losses and parameters."""

from __future__ import annotations

import functools
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from splitting import check_steps
from test_split_models import BatchNormResNet

import torch_lazymem

D = torch.float64


def quiet(fn):
    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return fn(*args, **kwargs)
    return wrapped


def train(make_model, batch, loss_fn, dev, steps=3):
    """Builds the model (seeded), moves it and the batch to `dev`, trains `steps` AdamW steps; the
    losses and the final parameters and buffers."""
    torch.manual_seed(0)
    model = make_model().double().to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    b = {k: v.to(dev) for k, v in batch.items()}
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = loss_fn(model, b)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    state = [p.detach().cpu() for p in model.parameters()] + [t.cpu() for t in model.buffers()]
    return [torch.tensor(losses, dtype=D)] + state


@quiet
def check(make_model, batch, loss_fn, fraction=0.3):
    check_steps(functools.partial(train, make_model, batch, loss_fn), fraction)


def ce(model, b):
    return F.cross_entropy(model(b["x"]), b["y"])


def hf(model, b):
    return model(**b).loss


def batch(*shape, classes, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"x": torch.randn(*shape, generator=g, dtype=D), "y": torch.randint(0, classes, (shape[0],), generator=g)}


def test_koila_mlp():
    def make():
        return nn.Sequential(nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))
    check(make, batch(4096, 784, classes=10), ce)


def test_batchnorm_cnn():
    check(BatchNormResNet, batch(2048, 3, 8, 8, classes=10), ce)


def test_sequence_first_transformer():
    def make():
        return nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0)  # batch_first=False: (T, B, E)
    g = torch.Generator().manual_seed(1)
    b = {"x": torch.randn(16, 512, 32, generator=g, dtype=D), "y": torch.randn(512, 32, generator=g, dtype=D)}
    check(make, b, lambda m, b: F.mse_loss(m(b["x"]).mean(0), b["y"]))


class LSTMClassifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.LSTM(16, 32)  # (T, B, F)
        self.head = nn.Linear(32, 5)

    def forward(self, x):
        return self.head(self.rnn(x)[0][-1])


def test_lstm():
    g = torch.Generator().manual_seed(2)
    b = {"x": torch.randn(20, 1024, 16, generator=g, dtype=D), "y": torch.randint(0, 5, (1024,), generator=g)}
    check(LSTMClassifier, b, ce)


transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()


def bert():
    cfg = transformers.BertConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                  intermediate_size=64, max_position_embeddings=64, num_labels=3,
                                  hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return transformers.BertForSequenceClassification(cfg)


def bert_batch():
    g = torch.Generator().manual_seed(3)
    mask = torch.ones(256, 32, dtype=torch.long)
    mask[::3, 20:] = 0
    return {"input_ids": torch.randint(0, 128, (256, 32), generator=g), "attention_mask": mask,
            "labels": torch.randint(0, 3, (256,), generator=g)}


def test_bert_with_an_attention_mask():
    check(bert, bert_batch(), hf)


def test_bert_under_a_cap_below_its_token_type_embedding():
    """No token_type_ids: BERT embeds a constant buffer expanded to the batch (256x32 zeros), whose
    embedding (2 MiB in float64) and its gradient are replicated values of the batch's size. Under 5%
    of eager's peak (about 3 MiB, with 0.6 MiB held by the model and optimizer) they must be computed
    chunk by chunk: index_select takes the chunk's rows of the replicated indices when its output is
    wanted batch-sharded, and embedding_dense_backward reads them beside the gradient's rows. (Until
    then bench_split's BERT stopped at 32 times eager's batch.)"""
    check(bert, bert_batch(), hf, fraction=0.05)


def test_t5():
    def make():
        cfg = transformers.T5Config(vocab_size=128, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                                    dropout_rate=0.0, decoder_start_token_id=0)
        return transformers.T5ForConditionalGeneration(cfg)
    g = torch.Generator().manual_seed(4)
    b = {"input_ids": torch.randint(1, 128, (128, 24), generator=g), "labels": torch.randint(1, 128, (128, 12), generator=g)}
    check(make, b, hf)


def test_llama():
    def make():
        cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
        return transformers.LlamaForCausalLM(cfg)
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 128, (128, 32), generator=g)
    check(make, {"input_ids": ids, "labels": ids}, hf)


# --- issue 31: idioms that ran out of memory ---------------------------------------------------------


def sampled_steps(kind, dev, steps=3, n=4096, b=2048):
    """A dataset held on the device, each step's batch drawn there: idx = multinomial(w, B) (or
    randint, or randperm(N)[:B]), then X[idx], Y[idx]; AdamW. Losses and parameters."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))
    model = model.double().to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(n, 32, generator=g, dtype=D), torch.randint(0, 10, (n,), generator=g)
    w = torch.rand(n, generator=g, dtype=D)
    if kind.endswith("buffers"):  # the dataset is module state (no upload is a source: nothing else splits)
        data = nn.Module()
        data.register_buffer("x", x)
        data.register_buffer("y", y)
        data.register_buffer("w", w)
        data.to(dev)
        x, y, w = data.x, data.y, data.w
        kind = kind.split()[0]
    else:
        x, y, w = x.to(dev), y.to(dev), w.to(dev)
    torch.manual_seed(2)  # eager's and lazymem's generators at the same point of their streams
    losses = []
    for _ in range(steps):
        if kind == "multinomial":
            idx = torch.multinomial(w, b, replacement=True)
        elif kind == "randint":
            idx = torch.randint(0, n, (b,), device=dev)
        else:
            idx = torch.randperm(n, device=dev)[:b]
        opt.zero_grad()
        loss = F.cross_entropy(model(x[idx]), y[idx])
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return [torch.tensor(losses, dtype=D)] + [p.detach().cpu() for p in model.parameters()]


@pytest.mark.parametrize("kind", ["multinomial", "randint", "randperm", "multinomial buffers"])
def test_a_batch_indexed_from_a_dataset_on_the_device(kind):
    """Indices drawn on the device are the batch (issue 31, item 3): under 25% of eager's peak the
    gathers X[idx], Y[idx] and everything after them split along idx's rows, with eager's draws and
    results."""
    text = check_steps(functools.partial(sampled_steps, kind))
    assert "made on the device): batch" in text, text


def gan_steps(dev, steps=2, b=1024):
    """A GAN (issue 31, item 1): fake = G(z); D's loss on real and fake.detach(), D's step; G's loss
    through the updated D, G's step — two optimizer steps in one program. Losses and parameters."""
    torch.manual_seed(0)
    gen = nn.Sequential(nn.Linear(16, 256), nn.LeakyReLU(0.2), nn.Linear(256, 64)).double().to(dev)
    disc = nn.Sequential(nn.Linear(64, 256), nn.LeakyReLU(0.2), nn.Linear(256, 1)).double().to(dev)
    opt_g = torch.optim.Adam(gen.parameters(), lr=1e-3, betas=(0.5, 0.999))
    opt_d = torch.optim.Adam(disc.parameters(), lr=1e-3, betas=(0.5, 0.999))
    g = torch.Generator().manual_seed(1)
    real, z = torch.randn(b, 64, generator=g, dtype=D).to(dev), torch.randn(b, 16, generator=g, dtype=D).to(dev)
    ones, zeros = torch.ones(b, 1, dtype=D).to(dev), torch.zeros(b, 1, dtype=D).to(dev)
    bce = F.binary_cross_entropy_with_logits
    losses = []
    for _ in range(steps):
        fake = gen(z)
        loss_d = bce(disc(real), ones) + bce(disc(fake.detach()), zeros)
        opt_d.zero_grad()
        loss_d.backward()
        opt_d.step()
        loss_g = bce(disc(fake), ones)
        opt_g.zero_grad()
        loss_g.backward()
        opt_g.step()
        losses += [loss_d.item(), loss_g.item()]
    return [torch.tensor(losses, dtype=D)] + [p.detach().cpu() for p in [*gen.parameters(), *disc.parameters()]]


def test_a_gan_with_two_optimizer_steps_in_one_program():
    check_steps(gan_steps)


def koila_steps(dev, steps=3, batch=64):
    """Koila's MLP (784-512-512-10) trained `steps` AdamW steps on a batch of `batch` samples: losses
    and parameters."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))
    m = m.double().to(dev)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(batch, 784, generator=g, dtype=D).to(dev), torch.randint(0, 10, (batch,), generator=g).to(dev)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = F.cross_entropy(m(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return [torch.tensor(losses, dtype=D)] + [p.detach().cpu() for p in m.parameters()]


@quiet
@pytest.mark.parametrize("batch, steps", [(64, 3), (4096, 1)])
def test_an_optimizer_step_along_a_parameters_rows(batch, steps):
    """Issue 31, item 2: under 4x the parameter bytes (parameters, gradients, AdamW's two moments)
    plus the batch's bytes plus 30% of the rest of eager's peak (or plus half the largest weight's
    bytes, if less), one parameter's temporaries do not fit, even one tensor at a time. Each parameter's element-wise chain runs in blocks of its rows,
    with eager's results. At batch 4,096 (the batch alone is 24.5 MiB), under 4x the parameter bytes
    plus 2 MiB, the forward and backward split along the batch too, in the same plan: a first step,
    whose backward holds no optimizer state yet (a later one's holds it beside the largest weight's
    gradient partial and accumulator: more than the step's temporaries)."""
    params = (784 * 512 + 512 + 512 * 512 + 512 + 512 * 10 + 10) * 8
    data = batch * (784 + 1) * 8
    # (The cap depends on eager's measured peak, which a process's earlier kernels can raise
    # (the CPU allocator counts their first scratch buffers): at most half the largest weight's
    # bytes above 4x the parameters and the batch, so that its temporaries never fit whole.)
    largest = 784 * 512 * 8

    def cap_of(peak):
        if batch > 64:
            return 4 * params + (2 << 20)
        return min(4 * params + data + int(0.3 * (peak - 4 * params - data)), 4 * params + data + largest // 2)

    text = check_steps(functools.partial(koila_steps, batch=batch, steps=steps), cap_of=cap_of)
    assert "of its tensors (element-wise)" in text, text
    if batch > 64:
        assert "split along a batch of 4096 rows" in text, text


def mlp_steps(dev, make_layer=nn.Linear, flush=None, steps=3):
    """A 64-256-256-10 MLP (its hidden layers made by `make_layer`) trained `steps` AdamW steps on
    4,096 samples; with `flush`, lazymem's flush threshold cuts each step into pieces of that many
    ops. Losses, parameters and buffers."""
    torch.manual_seed(0)
    m = nn.Sequential(make_layer(64, 256), nn.ReLU(), make_layer(256, 256), nn.ReLU(), nn.Linear(256, 10))
    m = m.double().to(dev)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(4096, 64, generator=g, dtype=D).to(dev), torch.randint(0, 10, (4096,), generator=g).to(dev)
    if flush and dev == "lazymem":
        torch_lazymem.set_flush_threshold(flush, 0)
    try:
        losses = []
        for _ in range(steps):
            loss = F.cross_entropy(m(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
    finally:
        if flush and dev == "lazymem":
            torch_lazymem.set_flush_threshold(0, 0)
    return [torch.tensor(losses, dtype=D)] + [p.detach().cpu() for p in m.parameters()] + [b.cpu() for b in m.buffers()]


class TopOneMoE(nn.Module):
    """Top-1 mixture of experts: a router, `nonzero` per expert, h[sel] through the expert, index_add_
    back weighted by the router's probability, and a load-balancing loss over the batch."""

    def __init__(self, width=64, experts=4, classes=5) -> None:
        super().__init__()
        self.stem = nn.Linear(32, width)
        self.router = nn.Linear(width, experts)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
                                     for _ in range(experts))
        self.head = nn.Linear(width, classes)

    def forward(self, x):
        h = self.stem(x).relu()
        probs = self.router(h).softmax(-1)
        top = probs.argmax(-1)
        out = torch.zeros_like(h)
        for e, expert in enumerate(self.experts):
            sel = (top == e).nonzero().squeeze(1)
            out = out.index_add(0, sel, expert(h[sel]) * probs[sel, e:e + 1])
        frac = F.one_hot(top, len(self.experts)).to(h.dtype).mean(0)
        balance = len(self.experts) * (frac * probs.mean(0)).sum()
        return self.head(h + out), balance


def moe_steps(dev, steps=3, b=2048):
    """TopOneMoE trained `steps` AdamW steps on `b` samples: losses and parameters."""
    torch.manual_seed(0)
    m = TopOneMoE().double().to(dev)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(4)
    x, y = torch.randn(b, 32, generator=g, dtype=D).to(dev), torch.randint(0, 5, (b,), generator=g).to(dev)
    losses = []
    for _ in range(steps):
        logits, balance = m(x)
        loss = F.cross_entropy(logits, y) + 0.01 * balance
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return [torch.tensor(losses, dtype=D)] + [p.detach().cpu() for p in m.parameters()]


def test_a_top_one_mixture_of_experts_runs_its_routed_rows_whole_and_says_so():
    """Issue 31, item 5 (README, barrier table): top-1 routing (a `nonzero` per expert, h[sel],
    index_add back, a load-balancing loss over the batch) splits around the routing in 3 chunks, with
    eager's results; the gathers by the selected rows run whole, and explain() says so. (Under 25% of
    eager's peak it runs out of memory: each expert's rows and what its backward keeps are held
    whole.)"""
    from torch_lazymem.testing import force_chunks

    want = moe_steps("cpu", steps=1)
    torch_lazymem.reset_stats()
    with force_chunks(3):
        got = moe_steps("lazymem", steps=1)
    text = torch_lazymem.explain(print_it=False)
    assert torch_lazymem.stats()["splits"] >= 1 and torch_lazymem.stats()["barriers"] >= 1, text
    assert "aten::index.Tensor" in text and "indexes along the batch" in text, text
    for g, e in zip(got, want):
        torch.testing.assert_close(g, e)


def test_spectral_norm_updates_its_vectors_in_place_at_every_forward():
    """spectral_norm's power iteration writes u and v in place at every training forward (issue 31,
    item 5): the step still splits under 25% of eager's peak, and u, v end as eager's."""
    def spectral(i, o):
        return nn.utils.parametrizations.spectral_norm(nn.Linear(i, o))
    check_steps(functools.partial(mlp_steps, make_layer=spectral))


def test_a_flush_threshold_that_cuts_the_step_into_pieces_of_seven_ops():
    """set_flush_threshold(7, 0) materializes every 7 recorded ops (issue 31, item 5): each piece
    splits on its own under 25% of eager's peak, with eager's results."""
    check_steps(functools.partial(mlp_steps, flush=7))


def bag_step(dev):
    """nn.EmbeddingBag(mode="mean") over a flat index tensor with offsets (24 bags of 1-5 indices)."""
    torch.manual_seed(0)
    m = nn.EmbeddingBag(100, 16, mode="mean").double().to(dev)
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(1, 6, (24,), generator=g)
    flat = torch.randint(0, 100, (int(lengths.sum()),), generator=g)
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)[:-1]])
    out = m(flat.to(dev), offsets.to(dev))
    out.square().sum().backward()
    return [out.detach().cpu(), m.weight.grad.cpu()]


def packed_step(dev):
    """An LSTM over pack_padded_sequence(..., enforce_sorted=False), unpacked again."""
    from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

    torch.manual_seed(0)
    lstm = nn.LSTM(8, 16, batch_first=True).double().to(dev)
    g = torch.Generator().manual_seed(1)
    x, lengths = torch.randn(12, 7, 8, generator=g, dtype=D), torch.randint(1, 8, (12,), generator=g)
    out, _ = lstm(pack_padded_sequence(x.to(dev), lengths, batch_first=True, enforce_sorted=False))
    y, _ = pad_packed_sequence(out, batch_first=True)
    y.square().sum().backward()
    return [y.detach().cpu()] + [p.grad.cpu() for p in lstm.parameters()]


def ctc_step(dev):
    """F.ctc_loss over concatenated targets with tensor lengths."""
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(20, 10, 6, generator=g, dtype=D).to(dev).requires_grad_()
    target_lengths = torch.randint(2, 6, (10,), generator=g)
    targets = torch.randint(1, 6, (int(target_lengths.sum()),), generator=g)
    loss = F.ctc_loss(logits.log_softmax(2), targets.to(dev), torch.full((10,), 20).to(dev), target_lengths.to(dev))
    loss.backward()
    return [loss.detach().cpu(), logits.grad.cpu()]


@pytest.mark.parametrize("step, says", [
    (bag_step, "the first: aten::_embedding_bag"),  # no rule splits bags given by offsets
    (packed_step, "not split"),  # packed data is time-major with per-step batch sizes: no batch dim
    (ctc_step, None),  # the lengths are read on the host; the loss runs eagerly on the whole batch
])
def test_batches_written_as_offsets_or_packed_run_whole_and_say_so(step, says):
    """Issue 31, item 4 (README, barrier table): bags given by offsets, packed sequences and CTC over
    concatenated targets run whole, with eager's results; explain() says why (CTC: an eager op)."""
    from torch_lazymem.testing import force_chunks

    want = step("cpu")
    torch_lazymem.reset_stats()
    with force_chunks(3):
        got = step("lazymem")
    if says:
        assert says in torch_lazymem.explain(print_it=False), torch_lazymem.explain(print_it=False)
    else:
        assert torch_lazymem.stats()["ops_eager"] >= 1
    for g, e in zip(got, want):
        torch.testing.assert_close(g, e)
