"""transformers: ``TrainingArguments`` (and so ``Trainer``, which moves the model to ``args.device``
and builds its ``Accelerator`` on the same shared state) chooses lazymem by default when lazymem is
the current accelerator, with ``n_gpu`` 1, and accepts ``bf16=True`` there.

``TrainingArguments._setup_devices`` (training_args.py) builds accelerate's ``PartialState`` first
(``self.distributed_state = PartialState(**accelerator_state_kwargs)``, ``cpu=True`` for ``use_cpu``),
which the accelerate integration makes choose lazymem; but for a non-distributed run it then picks the
device again by its own chain, ending in

    device = torch.device(
        "cuda:0" if torch.cuda.is_available() else os.environ.get("ACCELERATE_TORCH_DEVICE", "cpu")
    )
    self._n_gpu = torch.cuda.device_count()

so on a CUDA machine it would choose cuda:0 (and nn.DataParallel with several GPUs), and on a CPU
machine the CPU. transformers has no extension point for this, so ``_setup_devices`` is wrapped: when
the integrations are enabled, ``use_cpu`` is off, the run is not distributed and the state it built
chose lazymem, the device is the state's (lazymem) and ``n_gpu`` is 1. Otherwise transformers' own
choice stands: ``use_cpu=True``, ``ACCELERATE_TORCH_DEVICE=cpu|cuda`` and
``torch_lazymem.integrations.disable()`` opt out.

``TrainingArguments.__post_init__`` refuses ``bf16=True`` without ``use_cpu`` unless
``is_torch_bf16_gpu_available()``, which knows CUDA, XPU, HPU, ...; as training_args calls it, it
answers for lazymem (the backing device's support) when lazymem is the device that will be chosen.

fp16 and bf16 then run through accelerate (``Trainer`` passes ``mixed_precision`` to its
``Accelerator``), which the accelerate integration makes run on lazymem.

``Trainer._save_rng_state`` / ``_load_rng_state`` (trainer.py) keep the python, numpy, CPU and the
CUDA/NPU/HPU/MLU/MUSA generators' states in a checkpoint's ``rng_state.pth``, not lazymem's; so a run
resumed from a checkpoint would draw its dropout masks on lazymem from a freshly seeded generator.
Both are wrapped: on a lazymem run the file also holds ``"lazymem": torch.lazymem.get_rng_state()``,
restored on resume (a checkpoint without the key is loaded as before).
"""

from __future__ import annotations

import functools
import os
from functools import cached_property
from types import ModuleType

import torch

from . import check_version, enabled, lazymem_is_default, on_import
from .accelerate import backing_supports_bf16

# 5.17: the GPU machines'; 5.18: the CPU machines'.
TESTED = ("5.17", "5.18")


def _env_true(name: str) -> bool:
    return os.environ.get(name, "false").strip().lower() in ("1", "true", "yes", "on", "y")


def _will_choose_lazymem() -> bool:
    """Whether a TrainingArguments without use_cpu will choose lazymem (before _setup_devices runs)."""
    if not enabled() or _env_true("ACCELERATE_USE_CPU"):
        return False
    env_device = os.environ.get("ACCELERATE_TORCH_DEVICE")
    if env_device is not None:
        try:
            return torch.device(env_device).type == "lazymem"
        except RuntimeError:  # accelerate reports the bad device
            return False
    return lazymem_is_default()


def _patch_training_args(module: ModuleType) -> None:
    check_version("transformers", TESTED)

    TrainingArguments = module.TrainingArguments

    original = TrainingArguments.__dict__["_setup_devices"]
    if not getattr(original.func, "_lazymem", False):
        setup_devices = original.func

        @functools.wraps(setup_devices)
        def _setup_devices(self) -> torch.device:  # noqa: ANN001 - a TrainingArguments
            device = setup_devices(self)
            if not enabled() or self.use_cpu:
                return device
            state = self.distributed_state
            if (
                state is not None
                and state.distributed_type == "NO"  # accelerate's DistributedType.NO, a str enum
                and getattr(state, "device", None) is not None
                and state.device.type == "lazymem"
            ):
                # The state accelerate built chose lazymem: not cuda:0, nor DataParallel over every GPU.
                device = state.device
                self._n_gpu = 1
            return device

        _setup_devices._lazymem = True  # type: ignore[attr-defined]
        replacement = cached_property(_setup_devices)
        replacement.__set_name__(TrainingArguments, "_setup_devices")
        TrainingArguments._setup_devices = replacement

    original_bf16 = module.is_torch_bf16_gpu_available
    if not getattr(original_bf16, "_lazymem", False):

        @functools.wraps(original_bf16)
        def is_torch_bf16_gpu_available() -> bool:
            if _will_choose_lazymem():
                return backing_supports_bf16()
            return original_bf16()

        is_torch_bf16_gpu_available._lazymem = True  # type: ignore[attr-defined]
        module.is_torch_bf16_gpu_available = is_torch_bf16_gpu_available


def _rng_file(trainer, directory: str) -> str:  # noqa: ANN001 - a transformers.Trainer
    name = "rng_state.pth" if trainer.args.world_size <= 1 else f"rng_state_{trainer.args.process_index}.pth"
    return os.path.join(directory, name)


def _on_lazymem(trainer) -> bool:  # noqa: ANN001 - a transformers.Trainer
    return enabled() and trainer.args.device.type == "lazymem"


def _patch_trainer(module: ModuleType) -> None:
    check_version("transformers", TESTED)
    Trainer = module.Trainer
    save, load = Trainer._save_rng_state, Trainer._load_rng_state
    if getattr(save, "_lazymem", False):
        return

    @functools.wraps(save)
    def _save_rng_state(self, output_dir: str) -> None:  # noqa: ANN001 - a Trainer
        save(self, output_dir)
        path = _rng_file(self, output_dir)
        if not _on_lazymem(self) or not os.path.isfile(path):
            return
        with module.safe_globals():
            states = torch.load(path, weights_only=True)
        states["lazymem"] = torch.lazymem.get_rng_state()
        torch.save(states, path)

    @functools.wraps(load)
    def _load_rng_state(self, checkpoint: str | None) -> None:  # noqa: ANN001 - a Trainer
        load(self, checkpoint)
        if checkpoint is None or not _on_lazymem(self):
            return
        path = _rng_file(self, checkpoint)
        if not os.path.isfile(path):
            return
        with module.safe_globals():
            states = torch.load(path, weights_only=True)
        if "lazymem" in states:
            torch.lazymem.set_rng_state(states["lazymem"])

    _save_rng_state._lazymem = True  # type: ignore[attr-defined]
    _load_rng_state._lazymem = True  # type: ignore[attr-defined]
    Trainer._save_rng_state = _save_rng_state
    Trainer._load_rng_state = _load_rng_state


def install() -> None:
    on_import("transformers.training_args", _patch_training_args)
    on_import("transformers.trainer", _patch_trainer)
