"""accelerate: ``PartialState`` (and so ``Accelerator`` and transformers' ``TrainingArguments``, which
builds its device on ``PartialState``) chooses lazymem by default when lazymem is the current
accelerator; mixed precision (bf16 autocast, fp16 autocast with a ``GradScaler``) runs on lazymem.

accelerate has no extension point for a new device type, so three of its functions are wrapped, each
deferring to accelerate's own code unless the device is lazymem and the integrations are enabled:

* ``accelerate.state.PartialState.default_device`` (state.py, ``set_device``:
  ``self.device = torch.device("cpu") if self._cpu else self.default_device``): the fixed chain
  mps, mlu, sdaa, musa, npu, hpu, cuda, xpu, neuron, cpu gains lazymem in front when
  ``torch.accelerator.current_accelerator()`` is lazymem (PyTorch puts a registered PrivateUse1 backend
  before CUDA, so this holds on CUDA machines as well). ``cpu=True`` / transformers' ``use_cpu=True``
  and ``ACCELERATE_TORCH_DEVICE`` (read by ``PartialState.__init__`` before ``set_device``) never reach
  ``default_device``, so they opt out as before; so does ``torch_lazymem.integrations.disable()``.
* ``accelerate.accelerator.Accelerator.__init__``: accelerate's fp16 branch raises
  ``fp16 mixed precision requires a device in ('xpu', 'cuda', ...)`` for any other device type. While
  ``__init__`` runs on a lazymem state, ``AcceleratorState.mixed_precision`` reads "no" instead of
  "fp16" (the fp16 branch is the only reader it changes: the fp8 and bf16 checks compare with other
  values), and the fp16 set-up accelerate would do is done after it: ``native_amp`` (autocast to
  float16 on the model's forward) and ``torch.amp.GradScaler("lazymem")``.
* ``is_bf16_available`` as ``accelerate.accelerator`` calls it (``native_amp = is_bf16_available(True)``
  for a device other than cpu, xpu and hpu): on lazymem, bf16 is available when the backing device
  supports it.
"""

from __future__ import annotations

import functools
import sys
import threading
from types import ModuleType

import torch

from . import check_version, enabled, lazymem_is_default, on_import

TESTED = ("1.15",)

_local = threading.local()


def backing_supports_bf16() -> bool:
    """bf16 on lazymem runs on the backing device: CUDA's answer when it is CUDA, else True (CPU)."""
    from torch_lazymem import backing_device

    device = backing_device()
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    return True


def _state_on_lazymem() -> bool:
    """Whether the (shared) accelerate state has chosen lazymem."""
    state = sys.modules.get("accelerate.state")
    if state is None:
        return False
    device = state.PartialState._shared_state.get("device")
    return enabled() and isinstance(device, torch.device) and device.type == "lazymem"


def _patch_state(module: ModuleType) -> None:
    check_version("accelerate", TESTED)
    PartialState = module.PartialState
    AcceleratorState = module.AcceleratorState

    original_default = PartialState.__dict__["default_device"]
    if not getattr(original_default.fget, "_lazymem", False):

        @functools.wraps(original_default.fget)
        def default_device(self) -> torch.device:
            if lazymem_is_default():
                return torch.device("lazymem")
            return original_default.fget(self)

        default_device._lazymem = True  # type: ignore[attr-defined]
        PartialState.default_device = property(default_device, doc=original_default.__doc__)

    original_mp = AcceleratorState.__dict__["mixed_precision"]
    if not getattr(original_mp.fget, "_lazymem", False):

        @functools.wraps(original_mp.fget)
        def mixed_precision(self) -> str:
            value = original_mp.fget(self)
            # Only while Accelerator.__init__ runs on a lazymem state: its fp16 branch would raise.
            if value == "fp16" and getattr(_local, "deferring_fp16", 0) and _state_on_lazymem():
                return "no"
            return value

        mixed_precision._lazymem = True  # type: ignore[attr-defined]
        AcceleratorState.mixed_precision = property(mixed_precision, doc=original_mp.__doc__)


def _patch_accelerator(module: ModuleType) -> None:
    check_version("accelerate", TESTED)
    Accelerator = module.Accelerator

    original_bf16 = module.is_bf16_available
    if not getattr(original_bf16, "_lazymem", False):

        @functools.wraps(original_bf16)
        def is_bf16_available(ignore_tpu: bool = False) -> bool:
            if _state_on_lazymem():
                return backing_supports_bf16()
            return original_bf16(ignore_tpu)

        is_bf16_available._lazymem = True  # type: ignore[attr-defined]
        module.is_bf16_available = is_bf16_available

    original_init = Accelerator.__init__
    if getattr(original_init, "_lazymem", False):
        return

    @functools.wraps(original_init)
    def __init__(self, *args, **kwargs) -> None:  # noqa: ANN001, ANN002, ANN003 - accelerate's signature
        _local.deferring_fp16 = getattr(_local, "deferring_fp16", 0) + 1
        try:
            original_init(self, *args, **kwargs)
        finally:
            _local.deferring_fp16 -= 1
        _setup_fp16(self, module)

    __init__._lazymem = True  # type: ignore[attr-defined]
    Accelerator.__init__ = __init__


def _setup_fp16(accelerator, module: ModuleType) -> None:  # noqa: ANN001 - an accelerate.Accelerator
    """What Accelerator.__init__ does for fp16 on a supported device, done for lazymem."""
    if not _state_on_lazymem() or accelerator.state.mixed_precision != "fp16":
        return
    DistributedType = module.DistributedType
    if accelerator.distributed_type in (DistributedType.DEEPSPEED, DistributedType.MEGATRON_LM):
        return
    if accelerator.native_amp and accelerator.scaler is not None:
        return
    accelerator.native_amp = True
    handler = accelerator.scaler_handler
    kwargs = handler.to_kwargs() if handler is not None else {}
    if accelerator.is_fsdp2:
        accelerator.scaler = module.get_fsdp2_grad_scaler(device="lazymem", **kwargs)
    else:
        accelerator.scaler = torch.amp.GradScaler("lazymem", **kwargs)


def install() -> None:
    on_import("accelerate.state", _patch_state)
    on_import("accelerate.accelerator", _patch_accelerator)
