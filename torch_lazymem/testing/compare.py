"""The one comparator of the test helpers (opinfo, split_fuzz, test/python/conftest.assert_bitwise):
torch.testing.assert_close with equal_nan=True, bitwise (rtol=atol=0) unless given a tolerance, over
every leaf of two pytrees, returning a structured Comparison instead of raising, so that callers read
the mismatch count, the worst index and the largest difference without parsing a message.

Bitwise means isclose with zero tolerances: NaN equals NaN, -0.0 equals 0.0, infinities equal
themselves. Complex tensors are compared bitwise as their real and imaginary parts (view_as_real: a NaN
in one part equals a NaN in the same part only); with a tolerance, as complex numbers (assert_close's
own measure). Python scalars are compared exactly (NaN equal to NaN), whatever the tolerance."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch.testing._comparison import default_tolerances
from torch.utils._pytree import tree_flatten


@dataclasses.dataclass
class Comparison:
    """How `actual` compares with `expected`: the first leaf that differs, if any.

    equal: every leaf matches. message: "" when equal, else "output K: ..." (K the leaf's index in
    tree_flatten order). For a leaf whose values differ (same structure, shape, dtype and device):
    mismatches of numel elements differ, the worst (largest absolute difference, inf where one side
    is NaN) at `index` (a tuple into the leaf, () for a 0-dim tensor; a bitwise complex leaf is indexed
    as its view_as_real, the last index 0 for the real part, 1 for the imaginary), max_abs_diff apart."""

    equal: bool = True
    message: str = ""
    output: int | None = None
    mismatches: int = 0
    numel: int = 0
    index: tuple[int, ...] | None = None
    max_abs_diff: float | None = None


def _differs(i: int, message: str) -> Comparison:
    return Comparison(False, f"output {i}: {message}", i)


def _values(i: int, actual: torch.Tensor, expected: torch.Tensor, rtol: float, atol: float) -> Comparison:
    """The details of a failed assert_close of two tensors of one shape and dtype."""
    actual, expected = (t if t.layout == torch.strided else t.to_dense() for t in (actual, expected))
    close = torch.isclose(actual, expected, rtol=rtol, atol=atol, equal_nan=True)
    wide = torch.promote_types(expected.dtype, torch.float64)
    diff = (actual.to(wide) - expected.to(wide)).abs().nan_to_num(float("inf"), float("inf"))
    diff = torch.where(close, torch.full_like(diff, -1.0), diff)
    worst = int(diff.argmax())
    index = tuple(int(k) for k in torch.unravel_index(torch.tensor(worst), diff.shape))
    top = float(diff.reshape(-1)[worst])
    mismatches, numel = int((~close).sum()), close.numel()
    return Comparison(
        False,
        f"output {i}: values differ (max abs diff {top:.3g}; {mismatches} of {numel} elements, worst at index {index})",
        i, mismatches, numel, index, top,
    )


def compare(
    expected: Any,
    actual: Any,
    *,
    rtol: float | None = 0.0,
    atol: float | None = 0.0,
    shapes_only: bool = False,
) -> Comparison:
    """Compares the leaves of two pytrees (tensors, Python scalars, None...): their number, their
    types, each tensor's shape, dtype and device and, unless shapes_only, its values with
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol, equal_nan=True). The default
    is bitwise (rtol=atol=0); rtol=atol=None means assert_close's defaults for the dtype."""
    if (rtol is None) != (atol is None):
        raise ValueError("give both rtol and atol, or neither (assert_close's defaults)")
    fe, _ = tree_flatten(expected)
    fa, _ = tree_flatten(actual)
    if len(fe) != len(fa):
        return Comparison(False, f"{len(fa)} outputs instead of {len(fe)}")
    for i, (x, y) in enumerate(zip(fe, fa)):
        if isinstance(x, torch.Tensor) != isinstance(y, torch.Tensor):
            return _differs(i, f"{type(y).__name__} instead of {type(x).__name__}")
        if not isinstance(x, torch.Tensor):
            if x != y and not (x != x and y != y):
                return _differs(i, f"{y!r} instead of {x!r}")
            continue
        if x.shape != y.shape or x.dtype != y.dtype:
            return _differs(i, f"{tuple(y.shape)}/{y.dtype} instead of {tuple(x.shape)}/{x.dtype}")
        if y.device != x.device:
            return _differs(i, f"on {y.device} instead of {x.device}")
        if shapes_only:
            continue
        r, a = (rtol, atol) if rtol is not None else default_tolerances(y, x)
        if x.is_complex() and r == 0 and a == 0:
            x, y = torch.view_as_real(x.resolve_conj()), torch.view_as_real(y.resolve_conj())
        try:
            torch.testing.assert_close(y, x, rtol=r, atol=a, equal_nan=True, check_layout=False)
        except AssertionError:
            with torch.no_grad():
                return _values(i, y, x, r, a)
    return Comparison()
