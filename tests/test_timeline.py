"""bench/timeline.py and instruments.Timeline: what the timeline of one step shows, and that taking it changes nothing;
every overlap it prints, and every one bench/results/timeline/ publishes, is its trace's. Five runs of a tiny GPT on
2 ranks."""
import json
import os
import re
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from conftest import ROOT, last_lines
from devices import free_port
from instruments import Timeline
from options import parse_args
from train_gpt import PRESETS, GPTConfig

sys.path.insert(0, str(ROOT / "examples"))
import any_model  # noqa: E402

MODEL = ["--preset", "tiny", "--n_layer", "4", "--steps", "3"]


def take_timeline(script, out, *options):
    """bench/timeline.py of `script` on 2 ranks (MODEL, `options`) into `out`, without a GPU: (what it printed, the
    trace.json and run.json it wrote), or an AssertionError with its last lines."""
    cmd = [sys.executable, str(ROOT / "bench" / "timeline.py"), str(script), "--nproc", "2", *MODEL, *options,
           "--out", str(out)]
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300,
                       env=dict(os.environ, CUDA_VISIBLE_DEVICES=""))
    assert p.returncode == 0, f"{' '.join(cmd)} failed:\n" + "\n".join(last_lines(p.stdout + p.stderr, 25))
    return (p.stdout, *(json.loads((out / f).read_text()) for f in ("trace.json", "run.json")))


@pytest.fixture(scope="module")
def timeline(tmp_path_factory):
    """timeline(script, *options) -> take_timeline's (printed, trace, run) for a script of the repository; once each."""
    done = {}

    def run(script, *options):
        if (script, options) not in done:
            done[script, options] = take_timeline(ROOT / script, tmp_path_factory.mktemp("timeline"), *options)
        return done[script, options]
    return run


def spans(trace, rank, keep):
    return [(e["ts"], e["ts"] + e["dur"]) for e in trace["traceEvents"]
            if e.get("ph") == "X" and e["pid"] == rank and keep(e)]


def overlap(a, b):
    return max(0.0, min(a[1], b[1]) - max(a[0], b[0]))


def most_under_backward(trace):
    """The largest share of an all-reduce's flight that some rank spent computing a backward."""
    shares = []
    for rank in (0, 1):
        backward = spans(trace, rank, lambda e: e["cat"] == "compute" and e["name"].startswith("backward "))
        for a in spans(trace, rank, lambda e: e["name"] == "all_reduce" and e["args"]["MiB"] > 0.01):  # not the norm
            shares.append(sum(overlap(a, b) for b in backward) / (a[1] - a[0]))
    return max(shares)


def test_stage0_buckets_reduce_while_backward_runs(timeline):
    """Small buckets: a bucket's all-reduce is in flight while backward goes on (for at least half of its flight, so
    not only the microseconds between issuing it and the end of the unit's backward). One bucket: it starts only when
    backward is over."""
    _, trace, _ = timeline("stage0_ddp.py", "--bucket_mb", "0.05")
    assert most_under_backward(trace) >= 0.5, "no all-reduce of a gradient bucket overlapped backward"
    _, trace, _ = timeline("stage0_ddp.py", "--bucket_mb", "1000")
    assert most_under_backward(trace) < 0.5, "one bucket: its all-reduce cannot start before backward ends"


def gathered_during_forward(trace):
    """How long, summed over the ranks, an all-gather was in flight while a unit computed its forward."""
    return sum(overlap(g, f) for rank in (0, 1)
               for g in spans(trace, rank, lambda e: e["name"] == "all_gather")
               for f in spans(trace, rank, lambda e: e["cat"] == "compute" and e["name"].startswith("forward ")))


def test_stage3_no_prefetch_gathers_nothing_during_forward(timeline):
    """--no_prefetch: a unit's parameters are gathered only when it is about to run, so no all-gather is in flight
    while any unit computes its forward. With prefetch (the default), the next unit's is."""
    _, trace, _ = timeline("stage3.py", "--no_prefetch")
    assert spans(trace, 0, lambda e: e["name"] == "all_gather") and spans(trace, 0, lambda e: e["cat"] == "compute")
    assert gathered_during_forward(trace) == 0, "an all-gather was in flight during a forward, without prefetch"
    _, trace, _ = timeline("stage3.py")
    assert gathered_during_forward(trace) > 0, "with prefetch, the next unit's all-gather runs during a forward"


def test_tracing_changes_no_number(timeline, runner):
    """The traced run (hooks, wrapped handles, a thread waiting on each reduce-scatter) trains exactly as without."""
    _, _, traced = timeline("stage3.py", "--no_prefetch")
    plain = runner.run(str(ROOT / "stage3.py"), 2, *MODEL, "--no_prefetch", "--no_progress", "--sample_chars", "0",
                       "--eval_batches", "1").summary
    assert (traced["losses"], traced["grad_norms"]) == (plain["losses"], plain["grad_norms"])


def test_compute_waiting_for_copies_is_a_wait(timeline):
    """offload's copies are drawn as copies, never as compute; and its step does not wait for them on the host (Copies.landed, drawn as "wait
    copies"): it reads the global norm, which the copies precede, and that read finds the gradient shard landed."""
    _, trace, _ = timeline("offload.py")
    for rank in (0, 1):
        events = [e for e in trace["traceEvents"] if e.get("ph") == "X" and e["pid"] == rank]
        copies = {e["name"] for e in events if e["name"].startswith("copy to")}
        assert "copy to host" in copies, f"rank {rank}: copies drawn: {copies}"  # (on a CPU every copy's end is the host)
        assert all(e["cat"] != "compute" for e in events if e["name"].startswith("copy to")), f"rank {rank}"
        waits = [e for e in events if e["name"] == "wait copies"]
        assert not waits, f"rank {rank}: the step waits for its copies on the host ({len(waits)} waits)"


def test_an_engine_is_traced_by_its_own_units(tmp_path):
    """Stage 3 given units= (a block, the head; the root takes the rest) is traced by those units, not by the blocks of
    the model's ModuleList: each unit's forward and backward are drawn, and no other module's. In this process, as a
    world of one, on examples/any_model.py's model."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        device, Engine = torch.device("cpu"), any_model.load_engine(str(ROOT / "stage3.py"))
        args = parse_args(Engine, PRESETS, GPTConfig, ["--steps", "1"])
        model = any_model.SetClassifier()
        engine = Engine(model, args, device, units=[model.blocks[1], model.head])
        trace = Timeline.start(str(tmp_path), engine, model, device, 0, "stage3", step=0)
        with trace.window(0):
            any_model.train(engine, model, args, 0, 1, device)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    events = json.loads((tmp_path / "trace_rank0.json").read_text())["traceEvents"]
    drawn = {e["name"] for e in events if e.get("ph") == "X" and e["cat"] == "compute"}
    units = {"blocks.1", "head", "root"}
    assert {f"{pass_} {u}" for pass_ in ("forward", "backward") for u in units} <= drawn, sorted(drawn)
    assert {n.split(" ", 1)[1] for n in drawn if n.startswith(("forward ", "backward "))} == units, sorted(drawn)


def rows_from(tmp_path, segments, calls=(), waits=(), adam=(), kernels=None, cuda=False):
    """Timeline's rows from hand-made timings (seconds on the host clock), as the trace_rank0.json it writes: the step
    runs from 0 to 1 s; adam: C++ AdamW calls (start, end) on the computing thread."""
    t = Timeline.__new__(Timeline)  # the row-making part alone: no model, no engine
    t.out_dir, t.rank, t.stage, t.step, t.cuda = str(tmp_path), 0, "offload", 0, cuda
    t.segments, t.calls, t.waits, t.collectives = list(segments), list(calls), list(waits), []
    t.spans = {"copies": [], "cpu adam": [["adam_step", a, b, True] for a, b in adam]}
    if kernels is None:  # a CPU's rows
        t._write(0.0, 1.0)
    else:
        t._write(0.0, 1.0, kernels)
    events = json.loads((tmp_path / "trace_rank0.json").read_text())["traceEvents"]
    return {row: [(e["name"], e["ts"] / 1e6, (e["ts"] + e["dur"]) / 1e6) for e in events
                  if e.get("ph") == "X" and e["tid"] == tid] for row, tid in Timeline.ROWS.items()}


def close(got, want):
    return len(got) == len(want) and all(g[0] == w[0] and abs(g[1] - w[1]) + abs(g[2] - w[2]) < 1e-6
                                          for g, w in zip(got, want))


def test_cpu_compute_leaves_out_host_waits_and_adam(tmp_path):
    """On a CPU the compute row is the computing thread's marked segments, less its time elsewhere: inside `step`, a
    C++ AdamW call and a host wait (for --delayed_update's thread) are rows of their own, not compute."""
    rows = rows_from(tmp_path, segments=[("forward root", 0.0, 0.2), ("optimizer step", 0.2, 0.9)],
                     waits=[("wait cpu adam", 0.3, 0.5)], adam=[(0.6, 0.8)])
    assert close(rows["compute"], [("forward root", 0.0, 0.2), ("optimizer step", 0.2, 0.3),
                                   ("optimizer step", 0.5, 0.6), ("optimizer step", 0.8, 0.9)]), rows["compute"]
    assert close(rows["host waits"], [("wait cpu adam", 0.3, 0.5)]), rows["host waits"]
    assert close(rows["cpu adam"], [("adam_step", 0.6, 0.8)]), rows["cpu adam"]


def test_a_transfer_from_the_step_before_says_so(tmp_path):
    """The NVMe tier's write the step before left in flight is drawn from the step's start, with its bytes, and marked
    as submitted before the step (bench/bench_nvme.py counts a step's own transfers only); one the step submitted is
    not."""
    t = Timeline.__new__(Timeline)  # the row-making part alone: no model, no engine
    t.out_dir, t.rank, t.stage, t.step, t.cuda = str(tmp_path), 0, "offload", 0, False
    t.segments, t.calls, t.waits, t.collectives = [("optimizer step", 0.0, 1.0)], [], [], []
    t.spans = {"nvme writes": [["write", -0.2, 0.1, False, dict(MiB=20.0)], ["write", 0.5, 0.7, False, dict(MiB=1.0)]]}
    t._write(0.0, 1.0)
    events = json.loads((tmp_path / "trace_rank0.json").read_text())["traceEvents"]
    writes = [(e["ts"], e["args"]) for e in events if e.get("cat") == "nvme writes"]
    assert writes == [(0.0, dict(MiB=20.0, submitted_before_the_step=True)), (500000.0, dict(MiB=1.0))], writes


def profile_trace():
    """A hand-made torch.profiler Chrome trace (microseconds; its anchor's middle, 1001 us, is the host's 0.5 s): in
    forward two kernels that touch and one after a gap, in step one kernel, then the host waits for the GPU
    (cudaStreamSynchronize) and runs the C++ AdamW with no kernel running; an NCCL kernel and a copy on other
    streams."""
    x = lambda cat, name, ts, dur, tid=1, **args: dict(ph="X", cat=cat, name=name, ts=ts, dur=dur, tid=tid, args=args)
    launch = lambda ts, c: x("cuda_runtime", "cudaLaunchKernel", ts, 1, correlation=c)
    return [x("user_annotation", Timeline.ANCHOR, 1000, 2),
            launch(1010, 1), launch(1011, 2), launch(1012, 3), launch(1110, 4), launch(1120, 5), launch(1121, 6),
            x("kernel", "sgemm", 1015, 20, stream=7, correlation=1),
            x("kernel", "softmax", 1035, 10, stream=7, correlation=2),
            x("kernel", "gelu", 1060, 10, stream=7, correlation=3),  # launched in forward, runs after a gap
            x("kernel", "norm", 1112, 5, stream=7, correlation=4),  # the optimizer step's
            x("kernel", "ncclDevKernel_AllReduce", 1130, 50, stream=30, correlation=5),
            x("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 1200, 30, stream=40, correlation=6),
            x("cuda_runtime", "cudaStreamSynchronize", 1150, 100),
            x("cuda_runtime", "cudaStreamSynchronize", 1160, 10, tid=99)]  # another thread's (a watchdog's)


def test_gpu_compute_is_the_kernels(tmp_path):
    """On a GPU the compute row is the compute stream's kernels, each named by the marked segment in which it was
    launched: a stream idle while the host waits for it or runs the C++ AdamW is no compute, though both lie inside
    the marks of `step`; the host's synchronize is a host wait; NCCL kernels and copies are not compute."""
    from instruments import read_profile
    kernels, waits = read_profile(profile_trace(), Timeline.ANCHOR, 0.5)
    s = lambda us: 0.5 + (us - 1001) / 1e6
    rows = rows_from(tmp_path, segments=[("forward root", s(1005), s(1100)), ("optimizer step", s(1100), s(1400))],
                     waits=waits, adam=[(s(1260), s(1390))], kernels=kernels, cuda=True)
    assert close(rows["compute"], [("forward root", s(1015), s(1045)), ("forward root", s(1060), s(1070)),
                                   ("optimizer step", s(1112), s(1117))]), rows["compute"]
    assert close(rows["host waits"], [("wait cudaStreamSynchronize", s(1150), s(1250))]), rows["host waits"]
    assert close(rows["cpu adam"], [("adam_step", s(1260), s(1390))]), rows["cpu adam"]


def test_delayed_update_wait_is_a_host_wait(timeline):
    """offload --delayed_update: the host's wait for the update in flight is drawn in the host waits row, on every
    rank, and compute never covers it; bench/timeline.py prints how much of it compute overlapped (none, on a CPU)."""
    printed, trace, _ = timeline("offload.py", "--delayed_update")
    for rank in (0, 1):
        waits = spans(trace, rank, lambda e: e["cat"] == "host waits" and e["name"] == "wait cpu adam")
        assert waits, f"rank {rank}: no host wait for --delayed_update's thread"
        computes = spans(trace, rank, lambda e: e["cat"] == "compute")
        covered = any(overlap(w, c) > 1e-3 for w in waits for c in computes)
        assert not covered, f"rank {rank}: compute during a host wait"
    assert re.search(r"^host waits overlapped by compute: 0\.0%", printed, re.M), printed


def test_cpu_adam_in_step_is_not_compute(timeline):
    """offload without --delayed_update runs the C++ AdamW inside `step` on the computing thread: compute never covers
    it."""
    _, trace, _ = timeline("offload.py")
    for rank in (0, 1):
        adam = spans(trace, rank, lambda e: e["cat"] == "cpu adam")
        computes = spans(trace, rank, lambda e: e["cat"] == "compute")
        assert adam and not any(overlap(a, c) > 1e-3 for a in adam for c in computes), f"rank {rank}: adam as compute"


def reads_under_adam(trace, rank):
    """How many of rank's NVMe reads were in flight while a C++ AdamW call ran, and how many reads there were."""
    reads = spans(trace, rank, lambda e: e["cat"] == "nvme reads")
    adam = spans(trace, rank, lambda e: e["cat"] == "cpu adam")
    return sum(any(overlap(r, a) > 0 for a in adam) for r in reads), len(reads)


def test_nvme_reads_run_beside_adam(timeline, tmp_path_factory):
    """offload --offload_optimizer nvme: the state file's reads and writes are rows of their own, each with its bytes,
    beside cpu adam. With 3 buffers the next bucket's states are read while AdamW updates this one, so some read is in
    flight during an AdamW call; with 1 buffer every read is waited for before the update that needs it, so none is,
and the host's wait is drawn as one for the disk.
    One rank (--nproc 1 after the fixture's 2: the last wins), the tier being each rank's own."""
    path = tmp_path_factory.mktemp("nvme")  # pytest's own directory: a disk, or else tmpfs, where the file is buffered
    for count, ahead in (("3", True), ("1", False)):
        printed, trace, _ = timeline("offload.py", "--nproc", "1", "--offload_optimizer", "nvme", "--nvme_path",
                                     str(path), "--nvme_buffer_count", count)
        assert "nvme reads overlapped by cpu adam" in printed, printed
        rows = {e["cat"] for e in trace["traceEvents"] if e.get("ph") == "X"}
        assert {"nvme reads", "nvme writes", "cpu adam"} <= rows, f"{count} buffer(s): rows {sorted(rows)}"
        transfers = [e for e in trace["traceEvents"] if e.get("ph") == "X" and e["cat"].startswith("nvme")]
        assert all(e["args"]["MiB"] > 0 for e in transfers), transfers
        under, reads = reads_under_adam(trace, 0)
        if ahead:
            assert under > 0, f"{count} buffers: none of {reads} reads ran beside AdamW"
        else:
            assert under == 0, f"{count} buffer: {under} of {reads} reads ran beside AdamW"
            # the host waits for each read: drawn as a wait for the disk (there is no update's thread to wait for)
            waits = {e["name"] for e in trace["traceEvents"] if e.get("ph") == "X" and e["cat"] == "host waits"}
            assert "wait nvme read" in waits and "wait cpu adam" not in waits, f"1 buffer: host waits {sorted(waits)}"
    assert os.listdir(path) == [], os.listdir(path)


def in_flight_and_under(trace, rank, category):
    """(µs some `category` interval of the rank is in flight, µs of those the rank also computes), by walking every
    moment where an interval starts or ends (not bench/timeline.py's union and intersection)."""
    rows = spans(trace, rank, lambda e: e["cat"] == category)
    compute = spans(trace, rank, lambda e: e["cat"] == "compute")
    moments = sorted({t for s in rows + compute for t in s})
    total = both = 0.0
    for a, b in zip(moments, moments[1:]):
        mid = (a + b) / 2
        if any(s <= mid < e for s, e in rows):
            total += b - a
            both += (b - a) * any(s <= mid < e for s, e in compute)
    return total, both


def check_overlaps(text, trace, where):
    """What bench/timeline.py printed (or published) against its trace: each rank's time in flight and share under
    compute, and the all-ranks share, of communication, copies and the C++ AdamW (to the rounding printed: 0.1 ms,
    0.1%)."""
    checked = 0
    for category in ("communication", "copies", "cpu adam"):
        sums = [0.0, 0.0]
        for rank in (0, 1):
            said = re.search(rf"^(?:- |  )rank {rank}: .*?{category} ([\d.]+) ms(?: in flight)?, ([\d.]+)% of it under "
                             "compute", text, re.M)
            total, both = in_flight_and_under(trace, rank, category)
            sums = [sums[0] + total, sums[1] + both]
            if said is None:
                assert total == 0, f"{where}: rank {rank}'s {category} ({total / 1e3:.1f} ms in its trace) not printed"
                continue
            ms = float(said.group(1))
            share = float(said.group(2))
            under = 100 * both / total if total else 0.0  # (nothing in flight: printed as 0%)
            assert abs(ms - total / 1e3) <= 0.051 and abs(share - under) <= 0.051, (
                f"{where}: rank {rank} prints {category} {ms} ms, {share}% under compute; its trace gives "
                f"{total / 1e3:.2f} ms, {under:.2f}%")
            checked += 1
        said = re.search(rf"^(?:- )?{category} overlapped by compute: ([\d.]+)% \(all ranks; ([\d.]+) ms\)", text, re.M)
        if sums[0]:
            assert said, f"{where}: no all-ranks line for {category}"
            assert abs(float(said.group(1)) - 100 * sums[1] / sums[0]) <= 0.051, (
                f"{where}: {category} overlapped {said.group(1)}% over all ranks; the trace gives "
                f"{100 * sums[1] / sums[0]:.2f}%")
            assert abs(float(said.group(2)) - sums[0] / 1e3) <= 0.051, (where, category, said.group(2), sums[0])
    assert checked >= 2, f"{where}: no rank's overlap found"


@pytest.mark.parametrize("options", [("stage0_ddp.py", "--bucket_mb", "0.05"), ("offload.py",)],
                         ids=["stage0", "offload"])
def test_printed_overlaps_of_every_row_are_the_traces(timeline, options):
    """Every overlap bench/timeline.py prints, per rank and over all ranks (offload's copies and C++ AdamW too), is the
    one its trace.json gives, computed here another way."""
    printed, trace, _ = timeline(*options)
    check_overlaps(printed, trace, " ".join(options))


@pytest.mark.parametrize("name", sorted(p.stem for p in (ROOT / "bench" / "results" / "timeline").glob("*.md")))
def test_published_overlaps_are_their_traces(name):
    """A published timeline (bench/results/timeline/NAME.md beside NAME.trace.json): its overlaps are its trace's."""
    folder = ROOT / "bench" / "results" / "timeline"
    check_overlaps((folder / f"{name}.md").read_text(), json.loads((folder / f"{name}.trace.json").read_text()), name)
