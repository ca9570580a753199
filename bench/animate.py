"""
bench/animate.py: one training step, animated from what a run measured: per rank, what it holds by category, the
event of each moment (a unit gathered or freed, a bucket reduced, a copy, the C++ AdamW), the memory line rising and
falling to its peak, and the bytes each collective sends.

    python bench/animate.py stage3.py --nproc 2 --preset tiny
    python bench/animate.py offload.py --nproc 2 --preset tiny --delayed_update

Every option it does not know goes to the stage file. It runs the stage on the CPU (--device cpu: the CPU's memory
meter records every allocation and free, a GPU's only the allocator's peak) for 2 steps with bench/timeline.py's runner
(--timeline DIR): the second step is both the traced one and the memory meter's, so the Timeline also reads the
engine's holdings at each moment of the computing thread (instruments.Timeline.hold: DIR/holdings_rank<r>.json) and
the meter's allocations and frees are kept (DIR/memory_rank<r>.json). Then it writes runs/animate/<stage>.gif (--out):
a frame per measured moment, in the order of the ranks' shared clock:
- per rank, a bar of what it holds: the model states by category as the engine lists them (model_states()), and what
  its attributes hold beyond them (instruments.unlisted), counted with its category by name: an attribute whose path
  names `param` is parameters (a unit gathered), `grad` or `reduced` gradients (a bucket in flight), any other the
  engine's buffers. Hatched: the part in flight (gathered, reduced); outlined: the formula's model states
  (train_gpt.theory, as run.json has them);
- the event of the moment and the lesson whose code makes it ([ZeRO-3], [Prefetch], [Offload], [Copy stream], ...);
- each rank's memory line, the meter's running sum of live tensor bytes, with the moment marked;
- the bytes each rank has sent so far, by collective (the timeline's collectives, each with the bytes the ledger
  counted for it).
The step's times are those of a step under the meter's profiler and the holdings' reads (slower than a plain step:
bench/timeline.py times a step without them). The frames are built from the run's files alone (frames()), and check()
holds them to the run's own ledgers: the frame at the step's end draws each rank's model-state bytes as the ledger
measured them, the largest memory of a frame is the meter's peak, the frames' collectives come in the timeline's order,
and their bytes sum to the comm ledger's.

    python bench/animate.py stage3.py --nproc 2 --preset tiny --dtype fp32 --results

writes bench/results/animate/stage3.md (what the frames show, and that every check holds: the block in
bench/README.md), stage3.gif (README.md shows it) and stage3.frames.json (the run's files as read() reads them, from
which the GIF is drawn: tests/test_animate.py draws it again from them and holds them to the checks).
"""
import argparse, json, shutil, sys, time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from results import add_flag, publish  # noqa: E402
from timeline import ROOT, run  # noqa: E402

STATES = ["params", "grads", "grad_acc", "master", "adam_m", "adam_v", "nvme_buffers"]
COLORS = {"params": "#4C72B0", "grads": "#DD8452", "grad_acc": "#E8B27E", "master": "#55A868", "adam_m": "#8172B3",
          "adam_v": "#937860", "nvme_buffers": "#2CA02C", "buffers": "#BBBBBB",
          "on disk": "#D62728"}


def category(path):
    """The category of an engine attribute beyond the model states, by its path (instruments.unlisted's)."""
    name = path.lower()
    if "param" in name:
        return "params"
    if "grad" in name or "reduced" in name:
        return "grads"
    return "buffers"


WORDS = {"issue all_gather": "all-gather issued", "all_gather waited": "all-gather landed",
         "issue reduce_scatter": "a bucket's reduce-scatter issued", "reduce_scatter waited": "a reduce-scatter landed",
         "issue all_reduce": "all-reduce issued", "all_reduce done": "all-reduce done",
         "all_reduce waited": "all-reduce landed", "all_gather done": "all-gather done",
         "reduce_scatter done": "reduce-scatter done", "copy to host done": "a copy to the host done",
         "copy to device done": "a copy to the device done", "adam_step done": "the C++ AdamW updated a bucket's shard",
         "push optimizer step": "the optimizer step begins", "step begins": "the step begins",
         "step ends": "the step ends", "the peak": "its memory peaks"}


# the timeline's rows whose spans are moments too, whichever thread ran them (--delayed_update's C++ AdamW runs on a
# thread of its own, the NVMe tier's transfers on a pool), each as its start: (words, lesson)
SPANS = {"cpu adam": ("the C++ AdamW starts on a bucket's shard", "[Offload]"),
         "nvme reads": ("the NVMe tier reads a bucket's states", "[NVMe]"),
         "nvme writes": ("the NVMe tier writes a bucket's states back", "[NVMe]"),
         "host waits": ("the host waits", "")}


def span_moment(span, delayed):
    """The words and lesson of a span's start; with --delayed_update the C++ AdamW and the host's wait for it are
    [DPU]'s."""
    words, tag = SPANS[span["row"]]
    if span["row"] == "host waits":
        words = f"the host waits ({span['name']})"
    if delayed and span["row"] == "cpu adam":
        return f"{words}, on the update thread", "[DPU]"
    if delayed and span["name"] == "wait cpu adam":
        return "the host waits for the delayed update", "[DPU]"
    return words, tag


def event(moment, held, before):
    """The words for a moment of a rank, from its name and what its holdings did since the one before (None: the
    first); '' for a moment where the engine's hooks changed nothing."""
    words = WORDS.get(moment, "")
    if moment.startswith("top forward ") or moment.startswith("top backward "):
        words = f"{moment.split()[2]} computes its {moment.split()[1]}"
    elif moment.startswith("end backward "):
        words = f"{moment.split()[2]}'s backward is done"
    if before is not None:
        change = held.get("params", 0) - before.get("params", 0)
        if change < 0:
            words = f"{words}; a unit freed ({-change / 2**10:.0f} KiB)".lstrip("; ")
        if change > 0:
            words = f"{words}; a unit gathered ({change / 2**10:.0f} KiB)".lstrip("; ")
    return words


def lesson(stage, moment, before, words=""):
    """The lessons whose code makes this moment (their fence tags in the stage files), '' where none."""
    tags = []
    if "a unit freed" in words:
        tags.append("[ZeRO-3]")
    if moment.startswith("issue all_gather"):
        if stage in ("stage1", "stage2"):
            tags.append("[ZeRO-1]")
        else:
            tags.append("[Prefetch]" if before.startswith("all_gather waited") else "[ZeRO-3]")
    if moment.startswith("issue reduce_scatter"):
        tags.append("[ZeRO-1]" if stage == "stage1" else "[ZeRO-2]")
    if moment.startswith("issue all_reduce") and stage == "stage0":
        tags.append("[DDP]")
    if moment.startswith("copy"):
        tags.append("[Offload] [Copy stream]")
    if moment.startswith("adam_step"):
        tags.append("[Offload]")
    return " ".join(dict.fromkeys(tags))


def holding(sample):
    """A sample's bytes by category: (held, in flight). held: the model states with what is in flight added to its
    category; in flight: the attributes beyond the model states, by category."""
    flight = {}
    for path, n in sample["beyond"].items():
        flight[category(path)] = flight.get(category(path), 0) + n
    held = dict(sample["states"])
    for k, n in flight.items():
        if k != "buffers":
            held[k] = held.get(k, 0) + n
    return held, flight


def read(out_dir):
    """The run's files: its summary, the trace events per rank, the holdings and the memory meter's events per rank,
    every time in microseconds from the earliest rank's step start (as bench/timeline.py's merge() shifts them)."""
    traces = [json.loads(p.read_text()) for p in sorted(out_dir.glob("trace_rank*.json"))]
    traces.sort(key=lambda t: t["otherData"]["rank"])
    zero = min(t["otherData"]["window_us"][0] for t in traces)
    ranks = []
    for t in traces:
        r = t["otherData"]["rank"]
        holdings = json.loads((out_dir / f"holdings_rank{r}.json").read_text())
        memory = json.loads((out_dir / f"memory_rank{r}.json").read_text())
        comm = sorted((e for e in t["traceEvents"] if e.get("cat") == "communication"), key=lambda e: e["ts"])
        spans = [e for e in t["traceEvents"] if e.get("cat") in SPANS]
        ranks.append(dict(
            rank=r,
            holdings=[dict(h, t=h["t"] - zero) for h in holdings],
            memory=dict(memory, events=[(ts - zero, n) for ts, n in memory["events"]]),
            comm=[dict(name=e["name"], ts=e["ts"] - zero, end=e["ts"] + e["dur"] - zero, sent=e["args"]["sent"])
                  for e in comm],
            spans=[dict(row=e["cat"], name=e["name"], ts=e["ts"] - zero) for e in spans]))
    summary = json.loads((out_dir / "run.json").read_text())
    return summary, ranks


def memory_at(memory, t):
    """The meter's live tensor bytes at time t: its base plus the allocations and frees until then."""
    return memory["base"] + sum(n for ts, n in memory["events"] if ts <= t)


def peak_moment(memory):
    """When the memory line is highest (the first time), and its height."""
    running, best, when = memory["base"], memory["base"], memory["events"][0][0] if memory["events"] else 0
    for ts, n in memory["events"]:
        running += n
        if running > best:
            best, when = running, ts
    return when, best


def frames(summary, ranks):
    """A frame per measured moment: each rank's holdings sample and each rank's peak, in time order. A frame holds
    its time, the rank whose moment it is, the event and its lesson, and per rank: the last sample's holdings (held,
    in flight), the memory at that time, the collectives in flight and the bytes sent so far by collective."""
    moments = []
    for r in ranks:
        before, held = "", None
        for i, h in enumerate(r["holdings"]):
            now = holding(h)[0]
            words = event(h["moment"], now, held)
            moments.append((h["t"], r["rank"], h["moment"], words, lesson(summary["stage"], h["moment"], before, words),
                            i))
            before, held = h["moment"], now
        t, _ = peak_moment(r["memory"])
        moments.append((t, r["rank"], "the peak", WORDS["the peak"], "", None))
        for span in r["spans"]:
            words, tag = span_moment(span, summary["args"].get("delayed_update", False))
            moments.append((span["ts"], r["rank"], f"{span['row']}: {span['name']}", words, tag, None))
    moments.sort(key=lambda m: m[0])
    out = []
    for t, who, moment, words, tag, index in moments:
        per = []
        for r in ranks:
            samples = [h for h in r["holdings"] if h["t"] <= t] or r["holdings"][:1]
            held, flight = holding(samples[-1])
            sent = {}
            for c in r["comm"]:
                if c["ts"] <= t:
                    sent[c["name"]] = sent.get(c["name"], 0.0) + c["sent"]
            per.append(dict(held=held, flight=flight, memory=memory_at(r["memory"], t), sent=sent,
                            in_flight=[c["name"] for c in r["comm"] if c["ts"] <= t < c["end"]]))
        out.append(dict(t=t, rank=who, moment=moment, event=words, lesson=tag, sample=index, ranks=per))
    return out


def check(summary, ranks, data, tolerance=0):
    """What the frames draw against what the run measured; a list of the mismatches (empty: the frames agree).
    - the frame at the step's end: each rank's model states by category (a unit still gathered counts with its
      parameters) are the ledger's (run.json's model_state_bytes_per_rank), byte for byte;
    - the largest memory of a rank's frames is the meter's peak (peak_memory_bytes_per_rank), within `tolerance`
      bytes (on a CPU the meter adds up the same allocations: 0);
    - each rank's collectives, in the order the frames issue them, are the timeline's;
    - the bytes each rank's frames send, by collective, sum to the comm ledger's (rank 0's run.json)."""
    wrong = []
    end = data[-1]
    for r, frame in enumerate(end["ranks"]):
        ledger = summary["model_state_bytes_per_rank"][r]
        drawn = {k: n for k, n in frame["held"].items() if k in STATES and n}
        if drawn != {k: n for k, n in ledger.items() if n}:
            wrong.append(f"rank {r}: the end frame draws {drawn}, the ledger measured {ledger}")
        largest = max(f["ranks"][r]["memory"] for f in data)
        peak = summary["peak_memory_bytes_per_rank"][r]
        if abs(largest - peak) > tolerance:
            wrong.append(f"rank {r}: the largest frame holds {largest:,} bytes, the meter's peak is {peak:,}")
        issued = [f["moment"].split()[1] for f in data if f["rank"] == r and f["moment"].startswith("issue ")]
        timeline = [c["name"] for c in ranks[r]["comm"]]
        if issued != timeline:
            wrong.append(f"rank {r}: the frames issue {issued}, the timeline has {timeline}")
        ledger_sent = {k: v["measured"] for k, v in summary["comm_bytes_per_step"]["by_collective"].items()
                       if v["measured"]}
        # (a world of one sends nothing: its collectives count 0 bytes, which the ledger's table leaves out)
        sent = {k: v for k, v in frame["sent"].items() if v}
        if sent != ledger_sent:
            wrong.append(f"rank {r}: the frames send {sent}, the comm ledger counted {ledger_sent}")
    return wrong


def drawn(data):
    """The frames a GIF shows: those with an event (a moment where the engine's hooks changed nothing has none), and
    the last."""
    return [f for f in data[:-1] if f["event"]] + data[-1:]


def draw(summary, data, path, fps=3, dpi=64, only=None):
    """The frames drawn() keeps (only: those of these indices among them), as an animated GIF (matplotlib's
    PillowWriter)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.animation import PillowWriter
    from matplotlib.patches import Patch, Rectangle

    n = len(data[0]["ranks"])
    theory = sum(v["theory"] for v in summary["model_state_bytes"].values())
    where = {k: v["where"] for k, v in summary["model_state_bytes"].items()}
    # the NVMe tier's state file, as the ledger measured it (rank 0's; every rank's file is the same size)
    disk = summary.get("disk_bytes", {}).get("measured", 0) / 2**20
    widest = max(max(sum(p["held"].values()) + p["flight"].get("buffers", 0) for f in data for p in f["ranks"]),
                 theory) / 2**20 + disk
    top = max(p["memory"] for f in data for p in f["ranks"]) / 2**20
    times = [f["t"] / 1e3 for f in data]
    lines = [[f["ranks"][r]["memory"] / 2**20 for f in data] for r in range(n)]
    sent_max = max((v for f in data for p in f["ranks"] for v in p["sent"].values()), default=0) / 2**20 or 1
    shown = [k for k in STATES + ["buffers"] if any(p["held"].get(k) or p["flight"].get(k) for f in data
                                                    for p in f["ranks"])]
    rows = max(n, 2)  # (a world of one gets the room of two: the title and the legend above its bar)
    fig = plt.figure(figsize=(10, 2.6 + 0.8 * rows), dpi=dpi)
    grid = fig.add_gridspec(2, 2, height_ratios=[0.8 * rows, 1.5], width_ratios=[3, 1], hspace=0.75, wspace=0.3,
                            top=0.84, bottom=0.12, left=0.07, right=0.98)
    bars, sends, mem = fig.add_subplot(grid[0, 0]), fig.add_subplot(grid[0, 1]), fig.add_subplot(grid[1, :])
    # what every frame shares, drawn once: the axes, the legends, the memory lines, a bar per rank and collective
    bars.set_xlim(0, widest * 1.3)
    bars.set_ylim(-0.55, n - 0.45)
    bars.set_yticks(range(n), [f"rank {n - 1 - y}" for y in range(n)], fontsize=8)
    bars.set_xlabel("MiB held by category (dashed: the formula's model states; hatched: gathered or in flight)",
                    fontsize=8)
    bars.tick_params(labelsize=7)
    legend = shown + ["on disk"] * bool(disk)
    bars.legend(handles=[Patch(color=COLORS[k], label=k) for k in legend], fontsize=7, ncol=len(legend),
                loc="lower left", bbox_to_anchor=(0, 1.0), frameon=False)
    for r in range(n):
        bars.add_patch(Rectangle((0, n - 1 - r - 0.4), theory / 2**20, 0.8, fill=False, ls="--", lw=1.2))
    names = [(r, k) for r in range(n) for k in sorted({k for f in data for k in f["ranks"][r]["sent"]})]
    sent_bars = sends.barh([f"r{r} {k}" for r, k in names], [0] * len(names), color="#999999")
    sends.set_xlim(0, sent_max * 1.05)
    sends.set_title("MiB sent so far (red: in flight)", fontsize=8)
    sends.tick_params(labelsize=7)
    markers = []
    for r in range(n):
        mem.plot(times, lines[r], lw=1, label=f"rank {r}", color=f"C{r}")
        markers.append(mem.plot([], [], "o", ms=4, color=f"C{r}")[0])
    cursor = mem.axvline(0, color="gray", lw=0.8)
    mem.set_ylim(0, top * 1.1)
    mem.set_xlabel("ms since the step began", fontsize=8)
    mem.set_ylabel("live MiB", fontsize=8)
    mem.tick_params(labelsize=7)
    mem.legend(fontsize=7, loc="lower right", frameon=False, ncol=n)
    title = fig.suptitle("", fontsize=10)
    writer = PillowWriter(fps=fps)
    shown_frames = drawn(data)
    with writer.saving(fig, str(path), dpi):
        moment = []  # this frame's own artists, removed before the next
        for number, f in enumerate(shown_frames, 1):
            if only is not None and number - 1 not in only:
                continue
            for artist in moment:
                artist.remove()
            moment = []
            for r, p in enumerate(f["ranks"]):
                y = n - 1 - r
                x = 0.0
                for k in shown:
                    whole = (p["held"].get(k, 0) if k != "buffers" else p["flight"].get("buffers", 0)) / 2**20
                    flying = (p["flight"].get(k, 0) if k != "buffers" else 0) / 2**20
                    if whole:
                        moment.append(bars.add_patch(Rectangle((x, y - 0.3), whole - flying, 0.6, color=COLORS[k])))
                        if flying:
                            moment.append(bars.add_patch(Rectangle((x + whole - flying, y - 0.3), flying, 0.6,
                                                                   facecolor=COLORS[k], hatch="///",
                                                                   edgecolor="white", lw=0)))
                        if where.get(k) == "host" and whole > 0.06 * widest:
                            moment.append(bars.text(x + whole / 2, y, "host", ha="center", va="center", fontsize=7,
                                                    color="white"))
                    x += whole
                if disk:
                    moment.append(bars.add_patch(Rectangle((x, y - 0.3), disk, 0.6, color=COLORS["on disk"])))
                    moment.append(bars.text(x + disk / 2, y, "disk", ha="center", va="center", fontsize=7,
                                            color="white"))
                moment.append(bars.text(widest * 1.02, y, f"live {p['memory'] / 2**20:.2f} MiB", va="center",
                                        fontsize=8, color="C3" if r == f["rank"] else "black",
                                        weight="bold" if r == f["rank"] else "normal"))
                markers[r].set_data([f["t"] / 1e3], [p["memory"] / 2**20])
            for bar, (r, k) in zip(sent_bars, names):
                bar.set_width(f["ranks"][r]["sent"].get(k, 0) / 2**20)
                bar.set_color("#C44E52" if k in f["ranks"][r]["in_flight"] else "#999999")
            cursor.set_xdata([f["t"] / 1e3])
            title.set_text(f"{summary['stage']} on {n} ranks, step {summary['measured_step']}, frame {number} of "
                           f"{len(shown_frames)}, {f['t'] / 1e3:.1f} ms\nrank {f['rank']}: "
                           f"{f['event'] or f['moment']} {f['lesson']}")
            writer.grab_frame()
    plt.close(fig)


def report(summary, data):
    """What the frames show, in Markdown: the published result's body."""
    n = len(data[0]["ranks"])
    end = data[-1]["ranks"]
    theory = sum(v["theory"] for v in summary["model_state_bytes"].values())
    lines = [f"{summary['stage']} on {n} ranks, step {summary['measured_step']} of 2: {len(drawn(data))} frames drawn "
             f"of {len(data)} measured moments. Every frame check holds: the end frame draws the ledger's model "
             f"states, the largest frame the meter's peak, the collectives come in the timeline's order and send "
             f"the comm ledger's bytes.", "",
             "| rank | model states at the end, MiB | formula, MiB | largest frame (the peak), MiB | sent, MiB |",
             "|---:|---:|---:|---:|---:|"]
    for r, p in enumerate(end):
        states = sum(n for k, n in p["held"].items() if k in STATES)
        largest = max(f["ranks"][r]["memory"] for f in data)
        lines.append(f"| {r} | {states / 2**20:.3f} | {theory / 2**20:.3f} | {largest / 2**20:.3f} | "
                     f"{sum(p['sent'].values()) / 2**20:.3f} |")
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description="One training step animated from a measured run (a GIF). Options it "
                                "does not know go to the stage file.")
    p.add_argument("script", help="the stage file: stage0_ddp.py ... offload.py")
    p.add_argument("--nproc", type=int, default=2, help="ranks")
    p.add_argument("--out", default=None, metavar="GIF", help="default runs/animate/<stage>.gif")
    p.add_argument("--from_dir", action="store_true", help="no run: draw the run already beside the GIF")
    add_flag(p)
    args, stage_args = p.parse_known_args()
    if "--steps" in stage_args:
        raise SystemExit("error: the animation is of a 2-step run's second step (the memory meter's and the "
                         "timeline's): leave --steps out")
    # the memory line is the CPU meter's allocations and frees; on a GPU the meter keeps only the allocator's peak
    if any(a in ("--device", "--device=cuda", "--device=auto") for a in stage_args):
        raise SystemExit("error: the animated step runs on the CPU, whose memory meter records every allocation: "
                         "leave --device out")
    gif = Path(args.out) if args.out else ROOT / "runs" / "animate" / f"{Path(args.script).stem}.gif"
    out_dir = gif.with_suffix("")
    out_dir.mkdir(parents=True, exist_ok=True)
    if not args.from_dir:
        for old in [*out_dir.glob("holdings_rank*.json"), *out_dir.glob("memory_rank*.json")]:
            old.unlink()
        t0 = time.perf_counter()
        run(Path(args.script).resolve(), args.nproc, ["--steps", "2", "--device", "cpu", *stage_args], out_dir)
        print(f"ran {args.script} on {args.nproc} ranks in {time.perf_counter() - t0:.1f} s")
    summary, ranks = read(out_dir)
    data = frames(summary, ranks)
    wrong = check(summary, ranks, data)
    for line in wrong:
        print(f"mismatch: {line}")
    t0 = time.perf_counter()
    draw(summary, data, gif)
    size = gif.stat().st_size / 2**10
    print(f"wrote {gif}: {len(drawn(data))} frames of {len(data)} moments, {size:.0f} KiB, in "
          f"{time.perf_counter() - t0:.1f} s")
    if wrong:
        raise SystemExit(f"error: {len(wrong)} frame checks failed (above)")
    if args.results:  # bench/results/animate/<stage>.md, .gif and .frames.json
        path = publish(f"animate/{gif.stem}", report(summary, data), summary["dtype"], args.results)
        shutil.copyfile(gif, path.with_suffix(".gif"))
        keep = ("stage", "dtype", "measured_step", "args", "model_state_bytes", "model_state_bytes_per_rank",
                "peak_memory_bytes_per_rank", "comm_bytes_per_step")
        published = dict(summary={k: summary[k] for k in keep}, ranks=ranks)
        path.with_suffix(".frames.json").write_text(json.dumps(published))


if __name__ == "__main__":
    main()
