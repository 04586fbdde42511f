"""Conformance against PyTorch's own op database (``op_db`` of
``torch.testing._internal.common_methods_invocations``): every float32 sample of every OpInfo is run
on the CPU and on lazymem (inputs built on the CPU, copied with ``.to("lazymem")``, results forced
with ``.cpu()``) and the results are compared bitwise: on the CPU backing device lazymem replays the
same kernels on the same data. Random ops (whose CPU result changes with the seed) are compared by
shape and dtype only. The backward mode compares the gradients (torch.autograd.grad of the sum of
the outputs) of every differentiable sample the same way. Used by test/python/test_opinfo.py (a subset) and tools/opinfo_report.py.
"""

from __future__ import annotations

import dataclasses
import functools
import traceback
from collections.abc import Iterator
from typing import Any, Callable

import torch
from torch.utils._pytree import tree_flatten, tree_map

from ..api import backing_device
from .compare import compare

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
        return x.cpu() if x.device.type != "cpu" else x
    return x


def eager_device() -> str:
    """Where the eager reference runs: lazymem's backing device (the CPU, or CUDA in the suite's
    CUDA mode), so that "bitwise" means the same kernels on the same device."""
    return backing_device().type


def _run(op: Any, sample: Any, seed: int) -> Any:
    torch.manual_seed(seed)
    return op(sample.input, *sample.args, **sample.kwargs)


def _short(e: BaseException) -> str:
    msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {msg[:200]}"


def _lazy_sample(op: Any, sample: Any, move: Callable[[Any], Any]) -> Any:
    """The sample with its tensors moved by `move` (the input only, for ops that need CPU arguments)."""
    if op.name in CPU_ARGS:
        lazy = sample.transform(lambda x: x.detach() if isinstance(x, torch.Tensor) else x)
        lazy.input = move(sample.input)
        return lazy
    return sample.transform(move)


def _compare(
    op: Any,
    samples: list[Any],
    compute: Callable[[Any, Any, int], Any],
    eager_move: Callable[[Any], Any],
    lazy_move: Callable[[Any], Any],
    atol: float = 0.0,
) -> Iterator[Outcome]:
    """One Outcome per sample: compute(op, sample, seed) eagerly on the backing device and on lazymem,
    compared bitwise, or up to an absolute difference of `atol` (shapes only for random ops, detected
    by a second eager run with another seed, compared bitwise)."""
    name = full_name(op)
    for i, sample in enumerate(samples):
        try:
            expected = tree_map(_to_cpu, compute(op, sample.transform(eager_move), 1234))
        except _NotDifferentiable:
            yield Outcome(name, i, SKIP, "no differentiable output or input")
            continue
        except Exception as e:  # noqa: BLE001 - eager itself rejects the sample: not a lazymem case
            yield Outcome(name, i, SKIP, "eager raised " + _short(e))
            continue
        try:
            again = tree_map(_to_cpu, compute(op, sample.transform(eager_move), 4321))
            random = not compare(expected, again).equal
        except Exception:  # noqa: BLE001
            random = True
        try:
            got = tree_map(_to_cpu, compute(op, _lazy_sample(op, sample, lazy_move), 1234))
        except Exception as e:  # noqa: BLE001
            yield Outcome(name, i, ERROR, _short(e) + "\n" + traceback.format_exc(limit=-3), random)
            continue
        result = compare(expected, got, rtol=0.0, atol=atol, shapes_only=random or op.name in UNINITIALIZED)
        yield Outcome(name, i, PASS if result.equal else MISMATCH, result.message, random)


def _samples(op: Any, requires_grad: bool, max_samples: int | None) -> list[Any] | Outcome:
    name = full_name(op)
    if name in STORAGE_DEPENDENT:
        return Outcome(name, -1, SKIP, "sample depends on storage beyond the view; device copies hold only the view")
    try:
        samples = list(op.sample_inputs("cpu", torch.float32, requires_grad=requires_grad))
    except Exception as e:  # noqa: BLE001 - a broken sample generator is reported, not raised
        return Outcome(name, -1, SKIP, "sample_inputs failed: " + _short(e))
    return samples[:max_samples] if max_samples else samples


def run_op(op: Any, max_samples: int | None = None, atol: float = 0.0) -> Iterator[Outcome]:
    """Yields one Outcome per float32 sample of `op` (forward, requires_grad=False); values are
    compared bitwise, or up to an absolute difference of `atol`."""
    samples = _samples(op, False, max_samples)
    if isinstance(samples, Outcome):
        yield samples
        return
    yield from _compare(op, samples, _run, _to(eager_device()), _to("lazymem"), atol)


def _grad_inputs(sample: Any) -> list[torch.Tensor]:
    flat, _ = tree_flatten((sample.input, sample.args, sample.kwargs))
    return [t for t in flat if isinstance(t, torch.Tensor) and t.requires_grad]


def _leaf(device: str) -> Callable[[Any], Any]:
    def move(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return x.detach().to(device).requires_grad_(x.requires_grad)
        return x

    return move


class _NotDifferentiable(Exception):
    pass


def _grads(op: Any, sample: Any, seed: int) -> tuple[Any, ...]:
    """torch.autograd.grad of the sum of the op's differentiable outputs w.r.t. its grad inputs."""
    inputs = _grad_inputs(sample)
    out = sample.output_process_fn_grad(_run(op, sample, seed))
    flat, _ = tree_flatten(out)
    terms = [
        (torch.view_as_real(o) if o.is_complex() else o).sum()
        for o in flat
        if isinstance(o, torch.Tensor) and o.requires_grad
    ]
    if not terms or not inputs:
        raise _NotDifferentiable()
    total = terms[0]
    for t in terms[1:]:
        total = total + t
    return torch.autograd.grad(total, inputs, allow_unused=True)


def run_op_backward(op: Any, max_samples: int | None = None, atol: float = 0.0) -> Iterator[Outcome]:
    """Yields one Outcome per float32 sample of a differentiable `op`: the gradients of the sum of
    its outputs with respect to every input that requires grad, lazymem vs CPU, compared bitwise (or
    up to an absolute difference of `atol`)."""
    if not op.supports_autograd:
        yield Outcome(full_name(op), -1, SKIP, "op does not support autograd")
        return
    samples = _samples(op, True, max_samples)
    if isinstance(samples, Outcome):
        yield samples
        return
    yield from _compare(op, samples, _grads, _leaf(eager_device()), _leaf("lazymem"), atol)


# Modes of comparison: name -> generator of Outcomes for one op, called as runner(op, max_samples)
# (or runner(op, max_samples, atol=...) to tolerate an absolute difference).
# tools/opinfo_report.py picks them up by name (--mode forward|backward).
RUNNERS: dict[str, Callable[..., Iterator[Outcome]]] = {"forward": run_op, "backward": run_op_backward}


@functools.cache
def ops_by_name() -> dict[str, Any]:
    """Full name -> OpInfo, for every op run_op can run (float32 on the CPU), in op_db order."""
    return {full_name(op): op for op in _ops()}


def find_op(name: str) -> Any:
    """The OpInfo whose full name (``name`` or ``name.variant``) is ``name``; KeyError if none."""
    return ops_by_name()[name]


def sample_count(op: Any, mode: str = "forward", max_samples: int | None = None) -> int:
    """How many Outcomes RUNNERS[mode](op, max_samples) yields (1 for an op skipped as a whole)."""
    if mode == "backward" and not op.supports_autograd:
        return 1
    samples = _samples(op, mode == "backward", max_samples)
    return 1 if isinstance(samples, Outcome) else len(samples)


def seeded_outcomes(op: Any, mode: str = "forward", max_samples: int | None = None) -> Iterator[Outcome]:
    """RUNNERS[mode](op, max_samples) with the global RNG seeded to SAMPLE_SEED first."""
    torch.manual_seed(SAMPLE_SEED)
    yield from RUNNERS[mode](op, max_samples)
