"""Lightning's Trainer trains on lazymem (torch_lazymem/integrations/lightning.py, issue 32):
``accelerator="lazymem"`` and ``accelerator="auto"`` choose the LazymemAccelerator and a
SingleDeviceStrategy on lazymem:0; a small CNN ends with the parameters of the same run on the CPU
(bitwise on the CPU backing device); ``integrations.disable()`` gives Lightning's own choice back."""

from __future__ import annotations

import warnings

import pytest
import torch
from splitting import check_steps

import torch_lazymem
from torch_lazymem import integrations

pl = pytest.importorskip("lightning.pytorch")

from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from torch_lazymem.integrations import lightning as lazymem_lightning  # noqa: E402

BITWISE = torch_lazymem.backing_device().type == "cpu"


class SmallCNN(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(1, 4, 3, padding=1)
        self.pool = torch.nn.MaxPool2d(2)
        self.fc = torch.nn.Linear(4 * 4 * 4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.pool(torch.relu(self.conv(x))), 1))

    def training_step(self, batch, batch_idx):  # noqa: ANN001, ANN201 - Lightning's hook
        x, y = batch
        return torch.nn.functional.cross_entropy(self(x), y)

    def configure_optimizers(self):  # noqa: ANN201 - Lightning's hook
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def _trainer(accelerator: str, **kwargs) -> pl.Trainer:  # noqa: ANN003
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return pl.Trainer(
            accelerator=accelerator,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            **kwargs,
        )


class _RecordDevices(pl.Callback):
    """The parameters' device types during training (Lightning moves the model back to the CPU in
    ``Strategy.teardown`` at the end of fit, for every non-CPU device)."""

    def __init__(self) -> None:
        self.types: set[str] = set()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
        self.types.update(p.device.type for p in pl_module.parameters())
        self.types.add(batch[0].device.type)


def _fit(accelerator: str, batch: int = 4) -> tuple[pl.Trainer, SmallCNN, set[str]]:
    torch.manual_seed(0)
    model = SmallCNN().double()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3 * batch, 1, 8, 8, dtype=torch.float64, generator=g)
    y = torch.randint(0, 3, (3 * batch,), generator=g)
    loader = DataLoader(TensorDataset(x, y), batch_size=batch, shuffle=False, num_workers=0)
    devices = _RecordDevices()
    trainer = _trainer(accelerator, max_steps=3, devices=1, callbacks=[devices])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model, loader)
    return trainer, model, devices.types


def test_fit_on_lazymem_matches_cpu() -> None:
    trainer, model, types = _fit("lazymem")
    assert isinstance(trainer.accelerator, lazymem_lightning.LazymemAccelerator)
    assert trainer.strategy.root_device == torch.device("lazymem", 0)
    # Parameters and batches were on lazymem while training; teardown moved the model to the CPU.
    assert types == {"lazymem"}
    params = dict(model.named_parameters())
    _, cpu_model, cpu_types = _fit("cpu")
    assert cpu_types == {"cpu"}
    torch.manual_seed(0)
    initial = dict(SmallCNN().double().named_parameters())
    assert not torch.equal(initial["fc.weight"], cpu_model.fc.weight.detach())  # it trained
    for name, p in cpu_model.named_parameters():
        got = params[name].detach().cpu()
        if BITWISE:
            assert torch.equal(got, p.detach()), name
        else:
            torch.testing.assert_close(got, p.detach())
    stats = trainer.accelerator.get_device_stats(trainer.strategy.root_device)
    assert stats["memory_allocated"] >= 0


def test_registries() -> None:
    assert "lazymem" in pl.accelerators.AcceleratorRegistry
    assert "single_lazymem" in pl.strategies.StrategyRegistry
    trainer = _trainer("lazymem", strategy="single_lazymem")
    assert trainer.strategy.root_device == torch.device("lazymem", 0)


def test_auto_chooses_lazymem_unless_disabled() -> None:
    trainer = _trainer("auto")
    assert isinstance(trainer.accelerator, lazymem_lightning.LazymemAccelerator)
    assert trainer.strategy.root_device.type == "lazymem"
    integrations.disable()
    try:
        trainer = _trainer("auto")
        assert not isinstance(trainer.accelerator, lazymem_lightning.LazymemAccelerator)
        expected = "cuda" if torch.cuda.is_available() else "cpu"
        assert trainer.strategy.root_device.type == expected
    finally:
        integrations.enable()


def test_fit_splits_where_eager_runs_out_of_memory() -> None:
    """Lightning's fit, 3 steps at a batch of 4,096 images (float64), on a simulated device of 40% of
    the CPU run's peak: the CPU run under that cap runs out of memory; on lazymem the steps split
    along the batch within the capacity, and the parameters equal the CPU run's."""
    def steps(dev):
        _, model, types = _fit(dev, batch=4096)
        assert types == {dev}
        return [p.detach().cpu() for p in model.parameters()]

    # (Nothing reads a value between Lightning's steps here: the 3 steps may be one program, one plan.)
    check_steps(steps, fraction=0.4)


class _Mixed(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(8, 16)
        self.b = torch.nn.Linear(16, 2)
        self.seen: list[tuple[torch.dtype, bool]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        self.seen.append((h.dtype, torch.is_autocast_enabled(x.device.type)))
        return self.b(h.relu())

    def training_step(self, batch, batch_idx):  # noqa: ANN001, ANN201 - Lightning's hook
        x, y = batch
        return torch.nn.functional.cross_entropy(self(x).float(), y)

    def configure_optimizers(self):  # noqa: ANN201 - Lightning's hook
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize("precision, dtype", [("bf16-mixed", torch.bfloat16), ("16-mixed", torch.float16)])
def test_mixed_precision_autocasts_on_lazymem(precision, dtype) -> None:
    """precision="bf16-mixed" and "16-mixed" autocast lazymem's ops (Lightning itself would autocast
    "cuda" for any accelerator but the CPU and MPS: silently full precision), fp16 with a GradScaler
    on lazymem; the model trains."""
    torch.manual_seed(0)
    model = _Mixed()
    before = model.a.weight.detach().clone()
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(12, 8, generator=g), torch.randint(0, 2, (12,), generator=g)
    trainer = _trainer("lazymem", max_steps=3, devices=1, precision=precision)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model, DataLoader(TensorDataset(x, y), batch_size=4))
    plugin = trainer.precision_plugin
    assert plugin.device == "lazymem"
    assert model.seen and all(s == (dtype, True) for s in model.seen), model.seen
    if precision == "16-mixed":
        assert plugin.scaler is not None and plugin.scaler._device == "lazymem"
    after = model.a.weight.detach().cpu()
    assert torch.isfinite(after).all() and not torch.equal(after, before)
