"""torch_lazymem demo: a small model runs on the lazymem device and matches eager PyTorch bitwise.

Runs a CNN + MLP forward pass on eager CPU and on lazymem (backed by the CPU), checks that every
output is bitwise equal, and prints what lazymem recorded and ran: ops recorded, nodes executed and
eliminated, and the device memory it held, on the simulated memory-capped device. Then trains the
same model for a few steps with an unmodified training loop on both and compares every loss and
every parameter.
"""

from __future__ import annotations

import time

import torch
import torch.nn as nn

import torch_lazymem
from torch_lazymem.testing import simulated_device


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(inplace=True), nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(inplace=True),
            nn.AdaptiveAvgPool2d(1),
        )
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x)).log_softmax(-1)


def median_time(fn, repeats: int = 5) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[repeats // 2]


def main() -> None:
    torch.manual_seed(0)
    model = Net().eval()
    images = torch.randn(64, 3, 32, 32)

    with torch.no_grad():
        expected = model(images)
        eager_s = median_time(lambda: model(images))

    lazy_model = Net().eval()
    lazy_model.load_state_dict(model.state_dict())
    lazy_model.to("lazymem")
    x = images.to("lazymem")
    with torch.no_grad():
        lazy_model(x).cpu()  # warm-up: the first call of each op imports PyTorch's meta kernels (~1-2 s once)
    torch_lazymem.reset_stats()
    capacity = 256 * 1024 * 1024
    with simulated_device(capacity), torch.no_grad():
        out = lazy_model(x)  # recorded: nothing runs yet
        recorded = torch_lazymem.stats()
        held_before = torch.lazymem.memory_allocated()
        got = out.cpu()  # sync point: planned, run on the backing device, downloaded
        stats = torch_lazymem.stats()
        lazy_s = median_time(lambda: lazy_model(x).cpu())
    if stats["peak_bytes"] > capacity:
        raise SystemExit("lazymem went over the simulated device's capacity")

    print(f"torch {torch.__version__}, lazymem backed by {torch_lazymem.backing_device()}")
    print(f"output {tuple(got.shape)}: bitwise equal to eager CPU: {torch.equal(got, expected)}")
    print(f"predictions: {got.argmax(-1)[:12].tolist()} ...")
    print()
    print(f"  ops recorded before the sync      {recorded['pending_nodes']:>10}")
    print(f"  device bytes held before the sync {held_before:>10}")
    print(f"  materializations                  {stats['materializations']:>10}")
    print(f"  nodes executed                    {stats['nodes_executed']:>10}")
    print(f"  nodes eliminated (dead code)      {stats['nodes_eliminated']:>10}")
    print(f"  meta-inference cache hits/misses  {stats['meta_cache_hits']:>5}/{stats['meta_cache_misses']}")
    print(f"  peak device bytes in the run      {torch_lazymem._C._format_bytes(stats['peak_bytes']):>10}")
    print(f"  device bytes held after the run   {torch_lazymem._C._format_bytes(torch.lazymem.memory_allocated()):>10}")
    print(f"  time per forward (median of 5): eager {eager_s * 1e3:.1f} ms, "
          f"lazymem record + run + download {lazy_s * 1e3:.1f} ms")
    if not torch.equal(got, expected):
        raise SystemExit("lazymem result differs from eager")
    train(model, lazy_model, images)


def train(model: nn.Module, lazy_model: nn.Module, images: torch.Tensor, steps: int = 3) -> None:
    """An unmodified training loop, run on eager CPU and on lazymem."""
    print("\ntraining (SGD with momentum, BatchNorm in train mode):")
    labels = torch.randint(0, 10, (images.shape[0],), generator=torch.Generator().manual_seed(1))
    runs = {}
    for name, net, x, y in (("eager", model, images, labels),
                            ("lazymem", lazy_model, images.to("lazymem"), labels.to("lazymem"))):
        net.train()
        opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
        losses = []
        for _ in range(steps):
            opt.zero_grad()
            loss = nn.functional.nll_loss(net(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        runs[name] = losses
    same = all(torch.equal(p, q.cpu()) for p, q in zip(model.parameters(), lazy_model.parameters()))
    for step, (a, b) in enumerate(zip(runs["eager"], runs["lazymem"])):
        print(f"  step {step}: loss eager {a:.6f}  lazymem {b:.6f}  {'equal' if a == b else 'DIFFERENT'}")
    print(f"  every parameter bitwise equal after training: {same}")
    if not same or runs["eager"] != runs["lazymem"]:
        raise SystemExit("lazymem training differs from eager")


if __name__ == "__main__":
    main()
