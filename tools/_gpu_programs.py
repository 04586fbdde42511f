"""The programs tools/gpu_check.py runs on both sides (eager on the device, lazymem): the models, their
data, a training loop that returns what the checks compare, and the comparisons. Sizes are the GPU's,
or tiny ones in the smoke mode (LAZYMEM_GPU_CHECK_DEVICE=cpu, test_gpu_check.py)."""

from __future__ import annotations

import contextlib
import math
import os
import sys
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

# cuBLAS's deterministic workspaces (check 10's verdict runs under torch.use_deterministic_algorithms),
# before anything starts CUDA: both sides alike, the size an H100/H200 gets by default (8 x 4 MiB).
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
Result = dict[str, Any]  # what a worker item saves, and a row's figures
SMOKE = os.environ.get("LAZYMEM_GPU_CHECK_DEVICE") == "cpu"  # the test's smoke mode: the CPU, tiny sizes
DEV = "cpu" if SMOKE else "cuda"
DEVICE = {"eager": DEV, "lazy": "lazymem"}  # each side's device


def size(gpu: Any, cpu: Any) -> Any:
    return cpu if SMOKE else gpu


MLP = size((64, 256), (16, 32))  # batch, width
GPT = size(dict(n_embd=256, n_head=4, vocab_size=50257), dict(n_embd=32, n_head=2, vocab_size=512))
GPT_FP32, GPT_SPLIT, GPT_BF16 = size(((4, 16, 128), (2, 16, 128), (2, 16, 128)), ((1, 4, 16), (1, 8, 16), (1, 4, 16)))
# The split check's vocabulary: small enough that activations, not the embedding's gradient (whole in
# every chunk), set the peak, so that splitting lowers it.
SPLIT_VOCAB = size(2048, 512)
# Issue 30's speed rows: (name, layers, model config, batch, tokens), AdamW steps at eager's batch.
SPEED = size([("gpt2 4x256 16x128", 4, {}, 16, 128), ("gpt2 4x256 64x256", 4, {}, 64, 256),
              ("gpt2-small 12x768 16x512", 12, dict(n_embd=768, n_head=12, n_positions=512), 16, 512)],
             [("gpt2 2x32 4x16", 2, {}, 4, 16)])




class Skip(Exception):
    """An item that cannot run here: its row says skip, with the reason."""


def first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"[:200]


def ok(passed: bool, figures: Result) -> tuple[str, Result]:
    """A check's row: ok or FAIL, and its figures."""
    return ("ok" if passed else "FAIL"), figures


def lazy_stats() -> dict[str, int]:
    """torch_lazymem.stats() in a lazymem worker, {} in an eager one."""
    lazymem = sys.modules.get("torch_lazymem")
    return lazymem.stats() if lazymem else {}


def finish(device: str) -> None:
    """Everything recorded or queued so far has run: the end of a timed region."""
    if device == "lazymem":
        sys.modules["torch_lazymem"].sync()
    if DEV == "cuda":
        torch.cuda.synchronize()


def mlp() -> nn.Module:
    width = MLP[1]
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Linear(width, width), nn.GELU(), nn.Linear(width, 10))


def mlp_data() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(MLP[0], MLP[1], generator=g), torch.randint(0, 10, (MLP[0],), generator=g)]


def mlp_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    out = model(x)
    return F.cross_entropy(out, y), out


def gpt2(n_layer: int, dtype: torch.dtype = torch.float32, **config: Any) -> nn.Module:
    """transformers' GPT-2 with SDPA attention and no dropout, built on the CPU with a fixed seed."""
    import transformers

    config = {**GPT, **config}
    last = config["vocab_size"] - 1  # GPT-2's <|endoftext|> is 50256: inside a smaller vocabulary
    config.setdefault("n_positions", 256)
    cfg = transformers.GPT2Config(n_layer=n_layer, attn_pdrop=0.0, resid_pdrop=0.0,
                                  embd_pdrop=0.0, attn_implementation="sdpa", bos_token_id=last,
                                  eos_token_id=last, **config)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg).to(dtype)


def token_ids(batch: int, seq: int, vocab: int | None = None) -> torch.Tensor:
    high = vocab or GPT["vocab_size"]
    return torch.randint(0, high, (batch, seq), generator=torch.Generator().manual_seed(1))


def lm_loss(model: nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    out = model(input_ids=ids, labels=ids)
    return out.loss, out.logits


def train(model: nn.Module, device: str, inputs: list[torch.Tensor], loss_of: Callable[..., Any], steps: int,
          autocast: str | None = None) -> Result:
    """`steps` AdamW steps (loss.item() after each): losses, the last step's output, the final
    parameters; on lazymem also the most chunks and device bytes of a materialization, the splits and
    what stays held between steps (parameters, AdamW's state, the inputs)."""
    if device == "lazymem":
        sys.modules["torch_lazymem"].reset_stats()
    model.to(device)
    inputs = [t.to(device) for t in inputs]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    losses, chunks, peak = [], 0, 0
    for _ in range(steps):
        with torch.autocast(autocast, dtype=torch.bfloat16) if autocast else contextlib.nullcontext():
            loss, out = loss_of(model, *inputs)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        chunks, peak = max(chunks, lazy_stats().get("chunks", 0)), max(peak, lazy_stats().get("peak_bytes", 0))
    finish(device)
    stats = lazy_stats()
    result = {"losses": torch.tensor(losses, dtype=torch.float64), "out": out.detach().cpu(),
              "params": [p.detach().cpu() for p in model.parameters()], "chunks": max(chunks, stats.get("chunks", 0)),
              "peak": max(peak, stats.get("peak_bytes", 0)), "splits": stats.get("splits", 0)}
    del loss, out
    if device == "lazymem":
        result["held"] = torch.lazymem.memory_allocated()
    return result


def diff(a: Any, b: Any) -> float:
    """The largest absolute difference (NaNs in the same places equal; inf for other shapes or types)."""
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        return 0.0 if a == b else math.inf
    if a.shape != b.shape or a.dtype != b.dtype:
        return math.inf
    if a.numel() == 0:
        return 0.0
    a, b = a.double(), b.double()
    d = (a - b).abs()
    d[(a == b) | (a.isnan() & b.isnan())] = 0
    return float(d.nan_to_num(nan=math.inf).max())


def bitwise(eager: list[torch.Tensor], lazy: list[torch.Tensor]) -> tuple[str, float, bool]:
    """'equal/total', the largest difference, and whether all are equal."""
    equal = sum(torch.equal(a, b) for a, b in zip(eager, lazy))
    return f"{equal}/{len(eager)}", max(map(diff, eager, lazy), default=0.0), equal == len(eager) == len(lazy)
