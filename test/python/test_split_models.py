"""Real models trained 5 steps with every materialization split along the batch (force_chunks 2, 3,
8; the batch of 10 gives a ragged last chunk with 3 and 8), in float64: losses, every parameter,
buffer and AdamW state equal eager's at assert_close defaults. Both training-loop orders: the common
one (backward, step, then read the loss) and the one that reads the loss before backward (the forward
runs split, its activations stay pending and are recomputed chunk by chunk with the backward)."""

from __future__ import annotations

import functools
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from splitting import ORDERS, B, batch_of, ce, train_split


def mlp():
    return nn.Sequential(nn.Linear(20, 32), nn.ReLU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 5))


class GroupNormCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.GroupNorm(2, 8), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(8, 16, 3, padding=1), nn.GroupNorm(4, 16), nn.SiLU(), nn.AdaptiveAvgPool2d(1))
        self.head = nn.Linear(16, 10)

    def forward(self, x):
        return self.head(torch.flatten(self.features(x), 1))


class ResidualBlock(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.conv2, self.bn2 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c, momentum=None)

    def forward(self, x):
        return F.relu(x + self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x))))))


class BatchNormResNet(nn.Module):
    """ResNet-style: a BatchNorm stem, a residual block (one BN with momentum=None, i.e. a cumulative
    average), an affine-free BatchNorm1d in the head. Batch norm in training mode splits in passes."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU())
        self.block = ResidualBlock(8)
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(8 * 4 * 4, 16), nn.BatchNorm1d(16, affine=False), nn.ReLU(),
                                  nn.Linear(16, 10))

    def forward(self, x):
        return self.head(F.max_pool2d(self.block(self.stem(x)), 2))


def transformer_block():
    layer = nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, dropout=0.0, batch_first=True)
    return nn.Sequential(nn.TransformerEncoder(layer, 1, enable_nested_tensor=False), nn.Linear(16, 7))


class TokenTransformer(nn.Module):
    """Token and position embeddings, two pre-norm nn.TransformerEncoderLayer (nn.MultiheadAttention's
    time-major path: its projections flatten (T, B, E) to (T*B, E)), mean pooling, a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        self.pos = nn.Parameter(torch.randn(6, 16) * 0.02)
        layer = nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, dropout=0.0, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(16, 7)

    def forward(self, ids):
        return self.head(self.encoder(self.embed(ids) + self.pos).mean(1))


def token_batch(step):
    g = torch.Generator().manual_seed(step)
    return torch.randint(0, 50, (B, 6), generator=g), torch.randint(0, 7, (B,), generator=g)


CASES = {
    "mlp": (mlp, batch_of(20, classes=5), ce),
    "mlp_mse": (mlp, batch_of(20, classes=5), lambda m, b: F.mse_loss(m(b[0]), F.one_hot(b[1], 5).double())),
    "cnn_groupnorm": (GroupNormCNN, batch_of(3, 8, 8, classes=10), ce),
    "resnet_batchnorm": (BatchNormResNet, batch_of(3, 8, 8, classes=10), ce),
    "transformer_block": (transformer_block, batch_of(6, 16, classes=7),
                          lambda m, b: F.cross_entropy(m(b[0]).mean(1), b[1])),
    "token_transformer_prenorm": (TokenTransformer, token_batch, ce),
}


@pytest.mark.parametrize("chunks", [2, 3, 8])
@pytest.mark.parametrize("name", list(CASES))
def test_split_training_equals_eager(name, chunks):
    make, batch, loss = CASES[name]
    stats = train_split(make, batch, loss, chunks)
    assert stats["splits"] >= 5 and stats["chunks"] == -(-B // -(-B // chunks))
    assert stats["barriers"] == 0


@pytest.mark.parametrize("name", list(CASES))
def test_reading_the_loss_before_backward(name):
    make, batch, loss = CASES[name]
    stats = train_split(make, batch, loss, 3, order="item_first")
    # the forward's activations were left pending, not stored, at each loss.item()
    assert stats["nodes_kept_pending"] > 0 and stats["barriers"] == 0


transformers = pytest.importorskip("transformers")


def quiet(fn):
    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            transformers.logging.set_verbosity_error()
            return fn(*args, **kwargs)
    return wrapped


def tokens(vocab, seq=12):
    def make(step):
        t = torch.randint(0, vocab, (B, seq), generator=torch.Generator().manual_seed(step))
        return {"input_ids": t, "labels": t}
    return make


def hf_loss(model, batch):
    return model(**batch).loss


def gpt2():
    cfg = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=2, n_head=2,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(cfg)


def bert():
    cfg = transformers.BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                  intermediate_size=32, max_position_embeddings=16, num_labels=3,
                                  hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return transformers.BertForSequenceClassification(cfg)


def bert_batch(step):
    g = torch.Generator().manual_seed(step)
    mask = torch.ones(B, 12, dtype=torch.long)
    mask[1, 7:] = 0
    mask[4, 3 + step:] = 0
    return {"input_ids": torch.randint(0, 64, (B, 12), generator=g), "attention_mask": mask,
            "labels": torch.randint(0, 3, (B,), generator=g)}


def llama():
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    return transformers.LlamaForCausalLM(cfg)


def gpt2_contrastive_loss(model, batch):
    """The language-model loss plus a contrastive auxiliary loss between two views of each sequence
    (mean of its first and second half's last hidden states): logits z1 @ z2.T over the batch,
    targets arange(B) — every row's loss needs every other row's embedding."""
    out = model(**batch, output_hidden_states=True)
    h = out.hidden_states[-1]
    z1 = F.normalize(h[:, :6].mean(1), dim=1)
    z2 = F.normalize(h[:, 6:].mean(1), dim=1)
    logits = z1 @ z2.T / 0.5
    return out.loss + 0.1 * F.cross_entropy(logits, torch.arange(h.shape[0], device=h.device))


HF = {
    "gpt2": (gpt2, tokens(64)),
    "gpt2_contrastive_aux": (gpt2, tokens(64)),
    "bert_with_attention_mask": (bert, bert_batch),
    "llama": (llama, tokens(64)),
}


@quiet
@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("chunks", [2, 3, 8])
@pytest.mark.parametrize("name", list(HF))
def test_transformers_split_training_equals_eager(name, chunks, order):
    if order == "item_first" and chunks != 3:
        pytest.skip("one chunking is enough for the second loop order")
    make, batch = HF[name]
    loss = gpt2_contrastive_loss if name == "gpt2_contrastive_aux" else hf_loss
    stats = train_split(make, batch, loss, chunks, order=order)
    assert stats["splits"] >= 5 and stats["barriers"] == 0
