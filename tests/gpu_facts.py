"""The CUDA facts the fake device (tests/fake_cuda.py, fake_memory.py, fake_streams.py) models, read off a real GPU.

    python tests/gpu_facts.py facts.json

Each fact is measured on its own, and one that fails is recorded with its error, so that one run on a lent GPU
reads them all. Without CUDA it writes {"cuda": false} and exits 0 (tests/gpu_check.sh runs it anywhere)."""
import json
import os
import sys
import tempfile
import threading
import time
import traceback
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

MIB = 2**20


def environment():
    """The versions a GPU run depends on."""
    props = torch.cuda.get_device_properties(0)
    return {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "nccl": ".".join(str(v) for v in torch.cuda.nccl.version()),
        "gpu": props.name,
        "capability": list(torch.cuda.get_device_capability(0)),
        "memory_gib": round(props.total_memory / 2**30, 1),
        "gpus": torch.cuda.device_count(),
        "bf16_native": torch.cuda.is_bf16_supported(including_emulation=False),
    }


def matmul_workspace():
    """cuBLAS's workspace counts in memory_allocated: one per (handle, stream); autograd's backward thread has its own
    handle. Each figure is the growth of memory_allocated beyond the tensors made."""
    x = torch.randn(512, 512, device="cuda")
    torch.cuda.synchronize()
    start = torch.cuda.memory_allocated()
    y = x @ x
    torch.cuda.synchronize()
    main_stream = torch.cuda.memory_allocated() - start - y.nbytes
    side = torch.cuda.Stream()
    start = torch.cuda.memory_allocated()
    with torch.cuda.stream(side):
        z = x @ x
    torch.cuda.synchronize()
    side_stream = torch.cuda.memory_allocated() - start - z.nbytes
    w = torch.randn(512, 512, device="cuda", requires_grad=True)
    loss = (w @ x).sum()
    torch.cuda.synchronize()
    start = torch.cuda.memory_allocated()
    loss.backward()
    torch.cuda.synchronize()
    backward_thread = torch.cuda.memory_allocated() - start - w.grad.nbytes
    cleared = None
    if hasattr(torch._C, "_cuda_clearCublasWorkspaces"):
        before = torch.cuda.memory_allocated()
        torch._C._cuda_clearCublasWorkspaces()
        cleared = before - torch.cuda.memory_allocated()
    return {"main_stream_mib": main_stream / MIB, "side_stream_mib": side_stream / MIB,
            "backward_thread_mib": backward_thread / MIB, "freed_by_clearCublasWorkspaces_mib": cleared and cleared / MIB}


def resize_to_zero():
    """ZeRO-3's free: a storage resized to 0 returns its block to the caching allocator at once, and the next
    allocation of that size gets the same address, whatever still references the old storage."""
    t = torch.empty(MIB, device="cuda")
    address = t.data_ptr()
    held = t.untyped_storage()
    before = torch.cuda.memory_allocated()
    t.untyped_storage().resize_(0)
    after = torch.cuda.memory_allocated()
    u = torch.empty(MIB, device="cuda")
    return {"allocated_drop_bytes": before - after, "same_address_reused": u.data_ptr() == address,
            "old_storage_nbytes": held.nbytes()}


def nccl_stream():
    """Which stream NCCL's kernels run on, for a sync and an async all-reduce, beside the current stream's kernels."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    x = torch.ones(MIB, device="cuda")
    dist.all_reduce(x)
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        x.mul_(2)
        dist.all_reduce(x)
        work = dist.all_reduce(x, async_op=True)
        work.wait()
        x.add_(1)
        torch.cuda.synchronize()
    path = Path(tempfile.mkdtemp()) / "trace.json"
    prof.export_chrome_trace(str(path))
    events = json.loads(path.read_text())["traceEvents"]
    kernels = [(e["name"][:60], e["args"].get("stream")) for e in events if e.get("cat") == "kernel"]
    dist.destroy_process_group()
    return {"current_stream": torch.cuda.current_stream().stream_id, "kernels_and_streams": kernels}


def pinned_and_syncs():
    """zeros_like of a pinned tensor is not pinned; torch.tensor(x).to(cuda) synchronizes, torch.full does not."""
    pinned = torch.empty(1024, pin_memory=True)
    torch.cuda.set_sync_debug_mode("warn")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.tensor(3.0).to("cuda")
        from_tensor = len(caught)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.full((), 3.0, device="cuda")
        from_full = len(caught)
    torch.cuda.set_sync_debug_mode("default")
    return {"zeros_like_of_pinned_is_pinned": torch.zeros_like(pinned).is_pinned(),
            "syncs_tensor_to_cuda": from_tensor, "syncs_full_on_cuda": from_full}


def thread_copy():
    """A non_blocking device-to-host copy into pinned memory returns before the data is there (the host must wait on
    an event), and one into pageable memory returns only when done."""
    big = torch.randn(64 * MIB, device="cuda")
    pinned = torch.empty(big.shape, pin_memory=True)
    pageable = torch.empty(big.shape)
    done = torch.cuda.Event()
    torch.cuda.synchronize()
    pinned.copy_(big, non_blocking=True)
    done.record()
    pinned_returned_before_done = not done.query()
    torch.cuda.synchronize()
    pageable.copy_(big, non_blocking=True)
    done.record()
    pageable_returned_before_done = not done.query()
    torch.cuda.synchronize()
    return {"pinned_d2h_returns_early": pinned_returned_before_done,
            "pageable_d2h_returns_early": pageable_returned_before_done, "threads": threading.active_count()}


def attention_determinism():
    """Whether attention's backward (scaled_dot_product_attention, causal, as the GPT calls it) gives the same bits
    twice on the same inputs, per dtype: flash and memory-efficient kernels may accumulate with atomics."""
    import torch.nn.functional as F
    same = {}
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        grads = []
        for _ in range(2):
            torch.manual_seed(0)
            q, k, v = (torch.randn(8, 6, 256, 64, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3))
            F.scaled_dot_product_attention(q, k, v, is_causal=True).square().sum().backward()
            grads.append(torch.cat([q.grad.flatten(), k.grad.flatten(), v.grad.flatten()]))
        same[str(dtype).split(".")[1]] = torch.equal(grads[0], grads[1])
    return {"backward_bit_identical_twice": same}


def timed(fn, repeats):
    """Seconds per call of fn on the GPU, from CUDA events around `repeats` calls after one warm-up call."""
    fn()
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1000 / repeats


def rates():
    """The rates a model of a step's timeline needs: dense matmul (bf16, and fp32 without TF32), the device memory's
    bandwidth (a copy: bytes read plus written), copies between host and device each way from pinned and pageable
    memory, and what one small kernel costs: on the device when the queue is full, and on the host to launch it."""
    if torch.version.cuda is None:
        return {"skipped": "a CPU build of torch (the fake device): its rates would be the host's"}
    torch.backends.cuda.matmul.allow_tf32 = False
    found = {}
    n = 8192
    for dtype in (torch.bfloat16, torch.float32):
        a = torch.randn(n, n, device="cuda", dtype=dtype)
        b = torch.randn(n, n, device="cuda", dtype=dtype)
        seconds = timed(lambda: a @ b, 20)
        found[f"matmul_{str(dtype).split('.')[1]}_tflops"] = round(2 * n**3 / seconds / 1e12, 1)
    big = torch.empty(2**28, device="cuda")
    other = torch.empty_like(big)
    seconds = timed(lambda: other.copy_(big), 20)
    found["device_copy_gb_s"] = round(2 * big.nbytes / seconds / 1e9, 1)
    del other
    pinned = torch.empty(big.shape, pin_memory=True)
    pageable = torch.empty(big.shape)
    pageable.fill_(1.0)
    for name, host in (("pinned", pinned), ("pageable", pageable)):
        found[f"h2d_{name}_gb_s"] = round(big.nbytes / timed(lambda: big.copy_(host, non_blocking=True), 5) / 1e9, 1)
        found[f"d2h_{name}_gb_s"] = round(big.nbytes / timed(lambda: host.copy_(big, non_blocking=True), 5) / 1e9, 1)
    small = torch.zeros(1024, device="cuda")
    # the device time of a kernel too small to matter: what each launch costs the GPU when they queue back to back
    found["small_kernel_device_us"] = round(timed(lambda: small.add_(1), 2000) * 1e6, 2)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(2000):
        small.add_(1)
    found["small_kernel_launch_host_us"] = round((time.perf_counter() - t0) / 2000 * 1e6, 2)
    torch.cuda.synchronize()
    return found


def main():
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "gpu_facts.json")
    if not torch.cuda.is_available():
        out.write_text(json.dumps({"cuda": False}, indent=1))
        print("gpu_facts: no CUDA; nothing measured")
        return
    facts = {"cuda": True}
    probes = (environment, matmul_workspace, resize_to_zero, pinned_and_syncs, thread_copy, attention_determinism,
              rates, nccl_stream)
    for probe in probes:
        try:
            facts[probe.__name__] = probe()
        except Exception:
            facts[probe.__name__] = {"error": traceback.format_exc(limit=3)}
    out.write_text(json.dumps(facts, indent=1))
    print(json.dumps(facts, indent=1))


if __name__ == "__main__":
    main()
