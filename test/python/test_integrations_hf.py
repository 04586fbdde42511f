"""transformers' Trainer and accelerate's Accelerator choose lazymem by default once torch_lazymem is
imported (torch_lazymem/integrations/transformers.py and accelerate.py, issue 32): a tiny GPT-2 trained
by Trainer, and a small model trained by Accelerator, end with the parameters of the same run on the
CPU (bitwise on the CPU backing device), and mixed precision (bf16 autocast; fp16 with a GradScaler)
runs on lazymem."""

from __future__ import annotations

import functools
import os
from unittest import mock

import pytest
import torch
from splitting import check_steps

import torch_lazymem
from torch_lazymem import integrations

transformers = pytest.importorskip("transformers")
accelerate = pytest.importorskip("accelerate")

from accelerate import Accelerator  # noqa: E402
from accelerate.state import AcceleratorState, GradientState  # noqa: E402
from accelerate.utils import GradScalerKwargs  # noqa: E402
from transformers import (  # noqa: E402
    GPT2Config,
    GPT2LMHeadModel,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

# Without a GPU, lazymem runs the CPU's kernels on the same data as a CPU run: bitwise equal. On a
# CUDA backing device the kernels are CUDA's: float64 runs then agree to rounding.
BITWISE = torch_lazymem.backing_device().type == "cpu"
# What transformers chooses when lazymem is opted out of.
FRAMEWORK_DEFAULT = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True)
def _fresh_state(monkeypatch):
    """Each test starts without accelerate's shared state, with no device variable and integrations on."""
    for name in ("ACCELERATE_TORCH_DEVICE", "ACCELERATE_USE_CPU", "ACCELERATE_MIXED_PRECISION"):
        monkeypatch.delenv(name, raising=False)
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    integrations.enable()
    yield
    integrations.enable()
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def assert_same(lazy: dict[str, torch.Tensor], cpu: dict[str, torch.Tensor]) -> None:
    assert lazy.keys() == cpu.keys()
    for name in lazy:
        if BITWISE:
            assert torch.equal(lazy[name], cpu[name]), name
        else:
            torch.testing.assert_close(lazy[name], cpu[name], rtol=1e-9, atol=1e-11, msg=name)


# ------------------------------------------------------------------ TrainingArguments: the device


def _args(tmp_path, **kwargs) -> TrainingArguments:
    return TrainingArguments(output_dir=str(tmp_path), report_to=[], **kwargs)


def test_training_arguments_choose_lazymem(tmp_path, monkeypatch):
    args = _args(tmp_path)
    assert args.device.type == "lazymem" and args.n_gpu == 1
    assert args.distributed_state.device.type == "lazymem"
    assert str(args.parallel_mode) == "ParallelMode.NOT_PARALLEL"

    args = _args(tmp_path, use_cpu=True)
    assert args.device.type == "cpu" and args.n_gpu == 0

    monkeypatch.setenv("ACCELERATE_TORCH_DEVICE", "cpu")
    args = _args(tmp_path)
    assert args.device.type == FRAMEWORK_DEFAULT and args.distributed_state.device.type == "cpu"
    monkeypatch.delenv("ACCELERATE_TORCH_DEVICE")

    integrations.disable()
    try:
        args = _args(tmp_path)
        assert args.device.type == FRAMEWORK_DEFAULT
    finally:
        integrations.enable()
    assert _args(tmp_path).device.type == "lazymem"


def test_training_arguments_bf16_on_lazymem(tmp_path):
    # __post_init__ refuses bf16 without use_cpu unless is_torch_bf16_gpu_available(): on lazymem the
    # backing device answers.
    args = _args(tmp_path, bf16=True)
    assert args.device.type == "lazymem" and args.mixed_precision == "bf16"


def _clear_grown_caches(before: dict) -> None:
    for fn, size in before.items():
        if fn.cache_info().currsize != size:
            fn.cache_clear()


def _lru_functions() -> dict:
    import accelerate.utils.imports as a_imports
    import transformers.utils.import_utils as t_imports

    found = {}
    for module in (a_imports, t_imports):
        for value in vars(module).values():
            if isinstance(value, functools._lru_cache_wrapper):
                found[value] = value.cache_info().currsize
    return found


def test_training_arguments_on_a_cuda_machine(tmp_path):
    """As on a machine with two GPUs: transformers' own chain would pick cuda:0 with n_gpu 2
    (nn.DataParallel); lazymem is chosen, with n_gpu 1. (CUDA's availability is simulated; nothing runs.)"""
    before = _lru_functions()
    try:
        with mock.patch("torch.cuda.is_available", lambda: True), mock.patch(
            "torch.cuda.device_count", lambda: 2
        ), mock.patch("torch.cuda.set_device", lambda device: None):
            args = _args(tmp_path)
            assert args.device.type == "lazymem" and args.n_gpu == 1
            assert str(args.parallel_mode) == "ParallelMode.NOT_PARALLEL"
            integrations.disable()
            args = _args(tmp_path)
            assert args.device == torch.device("cuda:0") and args.n_gpu == 2
            integrations.enable()
            args = _args(tmp_path, use_cpu=True)
            assert args.device.type == "cpu" and args.n_gpu == 0
    finally:
        integrations.enable()
        _clear_grown_caches(before)


# ------------------------------------------------------------------ Trainer


def _dataset(n: int = 12, seq: int = 8) -> list[dict[str, torch.Tensor]]:
    ids = torch.randint(0, 64, (n, seq), generator=torch.Generator().manual_seed(1))
    return [{"input_ids": ids[i], "labels": ids[i]} for i in range(n)]


def _gpt2(dtype: torch.dtype = torch.float64, dropout: float = 0.0) -> GPT2LMHeadModel:
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=64, n_positions=32, n_embd=16, n_layer=2, n_head=2,
        resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout,
    )  # fmt: skip
    return GPT2LMHeadModel(config).to(dtype)


class _StaysOn(TrainerCallback):
    """Checks after every optimizer step that the parameters and the optimizer's state are on `device`."""

    def __init__(self, device: str) -> None:
        self.device = device
        self.steps = 0

    def on_step_end(self, args, state, control, model=None, optimizer=None, **kwargs):  # noqa: ANN001
        self.steps += 1
        assert all(p.device.type == self.device for p in model.parameters())
        for values in optimizer.state.values():
            for value in values.values():
                if torch.is_tensor(value) and value.dim() > 0:
                    assert value.device.type == self.device


def _train(tmp_path, use_cpu, model=None, max_steps=3, resume=None, dataset=None, **kwargs):  # noqa: ANN001
    kwargs.setdefault("save_strategy", "no")
    kwargs.setdefault("per_device_train_batch_size", 2)
    args = TrainingArguments(
        output_dir=str(tmp_path / ("cpu" if use_cpu else "lazymem")), report_to=[], use_cpu=use_cpu,
        max_steps=max_steps, learning_rate=1e-2, seed=0,
        dataloader_num_workers=0, logging_steps=1, disable_tqdm=True, **kwargs,
    )  # fmt: skip
    device = "cpu" if use_cpu else "lazymem"
    assert args.device.type == device
    check = _StaysOn(device)
    dataset = dataset or _dataset()
    trainer = Trainer(model=model or _gpt2(), args=args, train_dataset=dataset, callbacks=[check])
    trainer.train(resume_from_checkpoint=resume)
    if args.optim == "adamw_torch":
        assert len(trainer.optimizer.state) == len(list(trainer.model.parameters()))
    assert check.steps == max_steps - (int(resume.rsplit("-", 1)[1]) if resume else 0)
    assert all(p.device.type == device for p in trainer.model.parameters())
    params = {k: v.detach().cpu() for k, v in trainer.model.state_dict().items()}
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return trainer, params, losses


@pytest.mark.parametrize("accumulation", [1, 2])
def test_trainer_matches_cpu(tmp_path, accumulation):
    _, lazy, lazy_losses = _train(tmp_path, False, gradient_accumulation_steps=accumulation)
    _, cpu, cpu_losses = _train(tmp_path, True, gradient_accumulation_steps=accumulation)
    assert len(lazy_losses) == 3
    if BITWISE:
        assert lazy_losses == cpu_losses
    assert_same(lazy, cpu)


def test_trainer_splits_where_eager_runs_out_of_memory(tmp_path):
    """Trainer's 3 steps at a batch of 96 x 32 tokens (float64) on a simulated device of 40% of the
    peak the same steps take on the CPU: the CPU run under that cap runs out of memory; on lazymem
    every step splits along the batch, the peak stays within the capacity, and the parameters and
    losses equal the CPU run's (float64; the loss transformers computes in float32)."""
    kwargs = dict(per_device_train_batch_size=96, dataset=_dataset(n=288, seq=32))

    def steps(dev):
        _, params, losses = _train(tmp_path, dev == "cpu", **kwargs)
        return [torch.tensor(losses, dtype=torch.float64), *params.values()]

    check_steps(steps, fraction=0.4, min_splits=3)


def _autocast_dtypes(model: GPT2LMHeadModel) -> list[torch.dtype]:
    seen: list[torch.dtype] = []
    model.transformer.h[0].attn.c_attn.register_forward_hook(lambda m, i, out: seen.append(out.dtype))
    return seen


def test_trainer_mixed_precision(tmp_path):
    # bf16: autocast on lazymem, against the same run on the CPU. torch.autocast("lazymem") casts as
    # CUDA's autocast does (pow, layer_norm, ... in float32), the CPU's keeps them in bfloat16: close,
    # not bitwise.
    model = _gpt2(torch.float32)
    seen = _autocast_dtypes(model)
    trainer, lazy, lazy_losses = _train(tmp_path, False, model=model, bf16=True, optim="sgd")
    assert seen and set(seen) == {torch.bfloat16} and trainer.accelerator.native_amp
    _, cpu, cpu_losses = _train(tmp_path, True, model=_gpt2(torch.float32), bf16=True, optim="sgd")
    torch.testing.assert_close(lazy_losses, cpu_losses, rtol=1e-3, atol=0)
    for name in lazy:
        torch.testing.assert_close(lazy[name], cpu[name], rtol=0, atol=1e-3, msg=name)

    # fp16: autocast to float16 and a GradScaler on lazymem.
    model = _gpt2(torch.float32)
    seen = _autocast_dtypes(model)
    trainer, fp16, fp16_losses = _train(tmp_path / "fp16", False, model=model, fp16=True, optim="sgd")
    assert seen and set(seen) == {torch.float16}
    scaler = trainer.accelerator.scaler
    assert isinstance(scaler, torch.amp.GradScaler) and scaler.is_enabled() and scaler._device == "lazymem"
    assert trainer.state.global_step == 3 and 0 < scaler.get_scale() <= 2.0**16
    torch.testing.assert_close(fp16_losses, cpu_losses, rtol=1e-2, atol=0)


def test_trainer_checkpoint_resume(tmp_path):
    """Save at step 2 (safetensors, optimizer, scheduler, RNG states, lazymem's included) and resume in
    a fresh Trainer: the same parameters as the uninterrupted run, dropout masks included."""
    full_trainer, full, _ = _train(
        tmp_path / "full", False, model=_gpt2(dropout=0.1), max_steps=4, save_strategy="steps", save_steps=2
    )
    checkpoint = tmp_path / "full" / "lazymem" / "checkpoint-2"
    saved = set(os.listdir(checkpoint))
    assert {"model.safetensors", "optimizer.pt", "scheduler.pt", "rng_state.pth"} <= saved
    assert "lazymem" in torch.load(checkpoint / "rng_state.pth", weights_only=False)
    resumed_trainer, resumed, _ = _train(
        tmp_path / "resumed", False, model=_gpt2(dropout=0.1), max_steps=4, resume=str(checkpoint)
    )
    assert resumed_trainer.state.global_step == 4
    for name in full:
        assert torch.equal(full[name], resumed[name]), name


def test_trainer_auto_find_batch_size_never_shrinks(tmp_path):
    """lazymem plans a step that does not fit its memory budget in chunks of the batch instead of
    running out of memory, so auto_find_batch_size keeps the batch size it starts with. (The step of
    batch 32 peaks at about 4.3 MB unbudgeted on the CPU backing device; it runs within 2.5 MB.)"""
    budget = 2_500_000
    torch_lazymem.set_memory_budget(budget)
    torch.lazymem.reset_peak_memory_stats()
    try:
        trainer, _, losses = _train(
            tmp_path, False, max_steps=1, dataset=_dataset(32, 16), per_device_train_batch_size=32,
            auto_find_batch_size=True,
        )  # fmt: skip
    finally:
        torch_lazymem.set_memory_budget(None)
    assert trainer._train_batch_size == 32 and trainer.args.per_device_train_batch_size == 32
    assert len(losses) == 1 and torch.lazymem.max_memory_allocated() <= budget


# ------------------------------------------------------------------ Accelerator


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(8, 16)
        self.b = torch.nn.Linear(16, 1)
        self.seen: list[tuple[torch.dtype, bool]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        self.seen.append((h.dtype, torch.is_autocast_enabled(x.device.type)))
        return self.b(torch.relu(h))


def _accelerate_run(cpu: bool, mixed_precision: str = "no", dtype=torch.float64, **kwargs):  # noqa: ANN003
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    accelerator = Accelerator(cpu=cpu, mixed_precision=mixed_precision, **kwargs)
    torch.manual_seed(0)
    model = _Net().to(dtype)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(24, 8, generator=g, dtype=dtype), torch.randn(24, 1, generator=g, dtype=dtype)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    device = accelerator.device.type
    losses, norms = [], []
    for xb, yb in loader:
        assert xb.device.type == device
        loss = torch.nn.functional.mse_loss(model(xb).to(dtype), yb)
        accelerator.backward(loss)
        norms.append(accelerator.clip_grad_norm_(model.parameters(), 0.5))
        optimizer.step()
        optimizer.zero_grad()
        gathered = accelerator.gather(loss.detach())
        assert gathered.device.type == device
        losses.append(gathered.cpu())
    net = accelerator.unwrap_model(model)
    assert all(p.device.type == device for p in net.parameters())
    for values in optimizer.state.values():
        for value in values.values():
            if torch.is_tensor(value) and value.dim() > 0:
                assert value.device.type == device
    params = {k: v.detach().cpu() for k, v in net.state_dict().items()}
    return accelerator, net, params, losses


def test_accelerator_chooses_lazymem(monkeypatch):
    assert Accelerator().device.type == "lazymem"
    AcceleratorState._reset_state(reset_partial_state=True)
    assert Accelerator(cpu=True).device.type == "cpu"
    AcceleratorState._reset_state(reset_partial_state=True)
    monkeypatch.setenv("ACCELERATE_TORCH_DEVICE", "cpu")
    assert Accelerator().device.type == "cpu"
    monkeypatch.delenv("ACCELERATE_TORCH_DEVICE")
    AcceleratorState._reset_state(reset_partial_state=True)
    integrations.disable()
    try:
        assert Accelerator().device.type == FRAMEWORK_DEFAULT
    finally:
        integrations.enable()


def test_accelerator_training_matches_cpu():
    _, _, lazy, lazy_losses = _accelerate_run(cpu=False)
    _, _, cpu, cpu_losses = _accelerate_run(cpu=True)
    assert_same(lazy, cpu)
    assert_same(dict(enumerate(lazy_losses)), dict(enumerate(cpu_losses)))


def _accelerate_gpt2(cpu: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """accelerate's prepare / backward / clip_grad_norm_ / step over 3 batches of 96 x 32 tokens (the
    tiny GPT-2, float64, AdamW): the losses and the final parameters."""
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    accelerator = Accelerator(cpu=cpu)
    model = _gpt2()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.randint(0, 64, (288, 32), generator=torch.Generator().manual_seed(1))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids), batch_size=96)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    losses = []
    for (xb,) in loader:
        loss = model(input_ids=xb, labels=xb).loss
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    net = accelerator.unwrap_model(model)
    assert all(p.device.type == accelerator.device.type for p in net.parameters())
    for values in optimizer.state.values():
        for value in values.values():
            if torch.is_tensor(value) and value.dim() > 0:
                assert value.device.type == accelerator.device.type
    return torch.tensor(losses, dtype=torch.float64), {k: v.detach().cpu() for k, v in net.state_dict().items()}


def test_accelerator_splits_where_eager_runs_out_of_memory():
    """An accelerate loop on a simulated device of 40% of the CPU run's peak: the CPU run under that
    cap runs out of memory; on lazymem every step splits along the batch within the capacity, and the
    losses (transformers computes them in float32) and parameters equal the CPU run's (float64)."""
    def steps(dev):
        losses, params = _accelerate_gpt2(cpu=dev == "cpu")
        return [losses, *params.values()]

    check_steps(steps, fraction=0.4, min_splits=3)


def test_accelerator_bf16_autocast():
    accelerator, net, lazy, _ = _accelerate_run(cpu=False, mixed_precision="bf16", dtype=torch.float32)
    assert accelerator.native_amp and net.seen and set(net.seen) == {(torch.bfloat16, True)}
    _, net_cpu, cpu, _ = _accelerate_run(cpu=True, mixed_precision="bf16", dtype=torch.float32)
    assert set(net_cpu.seen) == {(torch.bfloat16, True)}
    # linear, relu and mse_loss are cast alike by lazymem's (CUDA's) and the CPU's autocast policies.
    if BITWISE:
        assert_same(lazy, cpu)
    else:
        for name in lazy:
            torch.testing.assert_close(lazy[name], cpu[name], rtol=0, atol=1e-2, msg=name)


def test_accelerator_fp16_grad_scaler():
    # accelerate's default scale, 2**16, overflows float16 gradients here: the step is skipped and the
    # scale halved, as on CUDA.
    accelerator, _, _, _ = _accelerate_run(cpu=False, mixed_precision="fp16", dtype=torch.float32)
    assert accelerator.scaler.get_scale() == 2.0**15
    # The scaler's kwargs (GradScalerKwargs) reach the lazymem GradScaler; with a scale that does not
    # overflow, no step is skipped and training follows the float32 run.
    handler = GradScalerKwargs(init_scale=2.0**10)
    accelerator, net, lazy, losses = _accelerate_run(
        cpu=False, mixed_precision="fp16", dtype=torch.float32, kwargs_handlers=[handler]
    )
    assert accelerator.native_amp and set(net.seen) == {(torch.float16, True)}
    scaler = accelerator.scaler
    assert isinstance(scaler, torch.amp.GradScaler) and scaler.is_enabled() and scaler._device == "lazymem"
    assert scaler.get_scale() == 2.0**10  # three finite steps: none skipped, no growth yet
    _, _, reference, reference_losses = _accelerate_run(cpu=True, dtype=torch.float32)
    torch.testing.assert_close(torch.stack(losses), torch.stack(reference_losses), rtol=1e-2, atol=0)
    for name in lazy:
        torch.testing.assert_close(lazy[name], reference[name], rtol=0, atol=1e-2, msg=name)


def test_an_untested_framework_version_warns_once_naming_it(monkeypatch):
    """The integrations check each framework's version once, and warn, naming the version, when it is
    not one they were tested with."""
    from torch_lazymem import integrations

    monkeypatch.setattr(integrations, "_checked", set())
    with pytest.warns(UserWarning, match="lazymem: the accelerate integration was tested with accelerate 1.15, not 0.9.1"):
        integrations.check_version("accelerate", ("1.15",), "0.9.1")
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        integrations.check_version("accelerate", ("1.15",), "0.9.1")  # once per framework
    monkeypatch.setattr(integrations, "_checked", set())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        integrations.check_version("transformers", ("5.17", "5.18"))  # the installed 5.18: no warning
