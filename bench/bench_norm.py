"""bench_norm.py: offload's gradient norm on the CPU, Σ g² over a rank's gradient shard, before its AdamW step.

Candidates, on the same gradient (bf16, offload's gradient dtype in mixed precision, and fp32):
    torch 1 thread    train_gpt.sum_of_squares (squares in fp32 per block of 2^20, the blocks added in float64) on one
                      intra-op thread: what a rank under torchrun (OMP_NUM_THREADS=1) runs with torch
    ours 1 thread     cpu_adam.cpp's sum_of_squares (each square in double, summed in double) on one thread
    ours N threads    the same on --threads threads: what offload.py runs (the C++ AdamW's threads)
Samples are taken round-robin with bench_adam.py's harness (median; a sample disturbed by other processes is taken
again), and the speeds are reported as ratios within this one run, with the CPU named.

    python bench/bench_norm.py [--sizes 24 26] [--repeats 11] [--threads N] [--retakes 5] [--results]
"""
import argparse
import platform
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
from bench_adam import measure  # noqa: E402
from devices import adam_threads  # noqa: E402
from offload import load_cpu_adam  # noqa: E402
from results import add_flag, cpu_model, publish  # noqa: E402
from train_gpt import sum_of_squares  # noqa: E402


def make_candidates(mod, g, threads):
    """name -> function computing Σ g² once; ours set the kernel's threads first (torch runs on one: main sets it)."""
    def ours(n_threads):
        mod.set_threads(n_threads)
        return mod.sum_of_squares(g)

    return {"torch 1 thread": lambda: sum_of_squares(g), "ours 1 thread": lambda: ours(1),
            f"ours {threads} threads": lambda: ours(threads)}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=[24, 26], help="log2 of the gradient shard's elements")
    ap.add_argument("--repeats", type=int, default=11, help="samples per candidate and size (median taken)")
    ap.add_argument("--threads", type=int, default=adam_threads()[0], help="the kernel's threads (default: the cores)")
    ap.add_argument("--retakes", type=int, default=5, help="times a sample disturbed by other processes is taken again")
    add_flag(ap)
    a = ap.parse_args()
    torch.set_num_threads(1)  # as torchrun sets a rank's intra-op threads (OMP_NUM_THREADS=1)
    mod = load_cpu_adam()
    rows, names = [], None
    for e in a.sizes:
        n = 1 << e
        for dtype in (torch.bfloat16, torch.float32):
            g = torch.randn(n, generator=torch.Generator().manual_seed(e)).to(dtype)
            cands = make_candidates(mod, g, a.threads)
            med, retaken = measure(cands, n, a.repeats, a.threads, a.retakes)
            names = list(med)
            base = med["torch 1 thread"]
            cells = [f"2^{e}", str(dtype).removeprefix("torch.")] + [f"{1e3 * med[k]:.1f}" for k in names]
            rows.append(cells + [f"{base / med[k]:.2f}x" for k in names[1:]] + [str(retaken)])
            print(f"done 2^{e} {dtype}", file=sys.stderr)
    out = [f"Kernel build cpu_adam_{mod.isa()}. Σ g² of one gradient shard, median of {a.repeats} round-robin samples, "
           f"in ms; speed-up = time of torch on 1 thread / time of ours ({a.threads} threads: --threads)", ""]
    head = ["size", "grad dtype"] + [f"{k} ms" for k in names] + [f"speed-up {k}" for k in names[1:]] + ["re-taken"]
    out += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    print(f"\nCPU: {cpu_model()} ({platform.machine()}), torch CPU capability "
          f"{torch.backends.cpu.get_cpu_capability()}, torch {torch.__version__}\n")
    print("\n".join(out))
    if a.results:
        publish("norm", "\n".join(out), "bf16 and fp32 gradients", a.results)


if __name__ == "__main__":
    main()
