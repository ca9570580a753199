"""
tests/fake_clock.py: how long the fake CUDA device's work would take on a real GPU, for its modelled clock.

The fake device (tests/fake_cuda.py) runs every op on the host at the host's speed; tests/fake_streams.py keeps a
modelled time per stream and per host thread instead, and asks this file what each piece of work costs, at the rates
of a GPU facts file (tests/gpu_facts_h200.json's "rates", measured on an H200 by tests/gpu_facts.py; another file:
FAKE_CUDA_FACTS=path):
  - a kernel: the larger of its FLOPs at its dtype's matmul rate (torch.utils.flop_counter's formulas: matmuls and
    attention; an op without a formula counts none) and its device tensors' bytes (inputs read, outputs written) at
    the device's copy bandwidth, and never less than a small kernel's device time; a view or an allocation launches
    no kernel and takes none;
  - a copy between device and host: its bytes at the link's rate that way, from or to pinned or pageable memory;
  - a collective: the bytes each GPU sends at the interconnect's rate (an all-reduce 2(N-1)/N of its buffer, an
    all-gather or a reduce-scatter (N-1)/N of the whole buffer, anything else the buffer), at least a small kernel's
    time. Each rank keeps its own clock: a collective starts when its own rank issued it, as if the others had too;
  - on the host: each launch (a kernel, a copy, a collective) costs small_kernel_launch_host_us; the C++ AdamW its
    parameters at the GPU machine's host rate (bench/bench_adam.py's), its sum of squares the gradient's bytes at that
    host's memory bandwidth.
The host's own time (FAKE_CUDA_HOST): "measured" (the default), the real time each thread runs less the time the fake
device spends in its own work (the math, its checks, the host's real waits for gloo and for other threads); "ideal",
none at all and a launch a nanosecond (which keeps the launches in order): the host queues all it can at once, as a
host far ahead of a busy GPU does, and the schedule is the same on every machine (the tests' mode). The C++ AdamW
keeps its modelled time in both. Not modelled: NVMe transfers (a
thread's own time), contention between streams for the same bandwidth, the GPU's clocks.
"""
import json, os, statistics, subprocess, sys, tempfile

import torch
from torch.utils.flop_counter import flop_registry

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FACTS = os.environ.get("FAKE_CUDA_FACTS") or os.path.join(ROOT, "tests", "gpu_facts_h200.json")
HOST = os.environ.get("FAKE_CUDA_HOST", "measured")
if HOST not in ("measured", "ideal"):
    raise SystemExit(f"error: FAKE_CUDA_HOST={HOST!r}: set it to 'measured' (the host's own time) or 'ideal' (none)")
IDEAL = HOST == "ideal"


def load_rates(path):
    with open(path) as f:
        rates = json.load(f).get("rates")
    if not rates or "error" in rates or "skipped" in rates:
        raise SystemExit(f"error: {path} has no measured 'rates': run `python tests/gpu_facts.py {path}` on a GPU")
    return rates


RATES = load_rates(FACTS)
# the host's cost of one launch; the ideal host's is a nanosecond, which keeps its launches in order
LAUNCH = 1e-9 if IDEAL else RATES["small_kernel_launch_host_us"] * 1e-6
SMALL = RATES["small_kernel_device_us"] * 1e-6  # the device's time for a kernel too small to matter
aten = torch.ops.aten
# the CPU's attention kernels, counted by the formulas of the GPU's flash attention (the kernels a GPU runs instead)
ATTENTION = {aten._scaled_dot_product_flash_attention_for_cpu: aten._scaled_dot_product_flash_attention,
             aten._scaled_dot_product_flash_attention_for_cpu_backward:
                 aten._scaled_dot_product_flash_attention_backward}
NO_KERNEL = (aten.empty.memory_format, aten.empty_strided.default, aten.new_empty.default,
             aten.new_empty_strided.default, aten.empty_like.default, aten.lift_fresh.default, aten.is_pinned.default)


def nbytes(t):
    return t.numel() * t.element_size()


def flops(func, args, kwargs, out):
    """func's FLOPs by torch's own formula (torch.utils.flop_counter), 0 where it has none."""
    packet = ATTENTION.get(func._overloadpacket, func._overloadpacket)
    formula = flop_registry.get(packet)
    if formula is None:
        return 0
    if packet in ATTENTION.values():  # (query, key, value) forward; (grad_out, query, key, value) backward
        args = args[:4] if "backward" in str(packet) else args[:3]
        return formula(*args, out_val=out)
    return formula(*args, **kwargs, out_val=out)


def matmul_rate(tensors):
    """FLOP/s for work on these tensors: bf16's rate for 16-bit floats, fp32's (without TF32) for the rest."""
    half = any(t.dtype in (torch.bfloat16, torch.float16) for t in tensors)
    return 1e12 * RATES["matmul_bfloat16_tflops" if half else "matmul_float32_tflops"]


def work(func, args, kwargs, out, device_tensors, *, ends=None):
    """What a device op is on a GPU: (seconds, name, kind: "kernel" or "gpu_memcpy"), or None if it launches nothing.
    ends: (source, destination) of a copy between device and host, as tagged ("cuda:i", "pinned", "cpu")."""
    if func.is_view or func in NO_KERNEL:
        return None
    moved = sum(nbytes(t) for t in device_tensors)
    if ends is not None:
        return copy(ends, max(nbytes(t) for t in device_tensors))
    seconds = max(flops(func, args, kwargs, out) / matmul_rate(device_tensors),
                  moved / (RATES["device_copy_gb_s"] * 1e9), SMALL)
    return seconds, str(func._overloadpacket).replace("aten.", "aten::"), "kernel"


def copy(ends, size):
    """A copy of `size` bytes between device and host: (seconds, name as CUPTI names it, "gpu_memcpy")."""
    src, dst = ends
    down = src.startswith("cuda")
    memory = "pinned" if (dst if down else src) == "pinned" else "pageable"
    rate = RATES[f"{'d2h' if down else 'h2d'}_{memory}_gb_s"] * 1e9
    if down:
        name = f"Memcpy DtoH (Device -> {memory.capitalize()})"
    else:
        name = f"Memcpy HtoD ({memory.capitalize()} -> Device)"
    return size / rate, name, "gpu_memcpy"


def collective(name, tensors, world):
    """A collective's seconds on the interconnect: the bytes each GPU sends (the largest of its tensors is the whole
    buffer), at least a small kernel's time."""
    whole = max((nbytes(t) for t in tensors), default=0)
    if name == "all_reduce":
        sent = 2 * (world - 1) / world * whole
    elif name.startswith(("all_gather", "reduce_scatter")):
        sent = (world - 1) / world * whole
    else:
        sent = whole if world > 1 else 0
    return max(sent / (RATES["nvlink_gb_s"] * 1e9), SMALL)


def adam(params):
    """The C++ AdamW's seconds for `params` parameters on the GPU machine's host."""
    return params / RATES["host_adamw_params_per_s"]


def host_read(nbytes_read):
    """Seconds for the host to read these bytes (the C++ sum of squares)."""
    return nbytes_read / (RATES["host_touch_gb_s"] * 1e9)


def modelled_step(script, *args, nproc=1, host="ideal", facts=None, timeout=3600):
    """The modelled seconds of one steady training step of `script` (a stage file) run with `args` on the fake
    device, on rank 0's clock: the median, over its steps after the first two (step 0 makes Adam's moments), of the
    time from the end of one step to the end of the next, each end the moment every stream and host thread is done.
    host: "ideal" or "measured" (FAKE_CUDA_HOST); facts: a GPU facts file (default: the H200's). Give --steps 4 or
    more. Raises with the run's last lines if it fails. For example, stage 0 at gpt2-xl's width, 2 of its 48 layers:
        modelled_step("stage0_ddp.py", "--preset", "gpt2-xl", "--n_layer", "2", "--batch_size", "4", "--dtype",
                      "bf16", "--steps", "4", "--eval_every", "1000", "--sample_chars", "0", "--no_progress")
    (scaling by depth is the caller's: the step of L layers less the step of 2, over L - 2, is a layer's time.)"""
    with tempfile.TemporaryDirectory() as out:
        env = dict(os.environ, FAKE_CUDA_HOST=host, FAKE_CUDA_FINDINGS=out, CUDA_VISIBLE_DEVICES="")
        env["FAKE_CUDA_FACTS"] = facts or FACTS
        fake = [os.path.join(ROOT, "tests", "fake_cuda.py"), os.path.join(ROOT, script), *args]
        launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"] if nproc > 1 else []
        p = subprocess.run([sys.executable, *launcher, *fake], capture_output=True, text=True, cwd=ROOT, env=env,
                           timeout=timeout)
        report = os.path.join(out, "rank0.json")
        if p.returncode != 0 or not os.path.exists(report):
            tail = "\n".join((p.stdout + p.stderr).strip().splitlines()[-15:])
            raise RuntimeError(f"{script} on the fake device failed (exit code {p.returncode}):\n{tail}")
        with open(report) as f:
            ends = json.load(f)["clock"]["step_ends_s"]
    if len(ends) < 4:
        raise ValueError(f"{len(ends)} steps ran: give --steps 4 or more (the first two are not steady)")
    return statistics.median(b - a for a, b in zip(ends[1:], ends[2:]))
