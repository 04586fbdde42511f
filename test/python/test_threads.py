"""Recording and syncing from several Python threads."""

from __future__ import annotations

import threading

import torch

import torch_lazymem


def worker(seed: int, out: dict, errors: list) -> None:
    try:
        g = torch.Generator().manual_seed(seed)
        a = torch.randn(32, 32, generator=g)
        x = a.to("lazymem")
        ref = a
        for i in range(50):
            x = (x @ x.t()).tanh() + i
            ref = (ref @ ref.t()).tanh() + i
        out[seed] = (x.cpu(), ref)
    except Exception as e:  # noqa: BLE001
        errors.append(e)


def test_recording_from_several_threads():
    out: dict = {}
    errors: list = []
    threads = [threading.Thread(target=worker, args=(s, out, errors)) for s in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    assert len(out) == 6
    for got, ref in out.values():
        assert torch.equal(got, ref)
    torch_lazymem._C._verify()


def test_threads_writing_one_shared_tensor():
    shared = torch.zeros(8, device="lazymem")
    lock = threading.Lock()

    def add(n: int) -> None:
        for _ in range(100):
            with lock:  # the user orders the writes; lazymem keeps the recorded order
                shared.add_(n)

    threads = [threading.Thread(target=add, args=(n,)) for n in (1, 2, 3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert shared.tolist() == [600.0] * 8
