"""Lightning: ``Trainer(accelerator="lazymem")`` trains on lazymem, and so does ``accelerator="auto"``
(Lightning's default) when lazymem is the current accelerator.

Lightning's accelerator registry is its extension point for a new accelerator: ``LazymemAccelerator``
(one device, ``lazymem:0``) is registered in ``AcceleratorRegistry`` under "lazymem" once
``lightning.pytorch.accelerators`` is imported, and the strategy ``SingleDeviceStrategy(device=
torch.device("lazymem", 0))`` in ``StrategyRegistry`` under "single_lazymem" once
``lightning.pytorch.strategies`` is. A registered accelerator is not enough on its own: three
methods of ``lightning.pytorch.trainer.connectors.accelerator_connector._AcceleratorConnector`` are
wrapped, each deferring to Lightning's own code unless lazymem applies:

* ``_choose_auto_accelerator`` (``return _select_auto_accelerator()``, whose fixed chain is tpu, mps,
  cuda, cpu): returns "lazymem" when ``torch.accelerator.current_accelerator()`` is lazymem and the
  integrations are enabled (PyTorch puts a registered PrivateUse1 backend before CUDA, so this holds on
  CUDA machines as well). ``torch_lazymem.integrations.disable()`` gives Lightning's choice back.
* ``_check_and_init_precision`` (``device = self._accelerator_flag if ... in ("cpu", "mps") else
  "cuda"; return MixedPrecision(self._precision_flag, device)``): for the lazymem accelerator,
  ``precision="bf16-mixed"`` and ``"16-mixed"`` get ``MixedPrecision(..., "lazymem")``: autocast on
  lazymem, and for fp16 a ``GradScaler`` on lazymem.
* ``_choose_strategy`` (``if isinstance(self._accelerator_flag, (CUDAAccelerator, MPSAccelerator)) or
  ... in ("cuda", "gpu", "mps"): device = _determine_root_gpu_device(...) else: device = "cpu"``; then
  ``return SingleDeviceStrategy(device=device)``): any other accelerator would get a CPU strategy, so
  the model would never be moved to lazymem. For the lazymem accelerator (the name or an instance) on
  one node, the strategy is ``SingleDeviceStrategy(device=torch.device("lazymem", 0))``. This applies
  whenever the lazymem accelerator was chosen, also with the integrations disabled, since then only an
  explicit ``accelerator="lazymem"`` chooses it.

The standalone package ``pytorch_lightning`` is the same code under another name: the same hooks are
registered for it, with its own ``LazymemAccelerator`` subclass (``accelerator_class("pytorch_lightning")``).

Tested with lightning 2.6 (pytorch_lightning 2.6). torch_lazymem never imports Lightning itself.
"""

from __future__ import annotations

import functools
import sys
from types import ModuleType
from typing import Any

import torch

from . import check_version, lazymem_is_default, on_import

TESTED = ("2.6",)
# The package prefix of Lightning's trainer code -> (distribution name for the version check).
_PACKAGES = {"lightning.pytorch": "lightning", "pytorch_lightning": "pytorch_lightning"}

# Package prefix -> its LazymemAccelerator class (a subclass of that package's Accelerator).
_accelerators: dict[str, type] = {}

LAZYMEM_DEVICE = torch.device("lazymem", 0)


def accelerator_class(package: str = "lightning.pytorch") -> type:
    """The ``LazymemAccelerator`` of ``package`` ("lightning.pytorch" or "pytorch_lightning"); exists once
    that package's accelerators are imported."""
    try:
        return _accelerators[package]
    except KeyError:
        raise RuntimeError(f"lazymem: {package} is not imported yet") from None


def __getattr__(name: str) -> Any:
    # `LazymemAccelerator` for lightning.pytorch: created when Lightning is imported, never before.
    if name == "LazymemAccelerator" and "lightning.pytorch" in _accelerators:
        return _accelerators["lightning.pytorch"]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _make_accelerator(package: str, base: type, misconfiguration: type) -> type:
    class LazymemAccelerator(base):  # type: ignore[misc, valid-type]
        """Accelerator for lazymem: one device, ``lazymem:0`` (ops are recorded, planned against the memory
        budget and replayed on the backing device)."""

        def setup_device(self, device: torch.device) -> None:
            if device.type != "lazymem":
                raise misconfiguration(f"Device should be lazymem, got {device} instead.")
            torch.lazymem.set_device(device)

        def get_device_stats(self, device: Any) -> dict[str, Any]:
            lazymem = torch.lazymem
            free, total = lazymem.mem_get_info(device)
            return {
                "memory_allocated": lazymem.memory_allocated(device),
                "max_memory_allocated": lazymem.max_memory_allocated(device),
                "memory_reserved": lazymem.memory_reserved(device),
                "memory_free": free,
                "memory_total": total,
            }

        def teardown(self) -> None:
            pass

        @staticmethod
        def parse_devices(devices: Any) -> int:
            if devices in ("auto", -1, "-1", 1, "1", [0], (0,), "0,"):
                return 1
            raise misconfiguration(f"lazymem has one device, `lazymem:0`; got `devices={devices!r}`.")

        @staticmethod
        def get_parallel_devices(devices: Any) -> list[torch.device]:
            LazymemAccelerator.parse_devices(devices)
            return [LAZYMEM_DEVICE]

        @staticmethod
        def auto_device_count() -> int:
            return 1

        @staticmethod
        def is_available() -> bool:
            return True

        @staticmethod
        def name() -> str:
            return "lazymem"

        @classmethod
        def register_accelerators(cls, accelerator_registry: Any) -> None:
            accelerator_registry.register(cls.name(), cls, description=cls.__name__, override=True)

    LazymemAccelerator.__module__ = __name__
    LazymemAccelerator.__qualname__ = "LazymemAccelerator"
    return LazymemAccelerator


def _is_lazymem_accelerator(package: str, flag: Any) -> bool:
    cls = _accelerators.get(package)
    return flag == "lazymem" or (cls is not None and isinstance(flag, cls))


def _patch_accelerators(package: str, module: ModuleType) -> None:
    check_version(_PACKAGES[package], TESTED)
    if package not in _accelerators:
        exceptions = sys.modules.get(f"{package}.utilities.exceptions") or __import__(
            f"{package}.utilities.exceptions", fromlist=["MisconfigurationException"]
        )
        _accelerators[package] = _make_accelerator(
            package, module.Accelerator, exceptions.MisconfigurationException
        )
    _accelerators[package].register_accelerators(module.AcceleratorRegistry)


def _patch_strategies(package: str, module: ModuleType) -> None:
    check_version(_PACKAGES[package], TESTED)
    module.StrategyRegistry.register(
        "single_lazymem",
        module.SingleDeviceStrategy,
        description="SingleDeviceStrategy on lazymem:0",
        override=True,
        device=LAZYMEM_DEVICE,
    )


def _patch_connector(package: str, module: ModuleType) -> None:
    check_version(_PACKAGES[package], TESTED)
    Connector = module._AcceleratorConnector
    SingleDeviceStrategy = module.SingleDeviceStrategy

    original_auto = Connector.__dict__["_choose_auto_accelerator"]
    if not getattr(original_auto, "_lazymem", False):
        auto_fn = original_auto.__func__ if isinstance(original_auto, staticmethod) else original_auto

        @functools.wraps(auto_fn)
        def _choose_auto_accelerator(*args: Any) -> Any:
            if lazymem_is_default() and package in _accelerators:
                return "lazymem"
            return auto_fn(*args)

        _choose_auto_accelerator._lazymem = True  # type: ignore[attr-defined]
        Connector._choose_auto_accelerator = (
            staticmethod(_choose_auto_accelerator) if isinstance(original_auto, staticmethod) else _choose_auto_accelerator
        )

    original_strategy = Connector._choose_strategy
    if not getattr(original_strategy, "_lazymem", False):

        @functools.wraps(original_strategy)
        def _choose_strategy(self) -> Any:  # noqa: ANN001 - Lightning's connector
            if (
                _is_lazymem_accelerator(package, self._accelerator_flag)
                and self._num_nodes_flag <= 1
                and len(self._parallel_devices) <= 1
            ):
                return SingleDeviceStrategy(device=LAZYMEM_DEVICE)
            return original_strategy(self)

        _choose_strategy._lazymem = True  # type: ignore[attr-defined]
        Connector._choose_strategy = _choose_strategy

    MixedPrecision = module.MixedPrecision
    original_precision = Connector._check_and_init_precision
    if not getattr(original_precision, "_lazymem", False):

        @functools.wraps(original_precision)
        def _check_and_init_precision(self) -> Any:  # noqa: ANN001 - Lightning's connector
            plugin = original_precision(self)
            # Lightning autocasts "cuda" for every accelerator but the CPU and MPS: lazymem's ops would
            # run in full precision, silently, and 16-mixed would scale on CUDA's GradScaler.
            if (
                type(plugin) is MixedPrecision
                and plugin.device != "lazymem"
                and _is_lazymem_accelerator(package, self._accelerator_flag)
            ):
                return MixedPrecision(plugin.precision, "lazymem")
            return plugin

        _check_and_init_precision._lazymem = True  # type: ignore[attr-defined]
        Connector._check_and_init_precision = _check_and_init_precision


def install() -> None:
    for package in _PACKAGES:
        on_import(f"{package}.accelerators", functools.partial(_patch_accelerators, package))
        on_import(f"{package}.strategies", functools.partial(_patch_strategies, package))
        on_import(
            f"{package}.trainer.connectors.accelerator_connector", functools.partial(_patch_connector, package)
        )
