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

import torch_lazymem
from torch_lazymem.testing import eager_max_memory_allocated, memory_cap, simulated_device
from test_split_models import BatchNormResNet

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
    run = functools.partial(train, make_model, batch, loss_fn)
    with memory_cap(1 << 45):
        expected = run("cpu")
        peak = eager_max_memory_allocated()
    cap = int(peak * fraction)
    with memory_cap(cap), pytest.raises(torch.OutOfMemoryError):
        run("cpu")
    torch.lazymem.synchronize()
    torch_lazymem.reset_stats()
    with simulated_device(cap):
        torch.lazymem.reset_peak_memory_stats()
        got = run("lazymem")
        torch.lazymem.synchronize()
        lazy_peak = torch.lazymem.max_memory_allocated()
    text = torch_lazymem.explain(print_it=False)
    assert lazy_peak <= cap, (lazy_peak, cap, text)
    assert torch_lazymem.stats()["splits"] >= 1, text
    for k, (g, e) in enumerate(zip(got, expected)):
        torch.testing.assert_close(g, e, msg=lambda m, k=k: f"value {k} (0: the losses): {m}")


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


def test_bert_with_an_attention_mask():
    def make():
        cfg = transformers.BertConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                      intermediate_size=64, max_position_embeddings=64, num_labels=3,
                                      hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
        return transformers.BertForSequenceClassification(cfg)
    g = torch.Generator().manual_seed(3)
    mask = torch.ones(256, 32, dtype=torch.long)
    mask[::3, 20:] = 0
    b = {"input_ids": torch.randint(0, 128, (256, 32), generator=g), "attention_mask": mask,
         "labels": torch.randint(0, 3, (256,), generator=g)}
    check(make, b, hf)


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
