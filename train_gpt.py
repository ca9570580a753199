"""
train_gpt.py: the one small GPT every stage trains, its data, the ZeRO paper's formulas, the recipe on one device,
and the training loop every stage shares. Run alone, it is the single-device reference:

    python train_gpt.py --preset tiny --steps 50          # seconds on a laptop (no --preset: the `small` GPT, ~10M)
    python train_gpt.py --data input.txt --dtype fp32     # any UTF-8 text; fp32 for exact comparisons

Every stage file (stage0_ddp.py ... offload.py) imports this file, comm.py (the collectives) and options.py (require,
Misuse), and brings only its Engine, which takes any nn.Module, trains the parameters that require a gradient
(examples/any_model.py), holds this rank's model states and moves them: forward(*args) -> the model's output,
backward(loss, sync), step(lr, scaler) -> global gradient norm, padded_numel (Ψ'); and for checkpoints and the ledgers
grad(p) -> (lo, view) of p's averaged gradient this rank holds, model_states(), state_pieces(), resume(step). The
device layer, meters, options and checkpoints come after the stages.
"""
import math, zlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint as activation_checkpoint  # (checkpoint.py saves the training state)

from checkpoint import consolidate, load_checkpoint, load_consolidated, pieces_of, plan_checkpoints, save_checkpoint
from options import Misuse, check_args, gpt_config, load_text, parse_args, refuse_sparse, require
from devices import from_rank0, init_distributed, pick_device, pick_dtype, stop
from comm import comm
from outside import Outside, leaves  # ZeRO-3's parameters that leave their unit (stage3.py, offload.py)
from instruments import Run, check_profile, evaluate, finish, holdings, pinned_theory, summarize
from nvme import ON_DISK, nvme_theory  # the NVMe tier's formula: its file and buffers

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
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=False)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=False)
        self.mlp = nn.Sequential(nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=False), nn.GELU(),
                                 nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=False))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))

class GPT(nn.Module):
    def __init__(self, cfg, checkpoint_activations=False):
        super().__init__()
        self.cfg = cfg
        self.checkpoint_activations = checkpoint_activations  # --checkpoint_activations: see forward
        # init_weight draws every weight: the embeddings skip their own draw (on meta, normal_ imports torch._dynamo)
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd, _weight=torch.empty(cfg.vocab_size, cfg.n_embd))
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd, _weight=torch.empty(cfg.block_size, cfg.n_embd))
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=False)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied: one tensor, counted once in Ψ
        self.seed = torch.initial_seed()  # torch.manual_seed's when the model is built: each parameter's init uses it
        for p in self.parameters():
            if not p.is_meta:  # on the meta device (shapes only), the engine calls init_weight bucket by bucket
                self.init_weight(p)

    @torch.no_grad()
    def init_weight(self, p):
        """GPT-2's init of parameter p; residual projections scaled by depth. Each draws from a generator of its own,
        seeded by (seed, p's name), in fp32 on the CPU: the same values on any device, in any order, one at a time,
        so that ZeRO-3 can make the model a unit at a time (stage3.py) and still start from the reference's weights."""
        name = next(n for n, q in self.named_parameters() if q is p)
        if p.dim() < 2:
            return p.fill_(1.0)  # a LayerNorm's weight
        std = 0.02 / math.sqrt(2 * self.cfg.n_layer) if name.endswith(("c_proj.weight", "mlp.2.weight")) else 0.02
        g = torch.Generator().manual_seed((self.seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63)
        p.copy_(torch.empty(p.shape).normal_(0.0, std, generator=g))

    def forward(self, idx, targets=None):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:  # checkpointed, a block keeps only its input x; its backward first runs it again
            x = activation_checkpoint(block, x, use_reentrant=False) if self.checkpoint_activations else block(x)
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

def sample_text(saved, args, device=torch.device("cpu")):
    """Text generated by the GPT with these fp32 weights (a consolidated file's dict), starting from a newline."""
    model = GPT(GPTConfig(**saved["config"])).to(device)
    chars = saved["chars"]
    model.load_state_dict({**saved["state_dict"], "lm_head.weight": saved["state_dict"]["wte.weight"]})  # the tied head
    g = torch.Generator(device=device).manual_seed(args.seed)
    start = torch.full((1, 1), chars.index("\n") if "\n" in chars else 0, dtype=torch.long, device=device)
    out = model.generate(start, args.sample_chars, generator=g)[0].tolist()
    return "--- sample ---\n" + "".join(chars[i] for i in out if i < len(chars)) + "\n--------------"

# ----------------------------------------------------------------------------------------------------------
# Data: real text, offline (options.load_text reads --data; by default a corpus that ships with every CPython).

class CharData:
    """Character-level tokens, 90/10 train/val split. The global batch of step s depends only on (seed, s)."""
    def __init__(self, text, block_size):
        self.chars = sorted(set(text))
        self.stoi = {c: i for i, c in enumerate(self.chars)}
        ids = torch.tensor([self.stoi[c] for c in text], dtype=torch.uint8 if len(self.chars) <= 256 else torch.int32)
        n = int(0.9 * len(ids))
        self.train = ids[:n]
        self.val = ids[n:]
        self.block_size = block_size
        if len(self.val) <= block_size + 1:
            raise SystemExit(f"error: the text has {len(text)} characters, too few for --block_size {block_size}; "
                             "use a larger file or a smaller --block_size")
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
        pinned = device.type == "cuda"  # up from pinned memory, not blocking the host (from pageable memory it would)
        return tuple(t.pin_memory().to(device, non_blocking=True) if pinned else t for t in (x, y))

# ----------------------------------------------------------------------------------------------------------
# The paper's memory and communication model: the formulas every stage measures itself against.

SHARDED = dict(reference=(), stage0=(), stage1=("master", "adam_m", "adam_v"))  # the categories each stage divides by N
SHARDED["stage2"] = ("grads",) + SHARDED["stage1"]
SHARDED["stage3"] = ("params",) + SHARDED["stage2"]
SHARDED["offload"] = SHARDED["stage3"] + ("grad_acc",)

def bytes_per_param(param_bytes=2, grad_shards=1, *, grad_acc=False, param_shards=1):
    """Model-state bytes per parameter by category: 2 + 2 + K (K = 12) in bf16 or fp16, 4 + 4 + 12 in fp32. Offload's
    delayed update holds a second gradient shard (grad_shards=2), the one its CPU update reads while the next fills,
    and a second parameter shard on the device (param_shards=2), the one its update writes while the next step
    gathers from the other; with gradient accumulation (grad_acc=True) offload sums the micro-steps' gradient shards on
    the device, one more shard of param_bytes per parameter (in "grad_acc"; the other stages accumulate in "grads")."""
    b = {"params": param_shards * param_bytes, "grads": grad_shards * param_bytes}
    b.update(master=4, adam_m=4, adam_v=4)
    if grad_acc:
        b["grad_acc"] = param_bytes
    return b

def model_state_theory(stage, n_params, world_size, param_bytes=2, grad_shards=1, *, grad_acc=False, param_shards=1):
    """Bytes per rank by category for Ψ = n_params on N = world_size ranks, the sharded categories divided by N
    (n_params is the padded count, a multiple of N, for sharded stages)."""
    full = {k: b * n_params for k, b in bytes_per_param(param_bytes, grad_shards, grad_acc=grad_acc,
                                                         param_shards=param_shards).items()}
    return {k: v // world_size if k in SHARDED[stage] else v for k, v in full.items()}

def formula_text(stage, param_bytes=2, grad_shards=1, *, grad_acc=False, param_shards=1):
    """The per-rank formula as the paper writes it: '16Ψ' (stage 0, bf16), '8Ψ + 12Ψ/N' (stage 1, fp32) ..."""
    b = bytes_per_param(param_bytes, grad_shards, grad_acc=grad_acc, param_shards=param_shards)
    whole = sum(v for k, v in b.items() if k not in SHARDED[stage])
    shard = sum(v for k, v in b.items() if k in SHARDED[stage])
    return " + ".join([f"{whole}Ψ"] * bool(whole) + [f"{shard}Ψ/N"] * bool(shard))

def host_categories(stage, offload_params=False, nvme=False):
    """The model states ZeRO-Offload keeps in CPU memory (the optimizer's side); the rest stay on the device (the
    parameters unless offload_params; with gradient accumulation, "grad_acc": the gradient shard summed there). With
    the optimizer states on NVMe (nvme=True) the host keeps the buffers they pass through instead."""
    if stage != "offload":
        return ()
    optimizer = ("nvme_buffers",) if nvme else ON_DISK
    return ("grads",) + optimizer + ("params",) * offload_params

def comm_theory(stage, n_params, world_size, param_bytes=2, grad_accum=1):
    """Bytes this rank sends per optimizer step, by collective, with ring algorithms: an all-reduce sends 2(N-1)/N of
    the tensor, a reduce-scatter or an all-gather (N-1)/N. Gradient accumulation: stages 0 and 1 reduce once per step
    (no_sync); stage 2 every micro-step; stage 3 gathers twice a micro-step (forward; backward, recompute included)."""
    once = n_params * param_bytes * (world_size - 1) / world_size  # one reduce-scatter or all-gather of all Ψ
    norm = 2 * 8 * (world_size - 1) / world_size  # one float64 scalar all-reduced: the shards' squared gradient norms
    # stage 3 also all-reduces two float64 scalars, the hash of the units' order and its negative (outside.Order)
    order = 2 * norm
    return {"reference": {}, "stage0": {"all_reduce": 2 * once},
            "stage1": {"reduce_scatter": once, "all_gather": once, "all_reduce": norm},
            "stage2": {"reduce_scatter": grad_accum * once, "all_gather": once, "all_reduce": norm},
            "stage3": {"all_gather": 2 * grad_accum * once, "reduce_scatter": grad_accum * once,
                       "all_reduce": norm + order},
            }[stage if stage != "offload" else "stage3"]

# ----------------------------------------------------------------------------------------------------------
# The reference engine: the recipe on one device, no distribution. Every stage must match it. Any engine takes any
# nn.Module: it trains what trained() lists, and refuses a Misuse (options.py) with one line that names the fix.

def trained(model):
    """(name, parameter) for each parameter an engine trains (hooks, buckets, shards): those that require a gradient.
    Frozen parameters and buffers are rank 0's (an engine broadcasts them once) and left alone."""
    if any(t.is_meta for t in [p for p in model.parameters() if not (p.requires_grad and hasattr(model, "init_weight"))]
           + list(model.buffers())):
        raise RuntimeError(Misuse.META)
    params = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    require(params, Misuse.NOTHING_TRAINED)
    refuse_sparse(model)
    # one dtype for every trained parameter: an engine's flat buffers, and so the run, take the first one's
    other = next(((name, p) for name, p in params if p.dtype != params[0][1].dtype), None)
    if other is not None:
        raise RuntimeError(Misuse.DTYPES.format(params[0][0], params[0][1].dtype, other[0], other[1].dtype))
    return params

def share_rank0s(model, args):
    """Rank 0's frozen parameters, once, and its buffers (BatchNorm's running statistics, say), once and, as DDP's
    broadcast_buffers=True, before each forward: a forward updates them on each rank's own data. With
    --no_broadcast_buffers, once only: then each rank's own (DDP's broadcast_buffers=False)."""
    def broadcast_buffers(module, inputs):
        for t in module.buffers():
            comm.broadcast(t, src=0)
    for t in [p for p in model.parameters() if not p.requires_grad] + list(model.buffers()):
        dist.broadcast(t, src=0)
    if list(model.buffers()) and not args.no_broadcast_buffers:
        model.register_forward_pre_hook(broadcast_buffers)

def units_of(model, units):
    """ZeRO-3's units (stage3.py, offload.py): {trained parameter: the unit that gathers it}, unit by unit in the order
    of `units`, the root last. A unit is a module whose forward runs; a parameter goes to the innermost unit that
    encloses every module registering it (nested units gather their own): a weight tied between modules, units or not
    (a tied embedding and output layer), to their lowest common ancestor among the units, the root at most, as FSDP."""
    units = list(dict.fromkeys([*units, model]))
    inside = {m: set(m.modules()) for m in units}
    users = {}  # id(parameter) -> the modules that register it (each module a tie joins)
    for m in model.modules():
        for q in m._parameters.values():
            users.setdefault(id(q), []).append(m)
    owner = {}
    for _, p in trained(model):
        # the units that enclose every module registering p: the innermost of them owns p
        enclosing = [u for u in units if all(m in inside[u] for m in users[id(p)])]
        owner[p] = min(enclosing, key=lambda u: len(inside[u]))
    return {p: m for m in units for p in m.parameters() if p in owner and owner[p] is m}

def before_backward(out, hook):
    """ZeRO-3's backward pre-hook: hook() runs each time backward reaches a tensor of a forward's output `out`, before
    backward goes on into the module that made it. Hooks on the output tensors, as FSDP2 registers its own, see every
    call of a module, however often it runs. `out` may be of any structure (outside.leaves walks it as FSDP2 does)."""
    def on_grad(grad):
        hook()

    for t in leaves(out):
        if t.requires_grad:
            t.register_hook(on_grad)

class AdamW:
    """AdamW on one fp32 tensor, as torch.optim.AdamW computes it. Per element, at step t:
        p -= lr * weight_decay * p                      (decoupled weight decay: not L2 added to the gradient)
        m = beta1 * m + (1 - beta1) * g ;  v = beta2 * v + (1 - beta2) * g * g
        p -= lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
    Its state is the paper's K = 12 bytes per parameter: the fp32 master it updates, m and v; t counts steps, not
    tensors or buckets. It runs torch's fused kernel (torch.optim.AdamW(fused=True)'s: one pass over memory, no import
    of torch's compiler), and decays every parameter, as torch does by default (nanoGPT spares biases and norms)."""
    def __init__(self, param, args, eps=1e-8):
        self.param = param  # the fp32 tensor it updates in place: a master copy, or a shard of one
        # lr schedule aside, the recipe (offload.py's C++ AdamW takes it too)
        self.recipe = dict(beta1=args.beta1, beta2=args.beta2, eps=eps, weight_decay=args.weight_decay)
        self.t = 0  # steps taken
        self.exp_avg = torch.zeros_like(param)  # m
        self.exp_avg_sq = torch.zeros_like(param)  # v
        self.step_tensor = torch.zeros((), dtype=torch.float32, device=param.device)  # where the kernel reads t

    @torch.no_grad()
    def step(self, grads, lr):
        """One step over `grads`: (where, fp32 gradient) pairs that cover the tensor, a bucket each, say. From a
        generator that makes each when asked, one exists at a time: never an fp32 copy of the whole gradient."""
        self.t += 1
        self.step_tensor.fill_(self.t)
        for where, grad in grads:
            torch._fused_adamw_([self.param[where]], [grad], [self.exp_avg[where]], [self.exp_avg_sq[where]], [],
                                [self.step_tensor], lr=lr, amsgrad=False, maximize=False, **self.recipe)
            del grad  # this bucket's fp32 gradient, before the generator makes the next one

def sum_of_squares(t, block=1 << 20):
    """Σ t² over all of t as a float64 scalar, accurate at any size (the norm decides the clipping): squares summed in
    fp32 per block of 1M elements (one block's fp32 copy at a time), the blocks added in float64 (bench/README.md says
    why). On CUDA a reduction is a tree, accurate at any size: one norm kernel in fp32 over all of t."""
    if t.is_cuda:
        return torch.linalg.vector_norm(t, dtype=torch.float32).double().square()
    return sum(part.float().square().sum().double() for part in t.reshape(-1).split(block))

class NonFiniteGradNorm(FloatingPointError):
    """The global gradient norm is NaN or infinite: no update may use it (main stops the run with one line)."""

class LossScaler:
    """fp16's dynamic loss scaling, DeepSpeed's with "hysteresis": 1 (course/README.md's table has its config). fp16's
    5 exponent bits make a gradient below 2^-24 zero and one above 65504 inf, so train_step multiplies the loss by
    `scale` before backward, and clip_coef divides it out in the clipping coefficient. An overflow (a non-finite norm)
    skips the step and halves the scale, `window` steps in a row without one double it, and one at the `floor` stops
    the run. Off (scale 1) in bf16 and fp32: fp32's range."""
    def __init__(self, enabled=False, scale=2.0**16, window=1000, floor=1.0):
        self.enabled = enabled  # its state is vars(self): the run's summary and checkpoints keep it
        self.scale = scale if enabled else 1.0
        self.window = window
        self.floor = floor
        self.good_steps = 0  # steps since the last overflow
        self.skipped = 0  # steps skipped in all

    def update(self, finite):
        """Once a step, by clip_coef, on every rank alike (the norm it reads is global)."""
        if self.enabled and finite:
            self.good_steps += 1
            self.scale *= 2.0 if self.good_steps % self.window == 0 else 1.0
        elif self.enabled:
            self.scale = max(self.scale / 2, self.floor)
            self.good_steps = 0
            self.skipped += 1

NO_SCALING = LossScaler()  # bf16 and fp32: scale 1, nothing skipped (an engine's step(lr) called without a scaler)

def clip_coef(norm, max_norm, scaler=None):
    """The factor torch.nn.utils.clip_grad_norm_ scales gradients by; --grad_clip 0 means no clipping (as in nanoGPT
    and DeepSpeed: scaling by 0 would silently stop learning). Every stage calls it before its update, so a non-finite
    norm stops the run here, before any NaN reaches the master weights or a checkpoint. In fp16 the factor also unscales
    by the loss scale of `scaler` (a power of two: exactly), which main's loop owns and passes to engine.step, and a
    non-finite norm above the scaler's floor returns None: skip the step. Every stage's norm is global (all-reduced, or
    the all-reduced gradient's): an overflow on any rank, and all ranks skip. The scaler learns of each step here, where
    the host knows whether the norm is finite, after the factor used its scale. No scaler (None): no scaling."""
    scaler = NO_SCALING if scaler is None else scaler
    # One host sync per step: the decision to update at all is the host's. The norm read once, the factor is made on
    # the host too (a 0-dim host tensor is a scalar to a GPU kernel), so offload's C++ AdamW reads it for free.
    norm = norm.cpu()
    if not math.isfinite(norm):
        if scaler.enabled and scaler.scale > scaler.floor:
            scaler.update(False)
            return None
        raise NonFiniteGradNorm(f"{float(norm)}" + f" at the loss scale's floor ({scaler.floor:g})" * scaler.enabled)
    norm = norm / scaler.scale
    coef = ((max_norm / (norm + 1e-6)).clamp(max=1.0) if max_norm > 0 else torch.ones_like(norm)) / scaler.scale
    scaler.update(True)
    return coef

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

    def step(self, lr, scaler=None):
        norm = sum(sum_of_squares(p.grad) for p in self.params).sqrt()
        coef = clip_coef(norm, self.args.grad_clip, scaler)
        for optimizer, p in zip(self.optimizers, self.params):
            if coef is not None:  # None: fp16 overflowed; the step is skipped (nothing changes, the gradient goes)
                optimizer.step([(slice(None), p.grad.float().mul_(coef))], lr)
        for p, m in zip(self.params, self.master):
            p.data.copy_(m)
            p.grad = None
        return norm

    def grad(self, p):
        return 0, p.grad.view(-1)  # all of p's gradient, from element 0

    def model_states(self):
        return {"params": self.params, "grads": [p.grad for p in self.params if p.grad is not None],
                "master": self.master, "adam_m": [o.exp_avg for o in self.optimizers],
                "adam_v": [o.exp_avg_sq for o in self.optimizers]}

    def state_pieces(self):
        return [(name, 0, p.numel(), [m.view(-1), o.exp_avg.view(-1), o.exp_avg_sq.view(-1)])
                for (name, p), m, o in zip(trained(self.model), self.master, self.optimizers)]

    def resume(self, step):
        for o, p, m in zip(self.optimizers, self.params, self.master):
            o.t = step
            p.data.copy_(m)

# ----------------------------------------------------------------------------------------------------------
# The loop every stage shares: its learning rate, what the paper's model says a run holds and sends, the steps.

def lr_at(step, args):
    """Linear warmup, then cosine decay to min_lr at the last step."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    t = (step - args.warmup) / max(1, args.steps - 1 - args.warmup)
    return args.min_lr + 0.5 * (1 + math.cos(math.pi * min(t, 1.0))) * (args.lr - args.min_lr)

def theory(stage, padded_numel, world_size, dtype, args, device, *, largest_bucket=0):
    """What the paper's model says this run holds and sends per rank: model states by category, their formula, the
    bytes sent per step, which states live on the host, pinned host memory (with CUDA), and the bytes on disk (offload's
    NVMe tier: largest_bucket, the elements of the largest bucket, sizes its buffers)."""
    param_bytes = torch.finfo(dtype).bits // 8
    offload_params = getattr(args, "offload_params", False)
    # offload's delayed update: a second gradient shard, and a second parameter shard where the parameters are on
    # the device
    grad_shards = 1 + bool(getattr(args, "delayed_update", False))
    param_shards = 1 + (grad_shards == 2 and not offload_params)
    grad_acc = stage == "offload" and args.grad_accum > 1  # offload sums the micro-steps' shards on the device
    states = model_state_theory(stage, padded_numel, world_size, param_bytes, grad_shards, grad_acc=grad_acc,
                                param_shards=param_shards)
    formula = formula_text(stage, param_bytes, grad_shards, grad_acc=grad_acc, param_shards=param_shards)
    nvme = getattr(args, "offload_optimizer", "cpu") == "nvme"
    disk = 0
    if nvme:
        states, disk = nvme_theory(states, world_size, args.nvme_buffer_count, largest_bucket)
        formula = f"{formula} less 12Ψ/N on disk, + {args.nvme_buffer_count} buffers"
    return dict(states=states, formula=formula, disk=disk,
                host=host_categories(stage, offload_params, nvme),
                comm=comm_theory(stage, padded_numel, world_size, param_bytes, args.grad_accum),
                pinned=pinned_theory(stage, padded_numel, world_size, param_bytes, offload_params, grad_shards == 2)
                if device.type == "cuda" else 0)  # nothing is pinned without CUDA

def train_step(engine, data, args, step, device, *, scaler=NO_SCALING, measured=None):
    """One optimizer step over the global batch; rank r takes slice (k*N + r) at micro-step k. With `measured`, also
    record there what this rank holds when the optimizer runs: the paper's model states, and everything else. The loss
    and the gradient norm come back as tensors on the device: reading them would make the host wait for the GPU, and
    the log needs them only now and then (main reads them at the steps that log)."""
    rank, world_size = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    loss_sum = torch.zeros((), device=device)
    scale = scaler.scale  # fp16's loss scale (1 in bf16 and fp32)
    for k in range(args.grad_accum):
        x, y = data.batch("train", args.seed * 1_000_003 + step, args.batch_size, k * world_size + rank,
                          world_size * args.grad_accum, device)
        with torch.profiler.record_function("forward"):  # (marks for --profile; nearly free without a profiler)
            loss = engine.forward(x, y)
        with torch.profiler.record_function("backward"):
            engine.backward(loss / args.grad_accum * scale, sync=(k == args.grad_accum - 1))
        loss_sum += loss.detach().float() / args.grad_accum
    if measured is not None:
        measured.update(holdings(engine, [data.train, data.val], [x, y], device))
    with torch.profiler.record_function("step"):
        grad_norm = engine.step(lr_at(step, args), scaler).double() / scale  # the true gradient's (non-finite: skipped)
    sent = comm.take()
    if dist.is_initialized():
        dist.all_reduce(loss_sum, op=dist.ReduceOp.AVG)  # for the log only: after the ledger's count
    return loss_sum, grad_norm, sent

def build_model(Engine, cfg, device, dtype, checkpoint_activations=False):
    """The GPT on the device; for an engine that makes the model itself (Engine.from_meta: every stage's) on the meta
    device, shapes without storage: the engine makes it a bucket at a time (ZeRO-3's keep only their shard of each, so
    no rank ever holds the whole model)."""
    if getattr(Engine, "from_meta", False):
        with torch.device("meta"):
            return GPT(cfg, checkpoint_activations).to(dtype=dtype)
    return GPT(cfg, checkpoint_activations).to(device=device, dtype=dtype)

def pick_run_dtype(args, device, rank, stage):
    """The run's dtype (--dtype, or auto's choice), rank 0's for every rank (ranks on two machines must agree), said
    by rank 0 with the reason, and its loss scaler (on in fp16 only)."""
    dtype, why = from_rank0(pick_dtype(args.dtype, device) if rank == 0 else None)
    args.dtype = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[dtype]
    scaler = LossScaler(enabled=dtype == torch.float16)
    if rank == 0:
        print(f"{stage}: {args.dtype} ({why})" + f"; loss scale from {scaler.scale:g}" * scaler.enabled, flush=True)
    return dtype, scaler

def main(Engine, stage, distributed=True, formula=None):
    """Train with `Engine`; `stage` names the run, `formula` the stage whose memory model applies (default: stage).
    Build, train, report. What a step records besides training (the memory meter, --profile's and --timeline's step,
    the log, the checkpoints) is `run`'s (instruments.Run), and so is the run's report."""
    args = parse_args(Engine, PRESETS, GPTConfig)
    if args.consolidate:
        return consolidate(*args.consolidate)
    if args.sample:
        return print(sample_text(load_consolidated(args.sample), args, pick_device(args.device, 0)))

    # build: the device, the data, the dtype, the steps to take, the model and its engine
    cfg = gpt_config(args, PRESETS, GPTConfig)
    rank, world_size, device = init_distributed(args) if distributed else (0, 1, pick_device(args.device, 0))
    check_args(args, world_size, rank)
    data = CharData(load_text(args.data), cfg.block_size)
    cfg.vocab_size = max(cfg.vocab_size, len(data.chars))
    dtype, scaler = pick_run_dtype(args, device, rank, stage)  # the loop owns fp16's loss scaler, and passes it
    plan = plan_checkpoints(args, cfg, data.chars, rank, world_size)  # the steps [start, end), the checkpoints
    check_profile(args, plan, rank)
    torch.manual_seed(args.seed + rank)  # ranks start different; each stage must broadcast rank 0's weights
    model = build_model(Engine, cfg, device, dtype, args.checkpoint_activations)
    engine = Engine(model, args, device)
    largest_bucket = max((b.end - b.start for b in getattr(engine, "buckets", [])), default=0)
    th = theory(formula or stage, engine.padded_numel, world_size, dtype, args, device, largest_bucket=largest_bucket)
    run = Run(stage, args, cfg, plan, engine=engine, data=data, th=th, scaler=scaler, device=device, rank=rank,
              world_size=world_size, distributed=distributed)
    run.announce()  # rank 0: Ψ, and the model states per rank the paper's formula gives for this stage
    if plan.manifest:  # this rank's state, the step (and fp16's loss scale) from the checkpoint
        load_checkpoint(plan.where, plan.manifest, engine, device, stage, scaler)

    # train: an optimizer step over the global batch at a time
    for step in run.steps():
        try:
            with run.watch(step) as measured:  # measured: a dict at the step the memory meter measures, else None
                loss, grad_norm, sent = train_step(engine, data, args, step, device, scaler=scaler, measured=measured)
        except NonFiniteGradNorm as e:  # every rank meets it at the same step: the norm is global
            stop(f"error: step {step}: the global gradient norm is {e}, so no update was made"
                 + (f"; the checkpoints in {plan.ckpt_dir} are intact" if plan.ckpt_dir else "")
                 + f"; lower --lr (it is {args.lr}) or --warmup's start, or check --data", rank)
        run.record(step, loss, grad_norm, sent)  # the history, read from the device at the steps that log or save
        if (step + 1) % args.eval_every == 0 or step == args.steps - 1:
            run.history["val_losses"].append((step + 1, evaluate(engine, data, args, device)))
        run.log(step)
        if run.saves(step):
            save_checkpoint(plan.ckpt_dir, engine, step + 1, run.checkpoint_meta(), device)

    # report: rank 0's summary (--out), memory table and sample; then every rank's orderly exit
    summary = summarize(run)
    finish(run, summary, sample=lambda master: sample_text(
        dict(config=vars(cfg), chars=data.chars, state_dict=master), args, device))

if __name__ == "__main__":
    main(SingleDeviceEngine, stage="reference", distributed=False)
