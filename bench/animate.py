"""
bench/animate.py: one training step, animated from what a run measured: per rank, what it holds by category and the
rest of its live memory (the activations), the event of each moment (a unit gathered or freed, a bucket reduced, a
copy, the C++ AdamW, the optimizer's update), the memory line rising and falling to its peak, and the bytes each
collective sends.

    python bench/animate.py stage3.py --nproc 2 --preset tiny --frames 8,21,37
    python bench/animate.py offload.py --nproc 2 --preset tiny --delayed_update

Every option it does not know goes to the stage file. It runs the stage on the CPU (--device cpu: the CPU's memory
meter records every allocation and free, a GPU's only the allocator's peak) for 2 steps with bench/timeline.py's runner
(--timeline DIR): the second step is both the traced one and the memory meter's, so the Timeline also reads the
engine's holdings at each moment of the computing thread (instruments.Timeline.hold: DIR/holdings_rank<r>.json) and
the meter's allocations and frees are kept (DIR/memory_rank<r>.json). Then it prints the list of frames and writes
runs/animate/<stage>.gif (--out), a frame per moment of rank 0 (the other ranks drawn at that time), and with --frames
those frames as PNG stills, DIR/frame<NN>.png, 1200 pixels wide:
- per rank, a bar of what the engine holds: the model states by category as the engine lists them (model_states()),
  and what its attributes hold beyond them (instruments.unlisted), counted with its category by name: an attribute
  whose path names `param` is parameters (a unit gathered), `grad` or `reduced` gradients (a bucket in flight), any
  other the engine's buffers. Hatched: the part in flight (gathered, reduced); dashed: the formula's model states
  (train_gpt.theory, as run.json has them);
- per rank, a bar of the rest of live: the activations, autograd's saved tensors, the micro-batch, working buffers;
- the event of the moment and the lesson whose code makes it ([ZeRO-3], [Prefetch], [Offload], [Copy stream], ...);
- each rank's live line, with rank 0's forward, backward and optimizer step shaded. Live is the run's memory table's:
  the meter's running sum of tensor bytes less the data set (the meter's peak counts the data set too);
- the bytes each rank has sent so far, by collective (the timeline's collectives, each with the bytes the ledger
  counted for it).
The GIF keeps a frame 1.2 s on screen, the peak, the optimizer's update and the end 4 s (durations()). The step's times
are those of a step under the meter's profiler and the holdings' reads (slower than a plain step: bench/timeline.py
times a step without them). The frames are built from the run's files alone (frames()), and check() holds them to the
run's own ledgers: the frame at the step's end draws each rank's model-state bytes as the ledger measured them, the
largest memory of a frame is the meter's peak, the frames' collectives come in the timeline's order, and their bytes
sum to the comm ledger's.

    python bench/animate.py stage3.py --nproc 2 --preset tiny --dtype fp32 --frames 8,21,37 --results

writes bench/results/animate/stage3.md (what the frames show, that every check holds, and the list of frames: the
block in bench/README.md), stage3.gif and the stills stage3.frame<NN>.png (README.md shows them) and stage3.frames.json
(the run's files as read() reads them, its options' paths written from the repository's root, from which the GIF and
stills are drawn: tests/test_animate.py draws them again from it and holds them to the checks).
"""
import argparse, json, shutil, sys, textwrap, time
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


# the end of the optimizer step, by stage: what its update did (words, lesson)
UPDATE = {"stage0": ("the optimizer step is done: AdamW updated every parameter, the same on every rank", ""),
          "stage1": ("the optimizer step is done: AdamW updated this rank's shard, then the ranks gathered the "
                     "parameters", "[ZeRO-1]"),
          "stage3": ("the optimizer step is done: AdamW updated this rank's shard (master, moments, parameters)",
                     "[ZeRO-1]"),
          "offload": ("the optimizer step is done", "")}
UPDATE["stage2"] = UPDATE["stage1"]


def step_done(moments):
    """The index of the moment that ends the optimizer step (the `pop` that closes `push optimizer step`), or None."""
    depth = None
    for i, moment in enumerate(moments):
        if moment == "push optimizer step":
            depth = 0
        elif depth is not None and moment.startswith("push"):
            depth += 1
        elif depth is not None and moment == "pop":
            if depth == 0:
                return i
            depth -= 1
    return None


def frames(summary, ranks):
    """A frame per measured moment: each rank's holdings sample and each rank's peak, in time order. A frame holds
    its time, the rank whose moment it is, the event and its lesson, and per rank: the last sample's holdings (held,
    in flight), the memory at that time (the meter's, data set included) and live (less the data set, as the run's
    table counts it), the collectives in flight and the bytes sent so far by collective."""
    data_bytes = summary.get("data_bytes", 0)
    update = UPDATE.get(summary["stage"], UPDATE["offload"])
    moments = []
    for r in ranks:
        before, held = "", None
        done = step_done([h["moment"] for h in r["holdings"]])
        for i, h in enumerate(r["holdings"]):
            now = holding(h)[0]
            words = event(h["moment"], now, held)
            tag = lesson(summary["stage"], h["moment"], before, words)
            if i == done:
                words, tag = update
            moments.append((h["t"], r["rank"], h["moment"], words, tag, i))
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
            memory = memory_at(r["memory"], t)
            per.append(dict(held=held, flight=flight, memory=memory, live=memory - data_bytes, sent=sent,
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


def drawn(data, rank=0):
    """The frames a GIF shows: the moments of one rank (the captioned one; the others are drawn beside it) that have
    an event (a moment where the engine's hooks changed nothing has none), and that rank's last."""
    own = [f for f in data if f["rank"] == rank]
    return [f for f in own[:-1] if f["event"]] + own[-1:]


def key(f):
    """Whether a learner needs longer on this frame: the peak, the optimizer's update, the step's end."""
    return f["moment"] in ("the peak", "step ends") or f["event"].startswith("the optimizer step is done")


def durations(shown, ms=1200, longer=4000):
    """Each drawn frame's time on screen in the GIF, in milliseconds (a browser cannot pause a GIF)."""
    return [longer if key(f) else ms for f in shown]


def frame_list(shown):
    """The drawn frames, one line each: the number --frames takes, the time and the caption."""
    return [f"{k:3d} {f['t'] / 1e3:7.1f} ms  rank {f['rank']}: {f['event'] or f['moment']} {f['lesson']}".rstrip()
            for k, f in enumerate(shown, 1)]


ACTIVATIONS = "#64B5CD"


def painter(summary, data):
    """The figure the frames share, and paint(number): the PIL image of drawn frame `number` (1-based). Per rank two
    bars: what the engine holds by category (hatched: gathered or in flight; dashed: the formula's model states) and
    the rest of live, the activations and working set; the bytes sent so far by collective; the live line of each
    rank with the frame's time marked. 1200 pixels wide at 100 dpi: every label readable at 100%."""
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.patches import Patch, Rectangle
    from PIL import Image

    shown = drawn(data)
    n = len(data[0]["ranks"])
    mib = 2**20
    theory = sum(v["theory"] for v in summary["model_state_bytes"].values())
    where = {k: v["where"] for k, v in summary["model_state_bytes"].items()}
    data_bytes = summary.get("data_bytes", 0)
    # the NVMe tier's state file, as the ledger measured it (rank 0's; every rank's file is the same size)
    disk = summary.get("disk_bytes", {}).get("measured", 0) / mib

    def engine(p):  # what the engine holds on the device: its model states, what is in flight, its buffers
        return sum(p["held"].values()) + p["flight"].get("buffers", 0)

    def rest(p):  # the rest of live: activations, autograd's saved tensors, the micro-batch, working buffers
        return max(p["live"] - engine(p), 0)

    widest = max(max(engine(p) / mib + disk, rest(p) / mib) for f in data for p in f["ranks"])
    widest = max(widest, theory / mib + disk)
    top = max(p["live"] for f in data for p in f["ranks"]) / mib
    shown_states = [k for k in STATES + ["buffers"] if any(p["held"].get(k) or p["flight"].get(k) for f in data
                                                           for p in f["ranks"])]
    captioned = shown[0]["rank"]
    own = [f for f in data if f["rank"] == captioned]

    rows = 2 * max(n, 2)  # (a world of one gets the room of two)
    height = 4.9 + 0.42 * rows
    fig = plt.figure(figsize=(12, height), dpi=100)
    grid = fig.add_gridspec(2, 2, height_ratios=[0.42 * rows + 0.6, 2.4], width_ratios=[2.3, 1], hspace=0.55,
                            wspace=0.55, top=1 - 1.85 / height, bottom=0.14, left=0.12, right=0.97)
    bars, sends, mem = fig.add_subplot(grid[0, 0]), fig.add_subplot(grid[0, 1]), fig.add_subplot(grid[1, :])
    bars.set_xlim(0, widest * 1.32)
    bars.set_ylim(-0.6, 2 * n - 0.4)
    ticks, labels = [], []
    for r in range(n):
        ticks += [2 * (n - 1 - r) + 1, 2 * (n - 1 - r)]
        labels += [f"rank {r}: engine", "activations"]
    bars.set_yticks(ticks, labels)
    bars.set_xlabel("MiB on the rank")
    legend = [Patch(color=COLORS[k], label=k) for k in shown_states]
    legend += [Patch(facecolor="#999999", hatch="///", edgecolor="white", label="gathered, in flight")]
    legend += [Patch(fill=False, ls="--", lw=1.2, label="formula's states")]
    legend += [Patch(color=ACTIVATIONS, label="activations, working set")]
    legend += [Patch(color=COLORS["on disk"], label="on disk")] * bool(disk)
    bars.legend(handles=legend, fontsize=11, ncol=5, loc="lower left", bbox_to_anchor=(-0.02, 1.0), frameon=False,
                handlelength=1.5, columnspacing=1.0)
    for r in range(n):
        bars.add_patch(Rectangle((0, 2 * (n - 1 - r) + 1 - 0.4), theory / mib, 0.8, fill=False, ls="--", lw=1.4))
    names = [(r, k) for r in range(n) for k in sorted({k for f in data for k in f["ranks"][r]["sent"]})]
    sent_max = max((v for f in data for p in f["ranks"] for v in p["sent"].values()), default=0) / mib or 1
    sent_bars = sends.barh([f"rank {r} {k}" for r, k in names[::-1]], [0] * len(names), color="#999999")[::-1]
    sends.set_xlim(0, sent_max * 1.6)
    sends.set_title("MiB sent so far (red: in flight)", fontsize=12)
    sends.tick_params(labelsize=11)
    sent_text = [sends.text(0, bar.get_y() + bar.get_height() / 2, "", va="center", fontsize=11) for bar in sent_bars]
    # the captioned rank's phases, behind the live lines
    starts = {"forward": own[0]["t"]}
    backward = [f["t"] for f in own if f["moment"].startswith("top backward")]
    optimizer = [f["t"] for f in own if f["moment"] == "push optimizer step"]
    if backward:
        starts["backward"] = backward[0]
    if optimizer:
        starts["optimizer step"] = optimizer[0]
    edges = list(starts.values()) + [own[-1]["t"]]
    for (name, a), b, shade in zip(starts.items(), edges[1:], ("#F3F3F3", "#E6E6E6", "#F3F3F3")):
        mem.axvspan(a / 1e3, b / 1e3, color=shade, lw=0)
        # the last phase (the optimizer step) may be narrow: its name ends at its end
        last = name == list(starts)[-1]
        mem.text(b / 1e3 if last else (a + b) / 2e3, top * 1.33, name, ha="right" if last else "center", va="top",
                 fontsize=11, color="#555555")
    times = [f["t"] / 1e3 for f in data]
    markers = []
    for r in range(n):
        mem.plot(times, [f["ranks"][r]["live"] / mib for f in data], lw=1.5, label=f"rank {r}", color=f"C{r}")
        markers.append(mem.plot([], [], "o", ms=7, color=f"C{r}")[0])
    cursor = mem.axvline(0, color="black", lw=1)
    mem.set_ylim(0, top * 1.38)
    mem.set_xlim(times[0], times[-1])
    mem.set_xlabel("ms since the step began (rank %d's phases shaded)" % captioned)
    mem.set_ylabel("live MiB")
    mem.legend(loc="upper left", frameon=False, ncol=n, bbox_to_anchor=(0.0, 0.86))
    peak = max(own, key=lambda f: f["ranks"][captioned]["live"])
    mem.annotate(f"rank {captioned}'s peak, {peak['ranks'][captioned]['live'] / mib:.2f} MiB",
                 (peak["t"] / 1e3, peak["ranks"][captioned]["live"] / mib), xytext=(8, 6), textcoords="offset points",
                 fontsize=11)
    fig.text(0.01, 0.005, f"live: every tensor on the rank less the data set ({data_bytes / mib:.2f} MiB), as the "
             f"run's memory table counts it", fontsize=10, color="#555555")
    title = fig.text(0.5, 0.985, "", ha="center", va="top", fontsize=12)
    caption = fig.text(0.5, 0.985 - 0.3 / height, "", ha="center", va="top", fontsize=15,
                       weight="bold")
    moment = []  # this frame's own artists, removed before the next

    def paint(number):
        f = shown[number - 1]
        for artist in moment:
            artist.remove()
        moment.clear()
        for r, p in enumerate(f["ranks"]):
            y = 2 * (n - 1 - r) + 1
            x = 0.0
            for k in shown_states:
                whole = (p["held"].get(k, 0) if k != "buffers" else p["flight"].get("buffers", 0)) / mib
                flying = (p["flight"].get(k, 0) if k != "buffers" else 0) / mib
                if whole:
                    moment.append(bars.add_patch(Rectangle((x, y - 0.32), whole - flying, 0.64, color=COLORS[k])))
                    if flying:
                        moment.append(bars.add_patch(Rectangle((x + whole - flying, y - 0.32), flying, 0.64,
                                                               facecolor=COLORS[k], hatch="///", edgecolor="white",
                                                               lw=0)))
                    if where.get(k) == "host" and whole > 0.06 * widest:
                        moment.append(bars.text(x + whole / 2, y, "host", ha="center", va="center", fontsize=11,
                                                color="white"))
                x += whole
            if disk:
                moment.append(bars.add_patch(Rectangle((x, y - 0.32), disk, 0.64, color=COLORS["on disk"])))
                moment.append(bars.text(x + disk / 2, y, "disk", ha="center", va="center", fontsize=11,
                                        color="white"))
            moment.append(bars.add_patch(Rectangle((0, y - 1 - 0.32), rest(p) / mib, 0.64, color=ACTIVATIONS)))
            own_rank = r == f["rank"]
            moment.append(bars.text(widest * 1.03, y - 0.5, f"live\n{p['live'] / mib:.2f} MiB", va="center",
                                    fontsize=12, color="C3" if own_rank else "black",
                                    weight="bold" if own_rank else "normal"))
            markers[r].set_data([f["t"] / 1e3], [p["live"] / mib])
        for bar, text, (r, k) in zip(sent_bars, sent_text, names):
            sent = f["ranks"][r]["sent"].get(k, 0)
            bar.set_width(sent / mib)
            bar.set_color("#C44E52" if k in f["ranks"][r]["in_flight"] else "#999999")
            text.set_x(sent / mib + sent_max * 0.03)
            text.set_text(f"{sent / mib:.2f} MiB" if sent >= 2**14 else f"{sent:.0f} B")
        cursor.set_xdata([f["t"] / 1e3])
        title.set_text(f"{summary['stage']} on {n} ranks, step {summary['measured_step']} of a 2-step run: frame "
                       f"{number} of {len(shown)}, {f['t'] / 1e3:.1f} ms")
        caption.set_text(textwrap.fill(f"rank {f['rank']}: {f['event'] or f['moment']} {f['lesson']}".rstrip(), 80))
        fig.canvas.draw()
        return Image.fromarray(np.asarray(fig.canvas.buffer_rgba())).convert("RGB")

    return fig, paint


def draw(summary, data, gif=None, stills=(), folder=None, only=None):
    """The frames drawn() keeps: as an animated GIF (only: just these 1-based numbers), and the frames numbered in
    `stills` as PNG files folder/frame<NN>.png. Returns the stills' paths."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    shown = drawn(data)
    written = []
    with plt.rc_context({"font.size": 12}):  # (tick labels take it when drawn, so every frame is drawn inside)
        fig, paint = painter(summary, data)
        for number in stills:
            path = Path(folder) / f"frame{number:02d}.png"
            paint(number).save(path)
            written.append(path)
        if gif is not None:
            numbers = [k for k in range(1, len(shown) + 1) if only is None or k in only]
            images = [paint(k) for k in numbers]
            images[0].save(gif, save_all=True, append_images=images[1:], loop=0,
                           duration=[durations(shown)[k - 1] for k in numbers])
        plt.close(fig)
    return written


def report(summary, data, stills=()):
    """What the frames show, in Markdown: the published result's body, with the list of drawn frames."""
    n = len(data[0]["ranks"])
    end = data[-1]["ranks"]
    shown = drawn(data)
    theory = sum(v["theory"] for v in summary["model_state_bytes"].values())
    lines = [f"{summary['stage']} on {n} ranks, step {summary['measured_step']} of 2: {len(shown)} frames drawn "
             f"(rank {shown[0]['rank']}'s moments) of {len(data)} measured moments. Every frame check holds: the end "
             f"frame draws the ledger's model states, the largest frame the meter's peak, the collectives come in the "
             f"timeline's order and send the comm ledger's bytes. Live is the table's: every tensor less the data set "
             f"({summary.get('data_bytes', 0) / 2**20:.2f} MiB), which the meter's peak counts.", "",
             "| rank | model states at the end, MiB | formula, MiB | largest live, MiB | the meter's peak, MiB | "
             "sent, MiB |",
             "|---:|---:|---:|---:|---:|---:|"]
    for r, p in enumerate(end):
        states = sum(n for k, n in p["held"].items() if k in STATES)
        live = max(f["ranks"][r]["live"] for f in data)
        largest = max(f["ranks"][r]["memory"] for f in data)
        lines.append(f"| {r} | {states / 2**20:.3f} | {theory / 2**20:.3f} | {live / 2**20:.3f} | "
                     f"{largest / 2**20:.3f} | {sum(p['sent'].values()) / 2**20:.3f} |")
    lines += ["", f"The stills: frames {', '.join(map(str, stills))}." if stills else "", "",
              "<details><summary>The frames (the numbers --frames takes)</summary>", "", "```", *frame_list(shown),
              "```", "</details>"]
    return "\n".join(lines)


def numbers(text):
    """--frames' value, "13,40,51": the frame numbers, each at least 1."""
    try:
        picked = [int(k) for k in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give frame numbers separated by commas, such as 13,40,51")
    if not picked or min(picked) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: frames are numbered from 1 (the run prints the list)")
    return picked


def portable(summary):
    """The run's summary with each path among its options written from the repository's root (a path outside it:
    its name alone), so that what is published names no one's checkout."""
    args = dict(summary["args"])
    for k, v in args.items():
        if isinstance(v, str) and Path(v).is_absolute():
            args[k] = str(Path(v).relative_to(ROOT)) if Path(v).is_relative_to(ROOT) else Path(v).name
    return dict(summary, args=args)


def main():
    p = argparse.ArgumentParser(description="One training step animated from a measured run (a GIF, and PNG stills "
                                "of the frames --frames names). Options it does not know go to the stage file.")
    p.add_argument("script", help="the stage file: stage0_ddp.py ... offload.py")
    p.add_argument("--nproc", type=int, default=2, help="ranks")
    p.add_argument("--out", default=None, metavar="GIF", help="default runs/animate/<stage>.gif")
    p.add_argument("--frames", type=numbers, default=[], metavar="K,K,...",
                   help="also write these frames (numbered as the printed list) as PNG stills beside the run's files")
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
        for old in [*out_dir.glob("holdings_rank*.json"), *out_dir.glob("memory_rank*.json"),
                    *out_dir.glob("frame*.png")]:
            old.unlink()
        t0 = time.perf_counter()
        run(Path(args.script).resolve(), args.nproc, ["--steps", "2", "--device", "cpu", *stage_args], out_dir)
        print(f"ran {args.script} on {args.nproc} ranks in {time.perf_counter() - t0:.1f} s")
    summary, ranks = read(out_dir)
    data = frames(summary, ranks)
    shown = drawn(data)
    wrong = check(summary, ranks, data)
    for line in wrong:
        print(f"mismatch: {line}")
    print("the frames (--frames takes their numbers):")
    print("\n".join(frame_list(shown)))
    beyond = [k for k in args.frames if k > len(shown)]
    if beyond:
        raise SystemExit(f"error: --frames {','.join(map(str, beyond))}: this run draws {len(shown)} frames (listed "
                         f"above); pick numbers from 1 to {len(shown)}")
    t0 = time.perf_counter()
    stills = draw(summary, data, gif, args.frames, out_dir)
    size = gif.stat().st_size / 2**10
    print(f"wrote {gif}: {len(shown)} frames of {len(data)} moments, {size:.0f} KiB, in "
          f"{time.perf_counter() - t0:.1f} s")
    for path in stills:
        print(f"wrote {path}")
    if wrong:
        raise SystemExit(f"error: {len(wrong)} frame checks failed (above)")
    if args.results:  # bench/results/animate/<stage>.md, .gif, .frames.json and the stills, .frame<NN>.png
        path = publish(f"animate/{gif.stem}", report(summary, data, args.frames), summary["dtype"], args.results)
        shutil.copyfile(gif, path.with_suffix(".gif"))
        for still in path.parent.glob(f"{gif.stem}.frame*.png"):
            still.unlink()
        for still in stills:
            shutil.copyfile(still, path.with_suffix(f".{still.name}"))
        keep = ("stage", "dtype", "measured_step", "args", "data_bytes", "model_state_bytes",
                "model_state_bytes_per_rank", "peak_memory_bytes_per_rank", "comm_bytes_per_step")
        published = dict(summary={k: portable(summary)[k] for k in keep}, ranks=ranks)
        path.with_suffix(".frames.json").write_text(json.dumps(published))


if __name__ == "__main__":
    main()
