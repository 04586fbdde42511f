"""op_db conformance, CI subset: one test per op, each running every float32 sample of the op forward on
the CPU and on lazymem (torch_lazymem.testing.opinfo.run_op) and requiring bitwise-equal results; and
a smaller subset of gradient tests (run_op_backward: torch.autograd.grad of the sum of the outputs).

The subset is deterministic: every 4th op of the sorted op names, the hand-picked ops below, and every
op of XFAIL (so that the list stays honest: a known failure that starts passing fails its test, as a
strict xfail), each with at most MAX_SAMPLES samples, generated after seeding the RNG with
opinfo.SAMPLE_SEED as tools/opinfo_report.py does. The whole op_db is tools/opinfo_report.py's job:

    PYTHONPATH=. python tools/opinfo_report.py
"""

from __future__ import annotations

import pytest
import torch

from torch_lazymem.testing import opinfo

STRIDE = 4
# Samples per op at most: a few ops have over a thousand (max_pool2d: 1440) and would dominate the run.
MAX_SAMPLES = 256
IMPORTANT = [
    "add",
    "sub",
    "mul",
    "div.no_rounding_mode",
    "matmul",
    "mm",
    "bmm",
    "addmm",
    "baddbmm",
    "einsum",
    "sum",
    "mean",
    "var",
    "amax",
    "softmax",
    "log_softmax",
    "nn.functional.linear",
    "nn.functional.conv1d",
    "nn.functional.conv2d",
    "nn.functional.layer_norm",
    "nn.functional.group_norm",
    "nn.functional.batch_norm",
    "nn.functional.cross_entropy",
    "nn.functional.nll_loss",
    "nn.functional.gelu",
    "nn.functional.relu",
    "nn.functional.silu",
    "nn.functional.dropout",
    "nn.functional.embedding",
    "nn.functional.scaled_dot_product_attention",
    "nn.functional.max_pool2d",
    "nn.functional.interpolate.bilinear",
    "nn.functional.pad.constant",
    "index_select",
    "index_add",
    "index_put",
    "gather",
    "scatter",
    "scatter_add",
    "scatter_reduce.sum",
    "cat",
    "stack",
    "where",
    "masked_fill",
    "masked_select",
    "cumsum",
    "sort",
    "argsort",
    "topk",
    "max.reduction_with_dim",
    "argmax",
    "nonzero",
    "unique",
    "reshape",
    "permute",
    "transpose",
    "expand",
    "contiguous",
    "to",
    "clone",
    "tril",
    "randn_like",
    "linalg.vector_norm",
]

# Known failures, from running the whole op_db (tools/opinfo_report.py): op -> why. Strict xfails.
XFAIL_CPU = {
    "to_sparse": (
        "sparse tensors are not supported on lazymem: x.to_sparse() on a lazymem tensor raises "
        "'NotImplementedError: Cannot access storage of SparseTensorImpl' (not lazymem's own clear message)"
    ),
    "sparse.mm.reduce": "sparse tensors are not supported on lazymem (aten::_sparse_mm_reduce_impl raises)",
    "sparse.sampled_addmm": "sparse tensors are not supported on lazymem (aten::sparse_sampled_addmm raises)",
}

# Ops whose CPU kernel is not bitwise reproducible: MKL's gelsy least squares and LAPACK's geev give
# results (~1e-6 apart) that depend on the memory alignment of their inputs and workspace, on plain CPU
# tensors alone. Which samples differ varies from run to run and from machine to machine (linalg.eig's
# gradients matched on one machine and differed on another), so these tolerate small value differences
# (no errors) in both modes and are never strict expectations either way.
NONDETERMINISTIC_CPU = {
    "linalg.lstsq": "MKL gelsy results depend on buffer alignment (differ by ~1e-6 between CPU runs too)",
    "linalg.lstsq.grad_oriented": "MKL gelsy results depend on buffer alignment (differ by ~1e-6 between CPU runs too)",
    "linalg.eig": "LAPACK geev eigenvectors depend on buffer alignment: gradients differ by ~1e-6 on some machines",
}
# The suite's CUDA mode (conftest.BACKING == "cuda": eager references on CUDA). The eval-mode batch
# norm statistics and sparse.mm.reduce pass there (CUDA's kernel sizes them as meta does; eager CUDA
# rejects the sparse sample); jiterator ops are CUDA-only JIT kernels that guard on their input's
# device.
XFAIL_CUDA = {
    **{k: v for k, v in XFAIL_CPU.items() if k not in ("sparse.mm.reduce",)},
    "jiterator_binary_return_by_ref": "jiterator kernels are CUDA JIT kernels that refuse a lazymem input",
    "nn.functional.scaled_dot_product_attention": (
        "samples with dropout: eager CUDA's fused kernels draw their dropout inside (a philox seed and offset "
        "their backward reads on the host); lazymem takes the math path there, with other draws"
    ),
}
# Not bitwise on CUDA, by design or not yet understood; values within TOLERANCE pass.
NONDETERMINISTIC_CUDA = {
    "nn.functional.grid_sample": "eager CUDA takes cuDNN's grid sampler for 4-d inputs; its backward adds atomically",
    "nn.functional.interpolate.bilinear": "the CUDA backward adds atomically (run-to-run nondeterministic)",
    "renorm": "the gradient differs from eager CUDA by ~4e-9 (not yet investigated)",
}
CUDA = opinfo.eager_device() == "cuda"
XFAIL = XFAIL_CUDA if CUDA else XFAIL_CPU
NOT_BITWISE = NONDETERMINISTIC_CUDA if CUDA else NONDETERMINISTIC_CPU
TOLERANCE = 1e-4


def _subset() -> list[str]:
    names = sorted(opinfo.op_names())
    known = set(names)
    chosen = set(names[::STRIDE]) | {n for n in IMPORTANT if n in known} | {n for n in XFAIL if n in known}
    chosen |= {n for n in NOT_BITWISE if n in known}
    return sorted(chosen)


def _params(names: list[str], xfail: dict[str, str]) -> list:
    """One pytest param per op; known failures are strict xfails, so a fixed op fails its test."""
    params = []
    for name in names:
        marks = [pytest.mark.xfail(reason=xfail[name], strict=True, raises=AssertionError)] if name in xfail else []
        params.append(pytest.param(name, marks=marks, id=name))
    return params


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """Samples are small: intra-op threads only add OpenMP spin contention, which on a busy 2-core
    machine makes this module several times slower. tools/opinfo_report.py's workers also run with
    cores / jobs threads (1 with the default 2 jobs)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _check(name: str, mode: str, max_samples: int) -> None:
    op = opinfo.find_op(name)
    torch.manual_seed(opinfo.SAMPLE_SEED)  # the same samples as tools/opinfo_report.py
    # NOT_BITWISE ops: values within TOLERANCE of eager's (absolute) pass.
    atol = TOLERANCE if name in NOT_BITWISE else 0.0
    outcomes = list(opinfo.RUNNERS[mode](op, max_samples, atol=atol))
    failures = [o for o in outcomes if o.status in (opinfo.ERROR, opinfo.MISMATCH)]
    assert not failures, f"{len(failures)}/{len(outcomes)} samples fail:\n" + "\n".join(
        f"  sample {o.index}: {o.status}: {o.detail.splitlines()[0] if o.detail else ''}" for o in failures
    )


@pytest.mark.parametrize("name", _params(_subset(), XFAIL))
def test_opinfo_forward(name: str) -> None:
    _check(name, "forward", MAX_SAMPLES)


# Backward: every BACKWARD_STRIDE-th op plus the important ones; known gradient failures.
BACKWARD_STRIDE = 8
XFAIL_BACKWARD = {
    "to_sparse": XFAIL["to_sparse"],
    "sparse.sampled_addmm": XFAIL["sparse.sampled_addmm"],
    **(
        {
            "to": "samples that move to CUDA: a backward from CUDA through lazymem raises (pytorch issue 161129)",
            "nn.functional.scaled_dot_product_attention": XFAIL["nn.functional.scaled_dot_product_attention"],
        }
        if CUDA
        else {"sparse.mm.reduce": XFAIL["sparse.mm.reduce"]}
    ),
}


def _backward_params() -> list:
    names = sorted(opinfo.op_names())
    known = set(names)
    chosen = set(names[::BACKWARD_STRIDE]) | {n for n in IMPORTANT if n in known}
    chosen |= {n for n in XFAIL_BACKWARD if n in known}
    chosen |= {n for n in NOT_BITWISE if n in known}
    return _params(sorted(chosen), XFAIL_BACKWARD)


@pytest.mark.parametrize("name", _backward_params())
def test_opinfo_backward(name: str) -> None:
    _check(name, "backward", MAX_SAMPLES // 4)


def test_subset_is_sane() -> None:
    names = set(opinfo.op_names())
    lists = [*XFAIL_CPU, *XFAIL_CUDA, *NONDETERMINISTIC_CPU, *NONDETERMINISTIC_CUDA]
    missing = [n for n in lists if n not in names]
    assert not missing, f"XFAIL/NONDETERMINISTIC name ops that op_db no longer has: {missing}"
    assert len(_subset()) >= len(names) // STRIDE
