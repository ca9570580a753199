"""
instruments.py: the ledgers and meters every stage is measured with, shared so that the stage files read as the
algorithm: the bytes each collective sends (`comm`), the bytes of the tensors an engine holds, the peak of live
tensor bytes during a step, pinned host memory as PyTorch allocates it, the per-rank memory table a run ends with,
and a profiler timeline of one step (--trace).
"""
import contextlib, gc, os, sys, tempfile, warnings
from collections import defaultdict

import torch
import torch.distributed as dist

from devices import everyone

def pinned_bytes(nbytes):
    """What PyTorch's pinned-memory cache (CachingHostAllocator) takes for a pinned allocation of nbytes: rounded up to
    the next power of two (and kept for reuse once freed). Pageable memory is not rounded."""
    return 1 << (nbytes - 1).bit_length() if nbytes > 0 else 0

def pinned_theory(stage, n_params, world_size, param_bytes=2, offload_params=False, delayed_update=False):
    """Pinned host memory per rank with CUDA, as allocated: ZeRO-Offload pins each buffer a device-host copy touches,
    one allocation of param_bytes·Ψ/N each: the gradient shard (two with --delayed_update), the staging buffer of
    updated parameters, and with --offload_params the parameter shard. (fp32 master and moments stay pageable.)"""
    if stage != "offload":
        return 0
    return (2 + delayed_update + offload_params) * pinned_bytes(param_bytes * n_params // world_size)

class CommLedger:
    """The collectives the stages call, each counting the bytes this rank sends (ring algorithm)."""
    def __init__(self):
        self.sent = defaultdict(float)

    def _ring(self):
        n = dist.get_world_size()
        return (n - 1) / n

    def all_reduce(self, t, op=dist.ReduceOp.AVG, async_op=False):
        self.sent["all_reduce"] += 2 * t.numel() * t.element_size() * self._ring()
        return dist.all_reduce(t, op=op, async_op=async_op)

    def reduce_scatter(self, out, inp, op=dist.ReduceOp.AVG, async_op=False):
        self.sent["reduce_scatter"] += inp.numel() * inp.element_size() * self._ring()
        fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor  # renamed in torch 2.13
        return fn(out, inp, op=op, async_op=async_op)

    def all_gather(self, out, inp, async_op=False):
        self.sent["all_gather"] += out.numel() * out.element_size() * self._ring()
        fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        return fn(out, inp, async_op=async_op)

comm = CommLedger()

def storage_bytes(tensors):
    """Bytes of the distinct storages behind `tensors`: views of one buffer count once."""
    seen = {}
    for t in tensors:
        try:
            s = t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # a tensor subclass with no storage of its own (DTensor)
            continue
        seen[s.data_ptr(), s.device] = s.nbytes()
    return sum(seen.values())

def live_tensor_bytes(device):
    """Every tensor storage Python can reach on `device`, each counted once."""
    with warnings.catch_warnings():  # isinstance() on some deprecated torch objects warns
        warnings.simplefilter("ignore")
        tensors = [o for o in gc.get_objects() if isinstance(o, torch.Tensor)]
    return storage_bytes(t for t in tensors if t.device.type == device.type)

@contextlib.contextmanager
def native_stderr_without(patterns):
    """Around a block, stderr lines (written by C++ too: it is done at the file-descriptor level) that contain one of
    `patterns` are dropped and the others passed on, after the block. The profiler behind PeakMemory prints `USDT:`
    lines and, with several ranks, an allocator warning; both are harmless."""
    sys.stderr.flush()
    saved, captured = os.dup(2), tempfile.TemporaryFile()
    os.dup2(captured.fileno(), 2)
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)
        captured.seek(0)
        lines = captured.read().decode(errors="replace").splitlines(keepends=True)
        sys.stderr.write("".join(ln for ln in lines if not any(p in ln for p in patterns)))
        sys.stderr.flush()

def holdings(model_states, data, device):
    """What this rank holds, in bytes: its model states by category; every other tensor on the device (all live ones
    less the states and the data set there: buffers in flight, leaks); pinned host memory (with CUDA)."""
    on_device = [t for t in sum(model_states.values(), []) + data if t.device.type == device.type]
    return dict(states={k: storage_bytes(v) for k, v in model_states.items()},
                other=live_tensor_bytes(device) - storage_bytes(on_device),
                pinned=torch.cuda.host_memory_stats().get("allocated_bytes.current", 0) if device.type == "cuda" else 0)

class PeakMemory:
    """Peak bytes of live tensors during a `with` block: the CUDA allocator's counter on GPU; on CPU, the
    live bytes at entry plus the highest running sum of the allocations and frees the profiler records
    (RSS would mislead: glibc keeps freed buffers)."""
    def __init__(self, device):
        self.device, self.peak, self.largest = device, 0, 0  # largest: the largest single allocation (CPU only)

    def __enter__(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            self.base = live_tensor_bytes(self.device)
            self.quiet = native_stderr_without(("USDT:", "allocated before the profiling started"))
            self.quiet.__enter__()
            # the autograd profiler itself: torch.profiler.profile would first import torch._inductor (~2 s per rank)
            self.prof = torch.autograd.profiler.profile(use_cpu=True, profile_memory=True, use_kineto=True)
            self.prof.__enter__()
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak = torch.cuda.max_memory_allocated(self.device)
            return
        self.prof.__exit__(*exc)
        self.quiet.__exit__(*exc)
        events = sorted((e.start_ns(), e.nbytes()) for e in self.prof.kineto_results.events()
                        if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU)
        running = highest = 0
        for _, nbytes in events:
            running += nbytes
            highest = max(highest, running)
            self.largest = max(self.largest, nbytes)
        self.peak = self.base + highest

@contextlib.contextmanager
def timeline(trace_dir, rank, device):
    """--trace DIR: a torch.profiler timeline of one step (CPU ops; on a GPU also its kernels and copies, each on its
    stream), forward, backward and step marked, as a Chrome trace per rank: DIR/rank{r}.json (ui.perfetto.dev shows it)."""
    cuda = device.type == "cuda"
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU] + [torch.profiler.ProfilerActivity.CUDA] * cuda) as prof:
        yield
        if cuda:
            torch.cuda.synchronize(device)  # the step's kernels have all run: the timeline holds them
    os.makedirs(trace_dir, exist_ok=True)
    prof.export_chrome_trace(os.path.join(trace_dir, f"rank{rank}.json"))

def memory_table(title, per_rank, peaks, theory, host, sent, sent_theory):
    """What a run ends with: each rank's model states by category beside the formula, its peak, and the bytes it sent
    per step beside the formula. Ranks that hold the same bytes share a row."""
    mib = lambda b: f"{b / 2**20:9.2f}"
    cats = list(theory)
    lines = [f"memory per rank, MiB ({title}; measured on step 1; " + (f"host: {', '.join(host)}" if host else "all on the device") + ")",
             f"{'rank':>8} |" + "".join(f"{c:>9} |" for c in cats) + f"{'states':>9} |{'peak':>9}"]
    rows = [(str(r), s, p) for r, s, p in zip(range(len(per_rank)), per_rank, peaks)]
    if len(rows) > 1 and all(s == per_rank[0] for s in per_rank):
        rows = [(f"0-{len(rows) - 1}", per_rank[0], max(peaks))]  # all ranks equal: one row, the highest peak
    for name, states, peak in rows:
        lines.append(f"{name:>8} |" + "".join(f"{mib(states.get(c, 0))} |" for c in cats)
                     + f"{mib(sum(states.values()))} |{mib(peak)}")
    lines.append(f"{'formula':>8} |" + "".join(f"{mib(theory[c])} |" for c in cats) + f"{mib(sum(theory.values()))} |")
    lines.append(f"sent per step {sum(sent.values()) / 2**20:.2f} MiB (formula {sum(sent_theory.values()) / 2**20:.2f}): "
                 + (", ".join(f"{k} {v / 2**20:.2f}" for k, v in sorted(sent.items())) or "nothing"))
    return "\n".join(lines)

# ----------------------------------------------------------------------------------------------------------
# What a run shows: progress, then its summary and the per-rank memory table.

def progress(steps, start, args, rank):
    """A progress bar on a terminal (rank 0); otherwise the steps themselves, and log() prints a line now and then."""
    if rank == 0 and not args.no_progress and sys.stderr.isatty():
        from tqdm import tqdm
        return tqdm(steps, initial=start, total=args.steps, dynamic_ncols=True)
    return steps

def log(bar, stage, step, end, args, loss, tok_s, peak):
    if hasattr(bar, "set_postfix"):
        bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tok_s:,.0f}", mem=f"{peak / 2**20:.1f}MiB")
    elif not args.no_progress and (step + 1 == end or (step + 1) % max(1, args.steps // 10) == 0):
        print(f"{stage}: step {step + 1}/{args.steps}, loss {loss:.3f}, {tok_s:,.0f} tokens/s", flush=True)

def summarize(stage, args, cfg, data, engine, history, measured, step_times, th, start, end, world_size, device):
    """The run's JSON summary (--out): losses, speed, and every ledger beside its formula; rank 0's, and every rank's
    model states and peak."""
    timed = sorted(step_times[1:] or step_times)  # the first step warms up
    states, sent, ranks = measured["states"], measured["sent"], everyone((measured["states"], measured["peak"]))
    return dict(stage=stage, world_size=world_size, n_params=sum(p.numel() for p in engine.model.parameters()),
                padded_numel=engine.padded_numel, dtype=args.dtype, device=device.type, config=vars(cfg), args=vars(args),
                **history, val_loss=history["val_losses"][-1][1] if history["val_losses"] else None, steps_done=end,
                resumed_from=start, unigram_loss=data.unigram_loss,
                tokens_per_s=args.batch_size * cfg.block_size / timed[len(timed) // 2] if timed else 0.0,
                peak_memory_bytes=measured["peak"], other_tensor_bytes=measured["other"],
                pinned_host_bytes={"measured": measured["pinned"], "theory": th["pinned"]},
                model_state_bytes={k: {"measured": states.get(k, 0), "theory": v, "where": "host" if k in th["host"] else "device"}
                                   for k, v in th["states"].items()},
                model_state_bytes_per_rank=[s for s, _ in ranks], peak_memory_bytes_per_rank=[p for _, p in ranks],
                comm_bytes_per_step={"measured": sum(sent.values()), "theory": sum(th["comm"].values()),
                                     "by_collective": {k: {"measured": sent.get(k, 0.0), "theory": th["comm"].get(k, 0.0)}
                                                       for k in sorted(set(sent) | set(th["comm"]))}})

def report(summary, th):
    """What a run ends with: its loss and speed, then the memory table the project is about."""
    s, val = summary, f"{summary['val_loss']:.4f}" if summary["val_loss"] is not None else "-"
    print(f"{s['stage']}: val loss {val} (unigram {s['unigram_loss']:.3f}), {s['tokens_per_s']:,.0f} tokens/s")
    print(memory_table(f"{s['stage']}, {s['dtype']}, {th['formula']}", s["model_state_bytes_per_rank"],
                       s["peak_memory_bytes_per_rank"], th["states"], th["host"],
                       {k: v["measured"] for k, v in s["comm_bytes_per_step"]["by_collective"].items()}, th["comm"]))
    if th["pinned"]:
        print(f"pinned host memory {s['pinned_host_bytes']['measured'] / 2**20:.2f} MiB (theory {th['pinned'] / 2**20:.2f}: "
              f"PyTorch rounds each pinned allocation up to a power of two)")
