"""Conformance against PyTorch's own op database (``op_db`` of
``torch.testing._internal.common_methods_invocations``): every float32 sample of every OpInfo is run
on the CPU and on lazymem (inputs built on the CPU, copied with ``.to("lazymem")``, results forced
with ``.cpu()``) and the results are compared bitwise: on the CPU backing device lazymem replays the
same kernels on the same data. Random ops (whose CPU result changes with the seed) are compared by
shape and dtype only. Used by test/python/test_opinfo.py (a subset) and tools/opinfo_report.py.
"""

from __future__ import annotations

import dataclasses
import functools
import traceback
from collections.abc import Iterator
from typing import Any, Callable

import torch
from torch.utils._pytree import tree_flatten, tree_map

PASS, MISMATCH, ERROR, SKIP = "pass", "mismatch", "error", "skip"
# Seed set before each op's samples are generated (by seeded_outcomes), so that an op sees the same
# sample values whatever ran before it in the process: the CI subset and the report agree.
SAMPLE_SEED = 0

# Ops whose outputs are uninitialized memory: compared by shape and dtype only.
UNINITIALIZED = {"empty", "empty_like", "new_empty", "empty_permuted", "new_empty_strided", "empty_strided"}
# Samples that depend on the source tensor's whole storage (as_strided past the view): a device copy
# (.to("cuda") as much as .to("lazymem")) holds only the view, so these do not transfer.
STORAGE_DEPENDENT = {"as_strided.partial_views"}
# Arguments (beyond the input) that the op requires on the CPU whatever the input's device.
CPU_ARGS = {"tensor_split"}


@dataclasses.dataclass
class Outcome:
    op: str
    index: int
    status: str
    detail: str = ""
    random: bool = False


def _ops(names: set[str] | None = None) -> list[Any]:
    from torch.testing._internal.common_methods_invocations import op_db

    out = []
    for op in op_db:
        name = op.name + (("." + op.variant_test_name) if op.variant_test_name else "")
        if names is not None and name not in names and op.name not in names:
            continue
        if torch.float32 not in op.supported_dtypes("cpu"):
            continue
        out.append(op)
    return out


def op_names() -> list[str]:
    return [full_name(op) for op in _ops()]


def full_name(op: Any) -> str:
    return op.name + (("." + op.variant_test_name) if op.variant_test_name else "")


def _to(device: str) -> Callable[[Any], Any]:
    def move(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return x.to(device)
        return x

    return move


def _to_cpu(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.cpu() if x.device.type == "lazymem" else x
    return x


def _run(op: Any, sample: Any, seed: int) -> Any:
    torch.manual_seed(seed)
    return op(sample.input, *sample.args, **sample.kwargs)


def _equal(a: Any, b: Any, shapes_only: bool) -> str:
    fa, _ = tree_flatten(a)
    fb, _ = tree_flatten(b)
    if len(fa) != len(fb):
        return f"{len(fb)} outputs instead of {len(fa)}"
    for i, (x, y) in enumerate(zip(fa, fb)):
        if isinstance(x, torch.Tensor) != isinstance(y, torch.Tensor):
            return f"output {i}: {type(y).__name__} instead of {type(x).__name__}"
        if isinstance(x, torch.Tensor):
            if x.shape != y.shape or x.dtype != y.dtype:
                return f"output {i}: {tuple(y.shape)}/{y.dtype} instead of {tuple(x.shape)}/{x.dtype}"
            if y.device.type != "cpu":
                return f"output {i} on {y.device} after .cpu()"
            if shapes_only:
                continue
            if x.is_complex():
                x, y = torch.view_as_real(x.resolve_conj()), torch.view_as_real(y.resolve_conj())
            if x.dtype == torch.bool or not (x.is_floating_point()):
                if not torch.equal(x, y):
                    return f"output {i}: values differ"
            else:
                same = (x == y) | (torch.isnan(x) & torch.isnan(y))
                if not bool(same.all()):
                    diff = (x.double() - y.double()).abs().nan_to_num(float("inf")).max().item()
                    return f"output {i}: values differ (max abs diff {diff:.3g})"
        elif x != y and not (x != x and y != y):
            return f"output {i}: {y!r} instead of {x!r}"
    return ""


def _short(e: BaseException) -> str:
    msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {msg[:200]}"


def run_op(op: Any, max_samples: int | None = None) -> Iterator[Outcome]:
    """Yields one Outcome per float32 sample of `op` (forward, requires_grad=False)."""
    name = full_name(op)
    if name in STORAGE_DEPENDENT:
        yield Outcome(name, -1, SKIP, "sample depends on storage beyond the view; device copies hold only the view")
        return
    try:
        samples = list(op.sample_inputs("cpu", torch.float32, requires_grad=False))
    except Exception as e:  # noqa: BLE001 - a broken sample generator is reported, not raised
        yield Outcome(name, -1, SKIP, "sample_inputs failed: " + _short(e))
        return
    for i, sample in enumerate(samples[:max_samples] if max_samples else samples):
        try:
            expected = _run(op, sample, seed=1234)
        except Exception as e:  # noqa: BLE001 - the CPU itself rejects the sample: not a lazymem case
            yield Outcome(name, i, SKIP, "cpu raised " + _short(e))
            continue
        try:
            random = not _equal(expected, _run(op, sample, seed=4321), shapes_only=False) == ""
        except Exception:  # noqa: BLE001
            random = True
        try:
            if op.name in CPU_ARGS:
                lazy_sample = sample.transform(lambda x: x)
                lazy_sample.input = _to("lazymem")(sample.input)
            else:
                lazy_sample = sample.transform(_to("lazymem"))
            got = tree_map(_to_cpu, _run(op, lazy_sample, seed=1234))
        except Exception as e:  # noqa: BLE001
            yield Outcome(name, i, ERROR, _short(e) + "\n" + traceback.format_exc(limit=-3), random)
            continue
        detail = _equal(expected, got, shapes_only=random or op.name in UNINITIALIZED)
        yield Outcome(name, i, MISMATCH if detail else PASS, detail, random)


# Modes of comparison: name -> generator of Outcomes for one op, called as runner(op, max_samples).
# A backward (gradient) mode is added here, and tools/opinfo_report.py picks it up by name.
RUNNERS: dict[str, Callable[..., Iterator[Outcome]]] = {"forward": run_op}


@functools.cache
def ops_by_name() -> dict[str, Any]:
    """Full name -> OpInfo, for every op run_op can run (float32 on the CPU), in op_db order."""
    return {full_name(op): op for op in _ops()}


def find_op(name: str) -> Any:
    """The OpInfo whose full name (``name`` or ``name.variant``) is ``name``; KeyError if none."""
    return ops_by_name()[name]


def sample_count(op: Any, max_samples: int | None = None) -> int:
    """How many Outcomes run_op(op, max_samples) yields (1 for an op skipped as a whole)."""
    if full_name(op) in STORAGE_DEPENDENT:
        return 1
    try:
        n = sum(1 for _ in op.sample_inputs("cpu", torch.float32, requires_grad=False))
    except Exception:  # noqa: BLE001 - run_op reports a broken sample generator as one skip
        return 1
    return min(n, max_samples) if max_samples else n


def seeded_outcomes(op: Any, mode: str = "forward", max_samples: int | None = None) -> Iterator[Outcome]:
    """RUNNERS[mode](op, max_samples) with the global RNG seeded to SAMPLE_SEED first."""
    torch.manual_seed(SAMPLE_SEED)
    yield from RUNNERS[mode](op, max_samples)
