"""Python-side registration of the PrivateUse1 backend as ``lazymem`` (idempotent)."""

from __future__ import annotations

import torch

from . import _C, _device_module, _printing

_done = False


def register() -> None:
    global _done
    if _done:
        return
    name = torch._C._get_privateuse1_backend_name()
    if name != "lazymem":
        if name != "privateuseone":
            raise RuntimeError(
                f"lazymem: the PrivateUse1 backend is already registered as '{name}' in this process; "
                "torch_lazymem needs it. Import torch_lazymem in a process without that backend."
            )
        torch.utils.rename_privateuse1_backend("lazymem")
    if not hasattr(torch, "lazymem"):
        torch._register_device_module("lazymem", _device_module)
    if not hasattr(torch.Tensor, "is_lazymem"):
        torch.utils.generate_methods_for_privateuse1_backend(
            for_tensor=True, for_module=True, for_storage=True
        )
    _printing.install()
    _mark_module_state()
    _register_missing_metas()
    _done = True


_meta_lib: torch.library.Library | None = None


def _register_missing_metas() -> None:
    """Meta kernels later torch versions have and earlier ones lack: without one, an op runs eagerly
    on lazymem (whole, at once) instead of being recorded and planned. torch 2.11 lacks the fused
    encoder layer's (nn.TransformerEncoderLayer's inference fast path), which 2.13 registers."""
    global _meta_lib
    op = "aten::_transformer_encoder_layer_fwd"
    if _meta_lib is not None or torch._C._dispatch_has_kernel_for_dispatch_key(op, "Meta"):
        return
    _meta_lib = torch.library.Library("aten", "IMPL")

    def encoder_layer_meta(src: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        # As 2.13's: the layer's output has its input's shape and dtype.
        return src.clone() if src.numel() == 0 else torch.empty_like(src)

    _meta_lib.impl("_transformer_encoder_layer_fwd", encoder_layer_meta, "Meta")


def _mark_module_state() -> None:
    """Tensors that nn.Module.to / _apply copies to lazymem are the module's parameters and buffers:
    their uploads are never batch seeds (a data leaf is a tensor copied to lazymem that is neither)."""
    original = torch.nn.Module._apply
    if getattr(original, "_lazymem", False):
        return

    def _apply(self, fn, *args, **kwargs):
        _C._enter_module_state()
        try:
            return original(self, fn, *args, **kwargs)
        finally:
            _C._exit_module_state()

    _apply._lazymem = True  # type: ignore[attr-defined]
    torch.nn.Module._apply = _apply
