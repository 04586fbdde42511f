"""Recording: ops are recorded, not run; shapes come from meta kernels; factories and copies."""

from __future__ import annotations

import contextlib
import copy
import gc
import sys
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_bitwise

import torch_lazymem


def test_no_real_bytes_before_a_sync_point():
    gc.collect()
    base = torch.lazymem.memory_allocated()
    big = torch.randn(256, 256)
    x = big.to("lazymem")
    w = torch.randn(256, 256, device="lazymem")
    y = (x @ w).relu_()
    for _ in range(10):
        y = y * 2 + 1
    assert torch.lazymem.memory_allocated() == base
    s = torch_lazymem.stats()
    assert s["nodes_executed"] == 0 and s["materializations"] == 0
    assert s["ops_recorded"] >= 23 and s["pending_nodes"] == s["ops_recorded"]
    assert y.shape == (256, 256) and y.dtype == torch.float32
    y.sum().item()
    assert torch_lazymem.stats()["materializations"] == 1


def test_meta_inference_is_cached():
    x = torch.randn(8, 8, device="lazymem")
    torch_lazymem.reset_stats()
    for _ in range(5):
        x = torch.sin(x)
    s = torch_lazymem.stats()
    assert s["meta_cache_hits"] >= 4
    assert s["meta_cache_misses"] <= 1


@contextlib.contextmanager
def python_meta_calls() -> Iterator[list[str]]:
    """The Python functions of torch's meta kernels (torch._refs, _meta_registrations, _prims,
    _decomp) called inside the block, watched with sys.setprofile."""
    calls: list[str] = []

    def profile(frame, event, arg):
        if event == "call":
            path = frame.f_code.co_filename.replace("\\", "/")
            if any(part in path for part in ("torch/_refs", "torch/_meta_registrations", "torch/_prims", "torch/_decomp")):
                calls.append(f"{path}:{frame.f_code.co_name}")

    sys.setprofile(profile)
    try:
        yield calls
    finally:
        sys.setprofile(None)


def test_a_structured_op_unseen_by_the_meta_cache_runs_no_python_meta_kernel():
    """torch registers Python meta kernels (torch._refs, torch._decomp) over the C++ ones of
    structured ops; meta inference runs the C++ one, eager's own meta function (about 200 us a call
    less, and no torch._dynamo import on the first). Its errors are eager's."""
    x = torch.randn(7, 5, device="lazymem")
    w = torch.randn(5, 3, device="lazymem")
    torch_lazymem._C._clear_meta_cache()
    torch_lazymem.reset_stats()
    with python_meta_calls() as python_meta:
        y = (x * 1.5 + x).mm(w).sum(dim=1)
        torch.addcmul(x, x, x, value=0.5).lerp_(x, 0.25)
    assert torch_lazymem.stats()["meta_cache_misses"] >= 5
    assert python_meta == []
    assert y.shape == (7,)
    assert_bitwise(y, ((x.cpu() * 1.5 + x.cpu()).mm(w.cpu())).sum(dim=1))
    # Eager's checks and messages: shapes, and an in-place result that cannot be cast.
    for bad in (lambda t: t.mm(t), lambda t: t.long().add_(t)):
        with pytest.raises(RuntimeError) as want:
            bad(x.cpu())
        with pytest.raises(RuntimeError) as got:
            bad(x)
        assert str(want.value) in str(got.value)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layer_norm_records_without_python_and_as_the_backing_kernel_returns(dtype):
    """native_layer_norm's only meta kernel is torch's Python reference (whose first call imported
    torch._dynamo: 1.9 s in a model's first step); lazymem's C++ meta function (record/native_meta.h)
    gives the backing kernel's outputs — on the CPU, a bfloat16 input's mean and rstd in bfloat16, as
    eager's — and eager's errors."""
    x = torch.randn(6, 4, 8, dtype=dtype)
    w, b = torch.randn(8, dtype=dtype), torch.randn(8, dtype=dtype)
    lx, lw, lb = (t.to("lazymem").requires_grad_() for t in (x, w, b))
    torch_lazymem._C._clear_meta_cache()
    with python_meta_calls() as python_meta:
        out, mean, rstd = torch.native_layer_norm(lx, (8,), lw, lb, 1e-5)
        grads = torch.autograd.grad(out.sum(), (lx, lw, lb))
    assert python_meta == []
    want = torch.native_layer_norm(x, (8,), w, b, 1e-5)
    for got, ref in zip((out, mean, rstd), want):
        assert (got.dtype, got.shape, got.stride()) == (ref.dtype, ref.shape, ref.stride())
        assert_bitwise(got, ref)
    xr, wr, br = (t.clone().requires_grad_() for t in (x, w, b))
    for got, ref in zip(grads, torch.autograd.grad(torch.native_layer_norm(xr, (8,), wr, br, 1e-5)[0].sum(), (xr, wr, br))):
        assert_bitwise(got, ref)
    for bad in (lambda t, w: torch.native_layer_norm(t, (5,), None, None, 1e-5),
                lambda t, w: torch.native_layer_norm(t, (8,), w[:4], None, 1e-5)):
        with pytest.raises(RuntimeError) as want_err:
            bad(x, w)
        with pytest.raises(RuntimeError) as got_err:
            bad(lx.detach(), lw.detach())
        assert str(want_err.value) in str(got_err.value)


def test_relu_and_the_fused_encoder_layer_record_and_plan_without_python_meta_kernels():
    """Their only meta kernels were Python references: relu's imported torch._dynamo and the fused
    encoder layer's (inference fast path) imported sympy, in a first step and in the planner's meta
    probes (record/native_meta.h). Eager's values, and eager's error for a boolean relu."""
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(16, 2, 32, batch_first=True).eval()
    x = torch.randn(3, 5, 16)
    lazy = copy.deepcopy(layer).to("lazymem")
    torch_lazymem._C._clear_meta_cache()
    with python_meta_calls() as python_meta, torch.no_grad():
        r = torch.relu(lazy(x.to("lazymem")))
        r.cpu()  # planned and run (the planner's meta probes included)
    assert python_meta == []
    with torch.no_grad():
        assert_bitwise(r, torch.relu(layer(x)))
    with pytest.raises(RuntimeError, match="Boolean inputs not supported for relu"):
        torch.relu(torch.tensor([True]).to("lazymem"))


BN_CASES = [  # input dtype, parameters' dtype (None: no affine parameters), shape, channels-last
    (torch.float32, torch.float32, (6, 3, 4, 5), False),
    (torch.float32, torch.float32, (6, 3, 4, 5), True),
    (torch.float64, None, (6, 3, 7), False),
    (torch.bfloat16, torch.bfloat16, (6, 3), False),
    (torch.bfloat16, torch.float32, (6, 3, 4, 5), True),  # mixed: float statistics
    (torch.float16, torch.float32, (6, 3, 2, 2, 2), False),
]


@pytest.mark.parametrize(("dtype", "param_dtype", "shape", "channels_last"), BN_CASES)
@pytest.mark.parametrize("train", [True, False])
@pytest.mark.parametrize("op", ["native_batch_norm", "_native_batch_norm_legit"])
def test_batch_norm_records_without_python_and_as_the_backing_kernel_returns(dtype, param_dtype, shape, channels_last, train, op):
    """native_batch_norm and its backward get C++ meta functions on the CPU backing (their only meta
    kernel was torch's Python decomposition, tens of milliseconds in a CNN's first step): every output
    has the dtype, shape and strides of the CPU kernel's (the saved statistics empty in evaluation,
    float beside a reduced-precision input with float parameters), and eager's values."""
    if torch_lazymem.backing_device().type != "cpu":
        pytest.skip("the CPU kernel's layout (a CUDA backing keeps torch's meta kernel)")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, generator=g).to(dtype)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    c = shape[1]
    pd = param_dtype or dtype
    w, b = (None, None) if param_dtype is None else (torch.randn(c, generator=g).to(pd), torch.randn(c, generator=g).to(pd))
    rm, rv = torch.randn(c, generator=g).to(pd), torch.rand(c, generator=g).to(pd) + 0.5
    go = torch.randn(*shape, generator=g).to(dtype)
    lazy = [None if t is None else t.to("lazymem") for t in (x, w, b, rm, rv, go)]
    torch_lazymem._C._clear_meta_cache()
    with python_meta_calls() as python_meta:
        out = getattr(torch.ops.aten, op)(*lazy[:5], train, 0.1, 1e-5)
        grads = torch.ops.aten.native_batch_norm_backward(
            lazy[5], lazy[0], lazy[1], lazy[3], lazy[4], out[1] if train else None, out[2] if train else None,
            train, 1e-5, [True, param_dtype is not None, param_dtype is not None])
        got = [t.cpu() if t is not None else None for t in (*out, *grads, lazy[3], lazy[4])]
    assert python_meta == []
    ref_out = getattr(torch.ops.aten, op)(x, w, b, rm, rv, train, 0.1, 1e-5)
    ref_grads = torch.ops.aten.native_batch_norm_backward(
        go, x, w, rm, rv, ref_out[1] if train else None, ref_out[2] if train else None, train, 1e-5,
        [True, param_dtype is not None, param_dtype is not None])
    for lz, r, ref in zip((*out, *grads, lazy[3], lazy[4]), got, (*ref_out, *ref_grads, rm, rv)):
        assert (lz is None) == (ref is None)
        if ref is None:
            continue
        assert (lz.dtype, lz.shape, lz.stride()) == (ref.dtype, ref.shape, ref.stride())
        assert torch.equal(r, ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("layout", ["contiguous", "heads-last"])
def test_cpu_flash_attention_records_without_python_meta_kernels(dtype, layout):
    """scaled_dot_product_attention's CPU kernel and its backward get C++ meta functions: torch's
    Python ones built the attention with the empty_like reference, whose first call imported sympy
    (0.8 s in an attention model's first step). Eager's values, gradients and layouts."""
    if torch_lazymem.backing_device().type != "cpu":
        pytest.skip("the CPU flash kernel")
    g = torch.Generator().manual_seed(0)
    b, h, n, e = 2, 3, 5, 8
    if layout == "contiguous":
        q, k, v = (torch.randn(b, h, n, e, generator=g).to(dtype) for _ in range(3))
    else:  # (batch, length, heads, head size) transposed, as attention modules make them
        q, k, v = (torch.randn(b, n, h, e, generator=g).to(dtype).transpose(1, 2) for _ in range(3))
    go = torch.randn(b, h, n, e, generator=g).to(dtype)
    lazy = [t.to("lazymem").requires_grad_() for t in (q, k, v)]
    torch_lazymem._C._clear_meta_cache()
    with python_meta_calls() as python_meta:
        out = F.scaled_dot_product_attention(*lazy, is_causal=True)
        out.backward(go.to("lazymem"))
        got = [out.cpu()] + [t.grad.cpu() for t in lazy]
    assert python_meta == []
    refs = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*refs, is_causal=True)
    ref.backward(go)
    for lz, r, want in zip([out] + [t.grad for t in lazy], got, [ref] + [t.grad for t in refs]):
        assert (lz.dtype, lz.shape, lz.stride()) == (want.dtype, want.shape, want.stride())
        assert torch.equal(r, want)


def test_float_arguments_key_by_value_only_where_they_shape_outputs():
    x = torch.randn(2, 3, 4, 4, device="lazymem")
    x.mul(1.5)
    torch._foreach_add_([x], 0.5)
    torch_lazymem.reset_stats()
    for i in range(5):
        x.mul(1.0 + i)  # pointwise: the value cannot change the output's metadata
        torch._foreach_add_([x], 0.25 * i)
    assert torch_lazymem.stats()["meta_cache_misses"] == 0
    shapes = {torch.nn.functional.interpolate(x, scale_factor=s).shape for s in (1.5, 2.0, 2.5)}
    assert len(shapes) == 3  # scale factors shape the output: keyed by value
    assert torch_lazymem.stats()["meta_cache_misses"] >= 3


def test_cache_key_sees_aliasing():
    torch.manual_seed(0)
    a = torch.randn(4)
    b = torch.randn(4)
    x, y = a.to("lazymem"), b.to("lazymem")
    x.add_(y)
    x.add_(x)  # same op and metadata, but self aliases other
    a.add_(b)
    a.add_(a)
    assert_bitwise(x, a)


@pytest.mark.parametrize(
    "make",
    [
        lambda d: torch.zeros(3, 4, device=d),
        lambda d: torch.ones(2, 3, dtype=torch.int64, device=d),
        lambda d: torch.full((2, 2), 7.5, device=d),
        lambda d: torch.arange(10, device=d),
        lambda d: torch.arange(0.5, 3.0, 0.25, device=d),
        lambda d: torch.linspace(0, 1, 7, device=d),
        lambda d: torch.eye(3, device=d),
        lambda d: torch.tensor([[1, 2], [3, 4]], device=d),
        lambda d: torch.zeros_like(torch.empty(3, 2, device=d)),
        lambda d: torch.full_like(torch.empty(2, device=d), 3),
        lambda d: torch.scalar_tensor(2.5, device=d),
        lambda d: torch.tril_indices(4, 3, device=d),
    ],
)
def test_deterministic_factories(make):
    assert_bitwise(make("lazymem"), make("cpu"))


@pytest.mark.parametrize(
    "make",
    [
        lambda d, g: torch.randn(5, 3, device=d, generator=g),
        lambda d, g: torch.rand(7, device=d, generator=g),
        lambda d, g: torch.randint(0, 10, (4, 4), device=d, generator=g),
        lambda d, g: torch.randperm(9, device=d, generator=g),
        lambda d, g: torch.empty(6, device=d).normal_(2.0, 3.0, generator=g),
        lambda d, g: torch.empty(6, device=d).uniform_(-1, 1, generator=g),
        lambda d, g: torch.empty(50, device=d).bernoulli_(0.3, generator=g),
    ],
)
def test_random_factories_reproduce_the_cpu_stream(make):
    cpu = make("cpu", torch.Generator().manual_seed(7))
    lazy = make("lazymem", torch.Generator(device="lazymem").manual_seed(7))
    assert_bitwise(lazy, cpu)


def test_randn_like_and_default_generator():
    torch.manual_seed(11)
    cpu = torch.randn_like(torch.empty(3, 3))
    torch.manual_seed(11)
    lazy = torch.randn_like(torch.empty(3, 3, device="lazymem"))
    assert_bitwise(lazy, cpu)


def test_to_lazymem_snapshots_the_source():
    src = torch.arange(6.0)
    x = src.to("lazymem")
    src.mul_(100)  # later CPU writes must not change what was copied
    assert_bitwise(x, torch.arange(6.0))
    view = torch.arange(12.0).reshape(3, 4)[:, 1]
    y = view.to("lazymem")
    view.zero_()
    assert_bitwise(y, torch.tensor([1.0, 5.0, 9.0]))


def test_copies_between_lazymem_tensors_and_conversions():
    a = torch.randn(3, 4)
    x = a.to("lazymem")
    y = torch.empty(3, 4, device="lazymem")
    y.copy_(x)
    z = torch.zeros(2, 3, 4, device="lazymem")
    z.copy_(x)  # broadcast
    assert_bitwise(y, a)
    assert_bitwise(z, torch.zeros(2, 3, 4).copy_(a))
    assert_bitwise(x.double(), a.double())
    assert_bitwise(x.to(torch.int32), a.to(torch.int32))
    assert_bitwise(a.to("lazymem", torch.float64), a.double())
    assert_bitwise(x.clone(), a)
    assert x.to("lazymem") is x


def test_mixing_with_a_cpu_tensor_fails_like_cpu_cuda():
    x = torch.randn(3, device="lazymem")
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device.*lazymem:0 and cpu"):
        x + torch.randn(3)
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        torch.mm(torch.randn(3, 3, device="lazymem"), torch.randn(3, 3))
    # 0-dim CPU tensors are scalars, allowed as on CUDA
    assert_bitwise(x.cpu().to("lazymem") + torch.tensor(2.0), x.cpu() + torch.tensor(2.0))


def test_dead_code_is_not_run():
    x = torch.randn(100, device="lazymem")
    y = x * 2  # dead: dropped before any sync
    del y
    z = x + 1
    torch_lazymem.reset_stats()
    z.cpu()
    s = torch_lazymem.stats()
    assert s["nodes_eliminated"] == 1
    assert s["nodes_executed"] == 2  # randn's normal_ and the add


def test_views_record_no_nodes():
    x = torch.randn(4, 6, device="lazymem")
    before = torch_lazymem.stats()["pending_nodes"]
    v = x.t()[1:3].unsqueeze(0).expand(2, 2, 4)
    w = x.view(24).reshape(2, 12).permute(1, 0).diagonal()
    assert torch_lazymem.stats()["pending_nodes"] == before
    assert v.shape == (2, 2, 4) and w.shape == (2,)


def test_program_introspection():
    x = torch.randn(3, device="lazymem")
    (x * 2).sum()
    text = torch_lazymem.program()
    assert "aten::normal_" in text and "aten::mul" in text and "aten::sum" in text
    info = torch_lazymem.buffer_info(x)
    assert info["version"] == 1 and not info["has_real"] and info["pending_writer"] > 0
    x.cpu()
    info = torch_lazymem.buffer_info(x)
    assert info["has_real"] and info["real_version"] == 1 and info["pending_writer"] == 0
    torch_lazymem._C._verify()


_NUMBERS = [1.0001, 0.5, -0.0, 0.0, 3, -7, 2**40 + 1, 1e300, -1e-310, 1 / 3, float("inf"), float("nan")]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32])
def test_python_numbers_in_arithmetic_give_eagers_bits(dtype):
    # add, sub, mul and div with a Python number: the recorder hands the CPU kernel the number already
    # converted to a float tensor's dtype (TensorIterator would convert it on every call); values must
    # be eager's, rounding, overflow, signed zeros and NaN included, and untouched for other dtypes.
    x = (torch.randn(257, dtype=torch.float64) * 5).to(dtype)

    def chain(y: torch.Tensor) -> list[torch.Tensor]:
        outs = []
        for v in _NUMBERS:
            if dtype == torch.int32 and isinstance(v, float):
                continue
            outs += [y * v, v * y, y + v, v + y, y - v, v - y, y.add(v, alpha=2), y.sub(v, alpha=3)]
            if dtype.is_floating_point:
                outs += [y / v, y.div(v)]
                z = y.clone()
                z.mul_(v).add_(v).sub_(v).div_(v)
                outs.append(z)
        return outs

    expected = chain(x)
    got = chain(x.to("lazymem"))
    for e, g in zip(expected, got, strict=True):
        assert_bitwise(g, e)


def test_many_distinct_numbers_and_both_float_dtypes_in_one_program():
    # More distinct numbers than the per-thread conversion cache holds, float32 and float64 operands
    # alternating, so entries are replaced while nodes still hold the ones they took.
    a, b = torch.randn(64), torch.randn(64, dtype=torch.float64)
    la, lb = a.to("lazymem"), b.to("lazymem")
    for i in range(300):
        v = 1.0 + i / 7.0
        a, b = a * v + i, b * v - i
        la, lb = la * v + i, lb * v - i
        a, la = a / 1.5, la / 1.5
    assert_bitwise(la, a)
    assert_bitwise(lb, b)


def test_replaying_arithmetic_with_a_python_number_converts_it_once():
    y0 = torch.randn(1024, device="lazymem")
    torch.lazymem.synchronize()
    y = y0
    for _ in range(50):
        y = y * 1.0001 + 0.5
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        torch.lazymem.synchronize()
        torch.ones(3).to(torch.float64)  # the profiler sees conversions: this one
    names = [e.name for e in prof.events()]
    # (Replay's kernels are redispatched, unseen; what they call is seen: eager's loop, and the replay
    # before the recorder converted the numbers, made 100 conversions, one per op.)
    assert names.count("aten::_to_copy") == 1
    e = y0.cpu()
    for _ in range(50):
        e = e * 1.0001 + 0.5
    assert_bitwise(y, e)


def test_python_numbers_in_a_split_program_equal_eager():
    # The converted numbers go to every chunk's kernel as they go to the whole one: a program of
    # arithmetic with Python numbers split into 3 chunks of 7 rows (the last one ragged), in float64.
    from torch_lazymem.testing import force_chunks

    x = torch.randn(7, 5, dtype=torch.float64)
    w = torch.randn(5, 4, dtype=torch.float64)

    def prog(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        h = (a * 1.0001 + 3) @ b
        h = h / 2.5 - 7
        h.mul_(0.3).add_(1, alpha=2)
        return 2 * h - 0.5

    expected = prog(x, w)
    before = torch_lazymem.stats()["splits"]
    with force_chunks(3):
        got = prog(x.to("lazymem"), w.to("lazymem")).cpu()
    assert torch_lazymem.stats()["splits"] > before
    torch.testing.assert_close(got, expected)


# The ops with unboxed kernels (sync/unboxed.cpp): their tensor arguments are borrowed, not copied.
_UNBOXED_UNARY = [torch.neg, torch.exp, torch.log, torch.sqrt, torch.rsqrt, torch.tanh, torch.sigmoid, torch.relu,
                  torch.abs]


def test_unboxed_kernels_record_as_the_fallback_does_and_equal_eager():
    a = torch.rand(4, 6) + 0.5
    b = torch.rand(4, 6) + 0.5
    x, y = a.to("lazymem"), b.to("lazymem")
    torch_lazymem.reset_stats()
    out_lazy = [x * y, x / y, x + y, x - y, torch.add(x, y, alpha=3), torch.sub(x, y, alpha=0.5), x * 1.5, 2.0 / x]
    out_lazy += [f(x) for f in _UNBOXED_UNARY]
    assert torch_lazymem.stats()["ops_recorded"] == len(out_lazy) + 1  # 2.0 / x: reciprocal, then mul
    assert torch_lazymem.stats()["ops_eager"] == 0
    out_eager = [a * b, a / b, a + b, a - b, torch.add(a, b, alpha=3), torch.sub(a, b, alpha=0.5), a * 1.5, 2.0 / a]
    out_eager += [f(a) for f in _UNBOXED_UNARY]
    for lz, eg in zip(out_lazy, out_eager):
        assert lz.device.type == "lazymem"
        assert_bitwise(lz, eg)


def test_the_other_unboxed_kernels_equal_eager():
    g = torch.Generator().manual_seed(3)
    a, b, c = (torch.rand(4, 4, generator=g) + 0.5 for _ in range(3))
    m = torch.rand(2, 4, 4, generator=g)
    cond = torch.rand(4, 4, generator=g) > 0.5

    def run(a, b, c, m, cond):
        return [a @ b, torch.mm(a, b), torch.bmm(m, m), torch.addmm(c, a, b, beta=0.5, alpha=2.0),
                torch.where(cond, a, b), torch.addcmul(c, a, b, value=0.3), torch.addcdiv(c, a, b, value=0.7),
                a ** 2.5, torch.pow(a, 3), torch.mul(a, 3), torch.div(a, 4), torch.add(a, 2, alpha=3),
                torch.reciprocal(a), a.clone().lerp_(b, 0.25), a.clone().addcmul_(b, c, value=2),
                a.clone().addcdiv_(b, c, value=0.5), (a - 1).relu_(), a.clone().sqrt_(), a.clone().neg_(),
                a.clone().mul_(0.5), a.clone().div_(3), a.clone().add_(1.5, alpha=2)]

    lazy = [t.to("lazymem") for t in (a, b, c, m, cond)]
    torch_lazymem.reset_stats()
    out = run(*lazy)
    assert torch_lazymem.stats()["ops_eager"] == 0
    for lz, eg in zip(out, run(a, b, c, m, cond)):
        assert_bitwise(lz, eg)


def test_unboxed_kernels_of_backward_formulas_equal_eager():
    g = torch.Generator().manual_seed(4)
    x0 = torch.randn(6, 5, generator=g)
    grads = []
    for dev in ("cpu", "lazymem"):
        x = x0.to(dev).detach().requires_grad_()
        (torch.sigmoid(x) * torch.tanh(x) + torch.relu(x)).sum().backward()  # sigmoid/tanh/threshold_backward
        grads.append(x.grad)
    assert_bitwise(grads[1], grads[0])


def test_unboxed_in_place_kernels_return_self_and_write_it():
    a = torch.rand(3, 5) + 0.5
    x = a.to("lazymem")
    other = torch.rand(3, 5).to("lazymem")
    before = sys.getrefcount(x)
    assert x.mul_(other) is x
    assert x.add_(other, alpha=2) is x
    assert x.sub_(0.25) is x
    assert x.div_(other) is x
    assert sys.getrefcount(x) == before
    expected = a.mul(other.cpu()).add_(other.cpu(), alpha=2).sub_(0.25).div_(other.cpu())
    assert_bitwise(x, expected)
    v = x[1]  # an in-place op on a view writes its base
    v.mul_(2.0)
    expected[1].mul_(2.0)
    assert_bitwise(x, expected)


def test_unboxed_kernels_hold_no_reference_to_their_arguments():
    import weakref

    x = torch.rand(8, device="lazymem")
    y = torch.rand(8, device="lazymem")
    rx, ry = sys.getrefcount(x), sys.getrefcount(y)
    z = x * y + x
    z = torch.relu(z) - y
    assert (sys.getrefcount(x), sys.getrefcount(y)) == (rx, ry)
    wx = weakref.ref(x)
    del x
    assert wx() is None  # the recorded node holds the buffer, not the tensor
    assert z.cpu().shape == (8,)
    assert y.cpu().shape == (8,)  # still alive and readable after being borrowed many times


def test_unboxed_kernels_raise_eagers_errors_and_lose_nothing():
    x = torch.rand(4, device="lazymem")
    r = sys.getrefcount(x)
    with pytest.raises(RuntimeError, match="same device"):
        _ = x + torch.rand(4)
    with pytest.raises(RuntimeError, match="same device"):
        x.mul_(torch.rand(4))
    with pytest.raises(RuntimeError):
        _ = x * torch.rand(3, device="lazymem")  # shapes that do not broadcast
    assert sys.getrefcount(x) == r
    xr = x.cpu()
    assert_bitwise(x * 2, xr * 2)


def test_unboxed_kernels_under_autograd_equal_eager():
    torch.manual_seed(0)
    a = torch.randn(5, 3)
    w = torch.randn(3, 3)
    xs = [a.clone().requires_grad_(), a.to("lazymem").requires_grad_()]
    ws = [w.clone().requires_grad_(), w.to("lazymem").requires_grad_()]
    grads = []
    for x, w_ in zip(xs, ws):
        h = torch.sigmoid(x @ w_) * torch.tanh(x) + torch.exp(-x.abs()) / (1 + torch.relu(x))
        loss = (h * h).sum()
        loss.backward()
        grads.append((x.grad, w_.grad))
    assert_bitwise(grads[1][0], grads[0][0])
    assert_bitwise(grads[1][1], grads[0][1])
