"""torch_lazymem demo: a training step that runs out of memory in eager PyTorch finishes on lazymem.

A GPT-2 language model (transformers, built from a small config, float64) trains with AdamW on a
batch whose activations need about 300 MiB, on a simulated device of 48 MiB: every byte a GPU would
hold is counted and an allocation past the capacity raises torch.OutOfMemoryError, as CUDA does.

  1. Eager PyTorch under the same 48 MiB cap runs out of memory.
  2. The unmodified training loop on lazymem finishes: each step is recorded, planned against the
     budget, split along the batch into chunks that fit, and its gradients accumulated exactly.
     The plan it made is printed.
  3. Its losses and parameters equal an eager run without the cap (float64, at assert_close
     defaults; the loss itself transformers computes in float32), and the measured peak stays under
     the capacity, as the memory model predicted before anything ran.
  4. A batch that fits is not split: the result is bitwise equal to eager.

  python tools/demo.py --trainer   the same job through transformers' Trainer, unchanged: after the
                                   import it trains on lazymem by default (use_cpu=True for the CPU)
"""

from __future__ import annotations

import copy
import sys
import time
import warnings

import torch

import torch_lazymem
from torch_lazymem.testing import eager_max_memory_allocated, memory_cap, simulated_device

MiB = 1024 * 1024
CAPACITY = 48 * MiB
BATCH, SEQ, VOCAB = 128, 64, 512
STEPS = 3


def make_model():
    import transformers

    transformers.logging.set_verbosity_error()
    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=64, n_layer=2, n_head=4,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg).double()


def batches():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (BATCH, SEQ), generator=g) for _ in range(STEPS)]


def train_step(model, opt, ids):
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def main() -> int:
    warnings.simplefilter("ignore")
    model = make_model()
    data = batches()
    print(f"torch {torch.__version__}; GPT-2 ({sum(p.numel() for p in model.parameters()):,} parameters, float64), "
          f"batch {BATCH} x {SEQ} tokens, AdamW; simulated device of {CAPACITY // MiB} MiB\n")

    # 1. Eager under the cap.
    eager = copy.deepcopy(model)
    try:
        with memory_cap(CAPACITY):
            train_step(eager, torch.optim.AdamW(eager.parameters(), lr=1e-3), data[0])
        print("eager: fits (unexpected)")
        return 1
    except torch.OutOfMemoryError as e:
        print(f"eager PyTorch, {CAPACITY // MiB} MiB cap:  torch.OutOfMemoryError: {str(e).splitlines()[0][:96]}")

    # Reference: eager without the cap.
    eager = copy.deepcopy(model)
    opt_e = torch.optim.AdamW(eager.parameters(), lr=1e-3)
    with memory_cap(1 << 40):
        t0 = time.perf_counter()
        expected = [train_step(eager, opt_e, ids) for ids in data]
        eager_s = (time.perf_counter() - t0) / STEPS
        eager_peak = eager_max_memory_allocated()
    print(f"eager PyTorch, no cap:    peak {eager_peak / MiB:.0f} MiB, {eager_s:.2f} s per step\n")

    # 2. lazymem on the simulated device: the same loop.
    lazy = copy.deepcopy(model).to("lazymem")
    opt_l = torch.optim.AdamW(lazy.parameters(), lr=1e-3)
    losses, peaks, plan = [], [], ""
    with simulated_device(CAPACITY):
        t0 = time.perf_counter()
        for step, ids in enumerate(data):
            torch.lazymem.reset_peak_memory_stats()
            losses.append(train_step(lazy, opt_l, ids.to("lazymem")))
            stats = torch_lazymem.stats()
            peaks.append(torch.lazymem.max_memory_allocated())
            print(f"lazymem step {step}: loss {losses[-1]:.6f} (eager {expected[step]:.6f}); split into "
                  f"{stats['chunks']} chunks; peak {peaks[-1] / MiB:.2f} MiB, predicted "
                  f"{stats['predicted_peak_bytes'] / MiB:.2f} MiB")
            if step == 0:
                plan = torch_lazymem.explain(print_it=False)
        lazy_s = (time.perf_counter() - t0) / STEPS
        params_equal = True
        worst = 0.0
        for p, q in zip(eager.parameters(), lazy.parameters()):
            q = q.detach().cpu()
            worst = max(worst, (p.detach() - q).abs().max().item())
            try:
                torch.testing.assert_close(q, p.detach())
            except AssertionError:
                params_equal = False
    print(f"\nthe plan of step 0 (torch_lazymem.explain()):\n{plan}")
    losses_equal = all(abs(a - b) <= 1.3e-6 * abs(b) + 1e-5 for a, b in zip(losses, expected))
    under = max(peaks) <= CAPACITY
    print(f"losses equal eager's (float32 loss, its tolerance): {losses_equal}")
    print(f"every parameter equals eager's after {STEPS} steps (float64, assert_close defaults): {params_equal} "
          f"(largest difference {worst:.1e})")
    print(f"peak never above the capacity: {under} ({max(peaks) / MiB:.2f} of {CAPACITY // MiB} MiB); "
          f"{lazy_s:.2f} s per step (eager without the cap: {eager_s:.2f} s)")

    # 4. What fits is not split: bitwise equal to eager.
    small = data[0][:4]
    fit_e = copy.deepcopy(model)
    fit_l = copy.deepcopy(model).to("lazymem")
    with torch.no_grad():
        ref = fit_e(input_ids=small).logits
        with simulated_device(CAPACITY):
            got = fit_l(input_ids=small.to("lazymem")).logits.cpu()
            unsplit = torch_lazymem.stats()["splits"] == 0 or "unsplit" in torch_lazymem.explain(print_it=False)
    bitwise = torch.equal(got, ref)
    print(f"a batch of 4 fits: not split ({unsplit}), logits bitwise equal to eager: {bitwise}")
    ok = losses_equal and params_equal and under and bitwise and unsplit
    if not ok:
        print("DEMO FAILED")
    return 0 if ok else 1


def trainer_run(use_cpu: bool, data: list[torch.Tensor], out: str) -> tuple[list[float], list[torch.Tensor]]:
    """The demo's 3 steps through transformers' Trainer (AdamW at 1e-3, its default schedule and
    gradient clipping): its logged losses and the final parameters."""
    from transformers import Trainer, TrainingArguments

    rows = [{"input_ids": ids[i], "labels": ids[i]} for ids in data for i in range(ids.shape[0])]
    args = TrainingArguments(output_dir=out, report_to=[], use_cpu=use_cpu, max_steps=STEPS,
                             per_device_train_batch_size=BATCH, learning_rate=1e-3, seed=0, logging_steps=1,
                             save_strategy="no", dataloader_num_workers=0, disable_tqdm=True)
    trainer = Trainer(model=make_model(), args=args, train_dataset=rows)
    trainer.train()
    assert all(p.device.type == ("cpu" if use_cpu else "lazymem") for p in trainer.model.parameters())
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return losses, [p.detach().cpu() for p in trainer.model.parameters()]


def main_trainer() -> int:
    import tempfile

    warnings.simplefilter("ignore")
    data = batches()
    out = tempfile.mkdtemp(prefix="lazymem_demo_")
    print(f"torch {torch.__version__}; transformers Trainer, GPT-2 (float64), batch {BATCH} x {SEQ} tokens, "
          f"{STEPS} steps; simulated device of {CAPACITY // MiB} MiB\n")
    try:
        with memory_cap(CAPACITY):
            trainer_run(True, data, out)
        print("Trainer on the CPU: fits (unexpected)")
        return 1
    except torch.OutOfMemoryError as e:
        print(f"Trainer on the CPU, {CAPACITY // MiB} MiB cap:  torch.OutOfMemoryError: {str(e).splitlines()[0][:80]}")
    with memory_cap(1 << 40):
        expected, want = trainer_run(True, data, out)
    with simulated_device(CAPACITY):
        torch_lazymem.reset_stats()
        torch.lazymem.reset_peak_memory_stats()
        t0 = time.perf_counter()
        losses, got = trainer_run(False, data, out)
        seconds = time.perf_counter() - t0
        peak = torch.lazymem.max_memory_allocated()
        splits = torch_lazymem.stats()["splits"]
    print(f"Trainer on lazymem (no change but the import): losses {[round(x, 4) for x in losses]} "
          f"(CPU {[round(x, 4) for x in expected]}); {splits} steps split; peak {peak / MiB:.2f} MiB; {seconds:.1f} s")
    params_equal = True
    for p, q in zip(got, want):
        try:
            torch.testing.assert_close(p, q)
        except AssertionError:
            params_equal = False
    losses_equal = all(abs(a - b) <= 1.3e-6 * abs(b) + 1e-5 for a, b in zip(losses, expected))
    under = peak <= CAPACITY
    print(f"losses equal the CPU run's: {losses_equal}; every parameter equal (float64, assert_close defaults): "
          f"{params_equal}; peak never above the capacity: {under}")
    ok = losses_equal and params_equal and under and splits >= STEPS
    if not ok:
        print("DEMO FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main_trainer() if "--trainer" in sys.argv[1:] else main())
