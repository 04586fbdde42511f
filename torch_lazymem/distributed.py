"""torch.distributed on lazymem tensors (issue 22).

``import torch_lazymem`` registers a c10d backend named ``lazymem`` for the ``lazymem`` device
(``Backend.register_backend(..., devices=["lazymem"])``). Its collectives are recorded in the pending
program like any op and run at materialization, once, whole, in the order they were recorded,
through a real backend of the backing device made over the same store: gloo for CPU, NCCL for
CUDA (csrc/distributed/collectives.cpp).

A process group made with the backing device's usual backend — ``init_process_group("gloo")`` on a
CPU backing, ``"nccl"`` on CUDA, or no backend at all — also gets ``lazymem`` for the lazymem
device, so the script that trains with DDP on CUDA runs unchanged with ``model.to("lazymem")``. A
``"device:backend"`` string is taken as written (add ``lazymem:lazymem`` to it).
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from . import _C

NAME = "lazymem"


def _inner_backend(store, rank: int, size: int, timeout: datetime.timedelta):
    """The backing device's backend over `store` (the lazymem device's own prefix of the group's
    store), with the group's timeout: collectives of a rank that died raise on the others."""
    if torch.device(_C._backing_device()).type == "cuda":
        if not dist.is_nccl_available():
            raise RuntimeError("lazymem: the backing device is CUDA but this torch has no NCCL")
        opts = c10d.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return c10d.ProcessGroupNCCL(store, rank, size, opts)
    if not dist.is_gloo_available():
        raise RuntimeError("lazymem: collectives on a CPU backing device need gloo, which this torch lacks")
    return c10d.ProcessGroupGloo(store, rank, size, timeout)


def _create(store, rank: int, size: int, timeout: datetime.timedelta):
    return _C._dist_backend(_inner_backend(store, rank, size, timeout), rank, size)


def _backing_backends() -> tuple[str, ...]:
    # The backends that serve the backing device: a group made with one of them serves lazymem too.
    return ("nccl",) if torch.device(_C._backing_device()).type == "cuda" else ("gloo",)


_original_config_init = c10d.BackendConfig.__init__


def _config_init(self, backend) -> None:
    _original_config_init(self, backend)
    name = str(backend).lower()
    serves_backing = name in _backing_backends() or name == c10d.Backend.UNDEFINED
    if serves_backing and NAME not in self.device_backend_map:
        # With two backends in the map, c10d makes one per device: gloo's "cuda" entry would get a
        # second gloo backend of its own. Without CUDA no tensor can use it, so it is left out.
        m = self.device_backend_map
        if "cuda" in m and m.get("cpu") == m["cuda"] and not torch.cuda.is_available():
            del m["cuda"]
        m[NAME] = c10d.Backend(NAME)


def register() -> None:
    """Registers the backend and adds it to groups made with the backing device's backend (once)."""
    if getattr(c10d.BackendConfig.__init__, "_lazymem", False):
        return
    if not dist.is_available():
        return
    dist.Backend.register_backend(NAME, _create, devices=[NAME])
    _config_init._lazymem = True  # type: ignore[attr-defined]
    c10d.BackendConfig.__init__ = _config_init  # type: ignore[method-assign]
