"""
bench/largest.py: the ZeRO papers' headline, measured: the largest GPT each stage trains within a fixed memory per rank.

    python bench/largest.py                    # every stage at N = 1, 2, 4 within 64 MiB per rank
    python bench/largest.py --quick            # 24 MiB, GPTs 128 wide (tests/test_largest.py)
    python bench/largest.py --budget_mb 8192 --n_embd 1024 --block_size 1024     # on GPUs
    python bench/largest.py --quick --checkpoint_activations --beside runs/largest/largest.json   # blocks checkpointed
    python bench/largest.py --from_json runs/largest/largest.json                # redraw the table and picture only
    python bench/largest.py --limit host --world_sizes 1 --checkpoint_activations   # offload beside its NVMe tier

"Fits" is measured, never computed. For a stage and N, N ranks build a GPT of a fixed width (--n_embd) and a given
depth exactly as the stage's main() builds it (train_gpt.build_model: stage 3 and offload from the meta device, a
unit at a time) and train two steps of --micro_batch sequences per rank; the depth fits if on every rank the memory
held at its peak, over the construction and both steps, stays within --budget_mb. That peak is counted above what the
rank held before the model was built, after a warm-up (so cuBLAS's workspaces, 8-32 MiB each, are not charged): on a
GPU the allocator's peak (torch.cuda.max_memory_allocated), run uncapped; on a CPU the peak of live tensor bytes
(instruments.PeakMemory) less offload's host-resident states (train_gpt.host_categories and the staging buffer), which
a GPU would not hold either.

The ranks take every decision together, or one would enter a collective the others skip and wait there forever. What
a rank reads alone is agreed once, before the first probe: the host memory available and the GPU's free memory (the
least of any rank) and the activations measured (the most). Each probe ends at one all-reduce where every rank brings
its charged peak, whether it ran out of memory, and the seconds it took; all leave with the worst of each, so all
take the same verdict and time limit, and probe the same next depth. Building the GPT runs no collective: a rank that
runs out of memory there says so at an all-reduce right after it, and every rank ends the probe ("does not fit").
Inside the engine and its steps the others may already wait in a collective that rank will never join, and no
agreement can reach them: at N > 1 that rank ends the run with one line (torch.multiprocessing then stops the
others); at N = 1 the error is the verdict. So that this stays rare, on a GPU at N > 1 a depth whose formula (model
states and activations) needs more than 90% of the GPU's free memory is refused without running, as is, with
offload, a depth whose host states need more host memory than the node has available (the kernel's out-of-memory
killer, not an exception, is what meets that). Each row names the limit its search hit: device memory, host memory,
or time (--probe_seconds).

"predicted" is the estimator: the paper's formula for the model states a rank keeps on the device
(train_gpt.model_state_theory) plus the activations measured (what autograd saves for backward in one forward of the
rank's micro-batch, linear in depth; with --checkpoint_activations, what autograd keeps then, each block's input, plus
one block's activations, which its recompute makes again in backward). It leaves out what the measurement charges
besides: gradient buckets in flight and their fp32 copies at the step (stages 0-2: up to two --bucket_mb buckets),
stage 3's working set (the units gathered at once), allocator-level transients. The search starts at the prediction
and walks to the boundary (steps doubling, then bisection), so a good prediction costs few probes. Near the boundary a
probe's peak can differ by a few hundred KiB between runs (when the collectives' asynchronous buffers are freed), so a
result can move by a layer; for stages 1-2 at N > 1 on shared cores by more, so their rows can move
by two or three.

--checkpoint_activations builds every GPT with the switch (train_gpt.GPT: each block under torch.utils.checkpoint),
as train_gpt's option of the same name does; its results go to runs/largest_checkpointed/ unless --out_dir says.
--beside FILE.json (a largest.json of the other setting) adds its largest depth and Ψ to each row, and the ratio.

--limit host makes --budget_mb the host's memory, for offload's rows (default: offload, and offload_nvme: offload.py
--offload_optimizer nvme, its state file under --nvme_path or a temporary directory): ZeRO-Infinity's headline, the
largest model when host memory, not the GPU's, is the limit. Measured on a CPU: the peak of live tensor bytes less
the device-resident states (the parameter shard), so that the transients (activations, the working set, a gathered
unit) are charged to the host too, more than a GPU's host would hold; plus the NVMe tier's buffers, mapped memory
the allocator never sees. With checkpointed activations the transients stay small beside the states.

Output: a table, largest.png (the papers' max-model-size figure in miniature) and largest.json in --out_dir; --out
FILE.json writes the rows as well: one per stage and N, with "stage", "world_size", "largest_params",
"predicted_params".
"""
import argparse, contextlib, gc, io, json, os, shutil, sys, tempfile, time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

SCRIPTS = {"stage0": "stage0_ddp.py", "stage1": "stage1.py", "stage2": "stage2.py", "stage3": "stage3.py",
           "offload": "offload.py", "offload_params": "offload.py", "offload_nvme": "offload.py"}
NVME_BUFFERS = 3  # offload_nvme's --nvme_buffer_count (offload.py's default)
# a row's options beyond its file's defaults (offload_nvme's --nvme_path: a temporary directory, or --nvme_path's)
FLAGS = {"offload_params": ["--offload_params"],
         "offload_nvme": ["--offload_optimizer", "nvme", "--nvme_buffer_count", str(NVME_BUFFERS)]}
MiB = 2**20
MAX_LAYERS = 4096


def load_engine(stage):
    """The Engine class a stage file runs: the last name in it ending in Engine (offload.py's OffloadEngine)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location(stage, ROOT / SCRIPTS[stage])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return [v for k, v in vars(module).items()
               if k.endswith("Engine") and isinstance(v, type) and v.__module__ == module.__name__][-1]


def n_params(cfg):
    """Ψ of the GPT with this config (the tied head counted once), from the meta device: no memory."""
    import torch
    from train_gpt import GPT
    with torch.device("meta"):
        return sum(p.numel() for p in GPT(cfg).parameters())


def engine_stage(row):
    """(the stage whose memory model a row follows, whether its parameter shard is in host memory, whether its
    optimizer states are on NVMe)."""
    return {"offload_params": ("offload", True, False), "offload_nvme": ("offload", False, True)}.get(row, (row, False, False))


def device_states(stage, psi, world_size, param_bytes):
    """The formula's model-state bytes a rank keeps on the device (offload's host categories are not charged, nor
    what the NVMe tier keeps on disk)."""
    from train_gpt import host_categories, model_state_theory
    stage, offload_params, _ = engine_stage(stage)
    padded = psi if stage == "stage0" else -(-psi // world_size) * world_size
    states = model_state_theory(stage, padded, world_size, param_bytes)
    return sum(v for k, v in states.items() if k not in host_categories(stage, offload_params))


def host_states(stage, psi, world_size, param_bytes, cuda, largest_bucket):
    """The bytes a rank keeps in host memory by the formula: offload's fp32 master and moments (pageable; with the
    NVMe tier, NVME_BUFFERS buffers of the largest bucket's states instead), its gradient shard, staging buffer and
    (--offload_params) parameter shard, pinned with CUDA and then rounded up to a power of two by PyTorch's
    pinned-memory cache (instruments.pinned_theory)."""
    from instruments import pinned_theory
    from nvme import nvme_buffer_bytes
    stage, offload_params, nvme = engine_stage(stage)
    if stage != "offload":
        return 0
    padded = -(-psi // world_size) * world_size
    pinned = (pinned_theory(stage, padded, world_size, param_bytes, offload_params) if cuda
              else (2 + offload_params) * param_bytes * padded // world_size)
    if nvme:
        return nvme_buffer_bytes(NVME_BUFFERS, -(-largest_bucket // world_size) * world_size, world_size) + pinned
    return 12 * padded // world_size + pinned


def refused(cuda, world_size, host_needs, host_budget, device_needs, device_free):
    """The limit a depth is refused for without running it (None: probe it): on a GPU, host states beyond the host
    memory available; at N > 1, a formula beyond 90% of the GPU's free memory (only an out-of-memory error would say
    more, and on one rank alone it hangs the others). On a CPU the probes are small: none is refused."""
    if cuda and host_budget is not None and host_needs > host_budget:
        return "host memory"
    if cuda and world_size > 1 and device_needs > 0.9 * device_free:
        return "device memory"
    return None


def host_available():
    """Host memory available now (MemAvailable), or None where /proc/meminfo does not say."""
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        return None


# ----------------------------------------------------------------------------------------------------------------
# On each rank

class Prober:
    """Builds and trains GPTs of growing depth on this rank, as every rank does in step: all ranks probe the same depth
    and agree on whether it fit (the worst rank's verdict wins)."""

    def __init__(self, opts, rank, world_size, device):
        import torch
        import torch.distributed as dist
        from devices import from_rank0, pick_dtype
        from train_gpt import CharData, load_text
        self.opts, self.rank, self.world_size, self.device = opts, rank, world_size, device
        self.dtype, why = from_rank0(pick_dtype(opts.dtype, device) if rank == 0 else None)
        self.dtype_name = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[self.dtype]
        self.data = CharData(load_text(None), opts.block_size)
        self.budget, self.said = opts.budget_mb * MiB, {}
        # offload_nvme's state files: under --nvme_path, or a temporary directory of this rank's own, made by its
        # first probe (nvme_dir)
        self.nvme_path = opts.nvme_path
        self.temporary = None
        # host memory: what the node has available at the start, shared by its ranks (less a margin for the process
        # itself); a probe whose formula needs more is refused before it runs, since the kernel's out-of-memory
        # killer, not an exception, is what running out of host memory meets
        avail = opts.host_budget_mb * MiB if opts.host_budget_mb else (host_available() or 0) * 0.9 - 4 * 2**30
        self.host_budget = max(avail, 0) / (1 if opts.host_budget_mb else world_size) if avail else None
        if rank == 0:
            print(f"N={world_size}: {self.dtype_name} ({why})", flush=True)
        self.device_free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else None
        self.warm_up()
        self.act = {ckpt: self.saved_bytes(ckpt) for ckpt in {False, opts.checkpoint_activations}}
        # each rank read these alone; the searches decide from them (the first depth, a depth refused unrun), so every
        # rank must hold the same: the least memory any rank has, the most activations any rank measured
        inf = float("inf")  # (no reading: no limit)
        least = self.agree([inf if self.host_budget is None else self.host_budget,
                            inf if self.device_free is None else self.device_free], dist.ReduceOp.MIN)
        self.host_budget = least[0] if least[0] < inf else None
        self.device_free = least[1] if least[1] < inf else None
        keys = sorted(self.act)  # [False], or [False, True] with --checkpoint_activations
        most = self.agree([b for k in keys for b in self.act[k]], dist.ReduceOp.MAX)
        self.act = {k: [int(most[2 * i]), int(most[2 * i + 1])] for i, k in enumerate(keys)}

    def nvme_dir(self):
        """Where offload_nvme's state files go: --nvme_path, or this rank's temporary directory (made once)."""
        if self.nvme_path is None and self.temporary is None:
            self.temporary = tempfile.mkdtemp(prefix=f"largest_nvme_rank{self.rank}_")
        return self.nvme_path or self.temporary

    def agree(self, values, op):
        """`values` reduced over the ranks with `op` (dist.ReduceOp.MIN or MAX): the same numbers on every rank. Every
        rank must call it at the same point, with as many values."""
        import torch
        import torch.distributed as dist
        numbers = torch.tensor([float(v) for v in values], dtype=torch.float64, device=self.device)
        dist.all_reduce(numbers, op=op)
        return numbers.tolist()

    def warm_up(self):
        """One forward and backward of a one-layer GPT of this width: what a first matmul allocates for good (cuBLAS's
        workspaces) is then held before any probe's baseline."""
        import torch
        from train_gpt import GPT
        model = GPT(self.config(1)).to(self.device, self.dtype)
        model(*self.data.batch("train", 0, self.opts.micro_batch, 0, 1, self.device)).backward()
        del model
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def params(self, depth):
        """Ψ at `depth` layers: linear in depth (every block alike), so two GPTs on the meta device give them all."""
        if not hasattr(self, "psi"):
            self.psi = [n_params(self.config(d)) for d in (1, 2)]
        return self.psi[0] + (depth - 1) * (self.psi[1] - self.psi[0]) if depth else 0

    def largest_bucket(self, depth):
        """The elements of offload's largest bucket at `depth` layers: a block's, or the root's (the rest)."""
        self.params(1)
        block = self.psi[1] - self.psi[0]
        return max(block, self.psi[0] - block)

    def host_bytes(self, stage, depth):
        """The formula's host-resident model states of a rank at `depth` layers (offload's rows; else 0)."""
        param_bytes = 4 if self.dtype_name == "fp32" else 2
        return host_states(stage, self.params(depth), self.world_size, param_bytes, self.device.type == "cuda",
                           self.largest_bucket(depth))

    def states_bytes(self, stage, depth):
        """The formula's model states in the budgeted memory at `depth` layers (the device's, or with --limit host
        the host's)."""
        if self.opts.limit == "host":
            return self.host_bytes(stage, depth)
        return device_states(stage, self.params(depth), self.world_size, 4 if self.dtype_name == "fp32" else 2)

    def predicts_fit(self, stage, depth):
        """Whether the estimator says `depth` fits: the formula's model states in the budgeted memory, plus the
        activations measured (with --limit host, charged to the host as the measurement charges them), within the
        budget; with CUDA and offload, also the host states within the host memory available."""
        if self.opts.limit == "host":
            return self.host_bytes(stage, depth) + self.activations(depth) <= self.budget
        on_device = self.states_bytes(stage, depth) + self.activations(depth)
        host_fits = self.device.type != "cuda" or self.host_budget is None or self.host_bytes(stage, depth) <= self.host_budget
        return on_device <= self.budget and host_fits

    def activations(self, depth):
        """Bytes autograd keeps for backward in one forward on this rank's micro-batch (parameters aside), at `depth`
        layers: linear in depth (every block saves alike), so measured once, at depths 1 and 2, on a plain GPT. With
        --checkpoint_activations, what it keeps then (each block's input, saved by the checkpoint) plus one block's
        activations (the plain GPT's per block), which a block's recompute makes again during its backward."""
        kept = self.act[self.opts.checkpoint_activations]
        one_block = (self.act[False][1] - self.act[False][0]) * self.opts.checkpoint_activations
        return kept[0] + (depth - 1) * (kept[1] - kept[0]) + one_block

    def saved_bytes(self, checkpoint_activations):
        """[at depth 1, at depth 2]: the bytes autograd keeps for backward in one forward (parameters aside)."""
        import torch
        from instruments import storage_bytes
        from train_gpt import GPT
        out = []
        x, y = self.data.batch("train", 0, self.opts.micro_batch, 0, 1, self.device)
        for d in (1, 2):
            model, saved = GPT(self.config(d), checkpoint_activations).to(self.device, self.dtype), []
            weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
            keep = lambda t: saved.append(t) if t.untyped_storage().data_ptr() not in weights else None  # noqa: E731
            with torch.autograd.graph.saved_tensors_hooks(lambda t: keep(t) or t, lambda t: t):
                loss = model(x, y)
            out.append(storage_bytes(saved))
            del model, loss
        return out

    def config(self, depth):
        from train_gpt import GPTConfig
        o = self.opts
        return GPTConfig(block_size=o.block_size, vocab_size=len(self.data.chars), n_layer=depth, n_head=o.n_head, n_embd=o.n_embd)

    def probe(self, Engine, stage, depth):
        """(fits, charged peak in bytes, limit, seconds): build the GPT of `depth` layers and train 2 steps. The peak
        and the seconds are the most of any rank's, the verdict the worst: the same on every rank."""
        import torch
        import torch.distributed as dist
        from instruments import PeakMemory
        from options import parse_args
        from train_gpt import GPTConfig, PRESETS, build_model
        flags = FLAGS.get(stage, []) + ["--nvme_path", self.nvme_dir()] * engine_stage(stage)[2]
        args = parse_args(Engine, PRESETS, GPTConfig, ["--dtype", self.dtype_name, "--steps", "2", "--warmup", "1",
                                                       "--batch_size", str(self.opts.micro_batch * self.world_size),
                                                       *flags])
        param_bytes, cuda = 4 if self.dtype_name == "fp32" else 2, self.device.type == "cuda"
        limit = refused(cuda, self.world_size, self.host_bytes(stage, depth),
                        self.host_budget, device_states(stage, self.params(depth), self.world_size, param_bytes)
                        + self.activations(depth), self.device_free)
        if limit:  # every rank computes the same verdict from the same (agreed) numbers: no collective needed
            return False, 0, limit, 0.0
        t0 = time.perf_counter()
        gc.collect()
        # What lives now outlives this probe (the imports, the prober and its data): the collector's permanent
        # generation. This probe's collections and its peak meter's walk of the live tensors skip it, which on a CPU
        # halves a probe's time; the bytes charged are the same (peak less base, and none of it is freed here).
        gc.freeze()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        model = None
        out_of_memory, held = False, dict(host=0, device=0, mapped=0)
        with PeakMemory(self.device) as meter:
            try:
                torch.manual_seed(args.seed + self.rank)
                model = build_model(Engine, self.config(depth), self.device, self.dtype,
                                    self.opts.checkpoint_activations)
            except torch.OutOfMemoryError:
                out_of_memory = True
            # building ran no collective, so every rank meets here: if one ran out of memory, all end the probe
            out_of_memory = self.agree([out_of_memory], dist.ReduceOp.MAX)[0] > 0
            if not out_of_memory:
                try:
                    held = self.train(Engine, stage, model, args)
                except torch.OutOfMemoryError:
                    if self.world_size > 1:  # the other ranks may wait in a collective this rank never joins
                        raise SystemExit(f"largest: rank {self.rank} ran out of device memory in {stage}'s engine or "
                                         f"steps at {depth} layers, where the other ranks may wait for it in a "
                                         f"collective: the run stops (at --world_sizes 1 the error is a verdict)")
                    out_of_memory = True
        del model
        gc.collect()
        if self.device.type == "cuda":  # give back the pinned-memory cache too, which keeps freed blocks for reuse
            torch.cuda.empty_cache()
            getattr(torch._C, "_host_emptyCache", lambda: None)()
        if self.opts.limit == "host":
            # the host's peak: the rank's peak less its device-resident states (the activations and the working set,
            # transient, stay charged: more than a GPU's host would hold), plus the NVMe tier's buffers, mapped memory
            # the allocator never sees
            charged = meter.peak - meter.base - held["device"] + held["mapped"]
        else:
            charged = meter.peak - meter.base - (held["host"] - held["mapped"])
        seconds = time.perf_counter() - t0
        # every rank must take the same decisions (the verdict, the time limit, the next depth to probe), or their
        # collectives would not match: the bytes, the verdict and the seconds are the worst rank's
        worst = self.agree([charged, out_of_memory, seconds], dist.ReduceOp.MAX)
        charged = int(worst[0])
        out_of_memory = worst[1] > 0
        seconds = worst[2]
        fits = not out_of_memory and charged <= self.budget
        return fits, charged, None if fits else f"{self.opts.limit} memory", seconds

    def train(self, Engine, stage, model, args):
        """The stage's engine around `model`, trained 2 steps; on a CPU, the bytes of the model states it then holds
        in host memory (offload's: host), on the device (device), and of those in host memory, the NVMe tier's
        mapped buffers (mapped); else 0s."""
        from instruments import storage_bytes
        from train_gpt import host_categories, train_step
        with contextlib.redirect_stdout(io.StringIO()) if self.said.get(stage) else contextlib.nullcontext():
            engine = Engine(model, args, self.device)  # (what an engine prints, such as offload's cpu_adam line: once)
        self.said[stage] = True
        held = dict(host=0, device=0, mapped=0)
        try:
            for step in range(2):
                train_step(engine, self.data, args, step, self.device)
            if self.device.type == "cpu":
                base_stage, offload_params, nvme = engine_stage(stage)
                states = engine.model_states()
                on_host = host_categories(base_stage, offload_params, nvme)
                held["host"] = storage_bytes([t for k in on_host for t in states[k]]
                                             + [getattr(engine, "staging", None)] * (base_stage == "offload"))
                held["device"] = storage_bytes([t for k in states if k not in on_host for t in states[k]])
                held["mapped"] = storage_bytes(states.get("nvme_buffers", []))
        finally:
            # the NVMe tier's state file goes (offload's engines close; the others have nothing to)
            if hasattr(engine, "close"):
                engine.close()
            # the engine's gradient hooks on its parameters hold the engine, a cycle torch's collector never frees (it
            # passes through the parameters' C++ side): the engine, with every buffer and state it holds, would stay
            # on the device through every later probe, which would run out of memory early. It lets go of all here.
            vars(engine).clear()
        return held

    def search(self, stage):
        """The largest depth that fits, and the estimator's: a row of the table."""
        Engine = load_engine(stage)
        param_bytes = 4 if self.dtype_name == "fp32" else 2
        seen, limits = {}, {}
        cuda = self.device.type == "cuda"

        def fits(depth):
            if depth not in seen:
                ok, charged, limit, seconds = self.probe(Engine, stage, depth)
                if ok and self.opts.probe_seconds and seconds > self.opts.probe_seconds:
                    limits["time"] = depth  # it fits, but deeper probes would take longer still: the search stops here
                seen[depth] = ok, charged, limit
                if self.rank == 0:
                    verdict = "fits" if ok else f"does not fit ({limit}" + (": refused before running" * (not charged)) + ")"
                    print(f"  {stage} N={self.world_size}: {depth:4d} layers ({self.params(depth) / 1e6:7.2f}M) "
                          f"{charged / MiB:9.1f} MiB {verdict} ({seconds:.1f} s)", flush=True)
            return seen[depth][0]

        # the estimator: the formula's model states on the device + the activations measured, for each depth
        predicted = 0
        while predicted < MAX_LAYERS and self.predicts_fit(stage, predicted + 1):
            predicted += 1
        # the measurement: from the prediction, out in doubling steps to a depth on each side, then bisect
        lo, hi = 0, None  # the largest depth known to fit; the smallest known not to
        start, step = max(predicted, 1), 1
        if fits(start):
            lo = start
            while hi is None and lo < MAX_LAYERS and "time" not in limits:
                d = min(lo + step, MAX_LAYERS)
                lo, hi = (d, hi) if fits(d) else (lo, d)
                step *= 2
        else:
            hi = start
        while hi is not None and hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid)
        peak = seen[lo][1] if lo else None
        # what stopped it: the first depth beyond the largest that did not fit, or the time a probe took
        limit = seen[hi][2] if hi in seen else "time" if "time" in limits else f"{MAX_LAYERS} layers"
        return dict(stage=stage, world_size=self.world_size, largest_params=self.params(lo) if lo else 0, limit=limit,
                    host_gib=round(self.host_bytes(stage, lo) / 2**30, 2),
                    predicted_params=self.params(predicted) if predicted else 0, largest_layers=lo,
                    predicted_layers=predicted, peak_mib=peak and round(peak / MiB, 2),
                    states_mib=round(self.states_bytes(stage, lo) / MiB, 2) if lo else None, probes=len(seen))


def worker(local_rank, world_size, port, opts, out):
    os.environ.update(RANK=str(local_rank), LOCAL_RANK=str(local_rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch
    import torch.distributed as dist
    from devices import init_distributed
    if opts.device != "cuda":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    rank, world_size, device = init_distributed(argparse.Namespace(device=opts.device))
    prober = Prober(opts, rank, world_size, device)
    rows = []
    for stage in opts.stages:
        rows.append(prober.search(stage))
        rows[-1].update(dtype=prober.dtype_name, device=device.type)
    if rank == 0:
        Path(out).write_text(json.dumps(rows))
    if prober.temporary:
        shutil.rmtree(prober.temporary)
    dist.barrier()
    dist.destroy_process_group()


def run_world(world_size, opts):
    """Start N ranks (one per GPU with CUDA), each searching every stage; return rank 0's rows. A rank that exits
    (with its own line) stops the others, and the run."""
    import torch.multiprocessing as mp
    from devices import free_port
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.json")
        try:
            mp.start_processes(worker, args=(world_size, free_port(), opts, out), nprocs=world_size,
                               start_method="spawn")
        except mp.ProcessExitedException as e:
            raise SystemExit(f"largest: N={world_size} stopped: {e}")
        return json.loads(Path(out).read_text())


# ----------------------------------------------------------------------------------------------------------------
# Report

def result_name(checkpoint_activations, limit):
    """A result's name in runs/ and bench/results: largest, largest_checkpointed, largest_host, ..."""
    return "largest" + "_host" * (limit == "host") + "_checkpointed" * checkpoint_activations


def limit_of(result):
    """The memory a result's budget is: "device", or "host" (a result without the option: device)."""
    return result["options"].get("limit", "device")


def setting(result):
    """How the GPTs of a result were trained: with activation checkpointing or not (results from before it: not)."""
    return "with" if result["options"].get("checkpoint_activations") else "without"


def render_table(result, beside=None):
    """The result's table; with `beside` (a result of the other setting, same budget and GPT), each row also gives the
    largest depth and Ψ there, and this row's Ψ over that one."""
    rows, o = result["rows"], result["options"]
    first = rows[0]["stage"]  # the rows' base: stage 0 (offload with --limit host)
    base = {r["world_size"]: r["largest_params"] for r in rows if r["stage"] == first}
    other = {(r["stage"], r["world_size"]): r for r in (beside or {}).get("rows", [])}
    extra = f" | {setting(beside)} checkpointing: layers | Ψ | × {setting(beside)}" if beside else ""
    lines = [f"largest GPT that trains within {o['budget_mb']} MiB of {limit_of(result)} memory per rank "
             f"({result['dtype']}, {o['n_embd']} wide, "
             f"{o['micro_batch']} x {o['block_size']} tokens per rank, {setting(result)} activation checkpointing; "
             f"{result['machine']})", "",
             f"| stage | N | largest: layers | Ψ | peak MiB | model states (formula) MiB | × {first} at N "
             f"| predicted: layers | Ψ | limit{extra} |", "|" + "---|" * (10 + 3 * bool(beside))]
    for r in rows:
        ratio = f"{r['largest_params'] / base[r['world_size']]:.2f}" if base.get(r["world_size"]) else "—"
        b = other.get((r["stage"], r["world_size"]))
        also = (f" {b['largest_layers']} | {b['largest_params'] / 1e6:.2f}M | "
                + (f"{r['largest_params'] / b['largest_params']:.2f} |" if b["largest_params"] else "— |")
                if b else " — | — | — |") if beside else ""
        lines.append(f"| {r['stage']} | {r['world_size']} | {r['largest_layers']} | {r['largest_params'] / 1e6:.2f}M | "
                     f"{r['peak_mib'] if r['peak_mib'] is not None else '—'} | "
                     f"{r['states_mib'] if r['states_mib'] is not None else '—'} | {ratio} | {r['predicted_layers']} | "
                     f"{r['predicted_params'] / 1e6:.2f}M | {r.get('limit', '—')} |{also}")
    return "\n".join(lines)


def headline(rows, limit="device"):
    """The ratios the papers lead with, measured, beside what the model states alone would give (in the run's dtype);
    the NVMe tier's against offload's where the budget is host memory (`limit`), the one the tier saves."""
    get = {(r["stage"], r["world_size"]): r["largest_params"] for r in rows}
    param = 4 if rows[0].get("dtype", "bf16") == "fp32" else 2  # offload keeps only the parameters on the device
    whole = 2 * param + 12  # stage 0's model states per parameter: parameters, gradients, fp32 master and Adam
    out = []
    if get.get(("stage3", 4)) and get.get(("stage0", 4)):
        out.append(f"stage 3 at N=4 trains {get['stage3', 4] / get['stage0', 4]:.2f}x the parameters of stage 0 at N=4 "
                   f"(the model states alone: {whole}Ψ against {whole}Ψ/N, 4x)")
    if get.get(("offload", 1)) and get.get(("stage0", 1)):
        out.append(f"offload at N=1 trains {get['offload', 1] / get['stage0', 1]:.2f}x the parameters of stage 0 at N=1 "
                   f"(the model states on the device alone: {whole}Ψ against {param}Ψ, {whole / param:.0f}x)")
    if limit == "host" and get.get(("offload_nvme", 1)) and get.get(("offload", 1)):
        ram, disk = 12 + 2 * param, 2 * param  # host bytes a parameter: gradient shard and staging, with(out) the states
        out.append(f"offload with the optimizer states on NVMe at N=1 trains {get['offload_nvme', 1] / get['offload', 1]:.2f}x "
                   f"the parameters of offload at N=1 (the host's model states alone: {ram}Ψ against {disk}Ψ and "
                   f"{NVME_BUFFERS} buffers, {ram / disk:.1f}x)")
    if get.get(("offload_params", 1)) and get.get(("stage0", 1)):
        out.append(f"offload --offload_params at N=1 trains {get['offload_params', 1] / get['stage0', 1]:.2f}x the "
                   f"parameters of stage 0 at N=1 (no model state on the device, only the working set)")
    return out


def draw(result, path):
    """Grouped bars: the largest Ψ per stage at each N, the estimator's prediction as a marker. False without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.lines import Line2D
        from matplotlib.patches import Patch
    except ImportError:
        return False
    rows, o = result["rows"], result["options"]
    stages = [s for s in SCRIPTS if any(r["stage"] == s for r in rows)]
    ns = sorted({r["world_size"] for r in rows})
    colors = dict(zip(SCRIPTS, ["#8C8C8C", "#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3", "#937860"]))
    fig, ax = plt.subplots(figsize=(8.5, 5.4))
    width = 0.8 / len(stages)
    for si, stage in enumerate(stages):
        for gi, n in enumerate(ns):
            r = next((r for r in rows if r["stage"] == stage and r["world_size"] == n), None)
            if r is None:
                continue
            x = gi + (si - (len(stages) - 1) / 2) * width
            ax.bar(x, r["largest_params"] / 1e6, width * 0.92, color=colors[stage])
            top = max(r["largest_params"], r["predicted_params"]) / 1e6  # the label above the bar and its marker
            ax.text(x, top, f"{r['largest_params'] / 1e6:.1f}", ha="center", va="bottom", fontsize=7)
            ax.plot([x], [r["predicted_params"] / 1e6], marker="_", markersize=14, mew=2, color="black")
    ax.set_xticks(range(len(ns)))
    ax.set_xticklabels([f"N = {n}" for n in ns])
    ax.set_ylabel("largest model that trains, parameters (M)")
    ax.grid(axis="y", alpha=0.3)
    ax.set_axisbelow(True)
    ax.set_title(f"Largest GPT within {o['budget_mb']} MiB of {limit_of(result)} memory per rank, measured\n"
                 f"({result['dtype']}, {o['n_embd']} wide, {o['micro_batch']} x {o['block_size']} tokens per rank"
                 f"{', activations checkpointed' * (setting(result) == 'with')})\n{result['machine']}", fontsize=10)
    handles = [Patch(color=colors[s], label=s.replace("stage", "stage ")) for s in stages]
    handles.append(Line2D([], [], color="black", marker="_", linestyle="", markersize=14, mew=2,
                          label="predicted: formula + measured activations"))
    ax.legend(handles=handles, loc="upper left", fontsize=8.5)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return True


def render(result, out_dir, out=None, results=None, beside=None):
    table = render_table(result, beside)
    print("\n" + table + "\n")
    for line in headline(result["rows"], limit_of(result)):
        print(line)
    ratio = []  # with `beside`: stage 3 at N=4 in this setting against the other
    if beside:
        get = {(r["stage"], r["world_size"]): r["largest_params"] for r in beside["rows"]}
        for r in result["rows"]:
            if r["stage"] == "stage3" and r["world_size"] == 4 and get.get(("stage3", 4)):
                ratio.append(f"stage 3 at N=4 {setting(result)} activation checkpointing trains "
                             f"{r['largest_params'] / get['stage3', 4]:.2f}x the parameters it trains {setting(beside)} "
                             f"({r['largest_params'] / 1e6:.2f}M against {get['stage3', 4] / 1e6:.2f}M)")
    for line in ratio:
        print(line)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "largest.json").write_text(json.dumps(result, indent=1) + "\n")
    (out_dir / "table.md").write_text(table + "\n")
    if out:
        Path(out).write_text(json.dumps(result["rows"], indent=1) + "\n")
    drew = draw(result, out_dir / "largest.png")
    if results:  # bench/results/largest.md, headed by the machine, torch, dtype and command; largest.png beside it
        from results import publish  # (bench/, this script's folder)
        name = result_name(setting(result) == "with", limit_of(result))  # each its own block in bench/README
        path = publish(name, table + "\n\n" + "\n".join(headline(result["rows"], limit_of(result)) + ratio), result["dtype"], results)
        if drew:
            shutil.copyfile(out_dir / "largest.png", path.with_suffix(".png"))
    print(f"\nwrote {out_dir / 'largest.json'}, {out_dir / 'table.md'}" + (f" and {out_dir / 'largest.png'}" if drew else
          "; `pip install matplotlib` draws the picture") + (f"; rows in {out}" if out else ""))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.strip().split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n".join(__doc__.strip().split("\n")[2:]))
    p.add_argument("--budget_mb", type=float, default=None, help="memory per rank (default 64; 24 with --quick)")
    p.add_argument("--world_sizes", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--stages", nargs="+", default=[s for s in SCRIPTS if s not in FLAGS], choices=list(SCRIPTS),
                   help="default: every stage file with its defaults (offload_params: offload.py --offload_params)")
    p.add_argument("--n_embd", type=int, default=None, help="the width, fixed (default 256; 128 with --quick)")
    p.add_argument("--n_head", type=int, default=4)
    p.add_argument("--block_size", type=int, default=64)
    p.add_argument("--micro_batch", type=int, default=1, help="sequences per rank per step")
    p.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp16", "fp32"], help="auto: train_gpt's choice")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--quick", action="store_true", help="a small budget and width: under 3 minutes on 2 cores")
    p.add_argument("--host_budget_mb", type=float, default=None, help="host memory per rank for offload's states "
                   "(with CUDA; default: 90%% of what the node has available, less 4 GiB, shared by its ranks)")
    p.add_argument("--probe_seconds", type=float, default=None, help="stop searching deeper once a probe that fits "
                   "takes longer than this (the row's limit is then time)")
    p.add_argument("--checkpoint_activations", action="store_true", help="every GPT with each block checkpointed "
                   "(train_gpt's --checkpoint_activations)")
    p.add_argument("--limit", choices=["device", "host"], default="device", help="the memory --budget_mb is: the "
                   "device's, or (offload's rows, on a CPU) the host's")
    p.add_argument("--nvme_path", default=None, help="offload_nvme's state files (default: a temporary directory)")
    p.add_argument("--out_dir", default=None, help="default: runs/largest (runs/largest_checkpointed with "
                   "--checkpoint_activations)")
    p.add_argument("--out", default=None, metavar="FILE.json", help="also write the rows here")
    p.add_argument("--from_json", default=None, help="redraw from a largest.json written before; run nothing")
    p.add_argument("--beside", default=None, metavar="FILE.json", help="a largest.json of the other setting (with or "
                   "without --checkpoint_activations): its largest depths beside this run's, and the ratios")
    from results import add_flag
    add_flag(p)
    o = p.parse_args(argv)
    beside = json.loads(Path(o.beside).read_text()) if o.beside else None
    if o.from_json:
        result = json.loads(Path(o.from_json).read_text())
        return render(result, o.out_dir or ROOT / "runs" / result_name(setting(result) == "with", limit_of(result)),
                      o.out, o.results, beside)
    if o.limit == "host":
        o.stages = o.stages if "--stages" in (argv or sys.argv) else ["offload", "offload_nvme"]
        if any(engine_stage(s)[0] != "offload" for s in o.stages):
            p.error("--limit host budgets offload's host memory: give --stages from offload, offload_params, offload_nvme")
    o.out_dir = o.out_dir or str(ROOT / "runs" / result_name(o.checkpoint_activations, o.limit))
    o.budget_mb = o.budget_mb or (24 if o.quick else 64)
    o.n_embd = o.n_embd or (128 if o.quick else 256)
    if o.budget_mb <= 0 or min(o.world_sizes) < 1 or o.n_embd % o.n_head:
        p.error("--budget_mb must be > 0, --world_sizes >= 1, and --n_embd a multiple of --n_head")
    import torch
    if o.device == "auto":
        o.device = "cuda" if torch.cuda.is_available() else "cpu"
    if o.device == "cuda" and o.limit == "host":
        p.error("--limit host is measured on a CPU (the host's peak of live tensors): run it with --device cpu")
    if o.device == "cuda" and max(o.world_sizes) > torch.cuda.device_count():
        p.error(f"N = {max(o.world_sizes)} needs as many GPUs; this machine has {torch.cuda.device_count()}: lower --world_sizes")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from bench_adam import cpu_model  # (bench/ is on the path: this script's own folder)
    machine = torch.cuda.get_device_name() if o.device == "cuda" else f"{cpu_model()}, {os.cpu_count()} cores"
    print(f"largest: {o.budget_mb} MiB of {o.limit} memory per rank; stages {' '.join(o.stages)} at N = {' '.join(map(str, o.world_sizes))}"
          f"{'; activation checkpointing' * o.checkpoint_activations}; {machine}", flush=True)
    t0, rows = time.perf_counter(), []
    for n in sorted(set(o.world_sizes)):
        rows += run_world(n, o)
    rows.sort(key=lambda r: (list(SCRIPTS).index(r["stage"]), r["world_size"]))
    result = dict(rows=rows, options={k: getattr(o, k) for k in ("budget_mb", "n_embd", "n_head", "block_size", "micro_batch",
                                                                 "checkpoint_activations", "limit")},
                  dtype=rows[0]["dtype"], machine=machine, seconds=round(time.perf_counter() - t0, 1))
    print(f"largest: {result['seconds']} s")
    render(result, o.out_dir, o.out, o.results, beside)


if __name__ == "__main__":
    main()
