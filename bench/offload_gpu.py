"""
bench/offload_gpu.py: the ZeRO-Offload paper's headline on one GPU, in one command.

    python bench/offload_gpu.py                                   # one GPU: within 6 minutes on an H100
    python bench/offload_gpu.py --smallest --out_dir runs/og      # the CI size (the tiny GPT), on any device

The paper (arXiv 2101.06840, abstract and section 6) trains a 10B-parameter GPT at 40 TFLOP/s on one 32 GB V100,
where PyTorch alone trains at most 1.4B, at 30 TFLOP/s: the larger model at a higher rate, because with a large enough
batch the GPU's work outweighs the CPU's AdamW, and the delayed update (DPU) hides the rest. This bench measures
where that holds on this GPU and host, every figure beside the paper's as a ratio (a V100 is not this GPU):

1. TFLOP/s per GPU (instruments.flops_per_token: model FLOPs, nanoGPT's count) of stage 0 (stage0_ddp.py), offload
   (offload.py) and offload with --delayed_update, at gpt2-xl (Ψ = 1.56B, bf16), as the tokens per step grow:
   --grad_accum 1, 4 and 16 of one micro-batch (4 x 1024 tokens). Offload's CPU AdamW costs the same at every batch,
   the GPU's work grows with it: where offload meets stage 0, and how far the DPU moves that point.
2. From each of those runs' last step, its timeline (--timeline, instruments.Timeline; bench/timeline.py's merge
   and overlaps): the share of offload's device-to-host copies under backward's kernels, and of the C++ AdamW under
   forward's and backward's (with the DPU, the update of the step before runs there).
3. The largest GPT of gpt2-xl's width that stage 0, offload and offload with the NVMe tier (--offload_optimizer nvme)
   train on this GPU and host, from the estimator, not a search: the paper's formula for the model states on the
   device and on the host (bench/largest.py's device_states and host_states) plus the activations and working set
   that item 1's runs measured at grad_accum 1 (peak less the model states on the device, bench/compare.py's
   other_bytes), scaled by depth; the NVMe tier's 12Ψ on the disk under --nvme_path. Each depth is then confirmed by
   ONE run at the largest grad_accum, its TFLOP/s beside the paper's.

Every run is `python <stage file> ... --out run.json` on one rank (the world of one that a plain `python` starts),
its output in --out_dir. The whole bench keeps within --budget_s seconds: runs go in the order above, but stage 0's
and offload's largest models before grad_accum 4 and the NVMe tier's last (its state file is written and read every
step), and a run is stopped at the budget, or not started within 10 s of it (its row says so).
Output: --out_dir/offload_gpu.json (every run's figures), offload_gpu.md and offload_gpu.png; on a GPU at full size
also bench/results/offload_gpu.md and .png (results.publish). --smallest writes to --out_dir only: on a CPU or the
fake CUDA device its numbers are no GPU's (tests/test_offload_gpu.py checks the table's shape there, not its numbers).
"""
import argparse, json, os, shutil, subprocess, sys, tempfile, time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for path in (str(ROOT), str(ROOT / "bench")):  # the stage files' helpers; the bench scripts beside this one
    if path not in sys.path:
        sys.path.insert(0, path)
from compare import other_bytes  # noqa: E402
from largest import device_states, host_available, host_states, n_params  # noqa: E402
from results import RESULTS, publish  # noqa: E402
import timeline  # noqa: E402

# The paper's figures (abstract): ZeRO-Offload 40 TFLOP/s at 10B, PyTorch 30 TFLOP/s at 1.4B (its largest), one V100.
PAPER = {"stage0": (30.0, 1.4e9, "PyTorch"), "offload": (40.0, 10e9, "ZeRO-Offload")}
SCRIPTS = {"stage0": ["stage0_ddp.py"], "offload": ["offload.py"], "offload_dpu": ["offload.py", "--delayed_update"],
           "offload_nvme": ["offload.py", "--offload_optimizer", "nvme"]}
NAMES = {"stage0": "stage 0", "offload": "offload", "offload_dpu": "offload + DPU", "offload_nvme": "offload + NVMe"}
# the sizes: the preset and its model options, the micro-batch in sequences, the grad_accums, the steps of a sweep
# run, and the most layers the estimator may plan
FULL = dict(preset="gpt2-xl", model=[], micro_batch=16, accums=[1, 4, 16], steps=5, max_layers=4096)
SMALLEST = dict(preset="tiny", model=["--n_layer", "2"], micro_batch=2, accums=[1, 2], steps=3, max_layers=3)
# what the estimator may plan to fill: shares of the GPU's free memory, the host's available memory and the free disk
DEVICE_SHARE = 0.9
HOST_SHARE = 0.9
DISK_SHARE = 0.8


# the pinned host-device link, each way, measured on the H200 (tests/gpu_facts_h200.json's rates)
LINK_GB_S = 55.3


def host_adam_rate(numel=2**26):
    """Parameters per second of the C++ AdamW as offload.py runs it (fp32 master and moments, bf16 gradient in, bf16
    parameters out), on this host's threads: the median of 5 steps."""
    import torch
    sys.path.insert(0, str(ROOT))
    from offload import load_cpu_adam
    adam = load_cpu_adam()
    master, m, v = (torch.zeros(numel) for _ in range(3))
    grad = torch.zeros(numel, dtype=torch.bfloat16)
    out = torch.zeros(numel, dtype=torch.bfloat16)
    recipe = dict(beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1)
    times = []
    for step in range(1, 7):
        t = time.perf_counter()
        adam.adam_step(master, grad, m, v, out, step=step, lr=1e-4, grad_scale=1.0, **recipe)
        times.append(time.perf_counter() - t)
    return numel / sorted(times[1:])[2]


def predicted(result, accum, name):
    """offload / stage 0 at `accum` micro-steps, from measured parts (a prediction, for one GPU run to check): stage
    0's time per micro-step t (its run at grad_accum 1), the C++ AdamW's Ψ / rate on this host, and the parameters'
    2Ψ bytes up the link. Without the DPU the update follows the step: accum·t + max(AdamW, upload); with it the update
    runs beside the next step: max(accum·t, AdamW + the last bucket's upload)."""
    base = result["sweep"].get(f"stage0.ga{result['size']['accums'][0]}", {}).get("step_s")
    if not base:
        return None
    psi = result["psi"]
    adam = psi / result["adam_rate"]
    upload = 2 * psi / (result["link_gb_s"] * 1e9)
    step = accum * base + max(adam, upload) if name == "offload" else max(accum * base, adam + upload / 48)
    return accum * base / step


def run(name, flags, out_dir, deadline):
    """One run of a stage file (SCRIPTS[name] + flags) on one rank, its summary or the reason it has none. It is
    stopped at the deadline (time.monotonic())."""
    out = out_dir / f"{name}.json"
    log = out_dir / f"{name}.log"
    left = deadline - time.monotonic()
    if left < 10:
        return None, "not run: the time budget (--budget_s) was spent"
    if out.exists():
        out.unlink()  # never report a stale run as this one
    script, *own = SCRIPTS[name.split(".")[0]]
    cmd = [sys.executable, str(ROOT / script), *own, *flags, "--out", str(out)]
    t0 = time.monotonic()
    with open(log, "w") as f:
        f.write(" ".join(cmd) + "\n")
        f.flush()
        try:
            rc = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, timeout=left).returncode
        except subprocess.TimeoutExpired:
            rc = "timed out at the budget"
    print(f"  {name}: {time.monotonic() - t0:.0f} s, exit {rc}", flush=True)
    if out.exists():
        return json.loads(out.read_text()), None
    tail = "\n    ".join(log.read_text(errors="replace").strip().splitlines()[-8:])
    print(f"  {name}: no summary; the end of {log}:\n    {tail}", flush=True)
    return None, f"failed (exit {rc}; {log.name})"


def overlap(trace_dir):
    """The timeline's fractions: offload's gradient copies (to the host) under backward's kernels, the C++ AdamW
    under forward's and backward's (None where the run has none)."""
    trace = timeline.merge(trace_dir)
    fractions = {}
    for row, phases, name in (("copies", ("backward",), "copy to host"), ("cpu adam", ("forward", "backward"), "")):
        over, total = timeline.under_phases(trace, row, phases, name)
        fractions[row] = over / total if total else None
    return fractions


def depth_flags(size, depth=None):
    """The sweep's GPT, or with `depth` that many layers of its width (the last --n_layer given wins)."""
    return ["--preset", size["preset"], *size["model"]] + (["--n_layer", str(depth)] if depth else [])


def train_flags(size, accum):
    quiet = ["--no_progress", "--sample_chars", "0", "--eval_every", str(10**9), "--eval_batches", "1"]
    return ["--batch_size", str(size["micro_batch"] * accum), "--grad_accum", str(accum), "--dtype", "bf16",
            "--device", "cuda", *quiet]


class Estimator:
    """The largest depth of the sweep's width each row trains here, by the formula and the measured activations."""
    def __init__(self, cfg, budgets, other_per_layer, max_layers):
        from train_gpt import GPTConfig
        self.psi = [n_params(GPTConfig(cfg["block_size"], cfg["vocab_size"], d, cfg["n_head"], cfg["n_embd"]))
                    for d in (1, 2)]
        self.budgets = budgets
        self.other_per_layer = other_per_layer  # bytes of activations and working set per layer, by stage
        self.max_layers = max_layers

    def params(self, depth):
        """Ψ at `depth` layers: linear in depth (bench/largest.py's Prober.params)."""
        return self.psi[0] + (depth - 1) * (self.psi[1] - self.psi[0])

    def limit(self, row, depth):
        """The memory `depth` layers would overfill (None: it fits): the device, the host, or the NVMe tier's disk."""
        psi = self.params(depth)
        block = self.psi[1] - self.psi[0]
        largest_bucket = max(block, self.psi[0] - block)
        stage = "stage0" if row == "stage0" else "offload"
        device = device_states(row, psi, 1, 2) + self.other_per_layer[stage] * depth
        if device > self.budgets["device"]:
            return "device memory"
        if host_states(row, psi, 1, 2, True, largest_bucket) > self.budgets["host"]:
            return "host memory"
        if row == "offload_nvme" and 12 * psi > self.budgets["disk"]:
            return "disk (the NVMe tier's 12Ψ)"
        return None

    def largest(self, row):
        """(depth, the limit one layer more meets): bisection, memory being monotone in depth."""
        if self.limit(row, self.max_layers) is None:
            return self.max_layers, f"none: the bench stops at {self.max_layers} layers"
        lo, hi = 0, self.max_layers
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if self.limit(row, mid) is None else (lo, mid)
        return lo, self.limit(row, lo + 1)


def budgets(nvme_path):
    """What the estimator may fill: a share of the GPU's free memory (read in a process of its own, so that this one
    holds no CUDA context), of the host's available memory less 4 GiB (bench/largest.py's margin), of the disk."""
    code = "import torch; print(torch.cuda.mem_get_info()[0])"
    said = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    free = int(said.split()[-1])
    return dict(device=DEVICE_SHARE * free, host=HOST_SHARE * (host_available() or 0) - 4 * 2**30,
                disk=DISK_SHARE * shutil.disk_usage(nvme_path).free)


def tflops(s):
    return s["tflops_per_rank"] if s else None


def cell(r, paper):
    """A run's TFLOP/s, its ratio to the paper's figure and its MFU where the GPU's peak is known ("-": no run)."""
    if not r or r.get("tflops") is None:
        return "-"
    mfu = f", MFU {r['mfu']:.0%}" if r.get("mfu") is not None else ""
    return f"{r['tflops']:.3g} ({r['tflops'] / paper:.2f}x{mfu})"


def render(result):
    """The Markdown the bench writes: the sweep, the overlaps, the largest models."""
    sweep = result["sweep"]
    largest = result["largest"]
    size = result["size"]
    s0 = PAPER["stage0"][0]
    off = PAPER["offload"][0]
    lines = [f"TFLOP/s per GPU (model FLOPs, instruments.flops_per_token) at {size['preset']} (Ψ = {result['psi']:,}), "
             f"bf16, one micro-batch of {size['micro_batch']} x {result['block_size']} tokens; in brackets the ratio "
             f"to "
             f"the paper's V100 figure: PyTorch's {s0:g} for stage 0, ZeRO-Offload's {off:g} for offload.", "",
             "| tokens per step | grad_accum | stage 0 | offload | offload + DPU | offload / stage 0 (predicted) | "
             "offload + DPU / stage 0 (predicted) |", "|---:|---:|---:|---:|---:|---:|---:|"]
    for accum in size["accums"]:
        row = {name: sweep.get(f"{name}.ga{accum}", {}) for name in ("stage0", "offload", "offload_dpu")}
        tf = {name: r.get("tflops") for name, r in row.items()}
        ratio = lambda name: f"{tf[name] / tf['stage0']:.2f}" if tf[name] and tf["stage0"] else "-"
        guess = lambda name: f"{p:.2f}" if (p := predicted(result, accum, name)) is not None else "-"
        tokens = accum * size["micro_batch"] * result["block_size"]
        lines.append(f"| {tokens:,} | {accum} | {cell(row['stage0'], s0)} | "
                     f"{cell(row['offload'], off)} | {cell(row['offload_dpu'], off)} | {ratio('offload')} "
                     f"({guess('offload')}) | {ratio('offload_dpu')} ({guess('offload_dpu')}) |")
    lines += ["", "Milliseconds per micro-step (a step's time / grad_accum), and the slope (T(last) - T(first)) / "
              "(its micro-steps' difference): what one more micro-step costs.", "",
              "| run | " + " | ".join(f"grad_accum {a}" for a in size["accums"]) + " | slope |",
              "|---|" + "---:|" * (len(size["accums"]) + 1)]
    for name in ("stage0", "offload", "offload_dpu"):
        steps = [sweep.get(f"{name}.ga{a}", {}).get("step_s") for a in size["accums"]]
        cells = [f"{t / a * 1e3:.1f}" if t else "-" for t, a in zip(steps, size["accums"])]
        first, last = size["accums"][0], size["accums"][-1]
        slope = f"{(steps[-1] - steps[0]) / (last - first) * 1e3:.1f}" if steps[0] and steps[-1] and last > first else "-"
        lines.append(f"| {NAMES[name]} | " + " | ".join(cells) + f" | {slope} |")
    lines += ["", f"Predicted (in brackets): from stage 0's micro-step at grad_accum {size['accums'][0]}, the C++ "
              f"AdamW measured on this host ({result['adam_rate'] / 1e9:.2f} G parameters/s) and a "
              f"{result['link_gb_s']:g} GB/s link (bench/offload_gpu.py's predicted()).", "",
              f"The paper's offload / PyTorch: {off / s0:.2f} (at 10B against 1.4B).", "",
              "Overlap in each run's traced (last) step: the share of offload's device-to-host copies under "
              "backward's kernels, and of the C++ AdamW under forward's and backward's.", "",
              "| run | grad_accum | copies under backward | C++ AdamW under forward + backward | note |",
              "|---|---:|---:|---:|---|"]
    pct = lambda v: "-" if v is None else f"{v:.1%}"
    for name in ("offload", "offload_dpu"):
        for accum in size["accums"]:
            r = sweep.get(f"{name}.ga{accum}", {})
            lines.append(f"| {NAMES[name]} | {accum} | {pct(r.get('copies'))} | {pct(r.get('cpu adam'))} | "
                         f"{r.get('note') or ''} |")
    lines += ["", f"The largest GPT of {size['preset']}'s width (n_embd {result['n_embd']}) each trains on this GPU "
              f"and host, by the estimator, confirmed by one run of {result['largest_steps']} steps at grad_accum "
              f"{size['accums'][-1]}; beside the paper's largest (PyTorch 1.4B, ZeRO-Offload 10B) and its TFLOP/s.", "",
              "| run | layers | Ψ | one layer more overfills | Ψ / paper's | ran | TFLOP/s (/ paper's) |",
              "|---|---:|---:|---|---:|---|---:|"]
    for name, r in largest.items():
        paper_tf, paper_psi, _ = PAPER["stage0" if name == "stage0" else "offload"]
        ran = "yes" if r.get("tflops") is not None else (r.get("note") or "no")
        lines.append(f"| {NAMES[name]} | {r['layers']} | {r['psi']:,} | {r['limit']} | {r['psi'] / paper_psi:.3f} | "
                     f"{ran} | {cell(r, paper_tf)} |")
    return "\n".join(lines)


def draw(result, path):
    """TFLOP/s per GPU against tokens per step (left), and offload over stage 0 beside the paper's 40/30 (right)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    size = result["size"]
    sweep = result["sweep"]
    tokens = [a * size["micro_batch"] * result["block_size"] for a in size["accums"]]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4), dpi=80)
    for name in ("stage0", "offload", "offload_dpu"):
        ys = [sweep.get(f"{name}.ga{a}", {}).get("tflops") for a in size["accums"]]
        left.plot(tokens, [float("nan") if y is None else y for y in ys], marker="o", label=NAMES[name])
        if name != "stage0":
            base = [sweep.get(f"stage0.ga{a}", {}).get("tflops") for a in size["accums"]]
            right.plot(tokens, [y / b if y and b else float("nan") for y, b in zip(ys, base)], marker="o",
                       label=f"{NAMES[name]} / stage 0")
    right.axhline(PAPER["offload"][0] / PAPER["stage0"][0], color="gray", linestyle="--",
                  label="the paper's 40 / 30 (V100)")
    for ax, ylabel in ((left, "TFLOP/s per GPU"), (right, "ratio")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens per step")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"{size['preset']}, bf16, one GPU: {result['machine']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.strip().split("\n")[0])
    p.add_argument("--smallest", action="store_true", help="the tiny GPT, 3 depths at most: the CI size (any device)")
    p.add_argument("--out_dir", default=str(ROOT / "runs" / "offload_gpu"))
    p.add_argument("--budget_s", type=float, default=330, help="seconds for the whole bench (default 330)")
    p.add_argument("--nvme_path", default=None, help="the NVMe tier's state file (default: a directory in --out_dir)")
    o = p.parse_args(argv)
    import torch
    if not torch.cuda.is_available():
        p.error("this bench trains on a CUDA GPU (--device cuda): run it on one, or on the fake CUDA device "
                "(PYTHONPATH=tests/fake_cuda_site FAKE_CUDA=1) with --smallest")
    size = SMALLEST if o.smallest else FULL
    out_dir = Path(o.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    nvme = Path(o.nvme_path or tempfile.mkdtemp(prefix="nvme_", dir=out_dir))
    deadline = time.monotonic() + o.budget_s
    t0 = time.monotonic()
    machine = torch.cuda.get_device_name()
    print(f"offload_gpu: {size['preset']} on {machine}, within {o.budget_s:g} s; runs in {out_dir}", flush=True)
    adam_rate = host_adam_rate()
    print(f"  the C++ AdamW on this host: {adam_rate / 1e9:.2f} G parameters/s", flush=True)
    sweep = {}
    summaries = {}
    # 1-2: the sweep, every grad_accum (the paper's headline), then the largest models (3), the NVMe tier's last (its
    # state file, written and read each step, is the slowest run)
    for accum in size["accums"]:
        for name in ("stage0", "offload", "offload_dpu"):
            key = f"{name}.ga{accum}"
            # offload's runs trace their last step (stage 0 has no copies and no C++ AdamW to place)
            trace_dir = out_dir / f"{key}.timeline"
            traced = ["--timeline", str(trace_dir)] if name != "stage0" else []
            flags = [*depth_flags(size), *train_flags(size, accum), "--steps", str(size["steps"]), *traced]
            s, note = run(key, flags, out_dir, deadline)
            summaries[key] = s
            fractions = overlap(trace_dir) if s and traced else {}
            seconds = s and s["args"]["batch_size"] * s["config"]["block_size"] / s["tokens_per_s"]
            sweep[key] = dict(tflops=tflops(s), mfu=s and s["mfu"], note=note, step_s=seconds, **fractions)
    largest = estimate_largest(size, summaries, nvme)
    for name in ("stage0", "offload"):
        confirm(largest, name, size, nvme, out_dir, deadline)
    if "offload_nvme" in largest:
        confirm(largest, "offload_nvme", size, nvme, out_dir, deadline)
    first = next(s for s in summaries.values() if s) if any(summaries.values()) else None
    if first is None:
        raise SystemExit("error: no run of the sweep finished: see the logs in " + str(out_dir))
    cfg = first["config"]
    result = dict(machine=machine, size=size, psi=first["n_params"], block_size=cfg["block_size"], n_embd=cfg["n_embd"],
                  largest_steps=3, sweep=sweep, largest=largest, seconds=round(time.monotonic() - t0, 1),
                  adam_rate=adam_rate, link_gb_s=LINK_GB_S)
    (out_dir / "offload_gpu.json").write_text(json.dumps(result, indent=1))
    body = render(result)
    print(body)
    draw(result, out_dir / "offload_gpu.png")
    (out_dir / "offload_gpu.md").write_text(body + "\n")
    if not o.smallest:  # a GPU's figures: bench/results/, headed by the machine and the command
        path = publish("offload_gpu", body, "bf16", RESULTS)
        shutil.copyfile(out_dir / "offload_gpu.png", path.with_suffix(".png"))
    if o.nvme_path is None:
        shutil.rmtree(nvme, ignore_errors=True)
    print(f"offload_gpu: {result['seconds']} s; wrote {out_dir / 'offload_gpu.md'} and {out_dir / 'offload_gpu.png'}")


def estimate_largest(size, summaries, nvme):
    """3: each row's largest depth by the estimator, the activations from the sweep's grad_accum 1 runs ({} where
    either did not finish)."""
    measured = {stage: summaries.get(f"{stage}.ga{size['accums'][0]}") for stage in ("stage0", "offload")}
    if not all(measured.values()):
        return {}
    cfg = measured["stage0"]["config"]
    other_per_layer = {stage: other_bytes(s) / s["config"]["n_layer"] for stage, s in measured.items()}
    estimator = Estimator(cfg, budgets(nvme), other_per_layer, size["max_layers"])
    rows = {}
    for name in ("stage0", "offload", "offload_nvme"):
        depth, limit = estimator.largest(name)
        rows[name] = dict(layers=depth, psi=estimator.params(depth) if depth else 0, limit=limit)
    return rows


def confirm(rows, name, size, nvme, out_dir, deadline):
    """One run of row `name` at its estimated depth and the sweep's largest grad_accum: its TFLOP/s, or why none."""
    depth = rows[name]["layers"]
    if not depth:
        rows[name]["note"] = "not one layer fits"
        return
    flags = [*depth_flags(size, depth), *train_flags(size, size["accums"][-1]), "--steps", "3"]
    flags += ["--nvme_path", str(nvme)] if name == "offload_nvme" else []
    s, note = run(f"{name}.largest", flags, out_dir, deadline)
    rows[name].update(tflops=tflops(s), mfu=s and s["mfu"], note=note)

if __name__ == "__main__":
    main()
