"""
bench/timeline.py: one steady-state training step on every rank, as a timeline: when each unit computes its forward
and backward, when each collective is in flight, when offload's copies and C++ AdamW run. The memory table says what a
stage holds and the ledger what it sends; this says when, which is where ZeRO's speed comes from: bucketed collectives
overlapping backward, stage 3's prefetch overlapping forward, offload's delayed update overlapping the next step.

    python bench/timeline.py stage0_ddp.py --nproc 2 --preset small --out runs/tl/stage0
    python bench/timeline.py stage0_ddp.py --nproc 2 --preset small --bucket_mb 1000 --out runs/tl/stage0_one_bucket
    python bench/timeline.py stage3.py --nproc 2 --preset small --no_prefetch --out runs/tl/stage3_no_prefetch
    python bench/timeline.py offload.py --nproc 2 --preset small --delayed_update --out runs/tl/offload_delayed

Every option it does not know goes to the stage file. It runs `torchrun --standalone --nproc_per_node N <stage file>
--steps 6 ...` with --timeline DIR, so that the Timeline (the instruments, beside the communication ledger)
records the run's last step on every rank, and then writes
    DIR/trace.json     the ranks' traces merged, in the Chrome trace format (open it in https://ui.perfetto.dev or
                       chrome://tracing): a process per rank, rows compute, communication (a lane per collective in
                       flight at once), copies, cpu adam, host waits (the host stopped for the GPU, for
                       --delayed_update's thread or for the disk), and with --offload_optimizer nvme the state file's
                       nvme reads and nvme writes, each from its submission to its completion. Compute is
                       "forward <unit>", "backward <unit>" and "optimizer step", the units the engine's own (stage 3's
                       buckets), or else each block and the root: on a CPU the computing thread's time, on a GPU the
                       compute stream's kernels, each named by the part that launched it ("other": the engine's
                       hooks); "issue <op>" and "wait <op>" are the computing thread inside a collective's call (on a
                       GPU drawn in the host waits row; instruments.Timeline says how each moment is measured). Times
                       are microseconds from the start of the earliest rank's step.
    DIR/timeline.png   the same picture: a band per rank (the ranks of one machine share its clock)
    DIR/run.json       the run's summary (train_gpt --out), with its tokens per second
and prints, per rank and over all ranks, the overlap fraction of communication (and of copies, the C++ AdamW, the
host's waits and the NVMe tier's reads and writes, which are also measured against the C++ AdamW):

    overlap = |union(communication intervals) ∩ union(compute intervals)| / |union(communication intervals)|

the share of the time during which some collective of this rank was in flight that this rank also spent computing
(forward, backward or the optimizer step; the computing thread's time inside collective calls, copies, C++ AdamW
calls and host waits is not compute, and on a GPU compute is only the time its compute stream runs kernels). Over
all ranks it is the sum of the numerators over the sum of the denominators. 1: all communication was hidden behind
compute; 0: compute stood still (or waited) whenever anything was in flight. It is
computed from DIR/trace.json alone.

On a CPU, gloo's collectives run on background threads, so the overlap is real, but N ranks share this machine's
cores: compare tokens per second between runs of one session, as ratios.
"""
import argparse, json, os, shutil, subprocess, sys, time
from pathlib import Path

from results import add_flag, publish

ROOT = Path(__file__).resolve().parents[1]
ROWS = ["compute", "communication", "copies", "cpu adam", "host waits", "nvme reads", "nvme writes"]
COLORS = {"forward": "#4C72B0", "backward": "#DD8452", "optimizer": "#55A868", "comm call": "#C8C8C8",
          "all_reduce": "#C44E52", "reduce_scatter": "#8172B3", "all_gather": "#937860",
          "copies": "#DA8BC3", "cpu adam": "#CCB974", "host waits": "#8C8C8C", "other": "#64B5CD",
          "nvme reads": "#2CA02C", "nvme writes": "#D62728"}
DEFAULTS = ["--steps", "6", "--no_progress", "--sample_chars", "0", "--eval_batches", "1"]


def run(script, nproc, stage_args, out_dir):
    """The stage on nproc ranks with --timeline out_dir; its output in out_dir/run.log."""
    for old in out_dir.glob("trace_rank*.json"):
        old.unlink()  # never merge a stale rank's trace into this run's
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", str(script),
           *DEFAULTS, *stage_args, "--out", str(out_dir / "run.json")]
    cmd += ["--timeline", str(out_dir)]
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)  # the caller's kept, after ours
    env = dict(os.environ, PYTHONPATH=path)
    with open(out_dir / "run.log", "w") as log:
        log.write(" ".join(cmd) + "\n")
        log.flush()
        p = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
    traces = sorted(out_dir.glob("trace_rank*.json"))
    if p.returncode != 0 or len(traces) != nproc:
        tail = "\n".join((out_dir / "run.log").read_text().strip().splitlines()[-20:])
        raise SystemExit(f"error: the run failed (exit code {p.returncode}, {len(traces)} of {nproc} traces); "
                         f"the end of {out_dir / 'run.log'}:\n{tail}")


def merge(out_dir):
    """DIR/trace_rank*.json -> one trace, its times shifted so that the earliest rank's step starts at 0."""
    ranks = [json.loads(p.read_text()) for p in out_dir.glob("trace_rank*.json")]
    ranks.sort(key=lambda r: r["otherData"]["rank"])
    zero = min(r["otherData"]["window_us"][0] for r in ranks)
    events = []
    for r in ranks:
        for e in r["traceEvents"]:
            events.append(dict(e, ts=round(e["ts"] - zero, 3)) if "ts" in e else e)
    other = {k: v for k, v in ranks[0]["otherData"].items() if k not in ("rank", "window_us")}
    other["window_us"] = [[round(t - zero, 3) for t in r["otherData"]["window_us"]] for r in ranks]  # rank by rank
    return dict(traceEvents=events, displayTimeUnit="ms", otherData=other)


def union(intervals):
    """Sorted, disjoint intervals covering the same time."""
    out = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return out


def length(intervals):
    return sum(b - a for a, b in intervals)


def intersection(xs, ys):
    """The intersection of two unions (sorted, disjoint)."""
    out, i, j = [], 0, 0
    while i < len(xs) and j < len(ys):
        a, b = max(xs[i][0], ys[j][0]), min(xs[i][1], ys[j][1])
        if a < b:
            out.append([a, b])
        if xs[i][1] < ys[j][1]:
            i += 1
        else:
            j += 1
    return out


def overlaps(trace, under="compute"):
    """{row: {rank: (time overlapped by row `under`, time in the row)}} in microseconds, for the rows after compute
    (other than `under`)."""
    spans = {}
    for e in trace["traceEvents"]:
        if e.get("ph") == "X":
            spans.setdefault((e["cat"], e["pid"]), []).append((e["ts"], e["ts"] + e["dur"]))
    ranks = sorted({pid for _, pid in spans})
    result = {}
    for row in ROWS[1:]:
        if row != under and any((row, r) in spans for r in ranks):
            result[row] = {}
            for r in ranks:
                busy, compute = union(spans.get((row, r), [])), union(spans.get((under, r), []))
                result[row][r] = (length(intersection(busy, compute)), length(busy))
    return result


def fraction(over, total):
    return over / total if total else 0.0


def under_phases(trace, row, phases, name="", begun_in=None):
    """(time of `row` overlapped by the compute of `phases`, time in `row`) in microseconds, summed over the ranks:
    overlaps() with only the compute events whose name begins with one of `phases` ("forward", "backward",
    "optimizer"), and only the events of `row` whose name begins with `name` and, given begun_in (a phase), begin
    before that phase's last compute event ends, rank by rank. Offload's gradient copies under backward's kernels:
    under_phases(trace, "copies", ("backward",), "copy to host")."""
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    ends = {}
    for e in events:
        if e["cat"] == "compute" and e["name"].split()[0] == begun_in:
            ends[e["pid"]] = max(ends.get(e["pid"], e["ts"]), e["ts"] + e["dur"])
    kept = []
    for e in events:
        if e["cat"] == "compute" and e["name"].split()[0] not in phases:
            continue
        begun = begun_in is None or e["ts"] < ends.get(e["pid"], 0)
        if e["cat"] == row and not (e["name"].startswith(name) and begun):
            continue
        kept.append(e)
    per = overlaps(dict(trace, traceEvents=kept)).get(row, {})
    return sum(o for o, _ in per.values()), sum(t for _, t in per.values())


def plot(trace, path, title):
    """One band per rank, a row each for compute, communication (its lanes stacked inside), copies and cpu adam."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    xs = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    ranks, width = sorted({e["pid"] for e in xs}), max(e["ts"] + e["dur"] for e in xs) - min(e["ts"] for e in xs)
    row_of = lambda e: ROWS[e["tid"] // 100]  # instruments.Timeline.ROWS: compute 0, communication 100 + lane, ...
    rows = [row for row in ROWS if any(row_of(e) == row for e in xs)]
    fig, ax = plt.subplots(figsize=(12, 0.55 * len(rows) * len(ranks) + 1.6), dpi=80)
    yticks, ylabels, y = [], [], 0.0
    for r in ranks:
        for row in rows:
            events = [e for e in xs if e["pid"] == r and row_of(e) == row]
            lanes = 1 + max([e["tid"] % 100 for e in events], default=0)
            for e in events:
                drawn_by_row = e["cat"] in ("comm call", "copies", "cpu adam", "host waits", "nvme reads",
                                            "nvme writes")
                kind = e["cat"] if drawn_by_row else e["name"].split()[0]
                lane = e["tid"] % 100
                h = 0.8 / lanes
                ax.broken_barh([(e["ts"] / 1e3, e["dur"] / 1e3)], (y - 0.4 + lane * h, h), color=COLORS[kind],
                               edgecolor="white", linewidth=0.8)
                if e["cat"] == "compute" and e["dur"] > 0.04 * width:  # the unit's name, where there is room
                    unit = e["name"].split(" ", 1)[-1].replace("blocks.", "b").replace("step", "")
                    ax.text((e["ts"] + e["dur"] / 2) / 1e3, y, unit, ha="center", va="center", fontsize=6, color="white")
            yticks.append(y)
            ylabels.append(f"rank {r} {row}")
            y -= 1
        y -= 0.5
    ax.set_yticks(yticks, ylabels, fontsize=8)
    ax.set_xlabel("ms since the step began")
    ax.set_title(title, fontsize=9)
    ax.grid(axis="x", alpha=0.3)
    used = {e["name"].split()[0] if e["cat"] in ("compute", "communication") else e["cat"] for e in xs}  # legend
    ax.legend(handles=[Patch(color=c, label=k) for k, c in COLORS.items() if k in used], loc="upper center",
              bbox_to_anchor=(0.5, -0.5 / (len(rows) * len(ranks)) - 0.12), ncol=9, fontsize=7, frameon=False)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main():
    p = argparse.ArgumentParser(description="One training step of every rank as a timeline (Chrome trace and a "
                                "picture), and how much of the communication compute overlapped. Options it does not "
                                "know go to the stage file.")
    p.add_argument("script", help="the stage file: stage0_ddp.py ... offload.py")
    p.add_argument("--nproc", type=int, default=2, help="ranks")
    p.add_argument("--out", required=True, metavar="DIR", help="where trace.json, timeline.png and run.json go")
    p.add_argument("--from_dir", action="store_true", help="no run: merge, print and draw the traces already in DIR")
    add_flag(p)
    args, stage_args = p.parse_known_args()
    steps = [int(v) for k, v in zip(stage_args, stage_args[1:]) if k == "--steps"]
    if steps and steps[-1] < 3:
        raise SystemExit("error: --steps must be at least 3: step 1 is measured by the memory profiler, and the traced "
                         "step is the last")
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    if not args.from_dir:
        t0 = time.perf_counter()
        run(Path(args.script).resolve(), args.nproc, stage_args, out_dir)
        print(f"ran {args.script} on {args.nproc} ranks in {time.perf_counter() - t0:.1f} s")
    trace = merge(out_dir)
    (out_dir / "trace.json").write_text(json.dumps(trace))
    summary = json.loads((out_dir / "run.json").read_text())
    command = (out_dir / "run.log").read_text().split("\n", 1)[0].split()  # as run() wrote it (also for --from_dir):
    given = " ".join(command[6 + len(DEFAULTS):-4]) or "defaults"  # python -m torchrun-module --standalone N script ...
    head = (f"{summary['stage']} ({given}), {summary['world_size']} rank(s), {summary['dtype']} on {summary['device']}: "
            f"{summary['tokens_per_s']:,.0f} tokens/s (median step of the run); its last step traced")
    print(head)
    report = [head, ""]
    result = overlaps(trace)
    xs = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    for r, (a, b) in enumerate(trace["otherData"]["window_us"]):
        mine = [e for e in xs if e["pid"] == r and e["cat"] in ("compute", "comm call")]  # (not the host's waits)
        ms = {kind: sum(e["dur"] for e in mine if e["name"].startswith(kind)) / 1e3
              for kind in ("forward", "backward", "optimizer", "issue", "wait")}
        parts = [f"{row} {t / 1e3:.1f} ms{' in flight' * (row == 'communication')}, {fraction(o, t):.1%} of it under "
                 f"compute" for row, per in result.items() for o, t in [per[r]]]
        report.append(f"- rank {r}: step {(b - a) / 1e3:.1f} ms: forward {ms['forward']:.1f}, backward "
                      f"{ms['backward']:.1f}, optimizer step {ms['optimizer']:.1f}, issuing collectives {ms['issue']:.1f}, "
                      f"waiting for them {ms['wait']:.1f}; " + "; ".join(parts))
        print("  " + report[-1][2:])
    lines = []
    for row, per in result.items():
        o, t = sum(v[0] for v in per.values()), sum(v[1] for v in per.values())
        lines.append(f"{row} overlapped by compute: {fraction(o, t):.1%}")
        print(lines[-1] + f" (all ranks; {t / 1e3:.1f} ms)")
        report.append(f"- {lines[-1]} (all ranks; {t / 1e3:.1f} ms)")
    for row, per in overlaps(trace, under="cpu adam").items():  # the NVMe tier's transfers beside the C++ AdamW
        if row.startswith("nvme"):
            o, t = sum(v[0] for v in per.values()), sum(v[1] for v in per.values())
            print(f"{row} overlapped by cpu adam: {fraction(o, t):.1%} (all ranks; {t / 1e3:.1f} ms)")
            report.append(f"- {row} overlapped by cpu adam: {fraction(o, t):.1%} (all ranks; {t / 1e3:.1f} ms)")
    plot(trace, out_dir / "timeline.png", head + "\n" + "; ".join(lines))
    print(f"wrote {out_dir / 'trace.json'} (open in https://ui.perfetto.dev) and {out_dir / 'timeline.png'}")
    if args.results:  # the report, the picture and the trace, named after DIR: bench/results/timeline/<DIR's name>.*
        name = f"timeline/{out_dir.name}"
        path = publish(name, "\n".join(report), summary["dtype"], args.results)
        shutil.copyfile(out_dir / "timeline.png", path.with_suffix(".png"))
        shutil.copyfile(out_dir / "trace.json", path.with_suffix(".trace.json"))


if __name__ == "__main__":
    main()
