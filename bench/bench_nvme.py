"""bench/bench_nvme.py: the disk's own sequential write and read bandwidth, as the NVMe tier sees it
(nvme.StateFile: O_DIRECT where the filesystem allows it, aligned blocks of --block_mb), with one I/O thread and with
StateFile's default.

This is the ceiling the tier's bandwidth during training is measured against: a step cannot stream its optimizer
states faster than the disk moves them. Each pass writes (or reads) the whole file in order, with as many blocks in
flight as threads; each file is written once before any timed pass, so that every pass meets written blocks. The
passes of the thread counts take turns, and the best of --repeats passes of each is reported, as MB/s (10^6 bytes per
second), beside the CPU and the filesystem.

    python bench/bench_nvme.py [--nvme_path DIR] [--file_mb 512] [--block_mb 4] [--repeats 2] [--steps 6] [--quick]
                               [--results]

Then the tier itself, during training (offload.py on one rank, run as bench/timeline.py runs it, with --timeline, so
that every read and write of the state file is a span from its submission to its completion): the same GPT three
ways, its optimizer states in RAM, on disk with --nvme_buffer_count 1 (each bucket's states read, updated, written,
one after the other) and with 3 (the next bucket read and the last written while AdamW updates this one), the three
taking turns --repeats times, with a pass of the disk's own bandwidth in the tier's block size after each round (the
baseline measured beside the runs, on a disk whose speed may move). From the runs' step times (the median after two
warm-up steps) and their last step's trace (the best of the repeats):
    tier bandwidth   the bytes the step read (wrote) / the time some read (write) was in flight, against the disk's
                     own sequential bandwidth in the same blocks (the best pass and thread count); goal: >= 80% of it
    AdamW            the C++ AdamW's time in the step, with the states in RAM (nothing beside it)
    I/O time         the bytes the step reads and writes, at the disk's own bandwidth: the least time the tier can take
    overlap ratio    (step on disk with 3 buffers - step in RAM) / max(AdamW, I/O time): what the tier adds to a step,
                     against what a perfect overlap would cost; the goal, <= 1.2, is the issue's "a step costs at most
                     1.2 x max(AdamW, I/O time) beyond forward and backward", also shown as such, with forward and
                     backward = the step in RAM - AdamW
The model (--train_args, default: the small preset with 4 layers, 7.2M parameters, 86 MB of states; batch 2 x 64
tokens, so that the optimizer's part of a step stands out) and the goals are printed beside what was measured, met
or not. `--results` writes both tables, bench/results/nvme_disk.md and nvme_tier.md, and the 3-buffer step's picture,
nvme_tier.png.

--nvme_path defaults to a temporary directory under the current directory (not /tmp, which may be tmpfs: memory).
"""
import argparse
import json
import math
import os
import shlex
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))  # before bench/: nvme is the repository's nvme.py
from nvme import StateFile, aligned, round_up  # noqa: E402
from results import add_flag, header, publish  # noqa: E402
import timeline  # noqa: E402  (bench/timeline.py: runs a stage with --timeline, its rows and intervals)

DEFAULT_THREADS = StateFile.__init__.__defaults__[0]
TRAIN = "--preset small --n_layer 4 --batch_size 2 --block_size 64"
QUICK_TRAIN = "--preset tiny --n_layer 4"
TIERS = {"states in RAM": [], "NVMe, 1 buffer": ["--nvme_buffer_count", "1"],
         "NVMe, 3 buffers": ["--nvme_buffer_count", "3"]}
GOAL_BANDWIDTH, GOAL_RATIO = 0.8, 1.2


def filesystem(path):
    """(type, source) of the filesystem that holds path, from the longest mount point above it in /proc/self/mounts."""
    path = os.path.realpath(path)
    best = ("", "?", "?")
    with open("/proc/self/mounts") as f:
        for line in f:
            source, point, kind = line.split()[:3]
            point = point.replace("\\040", " ")
            if (path == point or path.startswith(point.rstrip("/") + "/")) and len(point) > len(best[0]):
                best = (point, kind, source)
    return best[1], best[2]


def one_pass(f, op, buffers, block):
    """Read or write the whole file in order, len(buffers) blocks in flight; returns the seconds it took."""
    pending = [None] * len(buffers)
    start = time.perf_counter()
    for k, offset in enumerate(range(0, f.nbytes, block)):
        slot = k % len(buffers)
        # a buffer is reused only once its last transfer is done
        if pending[slot] is not None:
            f.wait(pending[slot])
        pending[slot] = f.read(offset, buffers[slot]) if op == "read" else f.write(offset, buffers[slot])
    for future in pending:
        if future is not None:
            f.wait(future)
    return time.perf_counter() - start


def measure(directory, file_bytes, block, thread_counts, repeats):
    """{threads: (write MB/s, read MB/s, StateFile's mode)}: a file per thread count, each written once, then timed
    round-robin (a pass of each in turn, --repeats times): a slow spell of a shared disk falls on every count."""
    files = [StateFile(directory, f"bench{t}", file_bytes, threads=t) for t in thread_counts]
    try:
        buffers = {t: [aligned(block) for _ in range(t)] for t in thread_counts}
        for b in [b for bs in buffers.values() for b in bs]:
            b.random_(0, 256)  # not zeros: a disk or filesystem may store zeros for less
        for f, t in zip(files, thread_counts):
            one_pass(f, "write", buffers[t], block)
        best = {(t, op): float("inf") for t in thread_counts for op in ("write", "read")}
        for op in ("write", "read"):
            for _ in range(repeats):
                for f, t in zip(files, thread_counts):
                    best[t, op] = min(best[t, op], one_pass(f, op, buffers[t], block))
        return {t: (f.nbytes / best[t, "write"] / 1e6, f.nbytes / best[t, "read"] / 1e6, f.mode)
                for f, t in zip(files, thread_counts)}
    finally:
        for f in files:
            f.close()


def one_run(directory, train_args, tier, out_dir):
    """offload.py on one rank with `tier`'s options and --timeline: (the summary, the last step's figures)."""
    nvme = ["--offload_optimizer", "nvme", "--nvme_path", str(directory)] if TIERS[tier] else []
    out_dir.mkdir(parents=True, exist_ok=True)
    timeline.run(ROOT / "offload.py", 1, [*train_args, *nvme, *TIERS[tier]], out_dir)
    trace = timeline.merge(out_dir)
    summary = json.loads((out_dir / "run.json").read_text())
    return summary, trace, step_figures(trace, summary)


def step_figures(trace, summary):
    """The traced step's figures: its time (the run's median step), its C++ AdamW time, and the state file's bytes and
    time in flight, of the transfers the step submitted. (The trace also draws a transfer the step before left in
    flight, from the step's start: it is not this step's.)"""
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"
              and not e["args"].get("submitted_before_the_step")]
    row = lambda cat: [e for e in events if e["cat"] == cat]
    busy = lambda es: timeline.length(timeline.union([(e["ts"], e["ts"] + e["dur"]) for e in es])) / 1e6
    step = summary["args"]["batch_size"] * summary["config"]["block_size"] / summary["tokens_per_s"]
    return dict(step=step, adam=sum(e["dur"] for e in row("cpu adam")) / 1e6,
                read_bytes=sum(e["args"]["MiB"] for e in row("nvme reads")) * 2**20,
                write_bytes=sum(e["args"]["MiB"] for e in row("nvme writes")) * 2**20,
                read_s=busy(row("nvme reads")), write_s=busy(row("nvme writes")),
                both_s=busy(row("nvme reads") + row("nvme writes")))


def largest_transfer(trace):
    """The bytes of the tier's largest read or write in a trace (a bucket's states), as the tier aligns them."""
    return max(round_up(math.ceil(e["args"]["MiB"] * 2**20)) for e in trace["traceEvents"]
               if e.get("cat", "").startswith("nvme"))


def train(directory, train_args, repeats, file_bytes, thread_counts):
    """{tier: the best of `repeats` runs' figures} (step time and AdamW: the least; tier bandwidth: the most), the
    runs taking turns, so that a slow spell of the shared machine falls on every tier; the last 3-buffer run's
    summary and trace; and after each round of runs a pass of the disk's own (measure()) in blocks of the tier's
    largest transfer, so that the baseline is measured beside the runs it is compared with."""
    runs = {tier: [] for tier in TIERS}
    disk = []
    with tempfile.TemporaryDirectory(prefix="runs-", dir=directory) as out:
        for r in range(repeats):
            for tier in TIERS:
                summary, trace, figures = one_run(directory, train_args, tier, Path(out) / f"{r}-{len(runs[tier])}")
                runs[tier].append(figures)
            block = largest_transfer(trace)
            disk.append(measure(directory, -(-file_bytes // block) * block, block, thread_counts, 1))
    best = {}
    for tier, figures in runs.items():
        best[tier] = {k: min(f[k] for f in figures) for k in ("step", "adam")}
        for op in ("read", "write"):  # bandwidth: bytes over the time in flight, the best run's
            best[tier][op] = max((f[f"{op}_bytes"] / f[f"{op}_s"] for f in figures if f[f"{op}_s"]), default=0.0)
            best[tier][f"{op}_bytes"] = figures[-1][f"{op}_bytes"]
        best[tier]["both_s"] = min(f["both_s"] for f in figures) or math.inf
    return best, summary, trace, disk


def tier_table(passes, block, best, summary, train_args, repeats, kind, source, mode):
    """The tier's table: what was measured beside the goals, each goal met or missed and by how much. passes:
    measure()'s rows in blocks of `block` bytes, the tier's largest transfer, one taken after each round of runs; the
    disk's bandwidth is the best pass's of the best thread count, its spread the passes' least and most."""
    each = [[max(r[k] for r in disk.values()) for disk in passes] for k in (0, 1)]  # MB/s, [write, read] per pass
    write_disk, read_disk = max(each[0]), max(each[1])
    spread = lambda k: f"{min(each[k]):,.0f}–{max(each[k]):,.0f} MB/s" if len(passes) > 1 else "one pass"
    threads = sorted(passes[0])
    ram, one, three = best["states in RAM"], best["NVMe, 1 buffer"], best["NVMe, 3 buffers"]
    adam = ram["adam"]
    io = three["read_bytes"] / (read_disk * 1e6) + three["write_bytes"] / (write_disk * 1e6)
    bound = max(adam, io)
    extra = lambda t: (t["step"] - ram["step"]) / bound
    beyond = lambda t: (t["step"] - (ram["step"] - adam)) / bound  # the step less forward and backward (RAM - AdamW)
    # each verdict judges the figure as the table prints it (a share in whole percent, a ratio to 2 decimals), so that
    # the two never disagree
    bandwidth_verdict = lambda share: "met" if round(share, 2) >= GOAL_BANDWIDTH else (
        f"missed by {100 * (GOAL_BANDWIDTH - round(share, 2)):.0f} points")
    ratio_verdict = lambda r: "met" if round(r, 2) <= GOAL_RATIO else f"missed: {round(r, 2) / GOAL_RATIO:.2f}x the goal"
    ms = lambda t: f"{t * 1e3:,.1f} ms"
    psi = summary["n_params"]
    out = [f"The NVMe tier during training: offload.py on one rank, `{' '.join(train_args)}` ({psi / 1e6:.1f}M "
           f"parameters, {summary['dtype']}; the optimizer states {three['read_bytes'] / 1e6:,.0f} MB, read and "
           f"written once a step, a bucket per transfer); {kind} on {source}, {mode}; best of {repeats} run"
           f"{'s' * (repeats > 1)} per tier, taking turns; a step's time is its run's median after two warm-up steps, "
           "the rest from its last step's trace (bench/timeline.py's rows). MB/s = 10^6 bytes per second.", "",
           "| measured | value | goal | |", "|---|---:|---|---|",
           f"| disk's own sequential read, {block / 2**20:.1f} MiB blocks (the tier's largest transfer), the best of "
           f"{' and '.join(map(str, threads))} threads, the best of {len(passes)} pass{'es' * (len(passes) > 1)} "
           f"between the rounds of runs ({spread(1)}) | {read_disk:,.0f} MB/s | | |",
           f"| disk's own sequential write, in the same blocks and passes ({spread(0)}) | {write_disk:,.0f} MB/s | | |"]
    for name, t in (("3 buffers", three), ("1 buffer", one)):
        # reads and writes share the disk: both together, against the disk's time for the same bytes
        both = (t["read_bytes"] + t["write_bytes"]) / t["both_s"] / 1e6
        share = both / ((t["read_bytes"] + t["write_bytes"]) / (t["read_bytes"] / read_disk + t["write_bytes"] /
                                                                  write_disk))
        goal = f"≥ {GOAL_BANDWIDTH:.0%} of the disk's" if name == "3 buffers" else ""
        met = bandwidth_verdict(share) if goal else ""
        out.append(f"| tier's reads and writes, {name}: bytes / time any was in flight | {both:,.0f} MB/s "
                   f"({share:.0%} of the disk's) | {goal} | {met} |")
        for op, own in (("read", read_disk), ("write", write_disk)):
            share = t[op] / 1e6 / own
            goal = f"≥ {GOAL_BANDWIDTH:.0%} of the disk's" if name == "3 buffers" else ""
            met = bandwidth_verdict(share) if goal else ""
            out.append(f"| tier's {op}, {name}: bytes / time in flight | {t[op] / 1e6:,.0f} MB/s ({share:.0%} of the "
                       f"disk's) | {goal} | {met} |")
    out += [f"| C++ AdamW per step (states in RAM) | {ms(adam)} | | |",
            f"| I/O time per step: the step's bytes at the disk's bandwidth | {ms(io)} | | |",
            f"| step, states in RAM | {ms(ram['step'])} | | |",
            f"| step, NVMe, 1 buffer (no overlap) | {ms(one['step'])} | | |",
            f"| step, NVMe, 3 buffers (overlap) | {ms(three['step'])} | | |"]
    for name, t in (("3 buffers", three), ("1 buffer", one)):
        goal = f"≤ {GOAL_RATIO}" if name == "3 buffers" else ""
        met = ratio_verdict(extra(t)) if goal else ""
        out.append(f"| (step on NVMe, {name} − step in RAM) / max(AdamW, I/O time) | {extra(t):.2f} | {goal} "
                   f"| {met} |")
    out.append(f"| (step on NVMe, 3 buffers − forward and backward) / max(AdamW, I/O time) | {beyond(three):.2f} "
               f"| ≤ {GOAL_RATIO} | {ratio_verdict(beyond(three))} |")
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nvme_path", default=None, help="the directory to measure (default: a temporary directory under "
                    "the current directory, removed at the end)")
    ap.add_argument("--file_mb", type=int, default=512, help="the file's size, MiB")
    ap.add_argument("--block_mb", type=int, default=4, help="the size of one read or write, MiB")
    ap.add_argument("--threads", type=int, default=DEFAULT_THREADS, help="StateFile's threads, besides one")
    ap.add_argument("--repeats", type=int, default=2, help="timed passes of each direction (the best is reported)")
    ap.add_argument("--steps", type=int, default=6, help="training steps of each run (its last is traced)")
    ap.add_argument("--train_args", default=TRAIN, help="offload.py's model and batch, one string")
    ap.add_argument("--quick", action="store_true", help="a file of 8 MiB in 1 MiB blocks, one pass; the tiny preset "
                    f"({QUICK_TRAIN}), 3 steps, one run per tier: a smoke test")
    add_flag(ap)
    a = ap.parse_args(argv)
    if a.quick:
        a.file_mb, a.block_mb, a.repeats, a.steps, a.train_args = 8, 1, 1, 3, QUICK_TRAIN
    train_args = [*shlex.split(a.train_args), "--steps", str(a.steps)]
    block = a.block_mb << 20
    file_bytes = -(-(a.file_mb << 20) // block) * block
    directory = a.nvme_path or tempfile.mkdtemp(prefix=".nvme-bench-", dir=os.getcwd())
    kind, source = filesystem(directory)
    try:
        rows = measure(directory, file_bytes, block, sorted({1, a.threads}), a.repeats)
        best, summary, trace, passes = train(directory, train_args, a.repeats, file_bytes, sorted({1, a.threads}))
    finally:
        if a.nvme_path is None:
            shutil.rmtree(directory, ignore_errors=True)
    modes = {mode for _, _, mode in rows.values()}
    out = [f"Sequential write and read through nvme.StateFile: a {file_bytes >> 20} MiB file in {a.block_mb} MiB "
           f"blocks, as many in flight as threads; {kind} on {source}, {' / '.join(sorted(modes))}; MB/s = 10^6 bytes "
           f"per second, best of {a.repeats} pass{'es' * (a.repeats > 1)}, taking turns.", ""]
    if kind == "tmpfs":
        out += ["(tmpfs holds its files in memory: these are memory's numbers, not a disk's.)", ""]
    out += ["| threads | write MB/s | read MB/s |", "|---:|---:|---:|"]
    out += [f"| {threads} | {write:,.0f} | {read:,.0f} |" for threads, (write, read, _) in rows.items()]
    print(header("raw bytes", argv and [sys.argv[0], *argv]) + "\n")
    print("\n".join(out), flush=True)
    tier = tier_table(passes, largest_transfer(trace), best, summary, train_args, a.repeats, kind, source,
                      rows[a.threads][2])
    print("\n" + header(summary["dtype"], argv and [sys.argv[0], *argv]) + "\n")
    print("\n".join(tier), flush=True)
    if a.results:
        publish("nvme_disk", "\n".join(out), "raw bytes", a.results, argv and [sys.argv[0], *argv])
        path = publish("nvme_tier", "\n".join(tier), summary["dtype"], a.results, argv and [sys.argv[0], *argv])
        timeline.plot(trace, path.with_suffix(".png"), f"offload.py {' '.join(train_args)}, its states on NVMe "
                      "through 3 buffers: the last step")
    return 0


if __name__ == "__main__":
    sys.exit(main())
