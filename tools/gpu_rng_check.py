"""Random ops on a CUDA backing device, split against eager CUDA (issue 27, item 2; DESIGN.md §7 RNG).

Eager CUDA's values come from a child process that never imports torch_lazymem (importing it
breaks eager CUDA autograd upstream: pytorch issue 161129; these programs need no autograd, but the
references stay clean of lazymem either way). The parent runs each program on lazymem with a CUDA
backing unsplit and split into 2, 3 and 8 chunks over 37 rows (ragged last chunks) and prints, per
op: whether the split values equal eager CUDA's bitwise, whether they are the same in every
chunking, and whether the generator's next draw equals eager's. The programs are element-wise around
the draw (no matmul: a chunk's kernels are eager's kernels on fewer rows), so every value is exact.

    python tools/gpu_rng_check.py [--out DIR]      # needs CUDA; writes DIR/gpu_rng_check.txt too
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import torch
import torch.nn.functional as F

D = torch.float64
B = 37


def layouts():
    return {
        "rows": lambda x: x * 2,
        "column-major": lambda x: (x * 2).t().contiguous().t(),
        "slice": lambda x: (x * 2)[3:30],
        "every other row": lambda x: (x * 2)[::2],
    }


OPS = {
    # Fills: the draw is the op itself on the whole geometry (eager's kernel) -> eager's numbers.
    "randn_like": lambda h: h + torch.randn_like(h),
    "rand_like": lambda h: h * torch.rand_like(h),
    "randint_like": lambda h: h + torch.randint_like(h, 7),
    "bernoulli(x, 0.3)": lambda h: h * torch.bernoulli(h, 0.3),
    "bernoulli_(0.3)": lambda h: h * torch.empty_like(h).bernoulli_(0.3),
    "uniform_": lambda h: h * h.clone().uniform_(-2, 3),
    "normal_": lambda h: h * h.clone().normal_(1, 2),
    "exponential_": lambda h: h * h.clone().exponential_(),
    "geometric_": lambda h: h * h.clone().geometric_(0.3),
    "log_normal_": lambda h: h * h.clone().log_normal_(),
    "cauchy_": lambda h: h * h.clone().cauchy_(),
    "random_": lambda h: h * h.clone().random_(0, 10),
    # Device-generic ATen composites around a fill.
    "normal(mean, 0.5)": lambda h: h * torch.normal(h, 0.5),
    "normal(0.5, std)": lambda h: h * torch.normal(0.5, h.abs()),
    "normal(mean, std)": lambda h: h * torch.normal(h, h.abs() + 0.1),
    "multinomial": lambda h: torch.multinomial(h.softmax(-1), 1).to(D) + h[:, :1],
    "multinomial 3": lambda h: torch.multinomial(h.softmax(-1), 3).to(D) * h[:, :1],
    # Dropout: its mask depends on the input's geometry and alignment alone (the op on uninitialized
    # operands at the input's offset gives eager's mask).
    "dropout": lambda h: F.dropout(h, 0.3) * h,
    "dropout float32": lambda h: F.dropout(h.float(), 0.3).double() * h,
    "dropout float32, misaligned": lambda h: F.dropout(h.float()[:, 1:], 0.3).double() * h[:, 1:],
    "dropout bfloat16": lambda h: F.dropout(h.bfloat16(), 0.3).double() * h,
    "native_dropout": lambda h: torch.native_dropout(h, 0.3, True)[0] * torch.native_dropout(h, 0.6, True)[1],
    # A CUDA kernel of its own (its uniforms are not observable): keyed by rows when split; the
    # generator then moves on as eager's kernel moves it.
    "bernoulli(p)": lambda h: h * torch.bernoulli(h.sigmoid()),
    # Draws depend on values: run whole.
    "poisson": lambda h: torch.poisson(h.abs()) + h,
}


def program(op, layout, dev):
    x = torch.randn(B, 12, dtype=D, generator=torch.Generator().manual_seed(5)).to(dev)
    torch.manual_seed(5)
    with torch.no_grad():
        y = OPS[op](layouts()[layout](x))
    after = torch.rand(4, dtype=D, device=dev)
    return y.cpu(), after.cpu()


def dropout_training(dev):
    """An MLP with dropout trained 3 AdamW steps (float64): the masks are eager's in any chunking."""
    torch.manual_seed(21)
    model = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.ReLU(), torch.nn.Dropout(0.3),
                                torch.nn.Linear(128, 10)).double().to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(600, 32, dtype=D, generator=g).to(dev), torch.randint(0, 10, (600,), generator=g).to(dev)
    torch.manual_seed(22)
    losses = []
    for _ in range(3):
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return torch.tensor(losses), [p.detach().cpu() for p in model.parameters()]


def eager_child(path: str) -> None:
    refs = {(op, lay): program(op, lay, "cuda") for op in OPS for lay in layouts()}
    refs["training"] = dropout_training("cuda")
    torch.save(refs, path)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--eager-child")
    args = parser.parse_args()
    if args.eager_child:
        eager_child(args.eager_child)
        return 0
    os.makedirs(args.out, exist_ok=True)
    ref_path = os.path.join(args.out, "rng_eager_refs.pt")
    subprocess.run([sys.executable, __file__, "--eager-child", ref_path], check=True)
    refs = torch.load(ref_path)
    os.remove(ref_path)
    torch.zeros(1, device="cuda")  # CUDA initialized before lazymem's first use (issue 29, defect 2)
    import torch_lazymem
    from torch_lazymem.testing import force_chunks

    assert torch_lazymem.backing_device().type == "cuda", torch_lazymem.backing_device()
    lines = ["| op | layout | unsplit = eager | split = eager | same in 2/3/8 chunks | next draw = eager | streams | row-keyed |",
             "|---|---|---|---|---|---|---|---|"]
    for op in OPS:
        for lay in layouts():
            e_vals, e_after = refs[(op, lay)]
            try:
                torch.lazymem.synchronize()
                u_vals, u_after = program(op, lay, "lazymem")
                unsplit = torch.equal(u_vals, e_vals) and torch.equal(u_after, e_after)
                split_vals, afters = [], []
                torch_lazymem.reset_stats()
                for n in (2, 3, 8):
                    with force_chunks(n):
                        v, a = program(op, lay, "lazymem")
                    split_vals.append(v)
                    afters.append(a)
                st = torch_lazymem.stats()
                eq = all(torch.equal(v, e_vals) for v in split_vals)
                same = all(torch.equal(v, split_vals[0]) for v in split_vals)
                nxt = all(torch.equal(a, e_after) for a in afters)
                lines.append(f"| {op} | {lay} | {unsplit} | {eq} | {same} | {nxt} | {st['random_streams']} | "
                             f"{st['random_row_keyed']} |")
            except Exception as e:  # noqa: BLE001 - a failure is a finding, reported in the table
                lines.append(f"| {op} | {lay} | error: {str(e).splitlines()[0][:160]} | | | | | |")
            print(lines[-1], flush=True)
    e_losses, e_params = refs["training"]
    for n in (1, 3):
        with force_chunks(n):
            losses, params = dropout_training("lazymem")
        close = all(torch.allclose(a, b, rtol=1e-10, atol=1e-12) for a, b in zip([losses] + params, [e_losses] + e_params))
        lines.append(f"\nMLP with dropout, 3 AdamW steps, {n} chunk(s): losses and parameters within 1e-10 of eager "
                     f"CUDA: {close} (max difference {max((a - b).abs().max().item() for a, b in zip(params, e_params)):.2e})")
        print(lines[-1], flush=True)
    text = "\n".join(lines)
    with open(os.path.join(args.out, "gpu_rng_check.txt"), "w") as f:
        f.write(torch.cuda.get_device_name() + ", torch " + torch.__version__ + "\n\n" + text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
