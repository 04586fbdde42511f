"""torch.compile on lazymem: the default backend (Inductor) compiles a graph that touches lazymem
through AOT autograd with no-op compilers, exactly as ``backend="aot_eager"`` does.

Inductor generates kernels (C++/OpenMP, Triton) that read and write device memory directly; a
lazymem tensor has no memory until the recorded program is planned and run, so no generated kernel
can take one. What Inductor's front half gives still applies: Dynamo captures the graph and AOT
autograd functionalizes it and splits forward from backward; the graphs then run op by op, and each
op is recorded onto lazymem like eager code (and planned, split and replayed by lazymem).

The hook: ``torch._inductor.compile_fx.compile_fx`` is Inductor's entry point for both
``torch.compile(model)`` (``torch._TorchCompileInductorWrapper.__call__`` imports it at each call)
and the registered ``"inductor"`` backend (``torch._dynamo.backends.inductor.inductor``, likewise).
When ``torch._inductor.compile_fx`` is imported (the first compile with Inductor, never at
``import torch_lazymem``), its ``compile_fx`` is wrapped: a graph with a lazymem input or value goes
to ``torch._dynamo.backends.debugging.aot_eager``; any other graph, and every graph while
``integrations.enabled()`` is False, goes to Inductor unchanged.
"""

from __future__ import annotations

import functools
from types import ModuleType
from typing import Any

from . import check_version, enabled, on_import

_MODULE = "torch._inductor.compile_fx"
_DEVICE = "lazymem"
_TESTED = ("2.11", "2.13")


def _is_lazy(value: Any) -> bool:
    import torch

    if isinstance(value, torch.Tensor):
        return value.device.type == _DEVICE
    if isinstance(value, (list, tuple)):
        return any(_is_lazy(v) for v in value)
    return False


def on_lazymem(gm: Any, example_inputs: Any) -> bool:
    """Whether the graph takes a lazymem tensor, or computes one (a factory op with
    ``device="lazymem"``: Dynamo's fake values on the graph's nodes say so)."""
    if any(_is_lazy(x) for x in example_inputs):
        return True
    graph = getattr(gm, "graph", None)
    if graph is None:
        return False
    for node in graph.nodes:
        meta = node.meta
        if _is_lazy(meta.get("val", meta.get("example_value"))):
            return True
    return False


def _aot_eager(gm: Any, example_inputs: Any) -> Any:
    from torch._dynamo.backends.debugging import aot_eager

    return aot_eager(gm, example_inputs)


def _patch(module: ModuleType) -> None:
    import torch

    inner = getattr(module, "compile_fx", None)
    if inner is None or getattr(inner, "_lazymem_wrapped", False):
        return
    check_version("torch", _TESTED, torch.__version__.split("+")[0])

    @functools.wraps(inner)
    def compile_fx(model_, example_inputs_, *args, **kwargs):  # noqa: ANN001, ANN202 - Inductor's signature
        if enabled() and on_lazymem(model_, example_inputs_):
            return _aot_eager(model_, example_inputs_)
        return inner(model_, example_inputs_, *args, **kwargs)

    compile_fx._lazymem_wrapped = True  # type: ignore[attr-defined]
    compile_fx._lazymem_inner = inner  # type: ignore[attr-defined]
    module.compile_fx = compile_fx


def install() -> None:
    on_import(_MODULE, _patch)
