"""
options.py: every option a run takes, with its default (`--help` lists them), and the checks that refuse a bad one,
with one line that names the fix, before any work starts; and the lines an engine refuses a misuse with (Misuse).
"""
import argparse, inspect, os, re
from dataclasses import fields

from checkpoint import add_checkpoint_args
from devices import stop

class Help(argparse.ArgumentDefaultsHelpFormatter):
    """--help shows the default of every option that has one (not None, and not a switch's False)."""
    def _get_help_string(self, action):
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)

def parse_args(Engine, presets, config, argv=None):
    """The options of train_gpt.main, and the Engine's own (its add_args): the GPT (a preset, and overrides of its
    `config` fields), the data, the recipe, the run."""
    p = argparse.ArgumentParser(description=(inspect.getdoc(Engine) or "").split("\n")[0], formatter_class=Help)
    p.add_argument("--preset", default="small", choices=sorted(presets), help="the GPT's size")
    for f in fields(config):
        p.add_argument(f"--{f.name}", type=int, default=None, help="override the preset")
    p.add_argument("--data", default=None, help="a UTF-8 text file; without it, CPython's pydoc topics")
    p.add_argument("--steps", type=int, default=500, help="optimizer steps")
    p.add_argument("--batch_size", type=int, default=16,
                   help="the global batch in sequences, over all ranks and micro-steps")
    p.add_argument("--grad_accum", type=int, default=1, help="micro-steps per optimizer step")
    p.add_argument("--lr", type=float, default=1e-3, help="the learning rate after warmup, decayed to --min_lr")
    p.add_argument("--min_lr", type=float, default=1e-4, help="the learning rate at the last step (cosine decay)")
    p.add_argument("--warmup", type=int, default=20, help="steps of linear warmup")
    p.add_argument("--weight_decay", type=float, default=0.1, help="AdamW's decoupled weight decay")
    p.add_argument("--beta1", type=float, default=0.9, help="Adam's decay of the gradient's mean")
    p.add_argument("--beta2", type=float, default=0.99, help="Adam's decay of the gradient's square")
    p.add_argument("--grad_clip", type=float, default=1.0,
                   help="clip the global gradient norm to this (0: no clipping)")
    p.add_argument("--checkpoint_activations", action="store_true", help="each transformer block keeps only its input "
                   "for backward, which runs the block's forward again (torch.utils.checkpoint, non-reentrant)")
    p.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp16", "fp32"], help="parameters and gradients "
                   "(fp16 with dynamic loss scaling); auto: bf16 where it is fast (a GPU with bf16, a CPU with native "
                   "bf16 matmul: AMX, AVX512-BF16), fp16 on a GPU without (V100, T4), else fp32")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="auto: a GPU where torch sees one")
    p.add_argument("--seed", type=int, default=1337, help="the seed of the weights and of every batch")
    p.add_argument("--collective_timeout", type=float, default=600, help="seconds a collective waits for the other "
                   "ranks before the job ends (a rank out of batches while the others go on would hang them)")
    p.add_argument("--no_broadcast_buffers", action="store_true", help="buffers (BatchNorm's running statistics, say) "
                   "rank 0's once, then each rank's own; by default rank 0's before every forward, as DDP's")
    p.add_argument("--eval_every", type=int, default=100, help="steps between validation losses")
    p.add_argument("--eval_batches", type=int, default=8, help="batches in each validation loss")
    p.add_argument("--sample_chars", type=int, default=300,
                   help="characters the trained GPT writes at the end (0: none)")
    p.add_argument("--out", default=None, help="write a JSON summary here (rank 0)")
    p.add_argument("--save_master", default=None, help="write the final fp32 parameters here (torch.save, rank 0)")
    p.add_argument("--no_progress", action="store_true", help="no progress bar, no progress lines")
    p.add_argument("--timeline", default=None, metavar="DIR", help="write the last step's timeline per rank here "
                   "(bench/timeline.py draws it)")
    p.add_argument("--profile", default=None, metavar="DIR", help="write a torch.profiler trace of one step per rank here")
    add_checkpoint_args(p)  # --ckpt_dir, --save_every, --stop_after, --resume, --consolidate, --sample
    if hasattr(Engine, "add_args"):
        Engine.add_args(p)
    return p.parse_args(argv)

def check_args(args, world_size, rank=0):
    """Every option that could ruin a run silently (beta = 1 turns every weight into NaN), refused before any work;
    every rank finds the same error, so rank 0 alone says it, in one line (devices.stop)."""
    try:
        _check(args, world_size)
    except SystemExit as e:
        stop(str(e), rank)

def _check(args, world_size):
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
    if args.save_every < 0:
        raise SystemExit(f"error: --save_every {args.save_every}: must be 0 or more (0: save only at the end)")
    if args.stop_after is not None and args.stop_after < 1:
        raise SystemExit(f"error: --stop_after {args.stop_after}: must be at least 1")
    if args.save_every and not args.ckpt_dir:
        raise SystemExit("error: --save_every needs --ckpt_dir DIR, the directory to save into")
    nvme = getattr(args, "offload_optimizer", "cpu") == "nvme"
    if nvme and not args.nvme_path:
        raise SystemExit("error: --offload_optimizer nvme needs --nvme_path DIR, the directory for the state files")
    if getattr(args, "nvme_path", None) and not nvme:
        raise SystemExit(f"error: --nvme_path {args.nvme_path} is for --offload_optimizer nvme: add it, or drop "
                         f"--nvme_path")
    if nvme and args.nvme_buffer_count < 1:
        raise SystemExit(f"error: --nvme_buffer_count {args.nvme_buffer_count}: must be at least 1 (3 overlaps the "
                         f"reads and the writes with AdamW)")

def load_text(path):
    """The text of --data; without one, a corpus that ships with every CPython (the text of its pydoc topics)."""
    if path is None:  # runs of spaces (its indented grammar and tables) collapsed, so samples read as prose
        from pydoc_data.topics import topics
        return re.sub(" {2,}", " ", "\n\n".join(topics[k] for k in sorted(topics)))
    if not os.path.isfile(path):
        raise SystemExit(f"error: --data {path}: no such file; pass a UTF-8 text file (or none: the built-in corpus)")
    with open(path, encoding="utf-8") as f:
        return f.read()

def gpt_config(args, presets, config):
    """The preset's GPT (a `config`) with the --n_layer ... overrides given."""
    n_layer, n_head, n_embd, block_size, vocab_size = presets[args.preset]
    cfg = config(block_size, vocab_size, n_layer, n_head, n_embd)
    for f in fields(config):
        if getattr(args, f.name) is not None:
            setattr(cfg, f.name, getattr(args, f.name))
    if cfg.n_embd % cfg.n_head:
        raise SystemExit(f"error: --n_embd {cfg.n_embd} is not divisible by --n_head {cfg.n_head}")
    return cfg

def require(condition, misuse):
    """An engine's guard: unless condition holds, refuse the misuse (a Misuse line, which names the fix)."""
    if not condition:
        raise RuntimeError(misuse)

def refuse_sparse(model):
    """Refuse a module that makes sparse gradients for a trained parameter (nn.Embedding or nn.EmbeddingBag with
    sparse=True): every engine adds gradients into dense flat buffers, which a sparse gradient cannot be viewed into."""
    for name, m in model.named_modules():
        if getattr(m, "sparse", False) is True and any(p.requires_grad for p in m.parameters(recurse=False)):
            raise RuntimeError(Misuse.SPARSE.format(name or "the model", type(m).__name__))

class Misuse:  # what an engine refuses, one line each (train_gpt.trained and every Engine, through require)
    OUTSIDE_BACKWARD = ("a gradient arrived outside engine.backward (was loss.backward() called directly?): call "
                        "engine.backward(loss, sync), which arms the engine's hooks and reduces gradients across ranks")
    NO_GRADIENT = ("engine.backward: a trained parameter got no gradient: each parameter that requires grad must take "
                   "part in the loss; freeze the others (requires_grad_(False)) before building the engine")
    NO_BACKWARD = ("engine.step: no engine.backward(loss, sync=True) since the last step: call it on each step's last "
                   "micro-step")
    META = ("a tensor on the meta device that no engine can make: an engine makes trained parameters from the meta "
            "device with the model's init_weight(p), as GPT.init_weight; build the rest, or the model, on a device")
    NOTHING_TRAINED = ("no parameter requires a gradient: an engine trains the parameters that require one; unfreeze "
                       "some (requires_grad_(True)) before building the engine")
    DTYPES = ("trained parameters of two dtypes, {} ({}) and {} ({}): an engine keeps them in one flat buffer of the "
              "first one's dtype; cast the model to one dtype (model.to(dtype)) before building the engine")
    SPARSE = ("{} ({}) makes sparse gradients (sparse=True): an engine adds gradients into dense buckets; build it "
              "with sparse=False (the default)")
    WRITTEN = ("engine.step: a trained parameter was written outside the engine since it was built or last stepped (an "
               "in-place change): the update starts from the engine's master weights and would undo it; change trained "
               "values before building the engine, or resume them from a checkpoint (checkpoint.py)")
    CHANGED = ("engine.forward: the model's trained parameters changed after the engine was built (a module added or "
               "replaced, requires_grad switched): build the engine after the model's last change")
