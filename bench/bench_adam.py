"""bench_adam.py: AdamW steps per second on the CPU, fp32 params and grads, against a memory-traffic ceiling.

Candidates: our C++ AdamW (cpu_adam.cpp), torch.optim.AdamW(foreach=True), torch.optim.AdamW(fused=True),
DeepSpeed's DeepSpeedCPUAdam (if `import deepspeed` works). The ceiling is the fastest of several loops in
bench/touch.cpp (touch_28_bytes) that move the same 28 bytes per parameter (read p, g, m, v; write p, m, v) on the same
threads with trivial arithmetic: tiles of 2^12, 2^16 or 2^20 elements, with or without software prefetching, with
ordinary or streaming (non-temporal) stores. No one loop is the fastest way to move memory on every CPU, so the
best of them is the bound; if a candidate still beats it, the table is followed by a warning: that is a defect of the
ceiling, not a result. Samples are taken round-robin (each candidate once per round), so noise hits all alike; the
median is reported. On Linux a sample during which other processes used the CPU for more than 5% of the time is thrown
away and taken again (up to --retakes times): the table then says how many were. The kernel build is
load_cpu_adam()'s: CPU_ADAM_ISA=avx2 (or scalar) benchmarks another; the loops are built for the same code path, with
the kernel compiled in (load_touch).

    python bench/bench_adam.py [--sizes 20 22 24 26] [--repeats 11] [--threads N] [--retakes 5] [--results]
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
import torch.utils.cpp_extension

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from devices import cpu_adam_flags  # noqa: E402
from offload import load_cpu_adam  # noqa: E402
from results import add_flag, cpu_model, publish  # noqa: E402,F401 (cpu_model: bench/largest.py takes it from here)

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


def load_touch(isa):
    """bench/touch.cpp, the ceiling loops, built for the kernel's code path `isa` with the kernel's flags (it compiles
    cpu_adam.cpp in, to tile and prefetch as the kernel does); torch caches the build as bench_touch_<isa>."""
    mod = torch.utils.cpp_extension.load_inline(
        name=f"bench_touch_{isa}", cpp_sources=[(ROOT / "bench" / "touch.cpp").read_text()],
        functions=["touch_28_bytes", "touch_can_stream", "set_threads", "isa"], extra_include_paths=[str(ROOT)],
        **cpu_adam_flags(isa))
    if mod.isa() != isa:
        raise RuntimeError(f"bench/touch.cpp: built for {isa} but compiled the {mod.isa()} path")
    return mod


def ceiling_loops(mod):
    """name -> (tile, prefetch, streaming stores) of each ceiling candidate this build has."""
    loops = {}
    for tile in (12, 16, 20):
        for prefetch in (True, False):
            for stream in (False, True) if mod.touch_can_stream() else (False,):
                loops[f"2^{tile}{' pf' * prefetch}{' nt' * stream}"] = (1 << tile, prefetch, stream)
    return loops


def make_candidates(mod, touch, n):
    """name -> function doing one step (or, with `touch`, one ceiling pass) over n parameters. Each has its own
    tensors, except the ceiling loops, which share theirs."""
    gen = torch.Generator().manual_seed(0)
    g = torch.randn(n, generator=gen)
    cands = {}

    p, m, v, state = torch.randn(n, generator=gen), torch.zeros(n), torch.zeros(n), {"step": 0}

    def ours():
        state["step"] += 1
        mod.adam_step(p, g, m, v, None, step=state["step"], lr=LR, beta1=BETAS[0], beta2=BETAS[1], eps=EPS,
                      weight_decay=WD, grad_scale=GRAD_SCALE)

    tp, tg, tm, tv = torch.randn(n, generator=gen), g.clone(), torch.zeros(n), torch.zeros(n)
    for name, (tile, prefetch, stream) in ceiling_loops(touch).items():
        cands["touch " + name] = lambda a=(tile, prefetch, stream): touch.touch_28_bytes(tp, tg, tm, tv, *a)
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


def measure(cands, n, repeats, threads, retakes=5):
    """Median seconds per call of each candidate, sampled round-robin; and how many samples were re-taken."""
    inner = max(1, (1 << 24) // n)  # several calls per sample for small sizes, so a sample lasts >= ~10 ms
    times = {k: [] for k in cands}
    retaken = 0
    for r in range(repeats + 1):  # round 0 warms up (first-touch page faults, lazy builds, caches)
        for name, f in cands.items():
            for attempt in range(retakes + 1):
                b0 = busy_ticks()
                t0 = time.perf_counter()
                for _ in range(inner):
                    f()
                dt = (time.perf_counter() - t0) / inner
                b1 = busy_ticks()
                if b0 is None or attempt == retakes:
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
    ap.add_argument("--retakes", type=int, default=5, help="times a sample disturbed by other processes is taken again")
    add_flag(ap)
    a = ap.parse_args()
    os.environ["OMP_NUM_THREADS"] = str(a.threads)  # for anything that reads it later
    torch.set_num_threads(a.threads)  # torch's threads (and DeepSpeed's: one OpenMP runtime, torch's libgomp)
    mod = load_cpu_adam()
    touch = load_touch(mod.isa())
    mod.set_threads(a.threads)  # ours
    touch.set_threads(a.threads)  # the ceiling loops: a module of their own, with threads of their own

    rows, ratio_rows, loop_rows, names, over = [], [], [], None, []
    for e in a.sizes:
        n = 1 << e
        cands = make_candidates(mod, touch, n)
        med, retaken = measure(cands, n, a.repeats, a.threads, a.retakes)
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

    out = [f"Kernel build cpu_adam_{mod.isa()}. AdamW step, fp32, {a.threads} threads, median of {a.repeats} "
           f"round-robin samples; M params/s and % of the ceiling (the fastest loop moving the same 28 bytes/param with "
           f"trivial arithmetic)", ""]
    head = ["size", "ceiling M/s", "its loop"] + [h for k in names for h in (f"{k} M/s", "% ceil")] + ["re-taken"]
    out += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    out += [f"WARNING: {o}: a defect of the ceiling (no loop here moves these bytes that fast), not a result" for o in over]
    out += ["", "The ceiling loops, M params/s (tile in elements; pf: software prefetch; nt: streaming stores)", "",
            "| size | " + " | ".join(k[len("touch "):] for k in loops) + " |", "|" + "---|" * (len(loops) + 1)]
    out += ["| " + " | ".join(r) + " |" for r in loop_rows]
    others = [k for k in names if k != "ours"]
    out += ["", "Speed of ours relative to each (time of the other / time of ours)", "",
            "| size | " + " | ".join(f"vs {k}" for k in others) + " |", "|" + "---|" * (len(others) + 1)]
    out += ["| " + " | ".join(r) + " |" for r in ratio_rows]
    print(f"\nCPU: {cpu_model()} ({platform.machine()}), torch CPU capability "
          f"{torch.backends.cpu.get_cpu_capability()}, torch {torch.__version__}\n")
    print("\n".join(out))
    if a.results:
        publish("adam", "\n".join(out), "fp32", a.results)


if __name__ == "__main__":
    main()
