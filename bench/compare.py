"""
bench/compare.py: every stage at N = 1, 2, 4 in one command, and the memory per rank falling stage by stage.

One Markdown table and one picture of the memory, built from the runs' JSON summaries only (nothing typed by hand),
written to --out_dir (runs/compare/: table.md, summary.json, memory.png); --results also writes bench/results/compare.md.

    python bench/compare.py                                   # defaults: a few minutes on a 2-core CPU
    python bench/compare.py --nproc 2 4 --stages stage0 stage3 --steps 10 --dtype bf16
    python bench/compare.py --preset small --n_layer 6 -- --grad_accum 2    # after --: passed to every run
    python bench/compare.py --from_dir runs/compare           # re-render table.md, summary.json, memory.png; no runs

Each run is `torchrun --standalone --nproc_per_node N <stage file> ... --out DIR/<stage>_n<N>.json` (its output in
<stage>_n<N>.log). The table gives, per rank (rank 0; a mark if another rank holds different bytes), each model-state
category measured / theory (train_gpt.model_state_theory), their total, the peak of live tensor bytes in the measured
step, "other" = peak - model states (activations, gradients and gathered parameters in flight), communication per
step measured / theory (train_gpt.comm_theory), tokens/s and the final training and validation losses (same model,
data, seed and global batch at every N: the losses should agree across rows; in fp32, to rounding).

The default model is the tiny preset widened to 8 layers of 128 (1.6M parameters), in the dtype train_gpt's --dtype
auto picks (bf16 where it is fast, else fp32; the table names it): the model states are large
next to the activations of a 16 x 64-token batch, so the ZeRO ordering of the peak shows (stage 0 > 1 > 2 > 3 at
N = 4), and 8 blocks make stage 3's working set (root + 2 blocks) small next to the whole model.
Memory is counted in tensor bytes (instruments.PeakMemory), not RSS. On CPU, tokens/s at N ranks measures N processes
sharing this machine's cores: compare stages at the same N, not across N.
"""
import argparse, json, math, os, shutil, subprocess, sys, time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for path in (str(ROOT), str(ROOT / "bench")):  # train_gpt's formulas; results.py, beside this file
    if path not in sys.path:
        sys.path.insert(0, path)
from results import add_flag, publish  # noqa: E402

SCRIPTS = {"stage0": "stage0_ddp.py", "stage1": "stage1.py", "stage2": "stage2.py", "stage3": "stage3.py",
           "offload": "offload.py"}
CATEGORIES = ["params", "grads", "master", "adam_m", "adam_v"]
MiB = 2**20


def host_categories(stage, offload_params):
    from train_gpt import host_categories as hc  # THE definition; imported late so --help needs no torch
    return hc(stage, offload_params)


def other_bytes(summary):
    """peak - the model states the peak counts: on a GPU the peak is the device's alone, so offload's host-resident
    states are not in it; on a CPU device and host are one memory, and the peak counts them all."""
    states = summary["model_state_bytes"]
    host = host_categories(summary["stage"], summary.get("args", {}).get("offload_params", False))
    counted = sum(v["measured"] for k, v in states.items() if summary.get("device") != "cuda" or k not in host)
    other = summary["peak_memory_bytes"] - counted
    if other < 0:
        raise ValueError(f"{summary['stage']}: peak {summary['peak_memory_bytes']:,} bytes is below the model states it "
                         f"holds ({counted:,}): the run's summary is inconsistent")
    return other


# ----------------------------------------------------------------------------------------------------------------
# Running

def stage_available(stage):
    """A stage file exists and implements a stage (offload.py is written in steps: it may not call main yet)."""
    path = ROOT / SCRIPTS[stage]
    if not path.exists():
        return False, f"{SCRIPTS[stage]} does not exist"
    if "main(" not in path.read_text():
        return False, f"{SCRIPTS[stage]} does not implement a stage yet (no call to main): skipped"
    return True, ""


def run_one(stage, nproc, train_args, out_dir):
    out, log = out_dir / f"{stage}_n{nproc}.json", out_dir / f"{stage}_n{nproc}.log"
    if out.exists():
        out.unlink()  # never report a stale run as this one
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           str(ROOT / SCRIPTS[stage]), *train_args, "--out", str(out)]
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)  # the caller's kept, after ours
    t0 = time.perf_counter()
    with open(log, "w") as f:
        f.write(" ".join(cmd) + "\n")
        f.flush()
        p = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, env=dict(os.environ, PYTHONPATH=path))
    dt = time.perf_counter() - t0
    if out.exists():
        note = "" if p.returncode == 0 else f" (exit code {p.returncode} after writing its summary; see {log})"
        print(f"  {stage:8s} N={nproc}: {dt:5.1f} s{note}", flush=True)
        return True
    tail = "\n".join(log.read_text().strip().splitlines()[-15:])
    print(f"  {stage:8s} N={nproc}: FAILED (exit code {p.returncode}, no summary written); last lines of {log}:\n{tail}",
          flush=True)
    return False


# ----------------------------------------------------------------------------------------------------------------
# Reading and rendering

def load_rows(run_dir, only=None):
    """One row per run summary in run_dir (or only the file names in `only`), sorted by N then stage, in bytes."""
    rows = []
    for path in sorted(Path(run_dir).glob("*.json")):
        if path.name == "summary.json" or (only is not None and path.name not in only):
            continue
        try:
            s = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            print(f"note: {path} is not readable JSON ({e}): skipped")
            continue
        if not isinstance(s, dict) or not {"stage", "world_size", "model_state_bytes", "peak_memory_bytes"} <= set(s):
            continue  # not a stage run's summary
        args = s.get("args", {})
        msb = s["model_state_bytes"]
        meas = {k: msb.get(k, {}).get("measured", 0) for k in CATEGORIES}
        theo = {k: msb.get(k, {}).get("theory", 0) for k in CATEGORIES}
        per_rank = [r for r in s.get("model_state_bytes_per_rank", []) if r]
        rank_totals = [sum(r.values()) for r in per_rank]
        offload_params = bool(args.get("offload_params", False))
        comm = s.get("comm_bytes_per_step", {})
        losses = s.get("losses") or [float("nan")]
        rows.append(dict(
            file=path.name, stage=s["stage"], world_size=s["world_size"], n_params=s.get("n_params"),
            padded_numel=s.get("padded_numel"), dtype=s.get("dtype"), device=s.get("device"),
            config=s.get("config", {}), steps=args.get("steps"), batch_size=args.get("batch_size"),
            checkpoint_activations=bool(args.get("checkpoint_activations", False)),
            grad_accum=args.get("grad_accum"), offload_params=offload_params,
            host=list(host_categories(s["stage"], offload_params)),
            measured=meas, theory=theo,  # the totals: every category (offload's grad_acc too, which has no column)
            states_measured=sum(v.get("measured", 0) for v in msb.values()),
            states_theory=sum(v.get("theory", 0) for v in msb.values()),
            ranks_differ=bool(rank_totals) and max(rank_totals) != min(rank_totals),
            max_rank_states=max(rank_totals) if rank_totals else sum(meas.values()),
            peak=s["peak_memory_bytes"], other=other_bytes(s),
            comm_measured=comm.get("measured", 0.0), comm_theory=comm.get("theory", 0.0),
            tokens_per_s=s.get("tokens_per_s", 0.0), final_loss=losses[-1], val_loss=s.get("val_loss", float("nan"))))
    order = list(SCRIPTS)
    rows.sort(key=lambda r: (r["world_size"], order.index(r["stage"]) if r["stage"] in order else len(order), r["stage"]))
    return rows


def model_key(r):
    return json.dumps([r["config"], r["dtype"], r["steps"], r["batch_size"], r["grad_accum"]], sort_keys=True)


def describe(r):
    c = r["config"]
    return (f"GPT {c.get('n_layer')} layers x {c.get('n_embd')} wide, {c.get('n_head')} heads, vocab {c.get('vocab_size')}, "
            f"Ψ = {r['n_params']:,} parameters; {r['dtype']} on {r['device']}; global batch {r['batch_size']} x "
            f"{c.get('block_size')} tokens (grad_accum {r['grad_accum']}); {r['steps']} steps"
            + ("; --checkpoint_activations (a block keeps only its input for backward)" * r["checkpoint_activations"]))


def render_table(rows):
    mib = lambda b: f"{b / MiB:.2f}"
    pair = lambda m, t: f"{mib(m)} / {mib(t)}"
    keys = {model_key(r) for r in rows}
    lines = [f"Per-rank memory, MiB (2^20 bytes), rank 0; cells \"measured / theory\". {describe(rows[0])}."]
    if len(keys) > 1:
        lines.append(f"WARNING: these runs used {len(keys)} different configurations: compare losses only between "
                     "rows of the same one (see summary.json).")
    lines += ["", "| stage | N | params | grads | master | adam_m | adam_v | model states | peak | other | "
                  "comm MiB/step | tokens/s | final loss | val loss |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        cells = [pair(r["measured"][k], r["theory"][k]) + (" ᴴ" if k in r["host"] else "") for k in CATEGORIES]
        stage = r["stage"] + (" (+params)" if r["offload_params"] else "") + (" *" if r["ranks_differ"] else "")
        lines.append(f"| {stage} | {r['world_size']} | " + " | ".join(cells) + f" | {pair(r['states_measured'], r['states_theory'])} | "
                     f"{mib(r['peak'])} | {mib(r['other'])} | {pair(r['comm_measured'], r['comm_theory'])} | "
                     f"{r['tokens_per_s']:,.0f} | {r['final_loss']:.5f} | {r['val_loss']:.5f} |")
    exact = sum(r["states_measured"] == r["states_theory"] for r in rows)
    lines += ["", f"Model states equal to the formula in {exact} of {len(rows)} runs; communication within 0.1% of "
                  f"the formula in {sum(abs(r['comm_measured'] - r['comm_theory']) <= 1e-3 * max(r['comm_theory'], 1) for r in rows)}."]
    for key in sorted(keys):
        same = [r for r in rows if model_key(r) == key]
        fl = [r["final_loss"] for r in same]
        lines.append(f"Final training loss over the {len(same)} runs of one configuration: {min(fl):.6f} to {max(fl):.6f} "
                     f"(spread {max(fl) - min(fl):.1e}).")
    for n in sorted({r["world_size"] for r in rows}):
        at = [r for r in rows if r["world_size"] == n]
        if len(at) > 1:
            lines.append(f"Peak at N = {n}: " + " > ".join(f"{r['stage']} {mib(r['peak'])}" for r in
                                                         sorted(at, key=lambda r: -r["peak"])) + " MiB.")
    if any(r["host"] for r in rows):
        lines.append("ᴴ: kept in host (CPU) memory by ZeRO-Offload (train_gpt.host_categories); on a CPU-only machine "
                     "host and device are the same memory.")
    if any(r["ranks_differ"] for r in rows):
        lines.append("*: ranks hold different model-state bytes; the largest: "
                     + ", ".join(f"{r['stage']} N={r['world_size']} {mib(r['max_rank_states'])}" for r in rows if r["ranks_differ"]))
    lines.append("peak: highest live tensor bytes during the measured step (step 1); other = peak - model states "
                 "(activations, buffers in flight). tokens/s: N ranks share this machine's cores.")
    return "\n".join(lines)


def draw(rows, path):
    """Stacked bars per rank: params, grads, optimizer states (master + Adam m, v) and other (peak - model states),
    one group per N; the formula's model-state total as a black marker. Returns False if matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
        from matplotlib.lines import Line2D
    except ImportError:
        return False
    parts = [("params", ["params"], "#4C72B0"), ("grads", ["grads"], "#DD8452"),
             ("optimizer states (master + Adam m, v)", ["master", "adam_m", "adam_v"], "#55A868")]
    ns = sorted({r["world_size"] for r in rows})
    stages = [s for s in SCRIPTS if any(r["stage"] == s for r in rows)] + \
             sorted({r["stage"] for r in rows} - set(SCRIPTS))
    width, gap = 0.8, 1.2
    fig, ax = plt.subplots(figsize=(max(7.0, 1.0 + 0.75 * len(ns) * len(stages) + 0.6 * len(ns)), 5.6))
    xticks, xlabels, top = [], [], 0
    for gi, n in enumerate(ns):
        x0 = gi * (len(stages) + gap)
        for si, stage in enumerate(stages):
            r = next((r for r in rows if r["world_size"] == n and r["stage"] == stage), None)
            x = x0 + si
            xticks.append(x)
            xlabels.append(stage.replace("stage", "stage ") if len(stages) <= 6 else stage.replace("stage", "s"))
            if r is None:
                ax.text(x, 0, "n/a", ha="center", va="bottom", fontsize=8, color="grey")
                continue
            bottom = 0.0
            for _, cats, color in parts:
                h = sum(r["measured"][c] for c in cats) / MiB
                on_host = any(c in r["host"] for c in cats)
                ax.bar(x, h, width, bottom=bottom, color=color, edgecolor="black" if on_host else color,
                       hatch="///" if on_host else None, linewidth=0.6 if on_host else 0)
                bottom += h
            other = r["other"] / MiB
            ax.bar(x, other, width, bottom=bottom, color="#C9C9C9", edgecolor="#8C8C8C", linewidth=0.5)
            t = r["states_theory"] / MiB
            ax.plot([x - width / 2 - 0.08, x + width / 2 + 0.08], [t, t], color="black", linewidth=2.2, solid_capstyle="butt")
            ax.text(x, bottom + other, f"{r['peak'] / MiB:.1f}", ha="center", va="bottom", fontsize=8)
            top = max(top, bottom + other)
        ax.text(x0 + (len(stages) - 1) / 2, -0.09, f"N = {n}", transform=ax.get_xaxis_transform(), ha="center",
                va="top", fontsize=11, fontweight="bold")
    ax.set_xticks(xticks)
    ax.set_xticklabels(xlabels, fontsize=8.5, rotation=0 if len(stages) * len(ns) <= 15 else 45)
    ax.set_ylim(0, top * 1.12)
    ax.set_ylabel("MiB per rank (rank 0)")
    ax.grid(axis="y", alpha=0.3)
    ax.set_axisbelow(True)
    c = rows[0]["config"]
    ax.set_title(f"Memory per rank, measured: GPT Ψ = {rows[0]['n_params'] / 1e6:.2f}M ({c.get('n_layer')} layers x "
                 f"{c.get('n_embd')}), {rows[0]['dtype']}, batch {rows[0]['batch_size']} x {c.get('block_size')} tokens\n"
                 "bars: model states + other (peak - model states); number on top: peak", fontsize=10.5)
    handles = [Patch(color=color, label=label) for label, _, color in parts]
    handles.append(Patch(facecolor="#C9C9C9", edgecolor="#8C8C8C", label="other: activations, buffers in flight"))
    if any(r["host"] for r in rows):
        handles.append(Patch(facecolor="white", edgecolor="black", hatch="///", label="on the host (ZeRO-Offload)"))
    handles.append(Line2D([], [], color="black", linewidth=2.2, label="ZeRO formula: model states"))
    ax.legend(handles=handles, loc="upper right", fontsize=8.5, framealpha=0.95)
    fig.subplots_adjust(bottom=0.14, left=0.08, right=0.98, top=0.88)
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return True


def render(run_dir, only=None, results=None):
    rows = load_rows(run_dir, only)
    if not rows:
        raise SystemExit(f"error: no run summaries (*.json written by --out) in {run_dir}")
    table = render_table(rows)
    print(table)
    run_dir = Path(run_dir)
    (run_dir / "table.md").write_text(table + "\n")
    (run_dir / "summary.json").write_text(json.dumps({"rows": rows}, indent=1) + "\n")
    png = run_dir / "memory.png"
    drew = draw(rows, png)
    if results:  # bench/results/compare.md, headed by the machine, torch, dtype and command; compare.png beside it
        path = publish("compare", table, rows[0]["dtype"], results)
        if drew:
            shutil.copyfile(png, path.with_suffix(".png"))
    if drew:
        print(f"\nwrote {run_dir / 'table.md'}, {run_dir / 'summary.json'} and {png}")
    else:
        print(f"\nwrote {run_dir / 'table.md'} and {run_dir / 'summary.json'}; `pip install matplotlib` draws the picture ({png})")
    return rows


# ----------------------------------------------------------------------------------------------------------------

def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    extra = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    p = argparse.ArgumentParser(description=__doc__.strip().split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n".join(__doc__.strip().split("\n")[2:]))
    p.add_argument("--nproc", type=int, nargs="+", default=[1, 2, 4], help="world sizes (default 1 2 4)")
    p.add_argument("--stages", nargs="+", default=list(SCRIPTS), choices=list(SCRIPTS), help="default: all")
    p.add_argument("--preset", default="tiny")
    p.add_argument("--n_layer", type=int, default=8)
    p.add_argument("--n_head", type=int, default=None)
    p.add_argument("--n_embd", type=int, default=128)
    p.add_argument("--block_size", type=int, default=None)
    p.add_argument("--vocab_size", type=int, default=None)
    p.add_argument("--dtype", default="auto", choices=["auto", "fp32", "bf16", "fp16"],
                   help="auto (default): what train_gpt picks, bf16 where this machine computes it fast, fp16 on a GPU "
                   "without bf16, else fp32")
    p.add_argument("--steps", type=int, default=5, help="at least 3: step 1 is measured, later ones timed (default 5)")
    p.add_argument("--batch_size", type=int, default=16, help="global batch in sequences (a multiple of every N)")
    p.add_argument("--lr", type=float, default=2e-3, help="min_lr is a tenth of it")
    p.add_argument("--offload_params", action="store_true", help="passed to offload.py")
    p.add_argument("--out_dir", default=str(ROOT / "runs" / "compare"))
    p.add_argument("--from_dir", default=None, help="re-render the table and picture from the JSON files here; run nothing")
    add_flag(p)
    a = p.parse_args(argv)
    if a.from_dir:
        render(a.from_dir, results=a.results)
        return 0
    if a.steps < 3:
        p.error("--steps must be at least 3 (step 1 is measured; tokens/s times the steps after it)")
    nprocs = sorted(set(a.nproc))
    if min(nprocs) < 1:
        p.error("--nproc values must be at least 1")
    bad = [n for n in nprocs if a.batch_size % n]
    if bad:
        p.error(f"--batch_size {a.batch_size} is not divisible by N = {bad}; use a multiple of {math.lcm(*nprocs)}")
    import torch
    if torch.cuda.is_available():
        gpus = torch.cuda.device_count()
        if max(nprocs) > gpus:
            print(f"note: this machine has {gpus} GPU(s); N capped at {gpus} (one rank per GPU): dropped N = "
                  f"{[n for n in nprocs if n > gpus]}")
            nprocs = sorted({min(n, gpus) for n in nprocs})
    elif max(nprocs) > (os.cpu_count() or 1):
        print(f"note: CPU run with {os.cpu_count()} cores: N > cores oversubscribes them (memory and bytes are exact; "
              "tokens/s is not comparable across N)")
    stages = []
    for s in a.stages:
        ok, why = stage_available(s)
        if ok:
            stages.append(s)
        else:
            print(f"note: {why}")
    out_dir = Path(a.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    train_args = ["--preset", a.preset, "--dtype", a.dtype, "--steps", str(a.steps), "--batch_size", str(a.batch_size),
                  "--lr", str(a.lr), "--min_lr", str(a.lr / 10),
                  "--eval_every", str(10**9), "--eval_batches", "2", "--sample_chars", "0", "--no_progress"]
    for k in ("n_layer", "n_head", "n_embd", "block_size", "vocab_size"):
        if getattr(a, k) is not None:
            train_args += [f"--{k}", str(getattr(a, k))]
    print(f"running {len(stages)} stage(s) x N = {nprocs} into {out_dir}: {' '.join(train_args + extra)}", flush=True)
    t0 = time.perf_counter()
    for n in nprocs:
        for s in stages:
            run_one(s, n, train_args + extra + (["--offload_params"] if s == "offload" and a.offload_params else []), out_dir)
    print(f"all runs: {time.perf_counter() - t0:.0f} s\n", flush=True)
    render(out_dir, only={f"{s}_n{n}.json" for s in stages for n in nprocs}, results=a.results)  # this command's runs
    return 0


if __name__ == "__main__":
    sys.exit(main())
