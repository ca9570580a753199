"""
train_gpt.py: the one small GPT every stage trains, its data, its training loop, and the ledgers that
measure each stage against the ZeRO paper's memory model. Run alone, it is the single-device reference:

    python train_gpt.py                                   # the `small` GPT (~10M) on CPU or one GPU
    python train_gpt.py --preset tiny --steps 50          # seconds on a laptop
    python train_gpt.py --data input.txt --dtype fp32     # any UTF-8 text; fp32 for exact comparisons

Every stage file (stage0_ddp.py ... offload.py) imports this file's GPT, data and `main` loop, and brings
only its Engine: the class that holds this rank's model states and moves them. An Engine takes any nn.Module (it
trains the parameters that require a gradient: examples/any_model.py) and has
    forward(*args, **kwargs) -> the model's output     backward(loss, sync)     step(lr) -> global grad norm
    grad(p) -> (lo, view) of the elements [lo, lo + view.numel()) of p's averaged gradient this rank holds
    model_states() -> {category: [tensors]}    state_pieces() -> [(name, lo, hi, [master, m, v views])]
    resume(step)   (a checkpoint has filled the pieces: count the steps, send the weights to the model)
and `padded_numel`, the parameter count its partitioning pads to (Ψ').

Checkpoints (any stage, any world size; see "Checkpoints" below):
    torchrun --standalone --nproc_per_node 4 stage3.py --steps 300 --save_every 50 --ckpt_dir runs/ck --stop_after 150
    torchrun --standalone --nproc_per_node 2 stage1.py --steps 300 --resume runs/ck
    python train_gpt.py --consolidate runs/ck gpt.pt  &&  python train_gpt.py --sample gpt.pt

The recipe (ZeRO paper, section 3): parameters and gradients in --dtype (2 + 2 bytes each in bf16), an fp32
master copy and fp32 AdamW moments in the optimizer (K = 12 bytes): 16Ψ bytes for Ψ parameters.
"""
import argparse, contextlib, gc, glob, hashlib, json, math, os, re, shutil, socket, sys, tempfile, time, warnings
from collections import defaultdict
from dataclasses import dataclass, fields

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

# ----------------------------------------------------------------------------------------------------------
# The model: nanoGPT's decoder (pre-LayerNorm blocks, GELU MLP, LM head tied to the token embedding), without
# biases (nanoGPT's bias=False: a little faster). A key bias, moreover, has an exactly zero true gradient (softmax
# ignores a constant added to a row), so Adam would turn its rounding noise into real steps that differ by stage.

@dataclass
class GPTConfig:
    block_size: int = 256
    vocab_size: int = 0    # at least the corpus's; GPT-2 presets pad it to 50257 so Ψ matches GPT-2's
    n_layer: int = 6
    n_head: int = 6
    n_embd: int = 384

PRESETS = {  # name: (n_layer, n_head, n_embd, block_size, vocab_size)
    "tiny": (2, 2, 64, 64, 0),
    "small": (6, 6, 384, 256, 0),
    "gpt2": (12, 12, 768, 1024, 50257),         # 124M
    "gpt2-medium": (24, 16, 1024, 1024, 50257),  # 350M
    "gpt2-large": (36, 20, 1280, 1024, 50257),   # 774M
    "gpt2-xl": (48, 25, 1600, 1024, 50257),      # 1.5B
}

class CausalSelfAttention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.n_head = cfg.n_head
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=False)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))

class Block(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(cfg.n_embd, bias=False), CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=False)
        self.mlp = nn.Sequential(nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=False), nn.GELU(),
                                 nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=False))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))

class GPT(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=False)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied: one tensor, counted once in Ψ
        for name, p in self.named_parameters():  # GPT-2 init; residual projections scaled by depth
            if p.dim() == 2:
                std = 0.02 / math.sqrt(2 * cfg.n_layer) if name.endswith("c_proj.weight") or name.endswith("mlp.2.weight") else 0.02
                nn.init.normal_(p, mean=0.0, std=std)

    def forward(self, idx, targets=None):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.view(-1))

    @torch.no_grad()
    def generate(self, idx, n_new, temperature=0.8, generator=None):
        for _ in range(n_new):
            logits = self(idx[:, -self.cfg.block_size:])[:, -1, :].float() / temperature
            nxt = torch.multinomial(F.softmax(logits, dim=-1), 1, generator=generator)
            idx = torch.cat([idx, nxt], dim=1)
        return idx

# ----------------------------------------------------------------------------------------------------------
# Data: real text, offline. The default corpus ships with every CPython (the text of its pydoc topics).

def load_text(path):
    if path is None:  # runs of spaces (its indented grammar and tables) collapsed, so samples read as prose
        from pydoc_data.topics import topics
        return re.sub(" {2,}", " ", "\n\n".join(topics[k] for k in sorted(topics)))
    if not os.path.isfile(path):
        raise SystemExit(f"error: --data {path}: no such file; pass a UTF-8 text file, or omit --data for the built-in corpus")
    with open(path, encoding="utf-8") as f:
        return f.read()

class CharData:
    """Character-level tokens, 90/10 train/val split. The global batch of step s depends only on (seed, s)."""
    def __init__(self, text, block_size):
        self.chars = sorted(set(text))
        self.stoi = {c: i for i, c in enumerate(self.chars)}
        ids = torch.tensor([self.stoi[c] for c in text], dtype=torch.uint8 if len(self.chars) <= 256 else torch.int32)
        n = int(0.9 * len(ids))
        self.train, self.val, self.block_size = ids[:n], ids[n:], block_size
        if len(self.val) <= block_size + 1:
            raise SystemExit(f"error: the text has {len(text)} characters, too few for --block_size {block_size}; use a larger file or a smaller --block_size")
        counts = torch.bincount(self.train.long(), minlength=len(self.chars)).double()
        p = counts[counts > 0] / counts.sum()
        self.unigram_loss = float(-(p * p.log()).sum())  # the loss of predicting character frequencies alone

    def batch(self, split, batch_seed, global_batch, part, n_parts, device):
        """Part `part` of `n_parts` equal slices of a global batch drawn from `batch_seed` alone."""
        data = self.train if split == "train" else self.val
        g = torch.Generator().manual_seed(batch_seed)
        ix = torch.randint(len(data) - self.block_size - 1, (global_batch,), generator=g)
        per = global_batch // n_parts
        ix = ix[part * per:(part + 1) * per]
        x = torch.stack([data[i:i + self.block_size] for i in ix]).long()
        y = torch.stack([data[i + 1:i + 1 + self.block_size] for i in ix]).long()
        return x.to(device), y.to(device)

    def decode(self, ids):
        return "".join(self.chars[i] for i in ids if i < len(self.chars))

# ----------------------------------------------------------------------------------------------------------
# The paper's memory and communication model: the formulas every stage measures itself against.

SHARDED = {"reference": (), "stage0": (), "stage1": ("master", "adam_m", "adam_v"),
           "stage2": ("grads", "master", "adam_m", "adam_v"),
           "stage3": ("params", "grads", "master", "adam_m", "adam_v")}
SHARDED["offload"] = SHARDED["stage3"]

def bytes_per_param(param_bytes=2, grad_shards=1):
    """Model-state bytes per parameter by category: 2 + 2 + K (K = 12) in bf16; 4 + 4 + 12 = 20 in fp32. ZeRO-Offload's
    delayed update holds a second gradient shard (grad_shards=2), the one its CPU update reads while the next fills."""
    return {"params": param_bytes, "grads": grad_shards * param_bytes, "master": 4, "adam_m": 4, "adam_v": 4}

def model_state_theory(stage, n_params, world_size, param_bytes=2, grad_shards=1):
    """Bytes per rank by category for Ψ = n_params on N = world_size ranks, the sharded categories divided by N
    (n_params is the padded count, a multiple of N, for sharded stages)."""
    full = {k: b * n_params for k, b in bytes_per_param(param_bytes, grad_shards).items()}
    return {k: v // world_size if k in SHARDED[stage] else v for k, v in full.items()}

def formula_text(stage, param_bytes=2, grad_shards=1):
    """The per-rank formula as the paper writes it: '16Ψ' (stage 0, bf16), '8Ψ + 12Ψ/N' (stage 1, fp32), '16Ψ/N' ..."""
    b = bytes_per_param(param_bytes, grad_shards)
    whole = sum(v for k, v in b.items() if k not in SHARDED[stage])
    shard = sum(v for k, v in b.items() if k in SHARDED[stage])
    return " + ".join([f"{whole}Ψ"] * bool(whole) + [f"{shard}Ψ/N"] * bool(shard))

def host_categories(stage, offload_params=False):
    """The model states ZeRO-Offload keeps in CPU memory (the optimizer's side); the rest stay on the device."""
    if stage != "offload":
        return ()
    return ("grads", "master", "adam_m", "adam_v") + (("params",) if offload_params else ())

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

def comm_theory(stage, n_params, world_size, param_bytes=2, grad_accum=1):
    """Bytes this rank sends per optimizer step, by collective, with ring algorithms: an all-reduce sends
    2(N-1)/N of the tensor, a reduce-scatter or an all-gather (N-1)/N. Gradient accumulation: stages 0
    and 1 reduce once per step (no_sync); stage 2 reduces every micro-step into its shard; stage 3 also
    gathers parameters twice per micro-step (forward and backward)."""
    ring, psi = (world_size - 1) / world_size, n_params * param_bytes
    norm = 2 * 8 * ring  # one float64 scalar all-reduced: the sum of the shards' squared gradient norms
    return {"reference": {}, "stage0": {"all_reduce": 2 * psi * ring},
            "stage1": {"reduce_scatter": psi * ring, "all_gather": psi * ring, "all_reduce": norm},
            "stage2": {"reduce_scatter": grad_accum * psi * ring, "all_gather": psi * ring, "all_reduce": norm},
            "stage3": {"all_gather": 2 * grad_accum * psi * ring, "reduce_scatter": grad_accum * psi * ring, "all_reduce": norm},
            }[stage if stage != "offload" else "stage3"]

# ----------------------------------------------------------------------------------------------------------
# Instrumentation, shared so the stage files read as the algorithm.

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

# ----------------------------------------------------------------------------------------------------------
# Any nn.Module: what an engine trains, and the misuse every engine refuses, each with one line that names the fix.

def trained(model):
    """(name, parameter) for each parameter an engine trains: those that require a gradient, each hooked, bucketed and
    sharded. Frozen parameters and buffers are rank 0's (an engine broadcasts them once) and are left alone."""
    return [(name, p) for name, p in model.named_parameters() if p.requires_grad]

class Misuse:
    OUTSIDE_BACKWARD = ("a gradient arrived outside engine.backward (was loss.backward() called directly?): call "
                        "engine.backward(loss, sync), which arms the engine's hooks and reduces gradients across ranks")
    NO_GRADIENT = ("engine.backward: a trained parameter got no gradient: every parameter that requires grad must take "
                   "part in the loss; freeze the others (requires_grad_(False)) before building the engine")
    NO_BACKWARD = ("engine.step: no engine.backward(loss, sync=True) since the last step: call it on each step's last "
                   "micro-step (sync=False on the ones before)")
    CHANGED = ("engine.forward: the model's trained parameters changed after the engine was built (a module added or "
               "replaced, requires_grad switched): build the engine after the model's last change")

# ----------------------------------------------------------------------------------------------------------
# The reference engine: the recipe on one device, no distribution. Every stage must match it.

class AdamW:
    """AdamW on one fp32 tensor, as torch.optim.AdamW computes it. Per element, at step t:
        p -= lr * weight_decay * p                      (decoupled weight decay: not L2 added to the gradient)
        m = beta1 * m + (1 - beta1) * g ;  v = beta2 * v + (1 - beta2) * g * g
        p -= lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
    Its state is the paper's K = 12 bytes per parameter: the fp32 master it updates, m and v. The step t is counted
    once per call, never per tensor or bucket. It runs torch's fused kernel (the one torch.optim.AdamW(fused=True)
    calls): one pass over memory instead of seven, and no import of torch's compiler, which building
    torch.optim.AdamW costs. It decays every parameter, as torch's default does; nanoGPT spares biases and norms,
    which would split each flat shard into two groups."""
    def __init__(self, param, args, eps=1e-8):
        self.param, self.args, self.eps, self.t = param, args, eps, 0
        self.exp_avg, self.exp_avg_sq = torch.zeros_like(param), torch.zeros_like(param)
        self.step_tensor = torch.zeros((), dtype=torch.float32, device=param.device)  # where the kernel reads t

    @torch.no_grad()
    def step(self, grads, lr):
        """One step over `grads`: (where, fp32 gradient) pairs that cover the tensor, a bucket each, say. Pass a
        generator that makes each bucket's fp32 gradient when asked, and only one exists at a time: no fp32 copy of
        the whole gradient ever does."""
        a, self.t = self.args, self.t + 1
        self.step_tensor.fill_(self.t)
        for where, grad in grads:
            torch._fused_adamw_([self.param[where]], [grad], [self.exp_avg[where]], [self.exp_avg_sq[where]], [],
                                [self.step_tensor], lr=lr, beta1=a.beta1, beta2=a.beta2, weight_decay=a.weight_decay,
                                eps=self.eps, amsgrad=False, maximize=False)
            del grad  # this bucket's fp32 gradient, before the generator makes the next one

def sum_of_squares(t, block=1 << 20):
    """Σ t² over all of t, as a float64 scalar on t's device, accurate at any size. torch.linalg.vector_norm of one
    124M-element fp32 vector is off by 1.3-2.7% on CPU (it accumulates in long runs), while torch.sum reduces
    pairwise: squares summed in fp32 per block of 1M elements, the blocks added in float64, stay within 1e-7. (The
    norm decides the clipping: it must be right at GPT-2 sizes, not only on small models.) One block at a time: its
    fp32 squares (and for bf16 its widened copy) are the only temporaries, never an fp32 copy of all of t."""
    total = torch.zeros((), dtype=torch.float64, device=t.device)
    for part in t.reshape(-1).split(block):
        total += part.float().square().sum()
    return total

class NonFiniteGradNorm(FloatingPointError):
    """The global gradient norm is NaN or infinite: no update may use it (main stops the run with one line)."""

def clip_coef(norm, max_norm):
    """The factor torch.nn.utils.clip_grad_norm_ scales gradients by; --grad_clip 0 means no clipping (as in nanoGPT
    and DeepSpeed: scaling by 0 would silently stop learning). Every stage calls it before its update, so a non-finite
    norm stops the run here, before any NaN reaches the master weights or a checkpoint."""
    if not math.isfinite(norm):  # one host sync per step: the decision to update at all is the host's
        raise NonFiniteGradNorm(f"{float(norm)}")
    return (max_norm / (norm + 1e-6)).clamp(max=1.0) if max_norm > 0 else torch.ones_like(norm)

class SingleDeviceEngine:
    def __init__(self, model, args, device):
        self.model, self.args = model, args
        self.params = [p for _, p in trained(model)]
        self.padded_numel = sum(p.numel() for p in self.params)
        self.master = [p.detach().float().clone() for p in self.params]  # fp32 master weights
        self.optimizers = [AdamW(m, args) for m in self.master]

    def forward(self, *args, **kwargs):
        return self.model(*args, **kwargs)

    def backward(self, loss, sync):
        loss.backward()  # gradients accumulate in p.grad across micro-steps

    def step(self, lr):
        norm = sum(sum_of_squares(p.grad) for p in self.params).sqrt()
        coef = clip_coef(norm, self.args.grad_clip)
        for optimizer, p in zip(self.optimizers, self.params):
            optimizer.step([(slice(None), p.grad.float().mul_(coef))], lr)
        for p, m in zip(self.params, self.master):
            p.data.copy_(m)
            p.grad = None
        return norm

    def grad(self, p):
        return 0, p.grad.view(-1)  # all of p's gradient, from element 0

    def model_states(self):
        return {"params": self.params, "grads": [p.grad for p in self.params if p.grad is not None], "master": self.master,
                "adam_m": [o.exp_avg for o in self.optimizers], "adam_v": [o.exp_avg_sq for o in self.optimizers]}

    def state_pieces(self):
        return [(name, 0, p.numel(), [m.view(-1), o.exp_avg.view(-1), o.exp_avg_sq.view(-1)])
                for (name, p), m, o in zip(trained(self.model), self.master, self.optimizers)]

    def resume(self, step):
        for o in self.optimizers:
            o.t = step
        for p, m in zip(self.params, self.master):
            p.data.copy_(m)

# ----------------------------------------------------------------------------------------------------------
# Checkpoints that any stage at any world size can resume. An engine lists the training state it holds as pieces:
#     (parameter name, [lo, hi) of that parameter's flattened elements, [views of fp32 master, Adam m, Adam v])
# Each rank saves its pieces; as they name parameters, not ranks or buckets, a rank of another stage or world size
# takes the overlaps of the pieces it needs with the pieces saved (DeepSpeed's "universal checkpoint" idea).
# Files are written atomically (temporary file, fsync, rename); rank 0 writes the manifest last, after every shard
# is on disk, and a checkpoint without its manifest does not exist: a crash mid-save leaves the previous one whole.

STATE = ("master", "exp_avg", "exp_avg_sq")  # the K = 12 bytes per parameter, what a checkpoint must not lose
KEEP = 2  # complete checkpoints kept: the newest, and one before it in case the newest is damaged

def everyone(obj):
    """obj from every rank, in rank order (a world of one needs no process group)."""
    if not dist.is_initialized():
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out

def from_rank0(obj):
    """Rank 0's obj, on every rank."""
    if not dist.is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]

def agree(error):
    """Stop every rank with the first rank's error, if any rank has one (a lone exit would hang the others)."""
    errors = [e for e in everyone(error) if e]
    if errors:
        raise SystemExit(errors[0])

def atomic_write(path, write):
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())  # the bytes are on disk before the name points at them
    os.replace(tmp, path)

def fsync_dir(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)  # the renames themselves are on disk
    finally:
        os.close(fd)

def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            h.update(block)
    return h.hexdigest()

def save_checkpoint(ckpt_dir, engine, step, meta, device):
    """Every rank writes its shard of the state after `step` optimizer steps; rank 0 then writes the manifest."""
    rank, world_size = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    where = os.path.join(ckpt_dir, f"step_{step:06d}")
    os.makedirs(where, exist_ok=True)
    pieces = engine.state_pieces()
    held_below = {key for keys in everyone([tuple(p[:3]) for p in pieces])[:rank] for key in keys}
    pieces = [p for p in pieces if tuple(p[:3]) not in held_below]  # replicated state (stage 0) is written once
    shard = {"step": step, "rank": rank, "world_size": world_size, "pieces": [tuple(p[:3]) for p in pieces],
             "rng": torch.get_rng_state(), "cuda_rng": torch.cuda.get_rng_state(device) if device.type == "cuda" else None}
    for i, k in enumerate(STATE):
        shard[k] = torch.cat([p[3][i].detach().cpu() for p in pieces]) if pieces else torch.zeros(0)
    name = f"shard_{rank:05d}_of_{world_size:05d}.pt"
    atomic_write(os.path.join(where, name), lambda f: torch.save(shard, f))
    shards = everyone({"file": name, "bytes": os.path.getsize(os.path.join(where, name)), "sha256": sha256(os.path.join(where, name))})
    if rank == 0:
        fsync_dir(where)
        manifest = dict(format=1, step=step, world_size=world_size, shards=shards, **meta)
        atomic_write(os.path.join(where, "manifest.json"), lambda f: f.write(json.dumps(manifest, indent=1).encode()))
        fsync_dir(where)
        for old in complete_checkpoints(ckpt_dir)[:-KEEP]:  # only now that this one is complete
            shutil.rmtree(old, ignore_errors=True)
    return where

def complete_checkpoints(ckpt_dir):
    """The step directories under ckpt_dir that have a manifest, oldest first."""
    found = sorted(glob.glob(os.path.join(glob.escape(ckpt_dir), "step_*", "manifest.json")))
    return [os.path.dirname(m) for m in found]

def find_checkpoint(path):
    """The step directory `path` names: itself if it holds a manifest, else the newest complete one under it (or None)."""
    return path if os.path.isfile(os.path.join(path, "manifest.json")) else (complete_checkpoints(path) or [None])[-1]

def open_checkpoint(path, cfg, chars, part=(0, 1)):
    """The manifest of the checkpoint at `path` (a step directory, or the newest complete one under it), checked
    against this run's model and data, and its shards (this rank's `part` of them) against their sizes and hashes."""
    where = find_checkpoint(path)
    if where is None:
        raise SystemExit(f"error: {path}: no complete checkpoint there (a checkpoint is complete once its "
                         f"manifest.json is written); check the path (or, to start afresh, drop --resume)")
    try:
        with open(os.path.join(where, "manifest.json")) as f:
            manifest = json.load(f)
        shards = manifest["shards"]
        if manifest["format"] != 1 or len(shards) != manifest["world_size"]:
            raise ValueError("format, or shards against world_size")
    except (ValueError, KeyError, TypeError) as e:
        raise SystemExit(f"error: {where}/manifest.json is not a checkpoint manifest of this program ({type(e).__name__}); "
                         f"resume from another step directory") from None
    if cfg is not None and manifest["config"] != vars(cfg):
        diff = ", ".join(f"{k} {v} (this run: {vars(cfg)[k]})" for k, v in manifest["config"].items() if vars(cfg).get(k) != v)
        raise SystemExit(f"error: {where} holds a different GPT: {diff}; pass the --preset and overrides it was trained with")
    if chars is not None and manifest["chars"] != "".join(chars):
        raise SystemExit(f"error: {where} was trained on another text (its vocabulary differs); pass the --data it was trained with")
    for i in range(len(shards))[part[0]::part[1]]:
        file, problem = os.path.join(where, shards[i]["file"]), None
        if not os.path.isfile(file):
            problem = "is missing"
        elif os.path.getsize(file) != shards[i]["bytes"]:
            problem = f"is truncated or damaged: {os.path.getsize(file)} bytes, the manifest says {shards[i]['bytes']}"
        elif sha256(file) != shards[i]["sha256"]:
            problem = "is corrupt: its sha256 differs from the manifest's"
        if problem:
            older = [c for c in complete_checkpoints(os.path.dirname(where)) if c < where]
            hint = f"resume from an earlier checkpoint: --resume {older[-1]}" if older else "no earlier checkpoint to resume from"
            raise SystemExit(f"error: checkpoint {where}: {shards[i]['file']} {problem}; {hint}")
    return where, manifest

def plan_checkpoints(args, cfg, chars, rank, world_size):
    """Before any work: the checkpoint to resume (it must fit this model and data, and each rank checks its share of
    the shards' hashes), the steps [start, end) this run takes, and where it saves: never over another run's
    checkpoints, nor over this run's later ones. Rank 0 picks the checkpoint: on a shared file system a rank's view of
    a directory can lag, and ranks that each took "the newest" could resume different steps. Every refusal is agreed."""
    where, manifest, error = None, None, None
    newest = from_rank0(find_checkpoint(args.resume) if rank == 0 else None) if args.resume else None
    try:
        if args.resume:  # rank 0's choice (or, if it found none, each rank's own search, to refuse it alike)
            where, manifest = open_checkpoint(newest or args.resume, cfg, chars, part=(rank, world_size))
        start, end = manifest["step"] if manifest else 0, min(args.steps, args.stop_after or args.steps)
        if start >= end:
            raise SystemExit(f"error: {where} is at step {start}, and this run ends at step {end}; raise --steps or --stop_after")
        ckpt_dir = args.ckpt_dir or (where and os.path.dirname(where))
        if ckpt_dir:
            same = where is not None and os.path.realpath(os.path.dirname(where)) == os.path.realpath(ckpt_dir)
            clash = [c for c in complete_checkpoints(ckpt_dir) if not same or int(os.path.basename(c)[5:]) > start]
            if clash:
                raise SystemExit(f"error: --ckpt_dir {ckpt_dir} already holds checkpoints this run would overwrite or mix "
                                 f"with (newest: {clash[-1]}); resume from them with --resume {clash[-1]}, or choose an empty directory")
    except SystemExit as e:
        error = str(e)
    agree(error)
    return where, manifest, start, end, ckpt_dir

def saved_pieces(where, manifest):
    """Every piece a checkpoint holds, as (name, lo, hi, {"master": values, "exp_avg": ..., "exp_avg_sq": ...})."""
    for s in manifest["shards"]:
        shard = torch.load(os.path.join(where, s["file"]), mmap=True, weights_only=True)  # reads only what is used
        at = 0
        for name, lo, hi in shard["pieces"]:
            yield name, lo, hi, {k: shard[k][at:at + hi - lo] for k in STATE}
            at += hi - lo

def load_checkpoint(where, manifest, engine, device):
    """Fill this rank's pieces from the saved ones, whatever stage and world size saved them; return the step."""
    wanted = defaultdict(list)
    for name, lo, hi, views in engine.state_pieces():
        wanted[name].append((lo, hi, views))
    need, found = sum(hi - lo for w in wanted.values() for lo, hi, _ in w), 0
    for name, lo, hi, saved in saved_pieces(where, manifest):
        for want_lo, want_hi, views in wanted.get(name, ()):
            a, b = max(lo, want_lo), min(hi, want_hi)  # the overlap of what was saved with what this rank holds
            if a < b:
                for k, view in zip(STATE, views):
                    view[a - want_lo:b - want_lo].copy_(saved[k][a - lo:b - lo])
                found += b - a
    rank = dist.get_rank() if dist.is_initialized() else 0
    agree(None if found == need else f"error: checkpoint {where}: its shards hold {found} of the {need} elements rank "
                                     f"{rank} needs; the shards do not match the manifest, resume from another checkpoint")
    if manifest["world_size"] > rank:  # the same rank's random state, where there is one (the training uses none)
        shard = torch.load(os.path.join(where, manifest["shards"][rank]["file"]), mmap=True, weights_only=True)
        torch.set_rng_state(shard["rng"])
        if shard["cuda_rng"] is not None and device.type == "cuda":  # (on a CPU run, touching CUDA makes a context)
            torch.cuda.set_rng_state(shard["cuda_rng"], device)
    engine.resume(manifest["step"])
    return manifest["step"]

def assemble(pieces, shapes):
    """{name: full fp32 tensor} from (name, lo, hi, values) pieces, and the names whose elements they do not all cover."""
    full = {name: torch.empty(math.prod(shape)) for name, shape in shapes.items()}
    covered = dict.fromkeys(shapes, 0)
    for name, lo, hi, values in pieces:
        if name in full:
            full[name][lo:hi] = values
            covered[name] += hi - lo
    missing = [name for name in shapes if covered[name] != full[name].numel()]
    return {name: t.view(*shapes[name]) for name, t in full.items()}, missing

def gather_master(engine):
    """The full fp32 master weights {name: tensor}, on rank 0 (None elsewhere): a collective over every rank."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    mine = [(name, lo, hi, views[0].detach().cpu()) for name, lo, hi, views in engine.state_pieces()]
    if dist.is_initialized():
        every = [None] * dist.get_world_size() if rank == 0 else None
        dist.gather_object(mine, every, dst=0)
    else:
        every = [mine]
    if rank != 0:
        return None
    shapes = {name: p.shape for name, p in engine.model.named_parameters()}
    return assemble((piece for pieces in every for piece in pieces), shapes)[0]

def consolidate(path, out):
    """A sharded checkpoint -> one file with the GPT's fp32 weights, config and vocabulary (zero_to_fp32.py's job)."""
    where, manifest = open_checkpoint(path, None, None)
    state, missing = assemble(((name, lo, hi, saved["master"]) for name, lo, hi, saved in saved_pieces(where, manifest)),
                              manifest["params"])
    if missing:
        raise SystemExit(f"error: checkpoint {where}: its shards do not hold all of {missing[0]}; the shards do not "
                         f"match the manifest")
    atomic_write(out, lambda f: torch.save({"config": manifest["config"], "chars": manifest["chars"], "step": manifest["step"],
                                            "state_dict": state}, f))
    print(f"wrote {out}: {sum(t.numel() for t in state.values()):,} fp32 parameters after step {manifest['step']} of {where}")

# ----------------------------------------------------------------------------------------------------------
# Set-up, with every bad input refused before any work starts.

def parse_args(Engine, argv=None):
    p = argparse.ArgumentParser(description=(Engine.__doc__ or "").strip().split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--preset", default="small", choices=sorted(PRESETS))
    for f in fields(GPTConfig):
        p.add_argument(f"--{f.name}", type=int, default=None, help="override the preset")
    p.add_argument("--data", default=None, help="a UTF-8 text file (default: CPython's pydoc topics)")
    p.add_argument("--steps", type=int, default=500)  # small: val 1.66 in 5.5 min on 2 cores (300 steps: 2.14)
    p.add_argument("--batch_size", type=int, default=16, help="GLOBAL batch in sequences, over all ranks and micro-steps")
    p.add_argument("--grad_accum", type=int, default=1)
    p.add_argument("--lr", type=float, default=1e-3)  # 2e-3: val 1.72 after 500 steps of small, 1e-3: 1.66
    p.add_argument("--min_lr", type=float, default=1e-4)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--weight_decay", type=float, default=0.1)
    p.add_argument("--beta1", type=float, default=0.9)
    p.add_argument("--beta2", type=float, default=0.99)
    p.add_argument("--grad_clip", type=float, default=1.0)
    p.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp32"], help="parameters and gradients; auto: "
                   "bf16 where it is fast (a GPU with bf16, a CPU with native bf16 matmul: AMX, AVX512-BF16), else fp32")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--eval_every", type=int, default=100)
    p.add_argument("--eval_batches", type=int, default=8)
    p.add_argument("--sample_chars", type=int, default=300)
    p.add_argument("--out", default=None, help="write a JSON summary here (rank 0)")
    p.add_argument("--save_master", default=None, help="write the final fp32 parameters here (torch.save, rank 0)")
    p.add_argument("--no_progress", action="store_true")
    p.add_argument("--trace", default=None, metavar="DIR", help="write a profiler timeline of one step per rank here")
    p.add_argument("--ckpt_dir", default=None, help="save checkpoints here: every --save_every steps and at the end")
    p.add_argument("--save_every", type=int, default=0, help="steps between checkpoints (0: only at the end)")
    p.add_argument("--stop_after", type=int, default=None, help="stop after this step, as if interrupted; the "
                   "schedule still follows --steps")
    p.add_argument("--resume", default=None, metavar="DIR", help="continue from the newest complete checkpoint in DIR "
                   "(or from DIR itself, a step_* directory); any stage, any world size")
    p.add_argument("--consolidate", nargs=2, default=None, metavar=("DIR", "OUT"), help="write the checkpoint's "
                   "fp32 weights to one file OUT, then exit")
    p.add_argument("--sample", default=None, metavar="FILE", help="print text from a consolidated file, then exit")
    if hasattr(Engine, "add_args"):
        Engine.add_args(p)
    return p.parse_args(argv)

def pick_device(choice, local_rank):
    if choice == "cuda" and not torch.cuda.is_available():
        raise SystemExit("error: --device cuda, but torch sees no CUDA GPU; use --device cpu (or auto)")
    if choice == "cpu" or not torch.cuda.is_available():
        return torch.device("cpu")
    if local_rank >= torch.cuda.device_count():
        raise SystemExit(f"error: local rank {local_rank} but this node has {torch.cuda.device_count()} GPUs; "
                         f"use --nproc_per_node {torch.cuda.device_count()} or fewer")
    return torch.device("cuda", local_rank)

def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

def init_distributed(args):
    if "RANK" not in os.environ:  # plain `python stageN.py`: a world of one, through the same code path
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    device = pick_device(args.device, int(os.environ["LOCAL_RANK"]))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", device_id=device if device.type == "cuda" else None)
    return dist.get_rank(), dist.get_world_size(), device

def stop(message, rank):
    """End every rank with one error line, printed once: for an error that all ranks meet at the same point."""
    if not dist.is_initialized():
        raise SystemExit(message)
    if rank == 0:
        print(message, file=sys.stderr, flush=True)
    dist.barrier()  # rank 0 has printed before any rank exits (torchrun stops the others once one has exited)
    dist.destroy_process_group()
    sys.stdout.flush(), sys.stderr.flush()
    os._exit(1)

def check_args(args, world_size):
    """Every option that could ruin a run silently (beta = 1 turns every weight into NaN), refused before any work."""
    for name in ("steps", "batch_size", "grad_accum", "eval_every", "eval_batches"):
        if getattr(args, name) < 1:
            raise SystemExit(f"error: --{name} {getattr(args, name)}: must be at least 1")
    for name in ("beta1", "beta2"):
        if not 0 <= getattr(args, name) < 1:
            raise SystemExit(f"error: --{name} {getattr(args, name)}: must be in [0, 1) (1 would divide by 1 - 1 = 0 in "
                             f"Adam's bias correction); the usual values are 0.9 and 0.99")
    for name in ("lr", "min_lr", "weight_decay", "warmup", "grad_clip"):
        if not getattr(args, name) >= 0:  # (NaN too)
            raise SystemExit(f"error: --{name} {getattr(args, name)}: must be 0 or more" +
                             (" (0: no clipping)" if name == "grad_clip" else ""))
    if getattr(args, "bucket_mb", 1) <= 0:
        raise SystemExit(f"error: --bucket_mb {args.bucket_mb}: must be more than 0 (4 is the default)")
    if args.batch_size % (world_size * args.grad_accum):
        raise SystemExit(f"error: --batch_size {args.batch_size} is not divisible by world_size {world_size} x "
                         f"--grad_accum {args.grad_accum}; use a multiple of {world_size * args.grad_accum}")
    if args.save_every < 0 or (args.stop_after is not None and args.stop_after < 1):
        raise SystemExit("error: --save_every must be 0 or more and --stop_after at least 1")
    if args.save_every and not args.ckpt_dir:
        raise SystemExit("error: --save_every needs --ckpt_dir DIR, the directory to save into")

def bf16_matmul_speedup(n=256, repeats=5):
    """How many times faster a bf16 matmul runs than an fp32 one on this CPU (best of `repeats`; 0.1 s at most)."""
    best = {}
    for dtype in (torch.float32, torch.bfloat16):
        a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
        a @ b  # warm-up: the first call picks and prepares a kernel
        for _ in range(repeats):
            t0 = time.perf_counter()
            a @ b
            best[dtype] = min(best.get(dtype, math.inf), time.perf_counter() - t0)
    return best[torch.float32] / best[torch.bfloat16]

def pick_dtype(choice, device):
    """(dtype, why) for --dtype. auto: bf16 where it is fast, fp32 otherwise. On a CPU, bf16 is fast only with native
    bf16 matrix instructions (AMX, AVX512-BF16): elsewhere torch's bf16 matmul runs a fallback some 80x slower than
    fp32. torch says whether oneDNN has such a path; a short measured probe confirms it (a check that torch provides
    alone would also pick bf16 where oneDNN only emulates it)."""
    if choice != "auto":
        return {"bf16": torch.bfloat16, "fp32": torch.float32}[choice], f"--dtype {choice}"
    if device.type == "cuda":
        if torch.cuda.is_bf16_supported():
            return torch.bfloat16, f"auto: {torch.cuda.get_device_name(device)} supports bf16"
        return torch.float32, f"auto: {torch.cuda.get_device_name(device)} has no bf16"
    isa = torch.backends.cpu.get_cpu_capability()
    check = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    if check is not None and not check():
        return torch.float32, f"auto: this CPU ({isa}) has no native bf16 matmul, where bf16 would run ~80x slower"
    speedup = bf16_matmul_speedup()
    if speedup >= 1.5:
        return torch.bfloat16, f"auto: a bf16 matmul runs {speedup:.1f}x faster than fp32 on this CPU ({isa})"
    return torch.float32, f"auto: a bf16 matmul runs only {speedup:.2f}x as fast as fp32 on this CPU ({isa})"

def load_consolidated(path):
    """The file --consolidate writes, or one line saying what --sample takes."""
    fix = f"--sample takes the one file that --consolidate writes (python train_gpt.py --consolidate CKPT_DIR OUT.pt)"
    if not os.path.isfile(path):
        raise SystemExit(f"error: --sample {path}: " + ("a directory" if os.path.isdir(path) else "no such file") + f"; {fix}")
    try:
        saved = torch.load(path, weights_only=True)
        if not {"config", "chars", "state_dict"} <= set(saved):
            raise KeyError("config")
    except Exception:
        raise SystemExit(f"error: --sample {path}: not a consolidated GPT (a checkpoint shard, or another file); {fix}") from None
    return saved

def sample_text(cfg, state_dict, chars, device, args):
    """Text generated by the GPT with these fp32 weights, starting from a newline."""
    model = GPT(cfg).to(device)
    model.load_state_dict({**state_dict, "lm_head.weight": state_dict["wte.weight"]})  # the tied head
    g = torch.Generator(device=device).manual_seed(args.seed)
    start = torch.full((1, 1), chars.index("\n") if "\n" in chars else 0, dtype=torch.long, device=device)
    out = model.generate(start, args.sample_chars, generator=g)[0].tolist()
    return "--- sample ---\n" + "".join(chars[i] for i in out if i < len(chars)) + "\n--------------"

def lr_at(step, args):
    """Linear warmup, then cosine decay to min_lr at the last step."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    t = (step - args.warmup) / max(1, args.steps - 1 - args.warmup)
    return args.min_lr + 0.5 * (1 + math.cos(math.pi * min(t, 1.0))) * (args.lr - args.min_lr)

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
# The loop every stage shares.

def main(Engine, stage, distributed=True, formula=None):
    """Train with `Engine`; `stage` names the run, `formula` the stage whose memory model applies (default: stage)."""
    args = parse_args(Engine)
    if args.consolidate:
        return consolidate(*args.consolidate)
    if args.sample:
        saved = load_consolidated(args.sample)
        print(sample_text(GPTConfig(**saved["config"]), saved["state_dict"], saved["chars"], pick_device(args.device, 0), args))
        return
    n_layer, n_head, n_embd, block_size, vocab_size = PRESETS[args.preset]
    cfg = GPTConfig(block_size, vocab_size, n_layer, n_head, n_embd)
    for f in fields(GPTConfig):
        if getattr(args, f.name) is not None:
            setattr(cfg, f.name, getattr(args, f.name))
    if cfg.n_embd % cfg.n_head:
        raise SystemExit(f"error: --n_embd {cfg.n_embd} is not divisible by --n_head {cfg.n_head}")
    if distributed:
        rank, world_size, device = init_distributed(args)
    else:
        rank, world_size, device = 0, 1, pick_device(args.device, 0)
    try:
        check_args(args, world_size)
    except SystemExit as e:
        stop(str(e), rank)  # every rank finds the same error: one line, from rank 0
    data = CharData(load_text(args.data), cfg.block_size)
    cfg.vocab_size = max(cfg.vocab_size, len(data.chars))
    dtype, why = pick_dtype(args.dtype, device) if rank == 0 else (None, None)
    if distributed:
        dtype, why = everyone((dtype, why))[0]  # rank 0's choice, so that a timed probe cannot split the ranks
    args.dtype = {torch.bfloat16: "bf16", torch.float32: "fp32"}[dtype]
    param_bytes = torch.finfo(dtype).bits // 8
    if rank == 0:
        print(f"{stage}: {args.dtype} ({why})", flush=True)
    where, manifest, start, end, ckpt_dir = plan_checkpoints(args, cfg, data.chars, rank, world_size)

    torch.manual_seed(args.seed + rank)  # ranks start different; each stage must broadcast rank 0's weights
    model = GPT(cfg).to(device=device, dtype=dtype)
    n_params = sum(p.numel() for p in model.parameters())
    engine = Engine(model, args, device)
    grad_shards = 1 + bool(getattr(args, "delayed_update", False))  # offload's delayed update: a second gradient shard
    theory = model_state_theory(formula or stage, engine.padded_numel, world_size, param_bytes, grad_shards)
    comm_th = comm_theory(formula or stage, engine.padded_numel, world_size, param_bytes, args.grad_accum)
    host = host_categories(formula or stage, getattr(args, "offload_params", False))
    pinned_th = pinned_theory(formula or stage, engine.padded_numel, world_size, param_bytes, getattr(args, "offload_params", False),
                              getattr(args, "delayed_update", False)) if device.type == "cuda" else 0  # nothing pinned without CUDA
    if rank == 0:
        print(f"{stage}: {n_params:,} parameters (Ψ), padded to {engine.padded_numel:,}; {world_size} rank(s) on {device.type}; "
              f"model states per rank {formula_text(formula or stage, param_bytes, grad_shards)} = "
              f"{sum(theory.values()) / 2**20:.2f} MiB in theory; unigram loss {data.unigram_loss:.3f}", flush=True)

    losses, grad_norms, val_losses, step_times = [], [], [], []
    if manifest:
        start = load_checkpoint(where, manifest, engine, device)
        losses, grad_norms, val_losses = manifest["losses"], manifest["grad_norms"], [tuple(v) for v in manifest["val_losses"]]
        if rank == 0:
            print(f"{stage}: resumed from {where} (saved by {manifest['stage']} on {manifest['world_size']} rank(s)) at step {start}")
    measure_step = start if start else min(1, end - 1)  # step 0 creates Adam's moments; step 1 is the steady state
    comm_sent, peak = {}, 0
    bar = range(start, end)
    if rank == 0 and not args.no_progress and sys.stderr.isatty():  # to a file, a line every tenth of the run instead
        from tqdm import tqdm
        bar = tqdm(bar, initial=start, total=args.steps, dynamic_ncols=True)

    def evaluate():
        total = torch.zeros((), device=device)
        with torch.no_grad():
            for k in range(args.eval_batches):
                x, y = data.batch("val", 10**9 + k, args.batch_size // args.grad_accum, rank, world_size, device)
                total += engine.forward(x, y).float()
        if distributed:
            dist.all_reduce(total, op=dist.ReduceOp.AVG)  # outside the step: not in the comm ledger
        return total.item() / args.eval_batches

    def train_step(step):
        """One optimizer step over the global batch; rank r takes slice (k*N + r) at micro-step k."""
        loss_sum = torch.zeros((), device=device)
        for k in range(args.grad_accum):
            x, y = data.batch("train", args.seed * 1_000_003 + step, args.batch_size, k * world_size + rank,
                              world_size * args.grad_accum, device)
            with torch.profiler.record_function("forward"):  # (marks for --trace; nearly free without a profiler)
                loss = engine.forward(x, y)
            with torch.profiler.record_function("backward"):
                engine.backward(loss / args.grad_accum, sync=(k == args.grad_accum - 1))
            loss_sum += loss.detach().float() / args.grad_accum
        if step == measure_step:  # what this rank holds when the optimizer runs: the paper's model states
            held = engine.model_states()
            states.update({k: storage_bytes(v) for k, v in held.items()})
            on_device = [t for t in sum(held.values(), []) + [data.train, data.val] if t.device.type == device.type]
            other["live"] = live_tensor_bytes(device) - storage_bytes(on_device)  # the rest: buffers in flight, leaks
            other["pinned"] = torch.cuda.host_memory_stats().get("allocated_bytes.current", 0) if device.type == "cuda" else 0
        with torch.profiler.record_function("step"):
            grad_norm = engine.step(lr_at(step, args))
        sent = dict(comm.sent)
        if distributed:
            dist.all_reduce(loss_sum, op=dist.ReduceOp.AVG)  # for the log only: after the ledger's count
        return loss_sum.item(), float(grad_norm), sent

    states, other = {}, {}
    for step in bar:
        t0 = time.perf_counter()
        comm.sent.clear()
        traced = args.trace and step == measure_step + 1  # a steady step, apart from the measured one
        try:
            with PeakMemory(device) if step == measure_step else contextlib.nullcontext() as meter, \
                    timeline(args.trace, rank, device) if traced else contextlib.nullcontext():
                loss, grad_norm, sent = train_step(step)
        except NonFiniteGradNorm as e:  # every rank meets it at the same step: the norm is global
            kept = f"; the checkpoints in {ckpt_dir} are intact" if ckpt_dir else ""
            stop(f"error: step {step}: the global gradient norm is {e}, so no update was made{kept}; lower --lr "
                 f"(it is {args.lr}) or --warmup's start, or check --data", rank)
        if meter:
            peak, comm_sent = meter.peak, sent
        elif not traced:
            step_times.append(time.perf_counter() - t0)
        losses.append(loss)
        grad_norms.append(grad_norm)
        if (step + 1) % args.eval_every == 0 or step == args.steps - 1:
            val_losses.append((step + 1, evaluate()))
        tok_s = args.batch_size * cfg.block_size / step_times[-1] if step_times else 0
        if rank == 0 and hasattr(bar, "set_postfix"):
            bar.set_postfix(loss=f"{losses[-1]:.3f}", tok_s=f"{tok_s:,.0f}", mem=f"{peak / 2**20:.1f}MiB")
        elif rank == 0 and not args.no_progress and (step + 1 == end or (step + 1) % max(1, args.steps // 10) == 0):
            print(f"{stage}: step {step + 1}/{args.steps}, loss {losses[-1]:.3f}, {tok_s:,.0f} tokens/s", flush=True)
        if ckpt_dir and (step + 1 == end or args.save_every and (step + 1) % args.save_every == 0):
            save_checkpoint(ckpt_dir, engine, step + 1, dict(
                stage=stage, config=vars(cfg), chars="".join(data.chars), losses=losses, grad_norms=grad_norms,
                val_losses=val_losses, params={n: list(p.shape) for n, p in model.named_parameters()}), device)

    per_rank, peaks = zip(*everyone((states, peak)))  # every rank's model states and peak, for the table
    stopped = end < args.steps
    master = gather_master(engine) if args.save_master or (args.sample_chars and not stopped) else None  # collective
    timed = sorted(step_times[1:] or step_times)  # the first step warms up
    tokens_per_s = args.batch_size * cfg.block_size / timed[len(timed) // 2] if timed else 0.0
    if rank == 0:
        if hasattr(bar, "close"):
            bar.close()
        summary = dict(stage=stage, world_size=world_size, n_params=n_params, padded_numel=engine.padded_numel,
                       dtype=args.dtype, device=device.type, config=vars(cfg), args=vars(args),
                       losses=losses, grad_norms=grad_norms, val_losses=val_losses,
                       val_loss=val_losses[-1][1] if val_losses else None, steps_done=end, resumed_from=start,
                       unigram_loss=data.unigram_loss, tokens_per_s=tokens_per_s, peak_memory_bytes=peak,
                       other_tensor_bytes=other["live"], pinned_host_bytes={"measured": other["pinned"], "theory": pinned_th},
                       model_state_bytes={k: {"measured": states.get(k, 0), "theory": theory[k],
                                              "where": "host" if k in host else "device"} for k in theory},
                       model_state_bytes_per_rank=list(per_rank), peak_memory_bytes_per_rank=list(peaks),
                       comm_bytes_per_step={"measured": sum(comm_sent.values()), "theory": sum(comm_th.values()),
                                            "by_collective": {k: {"measured": comm_sent.get(k, 0.0), "theory": comm_th.get(k, 0.0)}
                                                              for k in sorted(set(comm_sent) | set(comm_th))}})
        val = f"{summary['val_loss']:.4f}" if val_losses else "-"
        print(f"{stage}: val loss {val} (unigram {data.unigram_loss:.3f}), {tokens_per_s:,.0f} tokens/s")
        print(memory_table(f"{stage}, {args.dtype}, {formula_text(formula or stage, param_bytes, grad_shards)}", per_rank,
                           peaks, theory, host, comm_sent, comm_th))
        if pinned_th:
            print(f"pinned host memory {other['pinned'] / 2**20:.2f} MiB (theory {pinned_th / 2**20:.2f}: PyTorch rounds "
                  f"each pinned allocation up to a power of two)")
        if args.out:
            with open(args.out, "w") as f:
                json.dump(summary, f, indent=1)
        if args.save_master:
            torch.save(master, args.save_master)
        if stopped:
            print(f"{stage}: stopped after step {end} of {args.steps} (--stop_after)"
                  + (f"; continue with --resume {ckpt_dir}" if ckpt_dir else ""))
        elif args.sample_chars:
            print(sample_text(cfg, master, data.chars, device, args))
    if distributed:
        dist.barrier()
        dist.destroy_process_group()
        sys.stdout.flush(), sys.stderr.flush()
        os._exit(0)  # gloo ranks of torch 2.13 sometimes abort (SIGABRT) in their exit-time destructors

if __name__ == "__main__":
    main(SingleDeviceEngine, stage="reference", distributed=False)
