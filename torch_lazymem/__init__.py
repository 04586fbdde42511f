"""torch_lazymem: a PyTorch device, ``lazymem``, that records ops instead of running them and runs
the recorded program on a real backing device (CUDA when present, else CPU) when a value is needed.

    import torch, torch_lazymem
    x = torch.randn(64, 128).to("lazymem")
    y = (x @ x.T).relu_()        # recorded, nothing runs
    print(y.sum())               # materialized: planned, run on the backing device, printed
"""

from __future__ import annotations

import atexit

import torch

from . import (
    _C,  # noqa: F401 - loads the core library: guard, allocator, hooks and kernels register
    _cuda,
)
from ._progress import report as _report_progress
from ._registration import register as _register
from .api import (
    backing_device,
    buffer_info,
    cuda_graphs,
    explain,
    fusion,
    mark_batch,
    memory_budget,
    pipeline,
    program,
    recompute,
    reset_stats,
    set_backing_device,
    set_cuda_graphs,
    set_debug,
    set_flush_threshold,
    set_fusion,
    set_memory_budget,
    set_pipeline,
    set_recompute,
    stats,
    sync,
)

__all__ = [
    "backing_device",
    "buffer_info",
    "cuda_graphs",
    "explain",
    "fusion",
    "mark_batch",
    "memory_budget",
    "pipeline",
    "program",
    "recompute",
    "reset_stats",
    "set_backing_device",
    "set_cuda_graphs",
    "set_debug",
    "set_flush_threshold",
    "set_fusion",
    "set_memory_budget",
    "set_pipeline",
    "set_recompute",
    "stats",
    "sync",
]

__version__ = "0.1.0"

_register()
_cuda.install()
_C._set_progress_callback(_report_progress)
# The pipeline's worker finishes what it was handed before the interpreter goes away.
atexit.register(_C._pipeline_drain)

from . import distributed as _distributed  # noqa: E402  (the c10d backend of the lazymem device)

_distributed.register()

from . import testing  # noqa: E402,F401  (needs the registered device)

del torch

from . import integrations  # noqa: E402  (Trainer, accelerate, Lightning, torch.compile: issue 32)

integrations.install()
