"""torch.autocast("lazymem") casts like torch.autocast("cuda"); GradScaler works on lazymem."""

from __future__ import annotations

import torch
from conftest import assert_bitwise


def test_autocast_casts_like_cuda():
    torch.manual_seed(0)
    a, b = torch.randn(8, 8), torch.randn(8, 8)
    x, y = a.to("lazymem"), b.to("lazymem")
    with torch.autocast("lazymem", dtype=torch.bfloat16):
        z = x @ y  # lower-precision op
        s = z.softmax(-1)  # fp32 op
        t = torch.addcmul(x, z, y)  # promoting op
    assert z.dtype == torch.bfloat16 and s.dtype == torch.float32 and t.dtype == torch.float32
    ref = a.bfloat16() @ b.bfloat16()
    assert_bitwise(z, ref)
    assert_bitwise(s, ref.float().softmax(-1))
    with torch.autocast("lazymem"):
        assert (x @ y).dtype == torch.float16  # the default autocast dtype, as on CUDA
    assert (x @ y).dtype == torch.float32  # outside the region nothing is cast
    assert torch.float16 in torch.lazymem.get_amp_supported_dtype()


def test_replay_is_not_recast_by_an_active_autocast():
    x = torch.randn(4, 4, device="lazymem")
    y = x @ x  # recorded in float32
    with torch.autocast("lazymem", dtype=torch.bfloat16):
        got = y.cpu()  # materialized inside an autocast region: still float32 math
    assert got.dtype == torch.float32
    assert torch.equal(got, x.cpu() @ x.cpu())


def test_mixed_precision_training_with_grad_scaler():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)).to("lazymem")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("lazymem", init_scale=2.0**10)
    x = torch.randn(8, 16, device="lazymem")
    y = torch.randint(0, 4, (8,), device="lazymem")
    losses = []
    for _ in range(3):
        opt.zero_grad()
        with torch.autocast("lazymem", dtype=torch.bfloat16):
            loss = torch.nn.functional.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0]
    assert model[0].weight.dtype == torch.float32 and model[0].weight.grad.dtype == torch.float32
