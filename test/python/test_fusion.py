"""Pointwise chains run as one loop on the CPU backing (csrc/execute/fuse.h): results equal eager's
bit for bit (assert_bitwise: NaN payloads aside), nothing fused that eager's kernels would round
differently, what cannot be fused runs plainly, and the peak is never above the plain run's."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_bitwise

import torch_lazymem

LAZY = "lazymem"
SPECIAL = [0.0, -0.0, float("inf"), -float("inf"), float("nan"), 1e-40, -1e-40, 3.0e38, -3.0e38, 1.0, -1.0, 0.5]


@pytest.fixture(autouse=True)
def _fusion_on():
    torch_lazymem.set_fusion(True)
    yield
    torch_lazymem.set_fusion(True)


def operands(dtype: torch.dtype, n: int = 4099, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g, dtype=dtype)
    w = torch.randn(n, generator=g, dtype=dtype)
    x[: len(SPECIAL)] = torch.tensor(SPECIAL, dtype=dtype)
    w[: len(SPECIAL)] = torch.tensor(list(reversed(SPECIAL)), dtype=dtype)
    return x, w


def fused_run(fn, *args):
    """fn on lazymem copies of args, materialized; with the stats of that run."""
    lazy = [a.to(LAZY) for a in args]
    torch.lazymem.synchronize()
    torch_lazymem.reset_stats()
    out = fn(*lazy)
    out = out if isinstance(out, tuple) else (out,)
    torch.lazymem.synchronize()
    stats = torch_lazymem.stats()
    stats["held_after"] = torch.lazymem.memory_allocated()  # (inputs and results alive)
    return out, stats


# Every op the runner fuses, in every form Python writes it: a tensor and a number either side,
# numbers float, int and bool, and the Scalar overloads.
FORMS = {
    "add": lambda x, w: (x + w) + 0.1,
    "add_int": lambda x, w: (x + 3) + w,
    "add_bool": lambda x, w: (x + True) * w,
    "radd": lambda x, w: 0.25 + (x + w),
    "add_scalar_overload": lambda x, w: torch.ops.aten.add.Scalar(x * w, 0.3),
    "sub": lambda x, w: (x - w) - 0.7,
    "rsub": lambda x, w: 1 - (x - w),
    "rsub_overloads": lambda x, w: torch.ops.aten.rsub.Scalar(torch.ops.aten.rsub.Tensor(x, w), 2.5),
    "sub_scalar_overload": lambda x, w: torch.ops.aten.sub.Scalar(x * w, 0.3),
    "mul": lambda x, w: (x * w) * 1.0001,
    "mul_int": lambda x, w: (x * 7) * w,
    "mul_scalar_overload": lambda x, w: torch.ops.aten.mul.Scalar(x + w, 3.3),
    "div": lambda x, w: (x / w) / 3.0,
    "rdiv": lambda x, w: 2.0 / (x / w),
    "div_scalar_overload": lambda x, w: torch.ops.aten.div.Scalar(x - w, 0.7),
    "neg": lambda x, w: -(x * w),
    "reciprocal": lambda x, w: (x + w).reciprocal(),
    "same_operand": lambda x, w: (x * x) * (x - w),
    "maximum": lambda x, w: torch.maximum(x, w * 0.5) * 2,
    "minimum": lambda x, w: torch.minimum(x * 0.5, w) + 1,
    "relu": lambda x, w: (x * w).relu() - 1,
    "clamp": lambda x, w: (x * w).clamp(-0.5, 0.7) + (x - w).clamp(min=0.1) - (x + w).clamp(max=0.2),
    "clamp_min_max": lambda x, w: torch.clamp_max(torch.clamp_min(x * w, -1), 3),
    "clamp_int_bounds": lambda x, w: (x * w).clamp(-1, 2),
    "abs": lambda x, w: (x - w).abs() - 0.5,
    "pow_2": lambda x, w: (x - w) ** 2 + 1,
    "pow_3": lambda x, w: (x - w) ** 3 + 1,
    "pow_minus_2": lambda x, w: (x - w) ** -2 + 1,
    "pow_minus_1": lambda x, w: (x * w) ** -1 + 1,
    "square": lambda x, w: torch.square(x + w) * 3,
    "threshold_backward": lambda x, w: torch.ops.aten.threshold_backward(w * 2, x + 0.5, 0.25) * 3,
    # In place, on values of the chain (the registers the loop keeps them in):
    "inplace_binary": lambda x, w: (x * 1.0).mul_(2.0).add_(w).sub_(0.5).div_(w).add_(1, alpha=1),
    "inplace_unary": lambda x, w: (x - w).neg_().abs_().reciprocal_().relu_().pow_(2) * 1.0,
    "inplace_clamp": lambda x, w: (x * w).clamp_(-0.5, 0.7).clamp_min_(-0.25).clamp_max_(0.5) + 0.0,
    "inplace_self_operand": lambda x, w: (x + w).mul_(x + w).mul_(w) - 1.0,
    "chain": lambda x, w: (((x * 1.0001 + 0.001) - w) / 3.0).neg().reciprocal() * w - 7,
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("form", sorted(FORMS))
def test_each_fused_op_is_eagers_bit_for_bit(form, dtype):
    fn = FORMS[form]
    x, w = operands(dtype)
    (out,), s = fused_run(fn, x, w)
    assert s["fused_chains"] >= 1 and s["fused_nodes"] >= 2, s
    assert_bitwise(out, fn(x, w))


def test_a_double_constant_rounds_to_float_as_eager_rounds_it():
    # 0.1 is no float: eager rounds it to float32 once (its CPU scalar operand) before adding.
    x = torch.full((16,), 16777216.0)
    fn = lambda t: (t + 0.1) + (2**24 + 1) - 1.0  # noqa: E731
    (out,), s = fused_run(fn, x)
    assert s["fused_nodes"] == 3
    assert_bitwise(out, fn(x))
    # A 0-dim host tensor as the constant (not a wrapped Python number): the result's dtype still wins.
    c = torch.tensor(1.0000001, dtype=torch.float64)
    fn2 = lambda t: (t * c) * c  # noqa: E731
    (out2,), s2 = fused_run(fn2, x)
    assert s2["fused_nodes"] == 2
    assert_bitwise(out2, fn2(x))


def test_values_kept_outside_the_chain_are_stored_and_the_rest_are_not():
    x, w = operands(torch.float32, n=4096)

    def fn(x, w):
        a = x * 2.0
        b = a + w  # kept by the caller
        c = b * b
        d = c - a  # kept by the caller
        return b, d

    (b, d), s = fused_run(fn, x, w)
    assert s["fused_nodes"] == 4
    eb, ed = fn(x, w)
    assert_bitwise(b, eb)
    assert_bitwise(d, ed)
    # Stored: the two results (and the inputs); a and c never had storage: the peak is what is held
    # once the run is over (measured, so that values other tests left alive count on both sides).
    assert s["peak_bytes"] == s["held_after"], s


def test_the_peak_is_never_above_the_plain_runs():
    # y1 = x * 2 where x dies there, then y2 = y1 + 1, both kept: fused up front, y1 and y2 would be
    # held beside x (three values) where the plain run holds two at a time. The chain stops short.
    n = 8192

    def program():
        x = torch.randn(n, generator=torch.Generator().manual_seed(1)).to(LAZY)
        torch.lazymem.synchronize()
        torch_lazymem.reset_stats()
        y1 = x * 2.0
        del x
        y2 = y1 + 1.0
        y3 = y2 * 3.0
        torch.lazymem.synchronize()
        return (y1, y2, y3), torch_lazymem.stats()

    fused, s = program()
    torch_lazymem.set_fusion(False)
    plain, p = program()
    assert p["fused_nodes"] == 0
    assert s["peak_bytes"] <= p["peak_bytes"], (s["peak_bytes"], p["peak_bytes"])
    for a, b in zip(fused, plain):
        assert torch.equal(a.cpu(), b.cpu())


# Each case: the program, and how many of its nodes are fused (those not named in the comment).
NOT_FUSED = {
    # alpha != 1: eager's vectorized add is one fused multiply-add, not a product then a sum (the mul is fused).
    "alpha": (lambda x, w: torch.add(x, w, alpha=0.3).mul(1.5).add(w, alpha=2), 1),
    "broadcast": (lambda x, w: (x + w[0]) * w[:, :1], 0),
    "transposed": (lambda x, w: (x.t() * w) + w.t(), 0),
    "large": (lambda x, w: (x.repeat(64, 80) * 2.0) + 1.0, 0),  # (327,680 elements: ATen's threads)
    "integer": (lambda x, w: ((x * 10).long() * 3) + 1, 1),
    "half": (lambda x, w: (x.half() * 3.0) + 1.0, 0),
    # std::pow (a SLEEF vector body and libm's tail in eager): not one of the exponents of products.
    "pow_other": (lambda x, w: x.abs() ** 2.5, 1),
    "nan_bound": (lambda x, w: x.abs().clamp(min=float("nan")), 1),
    "tensor_bounds": (lambda x, w: x.sqrt().clamp(w[0], w[1]), 0),
    # eager's float sqrt is not IEEE's on every CPU (1 ulp off on the CI machine's AVX-512)
    "sqrt": (lambda x, w: (x.abs() ** 0.5).sqrt().rsqrt() ** -0.5, 1),
}


@pytest.mark.parametrize("case", sorted(NOT_FUSED))
def test_what_eager_would_round_differently_or_cannot_be_one_loop_runs_plainly(case):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(8, 8, generator=g)
    w = torch.randn(8, 8, generator=g)
    fn, fused = NOT_FUSED[case]
    (out,), s = fused_run(fn, x, w)
    assert_bitwise(out, fn(x, w))
    assert s["fused_nodes"] == fused, s


def test_a_view_of_an_operand_from_outside_is_read_at_its_offset():
    x = torch.randn(8, 8)
    fn = lambda t: (t * 2.0)[1:].reshape(-1) + 1.0  # noqa: E731
    (out,), s = fused_run(fn, x)
    assert s["fused_chains"] == 2 and s["fused_nodes"] == 2  # (64 elements, then 56 from offset 8)
    assert_bitwise(out, fn(x))


def test_a_bound_eager_cannot_convert_raises_as_eager_raises():
    x = torch.randn(8)
    with pytest.raises(RuntimeError) as eager:
        (x * 2.0).clamp(max=1e300)
    with pytest.raises(RuntimeError, match="overflow") as lazy:
        (x.to(LAZY) * 2.0).clamp(max=1e300).cpu()
    assert "overflow" in str(eager.value) and "clamp" in str(lazy.value)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_in_place_updates_of_tensors_from_outside_are_eagers(dtype):
    x, w = operands(dtype)
    m = torch.linspace(-1, 1, x.numel(), dtype=dtype)

    def step(x, w, m):
        # an optimizer's shape, by hand: momentum updated in place, the parameter too
        m.mul_(0.9).add_(w)
        x.sub_(m * 0.01)
        x.clamp_(-1, 1)
        t = x * 2
        t.add_(1).relu_()
        return t * m

    ex, em = x.clone(), m.clone()
    lx, lw, lm = x.to(LAZY), w.to(LAZY), m.to(LAZY)
    torch.lazymem.synchronize()
    torch_lazymem.reset_stats()
    for _ in range(3):
        ey = step(ex, w, em)
        ly = step(lx, lw, lm)
    torch.lazymem.synchronize()
    s = torch_lazymem.stats()
    # 9 nodes a step, of which the first two steps' t and what reads it are dead: every node run fused
    assert s["fused_nodes"] == s["nodes_executed"] == 3 * 9 - 2 * 4 and s["fusion_fallbacks"] == 0, s
    for a, b in ((ly, ey), (lx, ex), (lm, em)):
        assert_bitwise(a, b)


def test_in_place_updates_through_other_views_of_the_same_tensor_are_not_one_loop():
    # Blocks of one view are not those of another: x[1:] and x[:-1] overlap shifted, x[:8] and x[8:]
    # are other elements of one buffer. The chain is cut there; the values are eager's.
    def shifted(x):
        x[1:].mul_(2.0)
        x[:-1].add_(1.0)
        return x * 1.0

    def halves(x):
        x[:8].mul_(2.0)
        y = x[8:] + x[:8]
        return y * 3.0

    for fn, chains in ((shifted, 3), (halves, 2)):
        x = torch.randn(16)
        (out,), s = fused_run(fn, x.clone())
        assert_bitwise(out, fn(x.clone()))
        assert s["fused_chains"] == chains and s["fused_nodes"] == 3, (fn.__name__, s)


def test_a_failed_operand_is_reported_as_without_fusion():
    x = torch.randn(16).to(LAZY)
    idx = torch.tensor([0, 99]).to(LAZY)
    bad = x[idx]  # out of bounds: the gather fails when it runs
    y = (bad * 2.0 + 1.0) * 3.0
    with pytest.raises(IndexError, match="out of bounds"):
        y.cpu()


def test_set_fusion_turns_it_off_and_checks_its_argument():
    x, w = operands(torch.float64)
    fn = FORMS["chain"]
    torch_lazymem.set_fusion(False)
    assert not torch_lazymem.fusion()
    (out,), s = fused_run(fn, x, w)
    assert s["fused_nodes"] == 0
    assert_bitwise(out, fn(x, w))
    torch_lazymem.set_fusion(True)
    assert torch_lazymem.fusion()
    with pytest.raises(TypeError, match="lazymem: set_fusion"):
        torch_lazymem.set_fusion("yes")


def test_a_training_step_of_a_small_model_is_eagers_with_fusion():
    # Small parameters: SGD with momentum by hand (add, mul, sub on 8-element tensors), the loss by hand.
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2)).double()
    lazy = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2)).double()
    lazy.load_state_dict(model.state_dict())
    lazy = lazy.to(LAZY)
    x = torch.randn(16, 4, dtype=torch.float64)
    t = torch.randn(16, 2, dtype=torch.float64)

    def step(m, x, t, bufs):
        loss = ((m(x) - t) * (m(x) - t)).mean()
        loss.backward()
        with torch.no_grad():
            for i, p in enumerate(m.parameters()):
                bufs[i] = bufs[i] * 0.9 + p.grad
                p.copy_(p - bufs[i] * 0.01)
                p.grad = None
        return loss

    eb = [torch.zeros_like(p) for p in model.parameters()]
    lb = [torch.zeros_like(p) for p in lazy.parameters()]
    torch_lazymem.reset_stats()
    for _ in range(3):
        el = step(model, x, t, eb)
        ll = step(lazy, x.to(LAZY), t.to(LAZY), lb)
        assert_bitwise(ll, el)
    assert torch_lazymem.stats()["fused_nodes"] > 0
    for p, q in zip(lazy.parameters(), model.parameters()):
        assert_bitwise(p, q)


def test_an_out_form_writes_its_fresh_tensor_and_one_given_by_the_caller_runs_plainly():
    x, w = operands(torch.float32)
    fn = lambda x, w: x.abs() * w  # noqa: E731  (at::abs records abs.out into a fresh tensor)
    (out,), s = fused_run(fn, x, w)
    assert s["fused_nodes"] == 2 and s["fusion_fallbacks"] == 0
    assert_bitwise(out, fn(x, w))

    def given(x, w):
        y = torch.empty_like(x)
        y.fill_(3.0)  # (it exists when the chain runs)
        torch.lazymem.synchronize() if y.device.type == LAZY else None
        torch.abs(x * w, out=y)
        return y * 2.0

    (out2,), s2 = fused_run(given, x, w)
    assert s2["fusion_fallbacks"] >= 1, s2  # (abs.out into y: plainly; x * w and y * 2.0 each fused)
    assert_bitwise(out2, given(x, w))


def test_a_split_program_with_chains_is_eagers_in_float64_with_a_ragged_last_chunk():
    # Chains before the split loop (whole stages: fused), in it (chunk by chunk: not fused) and
    # after it; 10 rows in 3 chunks (4, 4, 2). Split results: eager's within float64 tolerance.
    from torch_lazymem.testing import force_chunks

    g = torch.Generator().manual_seed(5)
    x = torch.randn(10, 6, generator=g, dtype=torch.float64)
    w = torch.randn(6, 6, generator=g, dtype=torch.float64)
    b = torch.randn(6, generator=g, dtype=torch.float64)

    def fn(x, w, b):
        c = (b * 0.5 + 1).clamp_(-2, 2)  # (no batch: a whole stage)
        h = (x @ w + c).relu() * 2 - 1
        h.mul_(0.5).add_(0.25)
        s = (h * h).sum(1)
        return (s / 3.0 + 1.0).neg()

    expected = fn(x, w, b)
    with force_chunks(3):
        (out,), s = fused_run(fn, x, w, b)
    assert s["splits"] >= 1 and s["fused_nodes"] >= 2, s
    torch.testing.assert_close(out.cpu(), expected)
