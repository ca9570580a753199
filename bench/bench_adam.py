"""bench_adam.py: AdamW steps per second on the CPU, fp32 params and grads, against a memory-traffic ceiling.

Candidates: our C++ AdamW (cpu_adam.cpp), torch.optim.AdamW(foreach=True), torch.optim.AdamW(fused=True),
DeepSpeed's DeepSpeedCPUAdam (if `import deepspeed` works). The ceiling is the fastest of several loops in
cpu_adam.cpp (touch_28_bytes) that move the same 28 bytes per parameter (read p, g, m, v; write p, m, v) on the same
threads with trivial arithmetic: tiles of 2^12, 2^16 or 2^20 elements, with or without software prefetching, with
ordinary or streaming (non-temporal) stores. No one loop is the fastest way to move memory on every CPU (on an
AVX2-only AMD, torch's fused AdamW beat our one loop by 10%), so the best of them is the bound; if a candidate still
beats it, the table is followed by a warning: that is a defect of the ceiling, not a result. Samples are taken
round-robin (each candidate once per round), so noise hits all alike; the median is reported. On Linux a sample during
which other processes used the CPU for more than 5% of the time is thrown away and taken again (up to 5 times): the
table then says how many were. The kernel build is load_cpu_adam()'s: CPU_ADAM_ISA=avx2 (or scalar) benchmarks another.

    python bench/bench_adam.py [--sizes 20 22 24 26] [--repeats 11] [--threads N]
"""
import argparse
import contextlib
import io
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from devices import load_cpu_adam  # noqa: E402

BYTES = 28  # per parameter: read p, g, m, v (16) + write p, m, v (12), all fp32
LR, BETAS, EPS, WD = 1e-3, (0.9, 0.999), 1e-8, 0.01
GRAD_SCALE = 1.0  # adam_step's clipping coefficient: any value runs the same code (1.0 is a multiply by one)


def busy_ticks():
    """CPU ticks used by the whole machine (from /proc/stat) and by this process; None where unavailable."""
    try:
        with open("/proc/stat") as f:
            user, nice, system = (int(x) for x in f.readline().split()[1:4])
    except OSError:
        return None
    t = os.times()
    return user + nice + system, (t.user + t.system) * os.sysconf("SC_CLK_TCK")


def cpu_model():
    """The CPU's name, with its family and model numbers (a virtual machine may say no more than "AMD EPYC")."""
    try:
        with open("/proc/cpuinfo") as f:
            info = dict(line.split(":", 1) for line in f.read().split("\n\n")[0].splitlines() if ":" in line)
        info = {k.strip(): v.strip() for k, v in info.items()}
        return f"{info['model name']}, family {info.get('cpu family', '?')} model {info.get('model', '?')}"
    except (OSError, KeyError):
        return platform.processor() or platform.machine()


def ceiling_loops(mod):
    """name -> (tile, prefetch, streaming stores) of each ceiling candidate this build has."""
    loops = {}
    for tile in (12, 16, 20):
        for prefetch in (True, False):
            for stream in (False, True) if mod.touch_can_stream() else (False,):
                loops[f"2^{tile}{' pf' * prefetch}{' nt' * stream}"] = (1 << tile, prefetch, stream)
    return loops


def make_candidates(mod, n):
    """name -> function doing one step (or one ceiling pass) over n parameters. Each has its own tensors, except
    the ceiling loops, which share theirs."""
    gen = torch.Generator().manual_seed(0)
    g = torch.randn(n, generator=gen)
    cands = {}

    p, m, v, state = torch.randn(n, generator=gen), torch.zeros(n), torch.zeros(n), {"step": 0}

    def ours():
        state["step"] += 1
        mod.adam_step(p, g, m, v, None, state["step"], LR, *BETAS, EPS, WD, GRAD_SCALE)

    tp, tg, tm, tv = torch.randn(n, generator=gen), g.clone(), torch.zeros(n), torch.zeros(n)
    for name, (tile, prefetch, stream) in ceiling_loops(mod).items():
        cands["touch " + name] = lambda a=(tile, prefetch, stream): mod.touch_28_bytes(tp, tg, tm, tv, *a)
    cands["ours"] = ours

    def torch_opt(**kw):
        q = torch.nn.Parameter(torch.randn(n, generator=gen))
        q.grad = g.clone()
        opt = torch.optim.AdamW([q], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, **kw)
        return opt.step

    cands["torch foreach"] = torch_opt(foreach=True)
    cands["torch fused"] = torch_opt(fused=True)
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            from deepspeed.ops.adam import DeepSpeedCPUAdam
        q = torch.nn.Parameter(torch.randn(n, generator=gen))
        q.grad = g.clone()
        cands["deepspeed"] = DeepSpeedCPUAdam([q], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, adamw_mode=True).step
    except Exception as e:  # not installed, or its CPU Adam does not build here
        print(f"note: DeepSpeed skipped ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})")
    return cands


def measure(cands, n, repeats, threads):
    """Median seconds per call of each candidate, sampled round-robin; and how many samples were re-taken."""
    inner = max(1, (1 << 24) // n)  # several calls per sample for small sizes, so a sample lasts >= ~10 ms
    times = {k: [] for k in cands}
    retaken = 0
    for r in range(repeats + 1):  # round 0 warms up (first-touch page faults, lazy builds, caches)
        for name, f in cands.items():
            for attempt in range(6):
                b0 = busy_ticks()
                t0 = time.perf_counter()
                for _ in range(inner):
                    f()
                dt = (time.perf_counter() - t0) / inner
                b1 = busy_ticks()
                if b0 is None or attempt == 5:
                    break
                others = (b1[0] - b0[0]) - (b1[1] - b0[1])  # ticks other processes used meanwhile
                if others <= 1 + 0.05 * dt * inner * os.sysconf("SC_CLK_TCK") * threads:
                    break
                retaken += 1
                time.sleep(0.2)
            if r:
                times[name].append(dt)
    return {k: statistics.median(v) for k, v in times.items()}, retaken


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=[20, 22, 24, 26], help="log2 of the parameter counts")
    ap.add_argument("--repeats", type=int, default=11, help="samples per candidate and size (median taken)")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    a = ap.parse_args()
    os.environ["OMP_NUM_THREADS"] = str(a.threads)  # for anything that reads it later
    torch.set_num_threads(a.threads)  # torch's threads (and DeepSpeed's: one OpenMP runtime, torch's libgomp)
    mod = load_cpu_adam()
    mod.set_threads(a.threads)  # ours and the ceiling loops

    rows, ratio_rows, loop_rows, names, over = [], [], [], None, []
    for e in a.sizes:
        n = 1 << e
        cands = make_candidates(mod, n)
        med, retaken = measure(cands, n, a.repeats, a.threads)
        del cands
        loops = {k: n / t for k, t in med.items() if k.startswith("touch ")}
        best = max(loops, key=loops.get)
        ceil = loops[best]
        names = [k for k in med if k not in loops]
        cells = [f"2^{e}", f"{ceil / 1e6:,.0f} ({ceil * BYTES / 1e9:.1f} GB/s)", best[len("touch "):]]
        for k in names:
            rate = n / med[k]
            cells += [f"{rate / 1e6:,.0f}", f"{100 * rate / ceil:.1f}%"]
            if rate > ceil:
                over.append(f"at 2^{e}, {k} reached {100 * rate / ceil:.1f}% of the ceiling")
        rows.append(cells + [str(retaken)])
        ratio_rows.append([f"2^{e}"] + [f"{med[k] / med['ours']:.2f}x" for k in names if k != "ours"])
        loop_rows.append([f"2^{e}"] + [f"{r / 1e6:,.0f}" for r in loops.values()])
        print(f"done 2^{e}", file=sys.stderr)

    print(f"\nCPU: {cpu_model()} ({platform.machine()}), torch CPU capability "
          f"{torch.backends.cpu.get_cpu_capability()}; kernel build cpu_adam_{mod.isa()}, torch {torch.__version__}")
    print(f"AdamW step, fp32, {a.threads} threads, median of {a.repeats} round-robin samples; M params/s and % of the "
          f"ceiling (the fastest loop moving the same 28 bytes/param with trivial arithmetic)\n")
    head = ["size", "ceiling M/s", "its loop"] + [h for k in names for h in (f"{k} M/s", "% ceil")] + ["re-taken"]
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for r in rows:
        print("| " + " | ".join(r) + " |")
    for o in over:
        print(f"WARNING: {o}: a defect of the ceiling (no loop here moves these bytes that fast), not a result")
    print("\nThe ceiling loops, M params/s (tile in elements; pf: software prefetch; nt: streaming stores)\n")
    print("| size | " + " | ".join(k[len("touch "):] for k in loops) + " |\n|" + "---|" * (len(loops) + 1))
    for r in loop_rows:
        print("| " + " | ".join(r) + " |")
    others = [k for k in names if k != "ours"]
    print("\nSpeed of ours relative to each (time of the other / time of ours)\n")
    print("| size | " + " | ".join(f"vs {k}" for k in others) + " |\n|" + "---|" * (len(others) + 1))
    for r in ratio_rows:
        print("| " + " | ".join(r) + " |")


if __name__ == "__main__":
    main()
