"""
checkpoint.py: save, stop, and resume under any stage at any world size (a later chapter than the stages).

An engine lists the training state it holds as pieces:
    (parameter name, [lo, hi) of that parameter's flattened elements, [views of fp32 master, Adam m, Adam v])
Each rank saves its pieces; as they name parameters, not ranks or buckets, a rank of another stage or world size
takes the overlaps of the pieces it needs with the pieces saved (DeepSpeed's "universal checkpoint" idea).
Files are written atomically (temporary file, fsync, rename); rank 0 writes the manifest last, after every shard
is on disk, and a checkpoint without its manifest does not exist: a crash mid-save leaves the previous one whole.

    torchrun --standalone --nproc_per_node 4 stage3.py --steps 300 --save_every 50 --ckpt_dir runs/ck --stop_after 150
    torchrun --standalone --nproc_per_node 2 stage1.py --steps 300 --resume runs/ck     # another stage, another N
    python train_gpt.py --consolidate runs/ck gpt.pt  &&  python train_gpt.py --sample gpt.pt

train_gpt.main calls it; the stage files never do: an Engine only lists its pieces (state_pieces) and takes them
back (resume).

- `--ckpt_dir DIR --save_every K` saves after every K steps and at the end into DIR/step_000K/: one
  shard_0000r_of_0000N.pt per rank (its fp32 master weights, Adam moments and random state) and a manifest.json
  (step, model config, vocabulary, loss history, and the size and sha256 of every shard). The newest two complete
  checkpoints are kept. On several nodes, DIR must be a file system that every node sees.
- `--stop_after K` ends the run after step K, as if interrupted, while the learning-rate schedule still follows
  --steps (cut a long run into jobs that fit a cluster's time limit).
- `--resume DIR` continues from the newest complete checkpoint in DIR (or from a step_* directory named directly)
  and saves on into DIR unless --ckpt_dir says otherwise. The data position is the step: the batch of step s is a
  function of (seed, s) alone, so a stage that stops and resumes on the same N gives the uninterrupted run bit for bit
  on the CPU. On a GPU it is as deterministic as the kernels: CUDA promises the same bits only under
  torch.use_deterministic_algorithms(True) (with CUBLAS_WORKSPACE_CONFIG=:4096:8), since some kernels sum with atomics;
  on one H100 stage 3 was bit for bit in fp32 and bf16 without it (tests/gpu_check.sh's repeat step).
- Refused before anything is written, each with one line that says what is wrong and what to do: a directory with no
  complete checkpoint, a manifest that is not one, a shard missing, truncated or corrupt (size and sha256 against
  the manifest; each rank checks its share), shards that hold less than the manifest promises, a checkpoint of
  another model (--preset and overrides) or another text (--data), and a --ckpt_dir that holds another run's.
- With offload's --delayed_update, a save first lands the CPU update in flight (as the end of training does), so a
  run that saves is one update less stale at that step than one that does not; every other stage resumes exactly.
"""
import glob, hashlib, json, math, os, shutil
from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.distributed as dist

from devices import agree, everyone, from_rank0

def add_checkpoint_args(p):
    """The options of checkpoints (train_gpt's parser takes them from here)."""
    p.add_argument("--ckpt_dir", default=None, help="save checkpoints here: every --save_every steps and at the end")
    p.add_argument("--save_every", type=int, default=0, help="steps between checkpoints (0: only at the end)")
    p.add_argument("--stop_after", type=int, default=None, help="stop after this step, as if interrupted; the "
                   "schedule still follows --steps")
    p.add_argument("--resume", default=None, metavar="DIR", help="continue from the newest complete checkpoint in DIR "
                   "(or from DIR itself, a step_* directory); any stage, any world size")
    p.add_argument("--consolidate", nargs=2, default=None, metavar=("DIR", "OUT"), help="write the checkpoint's "
                   "fp32 weights to one file OUT, then exit")
    p.add_argument("--sample", default=None, metavar="FILE", help="print text from a consolidated file, then exit")

def pieces_of(engine, states):
    """A stage's state_pieces(): for each trained parameter p that this rank holds some of, (p's name, [lo, hi) of its
    elements, a view of each flat tensor in `states`, the master and Adam's m and v, at p's piece). engine.piece_of(p)
    says where: p's elements [lo, hi) lie from `at` on in the rank's flat states."""
    pieces = []
    for name, p in engine.model.named_parameters():
        if p.requires_grad:
            lo, hi, at = engine.piece_of(p)
            if lo < hi:  # this rank holds some of p
                pieces.append((name, lo, hi, [t[at:at + hi - lo] for t in states]))
    return pieces

STATE = ("master", "exp_avg", "exp_avg_sq")  # the K = 12 bytes per parameter, what a checkpoint must not lose
KEEP = 2  # complete checkpoints kept: the newest, and one before it in case the newest is damaged

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

def checkpoint_due(step, end, args):
    """Save after this step? Every --save_every steps, and at the end of the run."""
    return step + 1 == end or bool(args.save_every) and (step + 1) % args.save_every == 0

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
        # the step directory's own name, before older checkpoints go (a power cut must leave one of them)
        fsync_dir(ckpt_dir)
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

@dataclass
class CheckpointPlan:
    """What plan_checkpoints decided before any work: the steps [start, end) this run takes, and the checkpoints."""
    where: str | None  # the checkpoint it resumes (a step_* directory), or None
    manifest: dict | None  # that checkpoint's manifest.json, or None
    start: int  # the first step: the checkpoint's, or 0
    end: int  # the step it stops before: --steps, or --stop_after
    ckpt_dir: str | None  # where it saves (--ckpt_dir, else the directory it resumed from), or None: no checkpoints

def plan_checkpoints(args, cfg, chars, rank, world_size):
    """Before any work: the checkpoint to resume (it must fit this model and data, and each rank checks its share of
    the shards' hashes), the steps [start, end) this run takes, and where it saves: never over another run's
    checkpoints, nor over this run's later ones. Rank 0 picks the checkpoint: on a shared file system a rank's view of
    a directory can lag, and ranks that each took "the newest" could resume different steps. Every refusal is agreed.
    A CheckpointPlan."""
    where = None
    manifest = None
    error = None
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
    return CheckpointPlan(where=where, manifest=manifest, start=start, end=end, ckpt_dir=ckpt_dir)

def saved_pieces(where, manifest):
    """Every piece a checkpoint holds, as (name, lo, hi, {"master": values, "exp_avg": ..., "exp_avg_sq": ...})."""
    for s in manifest["shards"]:
        shard = torch.load(os.path.join(where, s["file"]), mmap=True, weights_only=True)  # reads only what is used
        at = 0
        for name, lo, hi in shard["pieces"]:
            yield name, lo, hi, {k: shard[k][at:at + hi - lo] for k in STATE}
            at += hi - lo

def load_checkpoint(where, manifest, engine, device, stage=None, scaler=None):
    """Fill this rank's pieces from the saved ones, whatever stage and world size saved them; return the step. With
    `stage` (the run's name), rank 0 says so. An fp16 run's `scaler` (train_gpt.LossScaler) continues a saved fp16
    run's; from a bf16 or fp32 checkpoint, or into one, it starts anew but for the count of steps skipped."""
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
    saved_scaler = manifest.get("loss_scaler") or {}
    engine.resume(manifest["step"] - saved_scaler.get("skipped", 0))  # Adam's t: the steps taken, less those fp16's
    # loss scaler skipped (a skipped step advances no step counter)
    if scaler is not None and scaler.enabled and saved_scaler.get("enabled"):
        vars(scaler).update(saved_scaler)
    elif scaler is not None:  # a new scale (one dtype saved, another resumes), but the steps skipped stay skipped
        scaler.skipped = saved_scaler.get("skipped", 0)
    if stage and rank == 0:
        print(f"{stage}: resumed from {where} (saved by {manifest['stage']} on {manifest['world_size']} rank(s)) at "
              f"step {manifest['step']}", flush=True)
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
    return {name: t.view(shapes[name]) for name, t in full.items()}, missing

_host_group = []

def host_group():
    """A process group whose collectives move host memory (gloo): NCCL's would stage every rank's pieces, the whole
    fp32 model, on rank 0's GPU. The default group where that is gloo already; made once, by every rank."""
    if dist.get_backend() == "gloo":
        return None
    if not _host_group:
        _host_group.append(dist.new_group(backend="gloo"))
    return _host_group[0]

def gather_master(engine):
    """The full fp32 master weights {name: tensor}, on rank 0 (None elsewhere): a collective over every rank. Each rank
    sends its pieces as one flat host buffer and their (name, lo, hi): pickled, a view would carry its whole storage,
    once per piece. Pieces a lower rank holds too (stage 0's replicated state) are sent once."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    pieces = engine.state_pieces()
    held_below = {key for keys in everyone([tuple(p[:3]) for p in pieces])[:rank] for key in keys}
    pieces = [p for p in pieces if tuple(p[:3]) not in held_below]
    flat = torch.empty(sum(hi - lo for _, lo, hi, _ in pieces))  # fp32, on the host
    at = 0
    for _, lo, hi, views in pieces:
        flat[at:at + hi - lo].copy_(views[0].detach().reshape(-1))
        at += hi - lo
    mine = ([tuple(p[:3]) for p in pieces], flat)
    if dist.is_initialized():
        every = [None] * dist.get_world_size() if rank == 0 else None
        dist.gather_object(mine, every, dst=0, group=host_group())
    else:
        every = [mine]
    if rank != 0:
        return None
    shapes = {name: p.shape for name, p in engine.model.named_parameters() if p.requires_grad}  # what is trained
    return with_tied_names(assemble(unflatten(every), shapes)[0], tied_names(engine.model))

def tied_names(model):
    """{name: the name it is tied to} for each further name of a trained parameter that a model holds under several
    (GPT's lm_head.weight, the token embedding's): pieces and shards carry a tied parameter under its first name."""
    first = {}
    tied = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if p.requires_grad and first.setdefault(p, name) != name:
            tied[name] = first[p]
    return tied

def with_tied_names(state, tied):
    """The state dict with every name of a tied parameter (as DeepSpeed's zero_to_fp32 restores them), one tensor
    under each, so that it loads with strict=True into the model it came from."""
    return {**state, **{name: state[to] for name, to in tied.items() if to in state}}

def unflatten(every):
    """(name, lo, hi, values) for each piece of each rank's (index, flat buffer), the values views of the buffer."""
    for index, flat in every:
        at = 0
        for name, lo, hi in index:
            yield name, lo, hi, flat[at:at + hi - lo]
            at += hi - lo

def consolidate(path, out):
    """A sharded checkpoint -> one file with the GPT's fp32 weights, config and vocabulary (zero_to_fp32.py's job)."""
    where, manifest = open_checkpoint(path, None, None)
    state, missing = assemble(((name, lo, hi, saved["master"]) for name, lo, hi, saved in saved_pieces(where, manifest)),
                              manifest["params"])
    if missing:
        raise SystemExit(f"error: checkpoint {where}: its shards do not hold all of {missing[0]}; the shards do not "
                         f"match the manifest")
    named = with_tied_names(state, manifest.get("tied", {}))  # (a manifest from before "tied" has none)
    atomic_write(out, lambda f: torch.save({"config": manifest["config"], "chars": manifest["chars"], "step": manifest["step"],
                                            "state_dict": named}, f))
    print(f"wrote {out}: {sum(t.numel() for t in state.values()):,} fp32 parameters after step {manifest['step']} of {where}")

def load_consolidated(path):
    """The file --consolidate writes, or one line saying what --sample takes."""
    fix = "--sample takes the one file that --consolidate writes (python train_gpt.py --consolidate CKPT_DIR OUT.pt)"
    if not os.path.isfile(path):
        raise SystemExit(f"error: --sample {path}: " + ("a directory" if os.path.isdir(path) else "no such file") + f"; {fix}")
    try:
        saved = torch.load(path, weights_only=True)
        if not {"config", "chars", "state_dict"} <= set(saved):
            raise KeyError("config")
    except Exception:
        raise SystemExit(f"error: --sample {path}: not a consolidated GPT (a checkpoint shard, or another file); {fix}") from None
    return saved
