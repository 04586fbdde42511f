"""The placement-rule fuzzer (batch_split_theory.md §9, T25, in the spirit of DTensor's
strategy_validation): every OpInfo sample of PyTorch's op database is run on lazymem with dim 0 of
its tensors marked as the batch and every materialization split into chunks
(torch_lazymem.testing.force_chunks), in float64 where the op supports it, and compared with the same
sample on eager CPU at torch.testing.assert_close defaults. A wrong rule — a batch dim passed through
where rows mix, a partial finished wrongly, a missed argument rewrite — shows as a mismatch; an op that
cannot be split runs whole (a barrier) and must still be right. Two seedings per sample: the input
alone carries the batch (every other tensor replicated), and every tensor whose dim 0 has the input's
size carries it. Random ops are compared by shape and dtype (split draws are keyed by rows, not
eager's stream).

    PYTHONPATH=. python tools/split_fuzz.py            # every op
    pytest test/python/test_split_rules.py             # the CI subset
"""

from __future__ import annotations

import dataclasses
import traceback
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map

import torch_lazymem

from . import force_chunks, opinfo
from .compare import compare

VARIANTS = ("input", "aligned")


@dataclasses.dataclass
class SplitOutcome:
    op: str
    index: int
    variant: str
    status: str           # opinfo.PASS / MISMATCH / ERROR / SKIP
    split: bool = False   # at least one materialization split
    barriers: int = 0     # ops that read the batch but ran whole
    detail: str = ""


def _dtype(op: Any) -> torch.dtype:
    return torch.float64 if torch.float64 in op.supported_dtypes("cpu") else torch.float32


# Ops whose lazymem result differs from the CPU's even unsplit (opinfo.XFAIL: placeholder outputs of
# batch norm in eval mode): their split results are compared with unsplit lazymem's instead.
REFERENCE_UNSPLIT = {"native_batch_norm", "_native_batch_norm_legit"}


def _mark(sample: Any, variant: str) -> Any:
    """Moves the sample to lazymem, marking which tensors carry the batch at dim 0."""
    rows = sample.input.shape[0]

    def move(x: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        lazy = x.detach().to("lazymem").requires_grad_(x.requires_grad)
        batched = x is sample.input or (variant == "aligned" and x.dim() > 0 and x.shape[0] == rows)
        try:
            torch_lazymem.mark_batch(lazy, 0 if batched else None)
        except ValueError:
            torch_lazymem.mark_batch(lazy, None)
        return lazy

    moved = sample.transform(move)
    return moved


def run_op_split(op: Any, max_samples: int | None = None, chunks: int = 3, mode: str = "forward"
                 ) -> Iterator[SplitOutcome]:
    """One outcome per sample and seeding; mode "backward" compares the gradients of the sum of the
    op's outputs with respect to its inputs that require grad (opinfo.run_op_backward's measure)."""
    name = opinfo.full_name(op)
    if name in opinfo.STORAGE_DEPENDENT or op.name in opinfo.CPU_ARGS or "sparse" in name:
        yield SplitOutcome(name, -1, "", opinfo.SKIP, detail="not a device-copyable sample")
        return
    backward = mode == "backward"
    if backward and not op.supports_autograd:
        yield SplitOutcome(name, -1, "", opinfo.SKIP, detail="op does not support autograd")
        return
    compute = opinfo._grads if backward else opinfo._run
    dtype = _dtype(op)
    try:
        samples = list(op.sample_inputs("cpu", dtype, requires_grad=backward))
    except Exception as e:  # noqa: BLE001
        yield SplitOutcome(name, -1, "", opinfo.SKIP, detail="sample_inputs failed: " + opinfo._short(e))
        return
    if max_samples:
        samples = samples[:max_samples]
    for i, sample in enumerate(samples):
        if not isinstance(sample.input, torch.Tensor) or sample.input.dim() == 0 or sample.input.shape[0] < 2:
            yield SplitOutcome(name, i, "", opinfo.SKIP, detail="no batch dim (input of fewer than 2 rows)")
            continue
        flat, _ = tree_flatten((sample.input, sample.args, sample.kwargs))
        if any(isinstance(t, torch.Tensor) and t.layout != torch.strided for t in flat):
            yield SplitOutcome(name, i, "", opinfo.SKIP, detail="sparse tensors are not supported on lazymem")
            continue
        try:
            expected = compute(op, sample, 1234)
            if name in REFERENCE_UNSPLIT:
                expected = tree_map(opinfo._to_cpu, compute(op, sample.transform(opinfo._leaf("lazymem")), 1234))
        except Exception as e:  # noqa: BLE001
            yield SplitOutcome(name, i, "", opinfo.SKIP, detail="cpu raised " + opinfo._short(e))
            continue
        try:  # outputs that differ between two runs with the same seed (uninitialized placeholders)
            unstable = not compare(expected, compute(op, sample, 1234), rtol=None, atol=None).equal
        except Exception:  # noqa: BLE001
            unstable = True
        for variant in VARIANTS:
            torch.lazymem.synchronize()
            torch_lazymem.reset_stats()
            try:
                with force_chunks(chunks):
                    got = tree_map(opinfo._to_cpu, compute(op, _mark(sample, variant), 1234))
            except Exception as e:  # noqa: BLE001
                yield SplitOutcome(name, i, variant, opinfo.ERROR,
                                   detail=opinfo._short(e) + "\n" + traceback.format_exc(limit=-3))
                continue
            stats = torch_lazymem.stats()
            # Split random ops draw eager's numbers (DESIGN.md §7 RNG): compared in full, but where
            # their draws are keyed by batch rows (a CUDA kernel no stream reproduces).
            shapes_only = unstable or stats["random_row_keyed"] > 0 or op.name in opinfo.UNINITIALIZED
            # assert_close's default tolerances for the dtype (rtol=atol=None).
            result = compare(expected, got, rtol=None, atol=None, shapes_only=shapes_only)
            yield SplitOutcome(name, i, variant, opinfo.PASS if result.equal else opinfo.MISMATCH,
                               stats["splits"] > 0, stats["barriers"], result.message)


def seeded(op: Any, max_samples: int | None = None, chunks: int = 3, mode: str = "forward"
           ) -> Iterator[SplitOutcome]:
    torch.manual_seed(opinfo.SAMPLE_SEED)
    yield from run_op_split(op, max_samples, chunks, mode)
