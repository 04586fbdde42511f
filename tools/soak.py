"""Soak: a long split GPT-2 training loop under a simulated-device cap, with plan reuse. Prints a
memory trace — lazymem's device bytes after each step (must be flat: no growth), the plan cache's
size (bounded), pending nodes, and the process's RSS growth — and exits 1 if device memory grows or
the cache is unbounded.

    python tools/soak.py [--steps 1000] [--batch 64] [--cap 24MiB] [--every 50]
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings

import psutil
import torch
import torch.nn.functional as F

import torch_lazymem
from torch_lazymem import _C
from torch_lazymem.testing import parse_bytes, simulated_device


def gpt2(vocab: int, seq: int) -> torch.nn.Module:
    import transformers
    transformers.logging.set_verbosity_error()
    cfg = transformers.GPT2Config(vocab_size=vocab, n_positions=seq, n_embd=64, n_layer=2, n_head=4,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(cfg)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=2000)
    parser.add_argument("--cap", default="24MiB")
    parser.add_argument("--every", type=int, default=50, help="print a trace line every this many steps")
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    cap = parse_bytes(args.cap)
    proc = psutil.Process()
    g = torch.Generator().manual_seed(0)
    with simulated_device(cap):
        model = gpt2(args.vocab, args.seq).to("lazymem")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        torch.lazymem.synchronize()
        rss0 = proc.memory_info().rss
        trace: list[int] = []
        t0 = time.perf_counter()
        print(f"{'step':>6} {'loss':>8} {'device MiB':>11} {'peak MiB':>9} {'plans cached':>12} "
              f"{'pending':>8} {'RSS +MiB':>9} {'splits':>7} {'reused':>7}")
        torch_lazymem.reset_stats()
        for step in range(args.steps):
            ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g).to("lazymem")
            logits = model(ids).logits
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, args.vocab), ids[:, 1:].reshape(-1))
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
            value = loss.item()
            del ids, logits, loss
            trace.append(torch.lazymem.memory_allocated())
            if step % args.every == 0 or step == args.steps - 1:
                st = torch_lazymem.stats()
                print(f"{step:6d} {value:8.4f} {trace[-1] / 2**20:11.3f} "
                      f"{torch.lazymem.max_memory_allocated() / 2**20:9.2f} {_C._plan_cache_size():12d} "
                      f"{st['pending_nodes']:8d} {(proc.memory_info().rss - rss0) / 2**20:9.1f} "
                      f"{st['splits']:7d} {st['plans_reused']:7d}", flush=True)
        seconds = time.perf_counter() - t0
    st = torch_lazymem.stats()
    settled = trace[min(10, len(trace) - 1):]
    growth = max(settled) - min(settled)
    print(f"\n{args.steps} steps in {seconds:.0f} s; device bytes after each step from step 10: min "
          f"{min(settled)} max {max(settled)} (growth {growth} bytes); peak "
          f"{torch.lazymem.max_memory_allocated() / 2**20:.2f} MiB of a {cap / 2**20:.2f} MiB cap; "
          f"{st['splits']} split plans, {st['plans_reused']} reused, {_C._plan_cache_size()} cached; "
          f"RSS growth {(proc.memory_info().rss - rss0) / 2**20:.1f} MiB")
    ok = growth == 0 and _C._plan_cache_size() <= 64 and torch.lazymem.max_memory_allocated() <= cap
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
