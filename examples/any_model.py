"""
examples/any_model.py: a stage on a model of your own, checked against the single-process reference.

    torchrun --standalone --nproc_per_node 2 examples/any_model.py --stage stage2.py
    python examples/any_model.py --stage stage3.py --steps 20             # a world of one

The model is no GPT: an MLP over sets of vectors, with a frozen input layer, a buffer, residual blocks in an
nn.ModuleList (stage 3's units) and a forward that takes a mask; the loss is computed outside it. Each rank trains it
with the stage's Engine on its slice of every global batch (as train_gpt.main does), and also trains it alone with
train_gpt's single-device reference on the whole batch, in fp32. It exits non-zero unless the two agree to the GPT
tests' tolerances: the losses, the global gradient norms, step 0's gradients as engine.grad reads them, and the final
parameters; and unless the frozen layer and the buffer are rank 0's on every rank, untouched. Other options are
train_gpt.py's that the engines read (--steps, --grad_accum, --lr, --grad_clip, --bucket_mb, --no_prefetch, ...).
"""
import argparse
import importlib.util
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from checkpoint import gather_master  # noqa: E402
from devices import everyone, init_distributed  # noqa: E402
from options import check_args, parse_args  # noqa: E402
from train_gpt import PRESETS, GPTConfig, SingleDeviceEngine, lr_at, trained  # noqa: E402

# The GPT tests' tolerances, for fp32 (tests/test_stages.py says why; tests/test_any_model.py checks they are the same)
LOSS_ATOL, NORM_RTOL, BULK_RTOL, BULK_SHARE, ATOL_ANY = 2e-6, 1e-5, 1e-6, 0.999, 1e-5
D_IN, WIDTH, CLASSES, LENGTH = 13, 24, 5, 7


class SetClassifier(nn.Module):
    """Classifies a set of up to LENGTH vectors, of which `mask` says which are real."""
    def __init__(self, depth=3):
        super().__init__()
        self.embed = nn.Linear(D_IN, WIDTH).requires_grad_(False)  # frozen: trained elsewhere, say
        self.register_buffer("scale", torch.rand(D_IN) + 0.5)  # per-feature input scale, not trained
        # LayerNorm without a bias, as in the GPT: a tensor that starts at 0 stays tiny for some steps, and the tests'
        # tolerance (1e-6 of a tensor's largest value) would then be finer than fp32's rounding of a different sum order
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(WIDTH, bias=False), nn.Linear(WIDTH, WIDTH), nn.GELU())
                                    for _ in range(depth))
        self.head = nn.Linear(WIDTH, CLASSES)

    def forward(self, x, mask):
        h = self.embed(x * self.scale)
        for block in self.blocks:
            h = h + block(h)
        m = mask.unsqueeze(-1).to(h.dtype)
        return self.head((h * m).sum(1) / m.sum(1))  # the mean over the real vectors


def batch(step, part, n_parts, size, device):
    """Part `part` of `n_parts` equal slices of step `step`'s global batch of `size` sets (a function of step alone)."""
    g = torch.Generator().manual_seed(step)
    x = torch.randn(size, LENGTH, D_IN, generator=g)
    mask = torch.arange(LENGTH) < torch.randint(1, LENGTH + 1, (size, 1), generator=g)
    teacher = torch.randn(D_IN, CLASSES, generator=torch.Generator().manual_seed(0))
    y = ((x * mask.unsqueeze(-1)).sum(1) @ teacher).argmax(1)  # a rule the model can learn
    per = size // n_parts
    return tuple(t[part * per:(part + 1) * per].to(device) for t in (x, mask, y))


def load_engine(path):
    """The Engine class a stage file runs: the last name in it ending in Engine (offload.py's OffloadEngine)."""
    spec = importlib.util.spec_from_file_location(Path(path).stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return [v for k, v in vars(module).items()
               if k.endswith("Engine") and isinstance(v, type) and v.__module__ == module.__name__][-1]


def train(engine, model, args, rank, world_size, device):
    """Train for args.steps; at micro-step k rank r takes slice k*N + r of the batch. Returns the losses (averaged over
    the ranks), the global gradient norms, and step 0's gradients as engine.grad reads them: {name: (lo, values)}."""
    losses, norms, grads = [], [], {}
    for step in range(args.steps):
        loss_sum = torch.zeros((), device=device)
        for k in range(args.grad_accum):
            x, mask, y = batch(step, k * world_size + rank, world_size * args.grad_accum, args.batch_size, device)
            loss = F.cross_entropy(engine.forward(x, mask=mask), y)
            engine.backward(loss / args.grad_accum, sync=(k == args.grad_accum - 1))
            loss_sum += loss.detach() / args.grad_accum
        if step == 0:
            for name, p in trained(model):
                lo, g = engine.grad(p)
                grads[name] = lo, g.clone()
        norms.append(float(engine.step(lr_at(step, args))))
        if world_size > 1:
            dist.all_reduce(loss_sum, op=dist.ReduceOp.AVG)
        losses.append(loss_sum.item())
    return losses, norms, grads


def differs(what, expected, got, lo=0):
    """tests/test_stages.py's compare_params on got, elements [lo, lo + n) of expected: 99.9% of them within 1e-6 of
    expected's largest value, all within 1e-5. None if they agree, else what differs."""
    e = expected.reshape(-1)[lo:lo + got.numel()].cpu()
    diff = (got.reshape(-1).cpu() - e).abs()
    bulk = (diff <= BULK_RTOL * expected.abs().max().cpu()).float().mean().item()
    if diff.numel() and (bulk < BULK_SHARE or diff.max() > ATOL_ANY):
        i = int(diff.argmax())
        return f"{what}: element {lo + i} is {got.reshape(-1)[i]:.8g}, expected {e[i]:.8g} (|diff| {diff[i]:.2e})"


def first_difference(expected, got, tol):
    return next((i for i, (e, g) in enumerate(zip(expected, got)) if abs(e - g) > tol * max(1.0, abs(e))), None)


def main():
    own = argparse.ArgumentParser(description=__doc__.strip().split("\n")[0], epilog="and train_gpt.py's options")
    own.add_argument("--stage", required=True, help="the stage file: stage0_ddp.py ... offload.py, or your own")
    ours, rest = own.parse_known_args()
    Engine = load_engine(ours.stage)
    args = parse_args(Engine, PRESETS, GPTConfig, ["--steps", "6", "--grad_accum", "2", "--warmup", "2", *rest])
    rank, world_size, device = init_distributed(args)
    check_args(args, world_size, rank)

    torch.manual_seed(args.seed + rank)  # ranks start different: the engine must broadcast rank 0's model
    model = SetClassifier().to(device)
    engine = Engine(model, args, device)
    losses, norms, grads = train(engine, model, args, rank, world_size, device)
    torch.manual_seed(args.seed)  # rank 0's model, trained alone on the whole batch
    reference = SetClassifier().to(device)
    ref_engine = SingleDeviceEngine(reference, args, device)
    ref_losses, ref_norms, ref_grads = train(ref_engine, reference, args, 0, 1, device)

    problems, stage = [], Path(ours.stage).stem
    k = first_difference(ref_norms, norms, NORM_RTOL)
    if k is not None:
        problems.append(f"global gradient norm at step {k}: {norms[k]:.7g}, expected {ref_norms[k]:.7g}")
    k = first_difference(ref_losses, losses, LOSS_ATOL)
    if k is not None:
        problems.append(f"loss at step {k}: {losses[k]:.7f}, expected {ref_losses[k]:.7f}")
    for name, (lo, g) in grads.items():
        problems.append(differs(f"engine.grad({name}) after step 0's backward", ref_grads[name][1], g, lo))
    n_trained = sum(p.numel() for _, p in trained(reference))
    if sum(everyone(sum(g.numel() for _, g in grads.values()))) < n_trained:
        problems.append("engine.grad: the ranks' parts of the gradients do not cover every trained element")
    untouched = {**dict(reference.named_parameters()), **dict(reference.named_buffers())}
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if not t.requires_grad and not torch.equal(t, untouched[name]):
            problems.append(f"{name} (frozen or a buffer) is not rank 0's, untouched")
    master = gather_master(engine)  # on rank 0: every rank's pieces of the final fp32 parameters
    if rank == 0:
        for name, p in trained(reference):
            problems.append(differs(f"parameter {name} after training", p.detach(), master[name]))
    problems = [p for p in problems if p]
    for p in problems:
        print(f"error: {stage} on rank {rank} of {world_size}: {p}", file=sys.stderr, flush=True)
    failed = any(everyone(bool(problems)))
    if rank == 0 and not failed:
        print(f"{stage}: {world_size} rank(s), {args.steps} steps, loss {losses[0]:.4f} -> {losses[-1]:.4f}: the same "
              f"as the single-process reference (losses, gradient norms, engine.grad, parameters; frozen layer and "
              f"buffer rank 0's, untouched)", flush=True)
    dist.barrier()  # gloo ranks of torch 2.13 may abort at exit without it
    dist.destroy_process_group()
    sys.stdout.flush(), sys.stderr.flush()
    os._exit(1 if failed else 0)


if __name__ == "__main__":
    main()
