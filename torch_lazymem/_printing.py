"""print/repr for lazymem tensors: one transfer of the whole tensor to the CPU, then PyTorch's own
CPU formatting; the header keeps ``device='lazymem:0'``. Without this, PyTorch's formatter would read
the tensor element by element (one materialization per element)."""

from __future__ import annotations

from typing import Any

import torch
import torch._tensor_str as _tensor_str

_original_str = _tensor_str._str


def _has_data(t: torch.Tensor) -> bool:
    """A tensor whose values can be read: not a fake one (a FakeTensor reports the device it stands
    for; AOT autograd prints its graphs' metadata under FakeTensorMode, where reading values raises)."""
    if type(t) in (torch.Tensor, torch.nn.Parameter):
        return True
    from torch._subclasses.fake_tensor import is_fake

    return not is_fake(t)


def _str(self: torch.Tensor, *, tensor_contents: Any = None) -> str:
    if (
        tensor_contents is None
        and self.device.type == "lazymem"
        and self.layout == torch.strided
        and self.numel() > 0
        and _has_data(self)
    ):
        with torch.no_grad():
            cpu = self.detach().cpu()
        if self.is_conj():
            cpu = cpu.resolve_conj()
        indent = len("tensor(") if type(self) in (torch.Tensor, torch.nn.Parameter) else len(type(self).__name__) + 1
        with torch.no_grad():
            tensor_contents = _tensor_str._tensor_str(cpu, indent)
    return _original_str(self, tensor_contents=tensor_contents)


def install() -> None:
    _tensor_str._str = _str
