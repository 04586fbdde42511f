"""Copies across the host/device boundary on the simulated device, in one run (DESIGN.md §3).

Rows of the printed table:

1. A pass that assembles y = tanh(x @ w) (4,096 x 512 float64, 16 MiB) in host memory under an 8 MiB
   device and reads it again in the same pass (y.cos()), with the modeled link at 1 GB/s: the median
   step with copies out synchronous (LAZYMEM_ASYNC_COPY_OUT=0) and behind the next chunk (1), steps
   alternating in one process; the time left to wait for copies out at the end; copies in per step
   (the rows the chunk wrote are read again from the device, not copied back).
2. A GPT-2 (4 x 128, vocabulary 8,192) training step at batch 32 under 1.1 x the measured peak of
   batch 8, keeping its logits (`loss, logits = ...`), with the planner pricing each node at 8 us per
   chunk (LAZYMEM_CHUNK_NODE_NS: the GPU's trade of chunks against host memory), link 25 GB/s: the
   first step's chunks, values held in host memory, bytes each way, reads of kept rows.

    PYTHONPATH=. python tools/bench_transfers.py [--steps N]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from _table import print_table  # tools/_table.py: the script's directory is on sys.path

import torch_lazymem
from torch_lazymem.testing import simulated_device

MiB = 1 << 20


def row_overlap(steps: int) -> tuple[str, ...]:
    torch.manual_seed(0)
    xh = torch.randn(4096, 512, dtype=torch.float64)
    wh = torch.randn(512, 512, dtype=torch.float64) / 23
    times: dict[int, list[float]] = {0: [], 1: []}
    waited, copies_in = {0: 0.0, 1: 0.0}, {0: 0, 1: 0}
    try:
        with simulated_device("8MiB", link="1GB/s"):
            x, w = xh.to("lazymem"), wh.to("lazymem")
            x.sum().item()
            w.sum().item()
            for rep in range(steps + 2):
                for mode in (0, 1):
                    torch_lazymem._C._set_async_copy_out(mode)
                    torch_lazymem.reset_stats()
                    t0 = time.perf_counter()
                    y = torch.tanh(x @ w)
                    y.sum().item()  # (y stays pending)
                    (y.cos() * 2).sum().item()  # y is assembled in host memory, and read in the same pass
                    dt = time.perf_counter() - t0
                    s = torch_lazymem.stats()
                    del y
                    if rep >= 2:
                        times[mode].append(dt)
                        waited[mode] = s["copy_out_wait_ns"] / 1e6
                        copies_in[mode] = s["h2d_copies"]
    finally:
        torch_lazymem._C._set_async_copy_out(-1)
    sync, behind = statistics.median(times[0]), statistics.median(times[1])
    return ("1 assemble y in host memory, 1 GB/s", f"{sync * 1e3:.1f} ms", f"{behind * 1e3:.1f} ms",
            f"{sync / behind:.2f}", f"{waited[1]:.1f} ms", f"{copies_in[0]} / {copies_in[1]}")


def row_held_logits() -> tuple[str, ...]:
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging

    logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=4, n_embd=128, n_head=4, vocab_size=8192, n_positions=128,
                     bos_token_id=0, eos_token_id=0, loss_type="ForCausalLM")
    model = GPT2LMHeadModel(cfg).to("lazymem")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step(ids: torch.Tensor) -> torch.Tensor:
        out = model(ids.to("lazymem"), labels=ids.to("lazymem"))
        out.loss.backward()
        opt.step()
        opt.zero_grad()
        out.loss.item()
        return out.logits

    torch.lazymem.reset_peak_memory_stats()
    ids8 = torch.randint(0, 8192, (8, 128))
    for _ in range(2):
        step(ids8)
    peak8 = torch.lazymem.max_memory_allocated()
    torch_lazymem._C._set_chunk_node_ns(8000)
    try:
        with simulated_device(int(1.1 * peak8), link="25GB/s"):
            torch_lazymem.reset_stats()
            t0 = time.perf_counter()
            logits = step(torch.randint(0, 8192, (32, 128)))
            dt = time.perf_counter() - t0
            s = torch_lazymem.stats()
            del logits
    finally:
        torch_lazymem._C._set_chunk_node_ns(-1)
    return (f"2 GPT-2 step, logits kept, first step {dt:.2f} s", f"{s['chunks']} chunks",
            f"{s['values_in_host_memory']} in host memory", f"{s['h2d_bytes'] / MiB:.1f} MiB in",
            f"{s['d2h_bytes'] / MiB:.1f} MiB out", f"{s['kept_reads']} kept reads")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=5, help="timed steps of row 1 per mode (after 2 warm-up)")
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, simulated device")
    # (Row 2 first: the planner prices copies by the slowest rate seen so far, and row 1's 1 GB/s link
    # would price the trade out.)
    held = row_held_logits()
    print_table(("row", "copies out synchronous", "behind the next chunk", "ratio", "waited at the end",
                 "copies in (sync / behind)"), [row_overlap(args.steps)])
    print()
    print_table(("row", "chunks", "held", "host to device", "device to host", "kept"), [held])


if __name__ == "__main__":
    main()
