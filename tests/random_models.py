"""Small models generated from a seed, trained 3 steps by one engine on this rank's slice of each batch and, in the same
process, by a single-process torch.optim.AdamW with the project's recipe on the whole batch (fp32). Run by
tests/test_any_model_random.py under N ranks, one process group for many seeds:

    python tests/random_models.py --stage stage3.py --seeds 0-11

A model is a few units in an nn.ModuleList called in a seeded order (some twice, some outputs left unused), nested
units, outputs of any structure (dict, list, namedtuple, dataclass, non-tensors beside tensors), frozen units, weights
tied across units, odd sizes and 1-element parameters; and parameters that leave their unit: a unit that returns its
bias beside its output, a unit's weight read by the root after the unit ran, a unit's weight tied to a module that is
no unit; and four patterns where ranks may differ: experts of one size run in an order that depends on each rank's own
data (a mixture of experts), a view of a unit's weight kept from its forward and used by the root after the unit ran
(self.weight.t()), a 0-d trained parameter (a LayerScale gain), a write to a trained parameter between steps. Each
engine trains a model as the reference does, or refuses it in one line before any update (the masters then equal
the reference's after the steps done): the write on every engine, and on stage 3 and offload at N > 1 experts in
data-dependent order as units (then, with the experts' caller one unit, units=[moe], it trains right). Exits non-zero
after printing, for each seed that differs by more than 1e-5 relative (losses, gradient norms, final weights), what
differed and the model; prints each refusal."""
import argparse
import dataclasses
import datetime
import inspect
import os
import random
import re
import sys
from collections import namedtuple
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from any_model import load_engine  # noqa: E402
from checkpoint import gather_master  # noqa: E402
from options import parse_args  # noqa: E402
from train_gpt import PRESETS, GPTConfig, lr_at  # noqa: E402

RTOL, STEPS, BATCH = 1e-5, 3, 8
Pair = namedtuple("Pair", "value note")


@dataclasses.dataclass
class Result:
    value: torch.Tensor
    name: str


def wrap(shape, y, x):
    """y (and the unit's input x, passed through) in an output of the given structure."""
    if shape == "dict":
        return {"value": y, "input": x, "note": "text", "count": 2}
    if shape == "list":
        return [None, y, 1.5]
    if shape == "namedtuple":
        return Pair(y, note="a note")
    if shape == "dataclass":
        return Result(y, "a name")
    return y


def unwrap(out):
    if isinstance(out, dict):
        return out["value"] + 0.5 * out["input"]
    if isinstance(out, list):
        return out[1]
    return out if isinstance(out, torch.Tensor) else out.value


class Linear(nn.Linear):
    """An nn.Linear that may keep a view of its weight from its forward (self.cached = self.weight.t()), for the root
    to use after it ran: on stage 3 and offload, after its unit is freed."""
    caches = False

    def forward(self, x):
        if self.caches:
            self.cached = self.weight.t()
        return super().forward(x)


class Unit(nn.Module):
    """A linear map of the width, or two nested in an nn.ModuleList (units in a unit), or one with a 1-element scale;
    its output wrapped in a structure."""
    def __init__(self, kind, width, shape):
        super().__init__()
        self.kind = kind
        self.shape = shape
        self.returns_bias = False  # (output, its last linear's bias): the caller adds the bias
        self.inner = nn.ModuleList(Linear(width, width) for _ in range(2 if kind == "nested" else 1))
        if kind == "scaled":
            self.scale = nn.Parameter(torch.ones(1) * 0.9)

    def forward(self, x):
        y = x
        for layer in self.inner:
            y = torch.tanh(layer(y))
        if self.kind == "scaled":
            y = y * self.scale
        if self.returns_bias:
            return wrap(self.shape, y, x), self.inner[-1].bias
        return wrap(self.shape, y, x)


class MoE(nn.Module):
    """Experts of one size, each run on the whole input in an order that depends on the data (on each rank, its own
    slice of the batch); their sum does not depend on the order."""
    def __init__(self, width, n):
        super().__init__()
        self.experts = nn.ModuleList(nn.Linear(width, width) for _ in range(n))

    def forward(self, h):
        order = sorted(range(len(self.experts)), key=lambda i: float(torch.sin(100 * (i + 1) * h.detach().sum())))
        return sum(torch.tanh(self.experts[i](h)) for i in order)


class RandomModel(nn.Module):
    def __init__(self, seed):
        super().__init__()
        r = random.Random(seed)
        self.width = r.choice([1, 3, 5, 7])
        n = r.randint(2, 4)
        kinds = [r.choice(["plain", "nested", "scaled"]) for _ in range(n)]
        shapes = [r.choice(["tensor", "dict", "list", "namedtuple", "dataclass"]) for _ in range(n)]
        self.units = nn.ModuleList(Unit(k, self.width, s) for k, s in zip(kinds, shapes))
        self.head = nn.Linear(self.width, 3)
        # the calls: every unit at least once, some twice, in a shuffled order; some outputs left unused
        self.calls = list(range(n)) + [r.randrange(n) for _ in range(r.randint(0, 2))]
        r.shuffle(self.calls)
        self.unused = [i for i in range(n) if r.random() < 0.3]
        self.frozen = [i for i in range(n) if r.random() < 0.25]
        for i in self.frozen:
            self.units[i].requires_grad_(False)
        self.tied = None
        if r.random() < 0.5 and n > 2:
            self.tied = r.sample(range(n), 2)  # the first linear of unit b takes unit a's weight
            a, b = self.tied
            self.units[b].inner[0].weight = self.units[a].inner[0].weight
        # parameters that leave their unit (drawn last: the draws above make the same models with or without them)
        self.returning = [i for i in range(n) if r.random() < 0.25]
        for i in self.returning:
            self.units[i].returns_bias = True
        self.read = r.randrange(n) if r.random() < 0.5 else None  # the root reads this unit's weight after the calls
        self.mix = None
        if r.random() < 0.5:  # a linear of the root's, no unit, whose weight is a unit's first linear's
            self.shared = r.randrange(n)
            self.mix = nn.Linear(self.width, self.width, bias=False)
            self.mix.weight = self.units[self.shared].inner[0].weight
        # where ranks may differ (drawn after the rest, as the rest was drawn after what came before it)
        self.moe = MoE(self.width, 3) if r.random() < 0.3 else None
        self.cache_reader = r.randrange(n) if r.random() < 0.3 else None  # the root uses this unit's kept view
        if self.cache_reader is not None:
            self.units[self.cache_reader].inner[0].caches = True
        self.gain = nn.Parameter(torch.tensor(0.9)) if r.random() < 0.3 else None
        self.written = r.random() < 0.2  # the head's weight halved in place after step 0
        self.description = (f"RandomModel({seed}): width {self.width}, units {list(zip(kinds, shapes))}, calls "
                            f"{self.calls}, outputs also computed and unused for {self.unused}, frozen {self.frozen}, "
                            f"tied (first linear's weight) {self.tied}, returning their bias {self.returning}, weight "
                            f"read by the root {self.read}, weight tied to the root's linear "
                            f"{self.shared if self.mix else None}, experts in data order {self.moe is not None}, view "
                            f"kept by {self.cache_reader}, 0-d gain {self.gain is not None}, written {self.written}")

    def forward(self, x):
        h = x
        for i in self.calls:
            if i in self.unused:
                self.units[i](h)  # an output no loss uses
            out = self.units[i](h)
            h = unwrap(out[0]) + out[1] if i in self.returning else unwrap(out)
        if self.read is not None:
            h = h + 0.5 * torch.tanh(h @ self.units[self.read].inner[0].weight.t())
        if self.mix is not None:
            h = h + 0.5 * torch.tanh(self.mix(h))
        if self.moe is not None:
            h = h + 0.5 * self.moe(h)
        if self.cache_reader is not None:
            h = h + 0.5 * torch.tanh(h @ self.units[self.cache_reader].inner[0].cached)
        return self.head(h) * self.gain if self.gain is not None else self.head(h)

    def __repr__(self):
        return self.description


def batch(step, width):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(BATCH, width, generator=g), torch.randn(BATCH, 3, generator=g)


def loss_of(out, y):
    return ((out - y) ** 2).mean()


def reference(model, args):
    """torch.optim.AdamW with the project's recipe: warmup and cosine lr, global-norm clipping, decoupled decay."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(args.beta1, args.beta2), eps=1e-8,
                            weight_decay=args.weight_decay)
    losses, norms = [], []
    masters = [{name: p.detach().clone() for name, p in model.named_parameters()}]
    for step in range(STEPS):
        x, y = batch(step, model.width)
        loss = loss_of(model(x), y)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(params, args.grad_clip)))
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        masters.append({name: p.detach().clone() for name, p in model.named_parameters()})
    return losses, norms, masters


def engine_run(engine, model, args, losses, norms):
    """Train STEPS steps, each step's loss and norm appended as it ends (a refusal leaves the steps done)."""
    rank = dist.get_rank()
    per = BATCH // dist.get_world_size()
    for step in range(STEPS):
        if step == 1 and model.written:
            with torch.no_grad():
                model.head.weight.mul_(0.5)
        x, y = batch(step, model.width)
        loss = loss_of(engine.forward(x[rank * per:(rank + 1) * per]), y[rank * per:(rank + 1) * per])
        engine.backward(loss, sync=True)
        norms.append(float(engine.step(lr_at(step, args))))
        total = loss.detach().clone()
        dist.all_reduce(total, op=dist.ReduceOp.AVG)
        losses.append(total.item())


def off(got, expected):
    return abs(got - expected) > RTOL * max(abs(expected), 1e-3)


# the one-line refusals a model may meet: a write between steps (stages 0-2; stage 3 and offload: the parameter is
# freed), and units run in a data-dependent order (stage 3 and offload at N > 1)
WRITTEN = r"^engine\.step: a trained parameter was written outside the engine|^head\.weight of unit the root is freed"
ORDER = r"^the ranks' collectives paired different units \(collective \d+ of the step, rank 0: moe\.experts\.\d.*" \
        r"units=\[model\.moe\]"


def check(seed, Engine, args, rank, world_size, moe_unit=False):
    """What differs between the engine and the reference on seed's model, or None. moe_unit: its experts' caller is
    one unit (units=[moe])."""
    torch.manual_seed(seed)
    model = RandomModel(seed)
    expected_model = RandomModel(seed)
    expected_model.load_state_dict(model.state_dict())
    takes_units = "units" in inspect.signature(Engine).parameters
    # the engine's own units (each nn.ModuleList's children), but with moe_unit the experts' caller for the experts
    units = [m for ml in model.modules() if isinstance(ml, nn.ModuleList) for m in ml
             if not moe_unit or ml is not model.moe.experts] + [model.moe] * moe_unit
    engine = Engine(model, args, torch.device("cpu"), **({"units": units} if takes_units else {}))
    losses, norms = [], []
    refusal = None
    try:
        engine_run(engine, model, args, losses, norms)
    except RuntimeError as e:
        refusal = str(e)
    ref_losses, ref_norms, ref_masters = reference(expected_model, args)
    problems = []
    allowed = [WRITTEN] * model.written + [ORDER] * (model.moe is not None and takes_units and world_size > 1)
    if refusal is not None:
        if rank == 0:
            print(f"seed {seed}: refused after {len(norms)} steps: {refusal}", flush=True)
        if "\n" in refusal or not any(re.search(a, refusal) for a in allowed):
            return [f"refused with: {refusal}"]
    elif model.written:
        problems.append("a write to a trained parameter between steps was not refused")
    if refusal is not None and re.search(ORDER, refusal) and not moe_unit:
        problems += check(seed, Engine, args, rank, world_size, moe_unit=True) or []
    for what, got, expected in (("loss", losses, ref_losses), ("gradient norm", norms, ref_norms)):
        problems += [f"{what} at step {k}: {g:.8g}, expected {e:.8g}" for k, (g, e) in enumerate(zip(got, expected))
                     if off(g, e)]
    master = gather_master(engine)
    if rank == 0:
        # after a refusal, the masters the steps done left
        for name, p in ref_masters[len(norms)].items():
            if name in master:
                diff = (master[name].view_as(p) - p.detach()).abs().max().item()
                if diff > RTOL * max(p.detach().abs().max().item(), 1e-3):
                    problems.append(f"{name} ends {diff:.2e} off the reference")
    return problems or None


def sparse_refused(Engine, args):
    """An nn.EmbeddingBag(sparse=True) (torch's sparse gradients) is refused as the engine is built, in one line that
    names it and sparse=False; else what happened."""
    model = nn.Sequential(nn.EmbeddingBag(10, 4, sparse=True), nn.Linear(4, 2))
    try:
        Engine(model, args, torch.device("cpu"))
    except RuntimeError as e:
        if str(e).startswith("0 (EmbeddingBag) ") and "sparse=False" in str(e) and "\n" not in str(e):
            return None
        return [f"refused sparse gradients with: {e}"]
    return ["built an engine on an nn.EmbeddingBag(sparse=True)"]


def seeds(text):
    """The seeds of "0-5,10,12"."""
    found = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        found += range(int(lo), int(hi or lo) + 1)
    return found


def main():
    own = argparse.ArgumentParser()
    own.add_argument("--stage", required=True)
    own.add_argument("--seeds", default="0-11")
    ours, rest = own.parse_known_args()
    Engine = load_engine(ours.stage)
    extra = ["--bucket_mb", "0.0001"] if "--bucket_mb" in Path(ours.stage).read_text() else []
    args = parse_args(Engine, PRESETS, GPTConfig, ["--steps", str(STEPS), "--warmup", "1", "--lr", "1e-2", "--dtype",
                                                   "fp32", "--device", "cpu", *extra, *rest])
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    failed = 0
    for seed in seeds(ours.seeds):
        # (a crash that takes the process down, a segmentation fault say, leaves this as the last line: the model)
        print(f"seed {seed}: {RandomModel(seed)!r}", file=sys.stderr, flush=True)
        try:
            problems = check(seed, Engine, args, rank, world_size)
        except Exception as e:  # a crash is a failure of this seed, named with its model
            problems = [f"{type(e).__name__}: {e}".split("\n")[0]]
        if problems:
            failed += 1
            where = f"{Path(ours.stage).stem}, rank {rank} of {world_size}"
            print(f"FAILED seed {seed} ({where}): {RandomModel(seed)!r}\n  " + "\n  ".join(problems), flush=True)
    problems = sparse_refused(Engine, args)
    if problems:
        failed += 1
        print(f"FAILED sparse gradients ({Path(ours.stage).stem}, rank {rank} of {world_size}): {problems[0]}",
              flush=True)
    if rank == 0:
        print(f"{Path(ours.stage).stem}: {len(seeds(ours.seeds))} seeds and sparse gradients at N={world_size}, "
              f"{failed} failed", flush=True)
    sys.stdout.flush()
    os._exit(1 if failed else 0)


if __name__ == "__main__":
    main()
