"""Public API of torch_lazymem beyond the device itself."""

from __future__ import annotations

import operator
from typing import Any, Union

import torch

from . import _C


def set_backing_device(device: Union[str, torch.device]) -> None:
    """Chooses the real device lazymem runs on: ``"cpu"`` or ``"cuda[:N]"``. Allowed while no lazymem
    buffer holds data on the current backing device (choose it before creating lazymem tensors)."""
    if not isinstance(device, (str, torch.device)):
        raise TypeError(f"lazymem: set_backing_device expects 'cpu', 'cuda' or 'cuda:N' (a str or torch.device), "
                        f"got {device!r}")
    try:
        torch.device(device)
    except RuntimeError as e:
        raise ValueError(f"lazymem: set_backing_device expects 'cpu', 'cuda' or 'cuda:N', got {device!r} ({e})") from None
    _C._set_backing_device(str(device))


def backing_device() -> torch.device:
    """The real device lazymem runs recorded programs on (CUDA when present, else CPU)."""
    return torch.device(_C._backing_device())


def sync() -> None:
    """Runs everything recorded so far: an explicit step marker for loops that never read a value."""
    _C._synchronize()


def stats() -> dict[str, int]:
    """Counters since the last reset_stats(): ops_recorded, ops_eager, views, meta_cache_hits,
    meta_cache_misses, materializations, nodes_executed, nodes_eliminated, peak_bytes (device bytes
    at the peak of the last materialization; pipelined, of the step so far: the worker's batches since
    the last read, and that read), auto_flushes, pipeline_handed, pipeline_handed_late,
    pipelined_flushes, pipeline_given_back (the pipeline's batches: handed to its worker, of them
    handed after their last op, run there, left to the next read); plus the current pending_nodes and more (splits, chunks, plan cache, host memory)."""
    s = dict(_C._stats())
    s["pending_nodes"] = int(_C._pending_nodes())
    return s


def reset_stats() -> None:
    _C._reset_stats()


def set_debug(level: Union[bool, int] = True) -> None:
    """Debug mode (also ``LAZYMEM_DEBUG=1``): prints each materialization's summary and records where
    each op was called from, for error messages; level 2 (``LAZYMEM_DEBUG=2``) also prints each plan."""
    if not hasattr(type(level), "__index__"):  # (a bool is an int: True is level 1)
        raise TypeError(f"lazymem: set_debug expects True, False or a level 0-3, got {level!r}")
    if not 0 <= int(level) <= 3:
        raise ValueError(f"lazymem: set_debug expects a level 0-3, got {level}")
    _C._set_debug(int(level))


def byte_size(value: Union[int, str], what: str) -> int:
    """``value`` in bytes: a non-negative integer, or a string such as ``"256MiB"`` or ``"2GB"``. The one
    validation of every byte argument (budgets, thresholds, capacities): a bool, a float or any other
    type is a TypeError, a negative size or a string that does not parse whole a ValueError, each a
    ``lazymem:`` error naming ``what``."""
    if isinstance(value, str):
        nbytes = int(_C._parse_bytes(value))
    elif isinstance(value, bool) or not hasattr(type(value), "__index__"):
        raise TypeError(f"lazymem: {what} must be a number of bytes or a string such as '256MiB', got {value!r}")
    else:
        nbytes = operator.index(value)
    if nbytes < 0:
        raise ValueError(f"lazymem: {what} must be non-negative, got {value!r}")
    return nbytes


def set_flush_threshold(nodes: int = 0, bytes: Union[int, str] = 0) -> None:
    """Runs the pending program automatically once ``nodes`` ops are pending or its new buffers
    would take ``bytes`` (0 disables each)."""
    if isinstance(nodes, bool) or not hasattr(type(nodes), "__index__"):
        raise TypeError(f"lazymem: the flush threshold's nodes must be an integer, got {nodes!r}")
    if operator.index(nodes) < 0:
        raise ValueError(f"lazymem: the flush threshold's nodes must be non-negative, got {nodes!r}")
    _C._set_flush_threshold(operator.index(nodes), byte_size(bytes, "the flush threshold's bytes"))


def set_pipeline(enabled: bool | None = True) -> None:
    """Pipelined execution: once a materialization has run unsplit within half the memory budget, what
    is recorded next runs on a worker thread, a batch of ops at a time, while the recording thread
    goes on recording. Each batch runs as an auto-flush would (eager's kernels in program order, with
    its own plan), so results are unchanged. A materialization that splits, runs out of memory or
    comes close to the budget turns it off until one fits with room again. ``None`` (the default):
    on where the backing device is a GPU, whose kernels run asynchronously, so that the GPU works
    while the step is still being recorded, as in eager; off on the CPU backing, where a chain of tiny ops, whose kernels are
    single-threaded, runs faster pipelined, but a training step with multi-threaded kernels runs
    slower, and so does the rest of the process: a live thread that has run parallel kernels (the
    worker) keeps an OpenMP team of its own, and every other thread's parallel kernels slow while it
    lives (plain PyTorch too). Also
    ``LAZYMEM_PIPELINE=0/1`` (``LAZYMEM_PIPELINE_BATCH``: ops per batch, 64 on a GPU and 1,024 on the
    CPU by default). An error a kernel raises on the worker surfaces at the next read of what it
    computed, or at the next ``synchronize()``."""
    if enabled is not None and not isinstance(enabled, bool):
        raise TypeError(f"lazymem: set_pipeline expects True, False or None, got {enabled!r}")
    _C._set_pipeline(-1 if enabled is None else int(enabled))


def pipeline() -> bool:
    """Whether pipelined execution is on for the backing device in use (see set_pipeline)."""
    return bool(_C._pipeline())


def set_cuda_graphs(enabled: bool = True) -> None:
    """Replays reused plans as CUDA graphs (on by default; ``LAZYMEM_CUDA_GRAPHS=0`` turns it off).
    On a CUDA backing device with a CUDA build of torch: from a plan's third run on, its nodes run
    in pieces each captured once and then launched as one graph, the nodes that cannot be captured
    (random ops, a kernel that synchronizes, arguments that change from step to step) plainly in
    between; results are those of the plain run. ``stats()``: ``cuda_graph_captures``,
    ``cuda_graph_replays``, ``cuda_graph_nodes``, ``cuda_graph_plain_nodes``, ``cuda_graph_fallbacks``,
    ``cuda_graph_pool_bytes``. Off drops every graph and its memory pool."""
    if not isinstance(enabled, bool):
        raise TypeError(f"lazymem: set_cuda_graphs expects True or False, got {enabled!r}")
    _C._set_cuda_graphs(enabled)


def cuda_graphs() -> bool:
    """Whether reused plans replay as CUDA graphs now (set_cuda_graphs, a CUDA backing device, and a
    CUDA build of torch whose graph support loaded)."""
    return bool(_C._cuda_graphs())


def set_fusion(enabled: bool = True) -> None:
    """Runs chains of pointwise arithmetic on small tensors as one loop (on by default;
    ``LAZYMEM_FUSION=0`` turns it off). On the CPU backing device: consecutive add, sub, mul, div,
    neg and reciprocal nodes on dense float or double tensors of one size (at most 32,768 elements),
    or such a tensor and a Python number, skip ATen's per-op dispatch and iterator; each op rounds
    as eager's kernel does, so results are bitwise eager's. ``stats()``: ``fused_chains``,
    ``fused_nodes``, ``fusion_fallbacks``."""
    if not isinstance(enabled, bool):
        raise TypeError(f"lazymem: set_fusion expects True or False, got {enabled!r}")
    _C._set_fusion(enabled)


def fusion() -> bool:
    """Whether pointwise chains run as one loop now (set_fusion, and a CPU backing device)."""
    return bool(_C._fusion())


def set_memory_budget(budget: Union[int, str, None]) -> None:
    """Caps the device memory lazymem may hold (resident values included) at ``budget`` bytes, or a
    string such as ``"6GiB"``; ``None`` restores the default: the backing device's free memory plus
    what lazymem holds, minus a margin (the capacity on a simulated device). A materialization that
    does not fit is split along the batch. Also ``LAZYMEM_MEMORY_BUDGET``."""
    if budget is None:
        _C._set_memory_budget(-1)
        return
    _C._set_memory_budget(byte_size(budget, "the memory budget"))


def set_recompute(enabled: bool | None = True) -> None:
    """What a split does with a batch-sharded value that crosses passes over the batch (batch norm in
    training, reductions over the batch used in the same step) when storing it whole does not fit the
    device budget. ``None`` (the default): whichever costs less — recompute it chunk by chunk in each
    pass that reads it (the nodes computing it run again, at their measured time), or hold it in host
    memory (copied out once and back in by each pass, at the link's time); until a step has run, it
    is recomputed. ``True``: recompute it whenever its nodes can run again, else hold it in host
    memory. ``False``: always hold it in host memory. Values that fit on the device are stored either
    way. Also ``LAZYMEM_RECOMPUTE=1``, ``0`` or ``auto``; ``explain()`` says what was chosen and why."""
    if enabled is not None and not isinstance(enabled, bool):
        raise TypeError(f"lazymem: set_recompute expects True, False or None, got {enabled!r}")
    _C._set_recompute(-1 if enabled is None else int(enabled))


def recompute() -> bool | None:
    """The recompute setting (see set_recompute): True, False, or None (priced, the default)."""
    v = int(_C._recompute())
    return None if v < 0 else bool(v)


def memory_budget() -> int:
    """The budget in bytes the next materialization is planned against (-1: unknown, no limit)."""
    return int(_C._memory_budget())


def explain(print_it: bool = True) -> str:
    """The last materialization's plan as text: unsplit or split (batch, passes over it, chunks, what
    stays pending, what is assembled in host memory, barriers and why), predicted and measured peak."""
    if not isinstance(print_it, bool):
        raise TypeError(f"lazymem: explain(print_it) expects True or False (it explains the last materialization, "
                        f"not a value), got {type(print_it).__name__}")
    text = str(_C._explain())
    if print_it:
        print(text, end="")
    return text


def mark_batch(t: torch.Tensor, dim: Union[int, None]) -> None:
    """Declares dim ``dim`` of lazymem tensor ``t`` its batch dimension (a seed of splitting), or with
    ``None`` that ``t`` holds no batch (a host tensor uploaded to lazymem is by default a data leaf
    whose dim 0 is the batch, unless it is module state or requires grad)."""
    if not isinstance(t, torch.Tensor) or t.device.type != "lazymem":
        raise TypeError(f"lazymem: mark_batch expects a lazymem tensor, got {type(t).__name__}"
                        + (f" on {t.device}" if isinstance(t, torch.Tensor) else ""))
    if dim is not None and (isinstance(dim, bool) or not isinstance(dim, int)):
        raise TypeError(f"lazymem: mark_batch's dim must be an int or None, got {dim!r}")
    _C._mark_batch(t, dim)


def program(max_nodes: int = 200) -> str:
    """The pending program as text, at most ``max_nodes`` nodes of it."""
    if isinstance(max_nodes, bool) or not hasattr(type(max_nodes), "__index__"):
        raise TypeError(f"lazymem: program(max_nodes) expects a non-negative int, got {max_nodes!r}")
    if int(max_nodes) < 0:
        raise ValueError(f"lazymem: program(max_nodes) expects a non-negative int, got {max_nodes!r}")
    return str(_C._program_str(int(max_nodes)))


def buffer_info(t: torch.Tensor) -> dict[str, Any]:
    """Internal state of a lazymem tensor's buffer (id, versions, whether it holds real data)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"lazymem: buffer_info expects a lazymem tensor, got {type(t).__name__}")
    return dict(_C._buffer_info(t))
