"""The GPU suite: `python -m pytest tests --gpu` on a machine with CUDA GPUs. Every stage and offload.py (plain,
--offload_params, --delayed_update, --offload_optimizer nvme) trains on CUDA with NCCL at N = 1 and at the number of GPUs present (up to 4),
and is checked against the CUDA single-process reference, against its ledgers (device and host apart), and, from a
profiler timeline, for the overlap each stage exists for. Without --gpu the same runs go through the fake CUDA device
(tests/fake_cuda.py: CPU storage, CUDA's rules, device and pinned memory counted as torch's allocators count it) at
N = 1 and 2, and the same assertions hold; only the overlap tests, which measure a real GPU's timeline, skip (the
timeline reader's own test runs anywhere). --gpu without CUDA skips. Each check says which PyTorch documentation
backs it.

The tolerances below are reasoned, not measured on a GPU (tests/README.md says where this suite has run). If a check
fails by a small margin, record the differences measured beside the tolerance before widening it."""
import json
import sys
from pathlib import Path

import pytest
import torch

from conftest import ROOT, STAGES, Runner
from test_offload import DELAYED_REFERENCE
from test_stages import BUCKETS, MODEL, TRAIN, compare_params, first_difference
from train_gpt import host_categories, pinned_theory

sys.path.insert(0, str(ROOT / "bench"))
import timeline  # noqa: E402  (bench/timeline.py: the overlap fractions bench/offload_gpu.py reports)

CUDA = ["--device", "cuda"]
GPU_TRAIN = [*TRAIN, "--batch_size", "24"]  # TRAIN's, with a global batch that N x grad_accum divides for N = 1 to 4
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
NPROCS = sorted({1, min(GPUS, 4)} - {0}) if GPUS else [2]  # (no GPU: 2 fake ranks; the battery runs 1)
RUNS = {Path(f).stem: (f, []) for f in STAGES} | {"offload_params": ("offload.py", ["--offload_params"]),
                                                  "delayed_update": ("offload.py", ["--delayed_update"]),
                                                  "nvme": ("offload.py", ["--offload_optimizer", "nvme"])}
# TF32 stays off: torch.backends.cuda.matmul.allow_tf32 is False by default (PyTorch >= 1.12, "TensorFloat-32 (TF32)
# on Ampere (and later) devices" in the CUDA semantics notes), and NVIDIA_TF32_OVERRIDE=0 keeps cuBLAS and cuDNN from
# choosing it whatever a library sets. So every matmul here is true fp32, as on the CPU.
ENV = {"NVIDIA_TF32_OVERRIDE": "0"}

# Tolerances, ten times the CPU suite's (test_stages.py: 2e-6, 1e-5, 1e-6, 1e-5). The notes "Numerical accuracy"
# (floating-point addition is not associative; "batched computations or slice computations" need not be bitwise equal
# to the same math done another way) and "Reproducibility" (results may differ between CPU and GPU, and some CUDA
# kernels, such as those using atomicAdd, are nondeterministic) say why a GPU differs more: with N ranks each GPU
# multiplies a batch N times smaller, for which cuBLAS may pick another kernel (another reduction order, split-K);
# NCCL sums over ranks in its own order; attention's backward may accumulate with atomics. Each difference is a few
# ulps of fp32, but 6 steps of Adam carry them along, and Adam turns rounding noise in a near-zero gradient into a
# step of up to lr. Ten times the CPU's margin keeps a real mistake visible: a gradient summed instead of averaged
# moves the norm by a factor N, a lost micro-step by one half.
LOSS_ATOL, NORM_RTOL, BULK_RTOL, BULK_SHARE, ATOL_ANY = 2e-5, 1e-4, 1e-5, 0.999, 1e-4


@pytest.fixture(scope="session")
def gpu_runner(tmp_path_factory, request):
    if not request.config.getoption("gpu"):
        return Runner(tmp_path_factory.mktemp("fake_gpu_runs"), request.config.getoption("torchrun"), fake=True)
    if not torch.cuda.is_available():
        pytest.skip("--gpu, but torch sees no CUDA GPU")
    return Runner(tmp_path_factory.mktemp("gpu_runs"), request.config.getoption("torchrun"), gpu=True)


def cuda_run(gpu_runner, name, nproc, *extra):
    script, flags = RUNS[name]
    if "nvme" in flags:  # the state files' directory, one for the session
        (gpu_runner.tmp / "nvme").mkdir(exist_ok=True)
        flags = [*flags, "--nvme_path", str(gpu_runner.tmp / "nvme")]
    buckets = BUCKETS if "--bucket_mb" in gpu_runner.options(str(ROOT / script)) else []
    return gpu_runner.run(str(ROOT / script), nproc, *MODEL, *GPU_TRAIN, *buckets, *flags, *CUDA, *extra, env=ENV)


@pytest.fixture(scope="session")
def cuda_references(gpu_runner, tmp_path_factory):
    """The single-process reference on CUDA, and the one that applies each update one step late (--delayed_update's)."""
    delayed = tmp_path_factory.mktemp("gpu_delayed") / "delayed_reference.py"
    delayed.write_text(DELAYED_REFERENCE.format(root=str(ROOT)))
    return {name: gpu_runner.run(script, None, *MODEL, *GPU_TRAIN, *CUDA, env=ENV)
            for name, script in (("exact", str(ROOT / "train_gpt.py")), ("delayed", str(delayed)))}


@pytest.mark.parametrize("nproc", NPROCS)
@pytest.mark.parametrize("name", list(RUNS))
def test_gpu_parity_with_the_cuda_reference(gpu_runner, cuda_references, name, nproc):
    run = cuda_run(gpu_runner, name, nproc)
    ref = cuda_references["delayed" if name == "delayed_update" else "exact"]
    where = f"{name} on {nproc} GPU(s)"
    assert run.summary["device"] == "cuda", f"{where} ran on {run.summary['device']}"
    k = first_difference(ref.summary["grad_norms"], run.summary["grad_norms"], NORM_RTOL)
    assert k is None, f"{where}: gradient norm at step {k} is {run.summary['grad_norms'][k]}, the reference's " \
                      f"{ref.summary['grad_norms'][k]}"
    k = first_difference(ref.summary["losses"], run.summary["losses"], LOSS_ATOL)
    assert k is None, f"{where}: loss at step {k} is {run.summary['losses'][k]}, the reference's {ref.summary['losses'][k]}"
    compare_params(ref.master, run.master, where, BULK_RTOL, BULK_SHARE, ATOL_ANY)


@pytest.mark.parametrize("nproc", NPROCS)
@pytest.mark.parametrize("name", list(RUNS))
def test_gpu_ledgers_device_and_host(gpu_runner, name, nproc):
    """Model states equal the formula category by category, each where host_categories puts it (the summary says on
    which device each category's tensors were: instruments.holdings); the device's peak
    (torch.cuda.max_memory_allocated: "the maximum GPU memory occupied by tensors", per the CUDA memory docs) holds at
    least the device's model states; other_tensor_bytes counts only device memory (never negative; for stage 2 on,
    no full gradient); pinned host memory, the live pinned storages each rounded up to a power of two (as
    torch.cuda.host_memory_stats's docs say the pinned cache rounds a block), is what pinned_theory predicts (the
    cache's own count would also hold the blocks each batch is pinned in, and cached blocks)."""
    s = cuda_run(gpu_runner, name, nproc).summary
    where, stage = f"{name} on {nproc} GPU(s)", s["stage"]
    host = host_categories(stage, s["args"].get("offload_params", False), s["args"].get("offload_optimizer") == "nvme")
    for category, v in s["model_state_bytes"].items():
        # (--delayed_update's second gradient shard is in the formula already: train_gpt.theory's grad_shards)
        assert v["measured"] == v["theory"], f"{where}: {category} measured {v['measured']:,}, formula {v['theory']:,}"
        assert v["where"] == ("host" if category in host else "device"), f"{where}: {category} is on the {v['where']}"
    on_device = sum(v["measured"] for v in s["model_state_bytes"].values() if v["where"] == "device")
    assert s["peak_memory_bytes"] >= on_device, f"{where}: peak {s['peak_memory_bytes']:,} < device model states {on_device:,}"
    assert s["other_tensor_bytes"] >= 0, f"{where}: other_tensor_bytes {s['other_tensor_bytes']:,} < 0: host memory subtracted"
    if stage in ("stage2", "stage3", "offload"):
        assert s["other_tensor_bytes"] < 0.25 * s["n_params"] * 4, f"{where}: {s['other_tensor_bytes']:,} bytes beyond model states"
    expected = pinned_theory(stage, s["padded_numel"], nproc, 4, s["args"].get("offload_params", False),
                             s["args"].get("delayed_update", False))
    assert s["pinned_host_bytes"] == {"measured": expected, "theory": expected}, f"{where}: pinned {s['pinned_host_bytes']}"


# ---- overlap, read from a profiler timeline (--profile): torch.profiler with ProfilerActivity.CUDA records "on-device
# CUDA kernels" through CUPTI (torch.profiler docs), each with its stream and its GPU start and duration, and the
# launch's correlation id, which ties it to the CPU call that launched it inside record_function("forward") or
# ("backward") (train_gpt.train_step marks them). Two activities on different streams whose GPU intervals intersect
# ran at the same time: the CUDA semantics notes say work on different streams may run concurrently, and only
# there. A GPT-2-sized model in bf16, so that copies and collectives are long enough to see.
OVERLAP = ["--preset", "gpt2", "--block_size", "256", "--batch_size", "24", "--steps", "3", "--dtype", "bf16",
           "--eval_every", "1000", "--eval_batches", "1", "--sample_chars", "0", "--no_progress", *CUDA]


def read_timeline(path):
    """The GPU activities of a Chrome trace: {name, kind, stream, start, end, phase}; phase is the marked range
    (forward, backward, step) in which its launch happened, or None."""
    events = json.loads(Path(path).read_text())["traceEvents"]
    phases = [(e["ts"], e["ts"] + e["dur"], e["name"]) for e in events
              if e.get("cat") == "user_annotation" and e["name"] in ("forward", "backward", "step")]
    launched = {e["args"]["correlation"]: e["ts"] for e in events
                if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    out = []
    for e in events:
        if e.get("cat") in ("kernel", "gpu_memcpy") and "correlation" in e.get("args", {}):
            t = launched.get(e["args"]["correlation"])
            phase = next((name for lo, hi, name in phases if t is not None and lo <= t <= hi), None)
            out.append(dict(name=e["name"], kind=e["cat"], stream=e["args"].get("stream"), start=e["ts"],
                            end=e["ts"] + e["dur"], phase=phase))
    return out


def concurrent(a, others):
    """The activities of `others` that ran on another stream at some moment while `a` ran."""
    return [o for o in others if o["stream"] != a["stream"] and o["start"] < a["end"] and a["start"] < o["end"]]


def compute_kernels(activities, phase):
    return [a for a in activities if a["kind"] == "kernel" and a["phase"] == phase and "nccl" not in a["name"].lower()]


def test_timeline_reader(runner, tmp_path):
    """The reader on a hand-made trace, and --profile's marks in a real one (runs anywhere, on the CPU): a GPU activity's
    phase comes from its launch, not from when the GPU ran it."""
    traced = tmp_path / "cpu_trace"
    runner.run(str(ROOT / "train_gpt.py"), None, "--preset", "tiny", "--steps", "3", "--no_progress", "--sample_chars", "0",
               "--profile", str(traced))
    marks = {e["name"] for e in json.loads((traced / "rank0.json").read_text())["traceEvents"] if e.get("cat") == "user_annotation"}
    assert {"forward", "backward", "step"} <= marks, marks
    x = lambda cat, name, ts, dur, **args: dict(ph="X", cat=cat, name=name, ts=ts, dur=dur, args=args)
    trace = [x("user_annotation", "forward", 0, 100), x("user_annotation", "backward", 100, 100),
             x("cuda_runtime", "cudaLaunchKernel", 10, 1, correlation=1), x("cuda_runtime", "cudaMemcpyAsync", 150, 1, correlation=2),
             x("cuda_runtime", "cudaLaunchKernel", 160, 1, correlation=3),
             x("kernel", "ampere_sgemm", 120, 50, stream=7, correlation=1),  # launched in forward, runs during backward
             x("gpu_memcpy", "Memcpy DtoH (Device -> Pinned)", 160, 30, stream=20, correlation=2),
             x("kernel", "elementwise", 180, 5, stream=7, correlation=3)]
    (tmp_path / "t.json").write_text(json.dumps({"traceEvents": trace}))
    acts = read_timeline(tmp_path / "t.json")
    assert [a["phase"] for a in acts] == ["forward", "backward", "backward"]
    copy = acts[1]
    assert [a["name"] for a in concurrent(copy, acts)] == ["ampere_sgemm", "elementwise"]
    assert [a["name"] for a in concurrent(copy, compute_kernels(acts, "backward"))] == ["elementwise"]


def trace(gpu_runner, script, nproc, *flags):
    if gpu_runner.fake:
        pytest.skip("overlap is measured on a real GPU's timeline (--gpu)")
    out = gpu_runner.tmp / f"trace_{Path(script).stem}_{nproc}{''.join(flags)}"
    gpu_runner.run(str(ROOT / script), nproc, *OVERLAP, *flags, "--profile", str(out), env=ENV)
    return read_timeline(out / "rank0.json")


def test_gpu_offload_gradient_copies_overlap_backward(gpu_runner):
    """Every device-to-host gradient copy lands in pinned memory (CUPTI names the kind: "Memcpy DtoH (Device ->
    Pinned)"; the CUDA semantics notes, "Use pinned memory buffers": only from pinned memory is a non_blocking copy
    asynchronous to the host), and they run while backward's kernels run on the compute stream."""
    acts = trace(gpu_runner, "offload.py", 1)
    copies = [a for a in acts if a["name"].startswith("Memcpy DtoH") and a["phase"] == "backward"]
    assert copies, "no device-to-host copy launched during backward"
    assert all("Pinned" in a["name"] for a in copies), sorted({a["name"] for a in copies})
    overlapped = [c for c in copies if concurrent(c, compute_kernels(acts, "backward"))]
    assert overlapped, f"none of the {len(copies)} gradient copies ran while a backward kernel ran"


def test_gpu_offload_params_prefetch_copies_overlap_forward(gpu_runner):
    """With --offload_params the parameter shard comes up from pinned memory on the copy stream ("Memcpy HtoD (Pinned
    -> Device)"), not on the compute stream, and the next unit's copy runs while this unit's forward kernels run."""
    acts = trace(gpu_runner, "offload.py", 1, "--offload_params")
    copies = [a for a in acts if a["name"].startswith("Memcpy HtoD") and a["phase"] == "forward"]
    compute = compute_kernels(acts, "forward")
    assert copies and compute, "no host-to-device copy, or no kernel, launched during forward"
    assert all("Pinned" in a["name"] for a in copies), sorted({a["name"] for a in copies})
    assert not {a["stream"] for a in copies} & {a["stream"] for a in compute}, "a parameter copy ran on the compute stream"
    assert any(concurrent(c, compute) for c in copies), f"none of the {len(copies)} parameter copies ran beside a forward kernel"


@pytest.mark.skipif(GPUS < 2, reason="stage 3's all-gathers need 2 GPUs or more")
def test_gpu_stage3_prefetch_overlaps_forward(gpu_runner):
    """Stage 3's prefetched all-gathers (NCCL kernels, on NCCL's stream: the torch.distributed docs say a collective
    with async_op=True runs on its own stream, and work.wait() only makes the current stream wait for it) run while
    forward's kernels run; with --no_prefetch none does (so the check can fail). An all-gather's own phase is not
    needed: NCCL may launch through the driver API, which the reader's correlation may not see."""
    nproc = min(GPUS, 4)
    for flags, expect in (((), True), (("--no_prefetch",), False)):
        acts = trace(gpu_runner, "stage3.py", nproc, *flags)
        gathers = [a for a in acts if "nccl" in a["name"].lower() and "allgather" in a["name"].lower()]
        assert gathers, f"no NCCL all-gather kernel in the timeline ({flags})"
        overlapped = [g for g in gathers if concurrent(g, compute_kernels(acts, "forward"))]
        assert bool(overlapped) == expect, (f"stage 3 {' '.join(flags) or 'with prefetch'} on {nproc} GPUs: "
                                            f"{len(overlapped)} of {len(gathers)} all-gathers ran beside forward kernels")


# ---- overlap as a fraction, from the Timeline (--timeline: instruments.Timeline, each rank's last step; merged and
# measured by bench/timeline.py's merge and under_phases, the arithmetic bench/offload_gpu.py reports with): on a GPU
# its compute row is the compute stream's kernels, each labelled by the forward or backward unit that launched it,
# and its copies are timed by CUDA events on the copy stream. The gpt2 preset, one rank, bf16.
#
# Gradient copies under backward. A block of gpt2 has 7.08M parameters: its bf16 gradient is 14.2 MB, 0.28 ms at the
# ~50 GB/s a pinned device-to-host copy reaches over PCIe Gen5 x16 (H100/H200 SXM hosts; NVLink-C2C on a GH200 is
# ~8x faster). Its backward is ~4 x 7.08M FLOPs per token x 6,144 tokens (24 x 256) = 1.8e11 FLOPs: 0.46 ms at 400
# TFLOP/s, about 40% of an H100's dense bf16 peak. So each block's copy can run under the next block's backward, and
# only the copies that begin before backward's last kernel ends can hide at all: the tied embedding's gradient (32%
# of the bytes) is complete only when backward's last kernel is, and the last block's copy has only the embedding's
# backward to hide under (1/12 of the blocks' bytes). Of the copies begun in backward, then, about 11/12 can be
# hidden; "mostly" is 3/4 of their time, which leaves room for the gaps between kernels. And since 68% of the bytes
# are the blocks', at least half the gradient-copy time must begin in backward: a copy issued too late (after
# backward, or behind a wait for the whole gradient) fails that, instead of dropping out of the fraction.
COPIES_UNDER_BACKWARD, COPIES_BEGUN_IN_BACKWARD = 0.75, 0.5
# The C++ AdamW under the next step's forward and backward, with --delayed_update. It moves ~28 bytes per parameter
# (NOTES: memory-bandwidth bound): 124M parameters are 3.5 GB, 35-70 ms at a 16-core host's 50-100 GB/s (on the H200's
# host the small preset's 10.8M took 10.1 ms, overheads included: ~120 ms scaled to gpt2, an upper bound). With
# --grad_accum 16 a step's forward and backward are 6Ψ x 98,304 tokens = 7.3e13 FLOPs: 74 ms even at the 989 TFLOP/s
# peak, ~180 ms at 40% of it. So the update fits inside them; only the traced step's own update, submitted as the
# step ends, lies past its last kernel. "Mostly": more than half.
ADAM_UNDER_FORWARD_BACKWARD = 0.5


def traced(gpu_runner, *flags):
    """offload.py on one GPU with --timeline: the merged trace of its last step."""
    if gpu_runner.fake:
        pytest.skip("overlap is measured on a real GPU's timeline (--gpu)")
    out = gpu_runner.tmp / f"timeline_offload{''.join(flags)}"
    gpu_runner.run(str(ROOT / "offload.py"), 1, *OVERLAP, *flags, "--timeline", str(out), env=ENV)
    return timeline.merge(out)


def copy_fractions(trace):
    """(the share of the gradient copies begun in backward that ran under backward's kernels, the share of all
    gradient-copy time those copies are)."""
    over, begun = timeline.under_phases(trace, "copies", ("backward",), "copy to host", begun_in="backward")
    _, total = timeline.under_phases(trace, "copies", ("backward",), "copy to host")
    return over / begun if begun else 0.0, begun / total if total else 0.0


def test_gpu_offload_gradient_copies_mostly_under_backward(gpu_runner):
    hidden, begun = copy_fractions(traced(gpu_runner))
    assert begun >= COPIES_BEGUN_IN_BACKWARD, f"only {begun:.1%} of the gradient-copy time began during backward"
    assert hidden >= COPIES_UNDER_BACKWARD, f"{hidden:.1%} of the gradient copies begun in backward ran under it"


def test_gpu_delayed_update_mostly_under_forward_and_backward(gpu_runner):
    trace = traced(gpu_runner, "--delayed_update", "--grad_accum", "16", "--batch_size", str(24 * 16))
    over, total = timeline.under_phases(trace, "cpu adam", ("forward", "backward"))
    assert total, "no C++ AdamW in the traced step"
    assert over / total >= ADAM_UNDER_FORWARD_BACKWARD, (f"{over / total:.1%} of the C++ AdamW ran under forward's and "
                                                         f"backward's kernels")


def test_overlap_fractions_on_a_made_up_timeline():
    """The arithmetic the two tests above read, on a trace written by hand (µs): compute of each phase, gradient
    copies, a copy up and the C++ AdamW, on one rank; runs anywhere."""
    x = lambda cat, name, ts, dur: dict(ph="X", cat=cat, name=name, ts=ts, dur=dur, pid=0, tid=0)
    trace = {"traceEvents": [
        x("compute", "forward blocks.0", 0, 100), x("compute", "backward blocks.0", 100, 50),
        x("compute", "backward root", 160, 40), x("compute", "optimizer step", 200, 100),
        x("copies", "copy to host", 120, 40),  # 30 under backward blocks.0, then 10 in the gap [150, 160)
        x("copies", "copy to host", 200, 60),  # begins as backward's last kernel ends: under none of it
        x("copies", "copy to device", 280, 20),  # the other way, under the optimizer step: not a gradient copy
        x("cpu adam", "adam_step", 50, 200)]}  # under forward 50, backward 90; not the optimizer step's 50
    assert timeline.under_phases(trace, "copies", ("backward",), "copy to host") == (30, 100)
    assert timeline.under_phases(trace, "copies", ("backward",), "copy to host", begun_in="backward") == (30, 40)
    assert copy_fractions(trace) == (0.75, 0.4)
    assert timeline.under_phases(trace, "cpu adam", ("forward", "backward")) == (140, 200)
    assert timeline.under_phases(trace, "copies", ("forward", "backward", "optimizer")) == (110, 120)  # both ways
