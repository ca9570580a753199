"""Models written the way DeepSpeed's and PyTorch's own test suites write theirs, trained 3 steps by each engine in
this process (a world of one, fp32) against the single-process reference: layers called out of registration order
and one of them twice (DeepSpeed's SimpleModel), outputs of any structure with non-tensors beside tensors, units
nested in units, a unit's output that the loss does not use, a weight shared by two units. Each is right to 1e-5 or
refused with one line that names the fix; in stage 3 and offload, no unit gathered after backward, and a step's
all-gathers one per forward call of a unit and one per unit for its backward. Stage 3 and offload are the engines
these patterns test; stages 0-2 train them too, as any engine must."""
import dataclasses
import subprocess
import sys
from collections import namedtuple

import pytest
import torch
import torch.nn as nn

from conftest import ROOT
from test_any_model import build, parse_args, world_of_one  # noqa: F401 (a fixture)
from checkpoint import consolidate, gather_master, save_checkpoint, tied_names
from comm import comm
from train_gpt import GPT, GPTConfig, Misuse, SingleDeviceEngine, lr_at

WIDTH = 6
Pair = namedtuple("Pair", "value note")


@dataclasses.dataclass
class Result:
    value: torch.Tensor
    name: str


class OutOfOrder(nn.Module):
    """DeepSpeed's SimpleModel pattern: layers called out of the order they were registered in, one of them twice."""
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(3))

    def forward(self, x):
        h = self.layers[1](x)
        h = self.layers[0](torch.tanh(h))
        h = self.layers[1](torch.tanh(h))
        return self.layers[2](h)


class Shaped(nn.Module):
    """A layer whose output is a structure: a dict, a list, a namedtuple or a dataclass, with non-tensors beside the
    tensors, and its input passed through beside (a tensor whose gradient does not go through the layer's weights)."""
    def __init__(self, shape):
        super().__init__()
        self.shape = shape
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        y = torch.tanh(self.linear(x))
        if self.shape == "dict":
            return {"value": y, "input": x, "note": "a string", "count": 3}
        if self.shape == "list":
            return [None, y, x, 1.5]
        if self.shape == "namedtuple":
            return Pair(y, note="a note")
        return Result(y, "a name")


def value_of(out):
    if isinstance(out, dict):
        return out["value"] + out["input"]
    if isinstance(out, list):
        return out[1] + out[2]
    return out.value


class Structured(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(Shaped(s) for s in ("dict", "list", "namedtuple", "dataclass"))

    def forward(self, x):
        for layer in self.layers:
            x = value_of(layer(x))
        return x


class Nested(nn.Module):
    """Units in units: a ModuleList in each block of a ModuleList, and a root with weights of its own."""
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(2)) for _ in range(2))
        self.out = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        for block in self.blocks:
            for layer in block:
                x = torch.tanh(layer(x))
        return self.out(x)


class Unused(nn.Module):
    """A layer called twice, the loss using one of its two outputs; then a layer whose output the loss ignores, its
    weights used again (its bias through the next layer's output)."""
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(2))

    def forward(self, x):
        self.layers[0](x)  # an output no loss uses
        h = torch.tanh(self.layers[0](x))
        return self.layers[1](h)


class Tied(nn.Module):
    """An embedding and an output layer that share one weight (GPT-2's tying), each a unit of its own."""
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Embedding(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)])
        self.layers[2].weight = self.layers[0].weight

    def forward(self, x):
        h = self.layers[0](x.abs().sum(-1).long() % WIDTH)
        return self.layers[2](torch.tanh(self.layers[1](h)))


MODELS = {"out of order": (OutOfOrder, {}), "structured outputs": (Structured, {}), "nested": (Nested, {}),
          "unused output": (Unused, {}), "tied": (Tied, {})}


def train(engine, args, steps=3):
    losses = []
    for step in range(steps):
        x = torch.randn(5, WIDTH, generator=torch.Generator().manual_seed(step))
        loss = (engine.forward(x) ** 2).mean()
        engine.backward(loss, sync=True)
        engine.step(lr_at(step, args))
        losses.append(loss.item())
    return losses


def close(got, expected, rtol=1e-5):
    return abs(got - expected) <= rtol * max(abs(expected), 1e-6)


@pytest.mark.parametrize("name", MODELS)
def test_call_pattern_trains_as_the_reference(world_of_one, stage_file, name):
    Model, kw = MODELS[name]
    torch.manual_seed(0)
    model = Model()
    reference = Model()
    reference.load_state_dict(model.state_dict())
    engine, _ = build(stage_file, world_of_one, model, **kw)
    args = engine.args
    args.lr, args.warmup = 1e-2, 1
    got = train(engine, args)
    expected = train(SingleDeviceEngine(reference, parse_args(type(engine), []), world_of_one), args)
    assert all(close(g, e) for g, e in zip(got, expected)), f"{name}: losses {got}, expected {expected}"
    for b in getattr(engine, "buckets", []):
        assert getattr(b, "gather", None) is None, f"{name}: a unit's all-gather still in flight after step()"
    master = gather_master(engine)
    for key, p in reference.named_parameters():
        if key in master:
            diff = (master[key] - p.detach()).abs().max().item()
            assert diff <= 1e-5 * p.abs().max().item(), f"{name}: {key} ends {diff:.2e} off the reference"

def test_no_unit_stays_gathered_across_step(world_of_one, stage_file):
    """After backward, every unit of stage 3 is freed: the next forward gathers the updated shard."""
    engine, model = build(stage_file, world_of_one, OutOfOrder())
    if not hasattr(engine, "param_shard"):
        pytest.skip("stages 0-2 keep every parameter")
    train(engine, engine.args, steps=1)
    gathered = [type(b.module).__name__ for b in engine.buckets if b.param.untyped_storage().nbytes()]
    assert not gathered, f"units still gathered after step(): {gathered}"


class LateGathers:
    """comm.all_gather with its async calls landing only at wait(): until then the output reads nan, as a gather in
    flight is memory still being written (gloo and NCCL write it in the background). A forward pre-hook on each unit,
    after the engine's, names a unit that computes on parameters whose gather was not waited on."""
    def __init__(self, monkeypatch, engine, model):
        self.real = comm.all_gather
        self.pending = set()  # the storages of the gathers issued and not waited on
        self.names = {id(m): unit or "the root" for unit, m in model.named_modules()}
        monkeypatch.setattr(comm, "all_gather", self.all_gather)
        for b in engine.buckets:
            b.module.register_forward_pre_hook(lambda m, inputs, b=b: self.check(b))

    def all_gather(self, out, inp, async_op=False):
        if not async_op:
            return self.real(out, inp)
        out.fill_(float("nan"))
        self.pending.add(out.untyped_storage().data_ptr())
        return LateGathers.Handle(self, out, inp)

    class Handle:
        def __init__(self, late, out, inp):
            self.late, self.out, self.inp = late, out, inp
            self.done = False

        def wait(self):
            if not self.done:
                self.late.real(self.out, self.inp)
                self.late.pending.discard(self.out.untyped_storage().data_ptr())
                self.done = True
            return True

    def check(self, b):
        early = [p for p in b.params if p.untyped_storage().data_ptr() in self.pending]
        unit = self.names[id(b.module)]
        assert not early, (
            f"the slip: parameters used before their all-gather landed: {unit} computed its forward on parameters "
            f"whose comm.all_gather(..., async_op=True) was not waited on; call wait() on its handle before the unit "
            f"runs")


@pytest.mark.slip
def test_parameters_are_used_after_their_gather_lands(world_of_one, stage_file, monkeypatch):
    """Stage 3's units compute only on parameters whose all-gather has landed: with gathers that land only when
    waited on (LateGathers), 2 steps of a model whose layers run out of order, one twice, train to finite losses."""
    model = OutOfOrder()
    engine, _ = build(stage_file, world_of_one, model)
    if not hasattr(engine, "param_shard"):
        pytest.skip("stages 0-2 keep every parameter")
    LateGathers(monkeypatch, engine, model)
    losses = train(engine, engine.args, steps=2)
    assert all(loss == loss for loss in losses), f"losses {losses}: nan"


@pytest.mark.slip
@pytest.mark.parametrize("name", MODELS)
def test_each_unit_gathered_once_a_call_and_once_for_its_backward(world_of_one, stage_file, name):
    """Stage 3's gathers, step by step: a unit is gathered for each forward call of it (freed after each), and once
    for its backward, where it stays until its gradient is complete; so after backward no unit is gathered, and the
    all-gathers of a step are the units' forward calls plus the buckets. A unit whose backward is over, gathered again
    (a prefetch that does not skip it), stays gathered until the step and adds one. (The count is the same on any N:
    here a world of one, which calls no collective, so each gather of a freed unit is counted at the engine's
    _gather.)"""
    Model, _ = MODELS[name]
    torch.manual_seed(0)
    engine, model = build(stage_file, world_of_one, Model())
    if not hasattr(engine, "param_shard"):
        pytest.skip("stages 0-2 keep every parameter")
    calls = []
    unit_names = {id(m): unit or "the root" for unit, m in model.named_modules()}
    for b in engine.buckets:
        b.module.register_forward_pre_hook(lambda m, inputs: calls.append(m))
    gathers = []
    gather = engine._gather

    def counted(b):
        if not b.param.untyped_storage().nbytes():  # freed: this call gathers it
            gathers.append(b)
        gather(b)
    engine._gather = counted
    for step in range(3):  # the first records the order, the others prefetch by it
        calls.clear()
        gathers.clear()
        x = torch.randn(5, WIDTH, generator=torch.Generator().manual_seed(step))
        engine.backward((engine.forward(x) ** 2).mean(), sync=True)
        gathered = [unit_names[id(b.module)] for b in engine.buckets if b.param.untyped_storage().nbytes()]
        expected = len(calls) + len(engine.buckets)
        got = len(gathers)
        # the slip each signature names: more gathers than calls and buckets, a unit gathered once its backward was
        # over; the right count, a unit never freed after its backward
        assert not (gathered and got > expected), (
            f"the slip: a unit gathered after its backward was over ({name} model, step {step}): {gathered} gathered "
            f"again by a hook that ran once its gradients were all in, and still gathered after backward ({got} "
            f"all-gathers, expected {expected}); a unit whose backward is done (no gradient awaited) must not be "
            f"gathered")
        assert not gathered, (f"the slip: a unit not freed after its backward ({name} model, step {step}): {gathered} "
                              f"still gathered after backward; free a unit once its last gradient is in")
        engine.step(lr_at(step, engine.args))
        got = len(gathers)
        assert got == expected, (f"{name}, step {step}: {got} all-gathers, expected {expected} ({len(calls)} forward "
                                 f"calls of units, and one backward gather for each of {len(engine.buckets)} buckets)")


# ---- refused at build time, in every engine, with one line that names the fix

def refused(call):
    with pytest.raises(RuntimeError) as e:
        call()
    assert "\n" not in str(e.value) and "before building the engine" in str(e.value), str(e.value)
    return str(e.value)


def test_a_model_with_nothing_to_train_is_refused(world_of_one, stage_file):
    model = OutOfOrder().requires_grad_(False)
    assert refused(lambda: build(stage_file, world_of_one, model)) == Misuse.NOTHING_TRAINED


def test_trained_parameters_of_two_dtypes_are_refused(world_of_one, stage_file):
    model = OutOfOrder()
    model.layers[2].double()
    message = refused(lambda: build(stage_file, world_of_one, model))
    assert "layers.0.weight (torch.float32) and layers.2.weight (torch.float64)" in message, message


class Shared(nn.Module):
    """Two units side by side inside a third that share one weight, and a weight tied across the whole model."""
    def __init__(self):
        super().__init__()
        self.outer = nn.ModuleList([nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)])
        self.outer[1].weight = self.outer[0].weight
        self.wrap = nn.Sequential(self.outer[0], nn.Tanh(), self.outer[1])
        self.head = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        return self.head(self.wrap(x))


def test_a_weight_shared_by_two_units_goes_to_the_unit_that_holds_both(world_of_one, stage_file):
    """As FSDP2 and DeepSpeed place tied weights: in the innermost unit that holds every unit sharing it."""
    model = Tied()
    engine, _ = build(stage_file, world_of_one, model)
    if not hasattr(engine, "param_shard"):
        pytest.skip("stages 0-2 have no units")
    assert engine.bucket_of[model.layers[0].weight].module is model  # the root: the only unit holding both
    assert engine.bucket_of[model.layers[2].bias].module is model.layers[2]
    model = Shared()
    expected = Shared()
    expected.load_state_dict(model.state_dict())
    engine, _ = build(stage_file, world_of_one, model, units=[model.outer[0], model.outer[1], model.wrap])
    assert engine.bucket_of[model.outer[0].weight].module is model.wrap
    assert engine.bucket_of[model.outer[1].bias].module is model.outer[1]
    got = train(engine, engine.args)
    assert got == pytest.approx(train(SingleDeviceEngine(expected, engine.args, world_of_one), engine.args), rel=1e-5)


# ---- tied weights in the consolidated fp32 state dict

def test_the_gathered_state_dict_carries_every_name_of_a_tied_weight(world_of_one, stage_file):
    """gather_master (--save_master, --sample's model) loads with strict=True into the model it came from."""
    model = Tied()
    engine, _ = build(stage_file, world_of_one, model)
    train(engine, engine.args, steps=1)
    master = gather_master(engine)
    assert torch.equal(master["layers.2.weight"], master["layers.0.weight"])
    Tied().load_state_dict(master, strict=True)


def test_a_consolidated_checkpoint_loads_strictly_into_the_gpt(tmp_path):
    """--consolidate: every name of the GPT's tied weight (lm_head.weight, wte.weight) is in its state dict."""
    cfg = GPTConfig(block_size=8, vocab_size=5, n_layer=1, n_head=1, n_embd=4)
    model = GPT(cfg)
    engine = SingleDeviceEngine(model, parse_args(SingleDeviceEngine, []), torch.device("cpu"))
    params = {n: list(p.shape) for n, p in model.named_parameters() if p.requires_grad}
    meta = dict(stage="reference", config=vars(cfg), chars="abcde", losses=[], grad_norms=[], val_losses=[],
                params=params, tied=tied_names(model))
    where = save_checkpoint(str(tmp_path / "ckpt"), engine, 1, meta, torch.device("cpu"))
    consolidate(where, str(tmp_path / "gpt.pt"))
    GPT(cfg).load_state_dict(torch.load(tmp_path / "gpt.pt", weights_only=True)["state_dict"], strict=True)


# ---- buffers: rank 0's before every forward (DDP's broadcast_buffers=True), or each rank's own when asked

BUFFERS = """
import sys
import torch, torch.distributed as dist, torch.nn as nn
sys.path.insert(0, {root!r})
sys.path.insert(0, {examples!r})
from any_model import load_engine
from options import parse_args
from train_gpt import PRESETS, GPTConfig
Engine = load_engine(sys.argv[1])
args = parse_args(Engine, PRESETS, GPTConfig, sys.argv[2:])
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 1))
engine = Engine(model, args, torch.device("cpu"))
for step in range(2):
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(10 * step + rank))  # each rank's own data
    engine.backward(engine.forward(x).pow(2).mean(), sync=True)
    engine.step(1e-3)
model.eval()
engine.forward(torch.randn(6, 4))  # (its buffers as this forward used them: eval mode updates none)
mean = model[1].running_mean.clone()
every = [torch.zeros_like(mean) for _ in range(dist.get_world_size())]
dist.all_gather(every, mean)
print("buffers", "equal" if all(torch.equal(every[0], m) for m in every) else "differ", flush=True)
dist.barrier()
dist.destroy_process_group()
"""


@pytest.mark.parametrize("broadcast", [True, False], ids=["broadcast", "no_broadcast_buffers"])
def test_buffers_are_rank_0s_before_every_forward(runner, tmp_path, stage_file, broadcast):
    """BatchNorm's running statistics, updated by each rank's forward on its own data: rank 0's on every rank at each
    forward (as under DDP), unless --no_broadcast_buffers asks for each rank's own."""
    script = tmp_path / "buffers.py"
    script.write_text(BUFFERS.format(root=str(ROOT), examples=str(ROOT / "examples")))
    p = runner.spawn(str(script), 2, [stage_file] + ([] if broadcast else ["--no_broadcast_buffers"]), timeout=300)
    expected = "buffers equal" if broadcast else "buffers differ"
    assert p.returncode == 0 and p.stdout.count(expected) == 2, p.stdout + p.stderr[-3000:]


# ---- uneven data: a rank out of batches while the others go on ends the job, with one line

UNEVEN = """
import sys
import torch, torch.nn as nn
sys.path.insert(0, {root!r})
sys.path.insert(0, {examples!r})
from any_model import load_engine
from devices import init_distributed
from options import parse_args
from train_gpt import PRESETS, GPTConfig
Engine = load_engine(sys.argv[1])
args = parse_args(Engine, PRESETS, GPTConfig, sys.argv[2:])
rank, world_size, device = init_distributed(args)
model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
engine = Engine(model, args, device)
for step in range(3 if rank == 0 else 1):  # rank 1 has one batch, rank 0 three
    engine.backward(engine.forward(torch.randn(6, 4)).pow(2).mean(), sync=True)
    engine.step(1e-3)
print("rank", rank, "out of batches", flush=True)
torch.distributed.barrier()
"""


def test_uneven_data_ends_the_job_with_one_line(runner, tmp_path):
    script = tmp_path / "uneven.py"
    script.write_text(UNEVEN.format(root=str(ROOT), examples=str(ROOT / "examples")))
    p = runner.spawn(str(script), 2, [str(ROOT / "stage2.py"), "--collective_timeout", "5"], timeout=120, grace=60)
    lines = [ln for ln in p.stderr.splitlines() if ln.startswith("error: rank")]
    assert p.returncode != 0 and lines and all("uneven data" in ln for ln in lines), p.stderr[-3000:]
    assert "Traceback" not in p.stderr, p.stderr[-3000:]


PEER_LEFT = """
import functools, sys
sys.path.insert(0, {root!r})
from devices import explain_timeout
sys.excepthook = functools.partial(explain_timeout, sys.excepthook, 0, 5.0)
raise RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:24984")
"""


def test_a_peer_that_left_ends_the_rank_with_one_line(tmp_path):
    """The rank of uneven data that times out first exits; a rank still waiting for it in a collective then meets gloo's
    "Connection closed by peer", not a timeout: it too ends with the one line, not a traceback. (Which rank times out
    first depends on the load, so the run above meets this only sometimes.)"""
    script = tmp_path / "peer_left.py"
    script.write_text(PEER_LEFT.format(root=str(ROOT)))
    p = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert p.returncode == 1 and p.stderr.startswith("error: rank 0: another rank left"), p.stderr[-3000:]
    assert "uneven data" in p.stderr and "Traceback" not in p.stderr, p.stderr[-3000:]
