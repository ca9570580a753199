"""A stage on a model that is not the GPT (examples/any_model.py: a frozen layer, a buffer, a forward that takes a
mask): it matches the single-process reference at N = 1, 2, 4 to the GPT tests' tolerances, in fp32, and says so in
its exit code; each misuse of an engine stops with one line that names the fix; stage 3 takes units of the caller's
choosing, and trains parameters that leave their unit as the reference does. The misuse checks and those models
build engines in this process, as a world of one; outside.py's guards are also run through each path in processes
of their own at N = 1 and 2, where a slip that crashes the process fails naming its case."""
import inspect
import json
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import test_stages
from checkpoint import gather_master, load_checkpoint, save_checkpoint
from conftest import ROOT, last_lines
from devices import free_port
from test_offload import SIMULATED
from options import parse_args as parse_options
from train_gpt import PRESETS, GPTConfig, Misuse, SingleDeviceEngine


def parse_args(Engine, argv):
    return parse_options(Engine, PRESETS, GPTConfig, argv)

sys.path.insert(0, str(ROOT / "examples"))
import any_model  # noqa: E402

EXAMPLE = str(ROOT / "examples" / "any_model.py")


def run_example(runner, stage_file, nproc, env=None):
    extra = ["--bucket_mb", "0.002"] if "--bucket_mb" in runner.options(stage_file) else []  # several buckets, padded
    if runner.torchrun:
        return runner.launch(EXAMPLE, nproc, "--stage", stage_file, *extra, env=env)
    return runner.spawn(EXAMPLE, nproc, ["--stage", stage_file, *extra], env)


def test_the_example_checks_to_the_gpt_tests_tolerances():
    names = ("LOSS_ATOL", "NORM_RTOL", "BULK_RTOL", "BULK_SHARE", "ATOL_ANY")
    assert [getattr(any_model, n) for n in names] == [getattr(test_stages, n) for n in names]


# At N = 2, README's command: every engine at N = 1, 2 and 4 on many models is test_any_model_random.py's.
@pytest.mark.parametrize("nproc", [2])
def test_any_model_matches_the_reference(runner, stage_file, nproc):
    p = run_example(runner, stage_file, nproc)
    assert p.returncode == 0 and "the same as the single-process reference" in p.stdout, (
        f"examples/any_model.py --stage {stage_file} at N={nproc} (exit code {p.returncode}):\n"
        + "\n".join(last_lines(p.stdout + p.stderr, 15)))


def test_offload_grad_waits_for_the_gradient_copies(runner):
    """On the simulated stream a device-host copy lands only when a wait covers it (tests/test_offload.py): without
    its wait, offload's grad() would read a gradient shard of zeros."""
    p = run_example(runner, str(ROOT / "offload.py"), 2, env=SIMULATED)
    assert p.returncode == 0, "\n".join(last_lines(p.stdout + p.stderr, 15))


def test_the_example_fails_on_a_mismatch(runner, tmp_path):
    """Gradients summed over the ranks instead of averaged: the example exits non-zero and names the norm."""
    source = (ROOT / "stage0_ddp.py").read_text()
    old = "comm.all_reduce(b.grad, op=dist.ReduceOp.AVG, async_op=True)"
    assert source.count(old) == 1, "stage0_ddp.py changed: update this test"
    broken = tmp_path / "summed_stage0.py"
    broken.write_text(source.replace(old, "comm.all_reduce(b.grad, op=dist.ReduceOp.SUM, async_op=True)"))
    p = run_example(runner, str(broken), 2)
    assert p.returncode != 0 and "error: summed_stage0 on rank 0 of 2: global gradient norm at step 0" in p.stderr, \
        "\n".join(last_lines(p.stdout + p.stderr, 15))


# ---- misuse, each refused with one line, in this process (a world of one)

@pytest.fixture(scope="module")
def world_of_one():
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield torch.device("cpu")
    dist.destroy_process_group()


def build(stage_file, device, model=None, **kw):
    Engine = any_model.load_engine(stage_file)
    model = model or any_model.SetClassifier()
    return Engine(model, parse_args(Engine, []), device, **kw), model


def loss_of(engine, step=0):
    x, mask, y = any_model.batch(step, 0, 1, 8, "cpu")
    return F.cross_entropy(engine.forward(x, mask=mask), y)


def refused(call, message):
    with pytest.raises(RuntimeError) as e:
        call()
    assert str(e.value) == message and "\n" not in message, str(e.value)


def test_backward_outside_the_engine_is_refused(world_of_one, stage_file):
    engine, _ = build(stage_file, world_of_one)
    refused(lambda: loss_of(engine).backward(), Misuse.OUTSIDE_BACKWARD)
    assert "engine.backward(loss, sync)" in Misuse.OUTSIDE_BACKWARD


def test_step_without_backward_is_refused(world_of_one, stage_file):
    engine, _ = build(stage_file, world_of_one)
    refused(lambda: engine.step(1e-3), Misuse.NO_BACKWARD)  # before any backward
    engine.backward(loss_of(engine), sync=False)
    refused(lambda: engine.step(1e-3), Misuse.NO_BACKWARD)  # after a micro-step that does not end the step
    engine.backward(loss_of(engine), sync=True)
    engine.step(1e-3)
    refused(lambda: engine.step(1e-3), Misuse.NO_BACKWARD)  # twice on one gradient


@pytest.mark.parametrize("change", ["replace the head", "freeze a block", "unfreeze the input layer"])
def test_model_changed_after_the_engine_is_refused(world_of_one, stage_file, change):
    engine, model = build(stage_file, world_of_one)
    if change == "replace the head":
        model.head = nn.Linear(any_model.WIDTH, any_model.CLASSES)
    elif change == "freeze a block":
        model.blocks[1].requires_grad_(False)
    else:
        model.embed.requires_grad_(True)
    refused(lambda: loss_of(engine), Misuse.CHANGED)


def test_parameter_without_gradient_is_refused(world_of_one, stage_file):
    model = any_model.SetClassifier()
    model.spare = nn.Linear(3, 3)  # trainable, but forward never uses it
    engine, _ = build(stage_file, world_of_one, model)
    refused(lambda: engine.backward(loss_of(engine), sync=True), Misuse.NO_GRADIENT)


def test_a_model_on_the_meta_device_without_init_weight_is_refused(world_of_one, stage_file):
    """Every engine makes trained parameters from the meta device, with the model's init_weight(p); buffers and frozen
    ones never."""
    with torch.device("meta"):
        model = any_model.SetClassifier()
    refused(lambda: build(stage_file, world_of_one, model), Misuse.META)


def test_units_of_the_callers_choosing(world_of_one, stage_file):
    """Stage 3's units: the modules passed (a frozen one gets no bucket), then the root; and training matches."""
    Engine = any_model.load_engine(stage_file)
    if "units" not in inspect.signature(Engine).parameters:
        pytest.skip(f"{Engine.__name__} takes no units (stage 3 and offload do)")
    torch.manual_seed(0)
    model = any_model.SetClassifier()
    reference = any_model.SetClassifier()
    reference.load_state_dict(model.state_dict())
    args = parse_args(Engine, ["--steps", "3"])
    engine = Engine(model, args, world_of_one, units=[model.embed, model.blocks[2], model.head])
    assert [b.module for b in engine.buckets] == [model.blocks[2], model.head, model]
    got = any_model.train(engine, model, args, 0, 1, world_of_one)
    expected = any_model.train(SingleDeviceEngine(reference, args, world_of_one), reference, args, 0, 1, world_of_one)
    assert got[0] == pytest.approx(expected[0], abs=test_stages.LOSS_ATOL), (got[0], expected[0])
    assert got[1] == pytest.approx(expected[1], rel=test_stages.NORM_RTOL), (got[1], expected[1])


# ---- parameters that leave their unit, and sparse gradients: models from DeepSpeed's, FSDP's and torch's own tests.
# Every engine trains the first three as the single-process reference does (stages 0-2 have no units: the same
# models, trained whole); a freed parameter used anyway names itself; sparse gradients are refused on every engine.

class DanglingBias(nn.Linear):
    """DeepSpeed's test_ext_param_return: a linear that returns its bias beside its output, for the caller to add."""
    def forward(self, x):
        return F.linear(x, self.weight), self.bias


class ReturnsItsBias(nn.Module):
    def __init__(self):
        super().__init__()
        self.u = DanglingBias(4, 4)
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        y, bias = self.u(x)
        return self.head(torch.tanh(y + bias))


class ReadsAWeight(nn.Module):
    """DeepSpeed's test_ext_param_getattr: the root reads l1's weight after l1 ran."""
    def __init__(self):
        super().__init__()
        self.l1 = nn.Linear(4, 4)
        self.l2 = nn.Linear(4, 4)

    def forward(self, x):
        return F.linear(torch.tanh(self.l2(self.l1(x))), self.l1.weight)


class TiedToANonUnit(nn.Module):
    """FSDP's test_parent_child_shared_params, as GPT's token embedding and head with units=[embed]."""
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(6, 4)
        self.out = nn.Linear(4, 6, bias=False)
        self.out.weight = self.embed.weight

    def forward(self, x):
        return self.out(torch.tanh(self.embed((x.abs() * 3).long().clamp(max=5))))


LEAVING = {"returns its bias": (ReturnsItsBias, lambda m: [m.u]),
           "reads a weight": (ReadsAWeight, lambda m: [m.l1, m.l2]),
           "tied to a non-unit": (TiedToANonUnit, lambda m: [m.embed])}


def build_leaving(stage_file, device, case):
    Engine = any_model.load_engine(stage_file)
    make, units = LEAVING[case]
    torch.manual_seed(0)
    model = make()
    reference = make()
    reference.load_state_dict(model.state_dict())
    args = parse_args(Engine, ["--steps", "3", "--warmup", "1", "--lr", "1e-2", "--dtype", "fp32"])
    takes_units = "units" in inspect.signature(Engine).parameters
    engine = Engine(model, args, device, **({"units": units(model)} if takes_units else {}))
    return (engine, model), (SingleDeviceEngine(reference, args, device), reference)


@pytest.mark.parametrize("case", list(LEAVING))
def test_parameters_leaving_their_unit_train_as_the_reference(world_of_one, stage_file, case):
    (engine, model), (ref_engine, reference) = build_leaving(stage_file, world_of_one, case)
    results = []
    for e in (engine, ref_engine):
        losses = []
        for step in range(3):
            x = torch.randn(5, 4, generator=torch.Generator().manual_seed(step))
            loss = e.forward(x).square().mean()
            e.backward(loss, sync=True)
            e.step(1e-2)
            losses.append(loss.item())
        results.append(losses)
    assert results[0] == pytest.approx(results[1], rel=1e-5), results
    master = gather_master(engine)
    for name, p in reference.named_parameters():
        assert torch.allclose(master[name].view_as(p), p.detach(), rtol=0, atol=1e-5 * p.abs().max().item()), name
    if case == "tied to a non-unit" and "units" in inspect.signature(type(engine)).parameters:  # owner: the root
        assert engine.bucket_of[model.embed.weight].module is model


def test_a_freed_parameter_used_names_itself(world_of_one, stage_file):
    """After a step ZeRO-3 holds only its shard: a parameter held from before, or read, fails in one line naming it."""
    (engine, model), _ = build_leaving(stage_file, world_of_one, "reads a weight")
    if not hasattr(engine, "buckets") or not hasattr(engine.buckets[0], "module"):
        pytest.skip("stages 0-2 keep every parameter whole")
    held = model.l2.bias
    engine.backward(engine.forward(torch.ones(2, 4)).sum(), sync=True)
    engine.step(1e-2)
    for use in (lambda: held + 1, lambda: model.l1.weight.sum(), lambda: print(model.l2.weight)):
        with pytest.raises(RuntimeError, match=r"^l[12]\.(weight|bias) of unit l[12] is freed") as e:
            use()
        assert "\n" not in str(e.value)


class ReadsOnRequest(ReadsAWeight):
    """ReadsAWeight's read of l1.weight after l1 ran, in the forwards that ask for it (`read`)."""
    read = True

    def forward(self, x):
        h = torch.tanh(self.l2(self.l1(x)))
        return F.linear(h, self.l1.weight) if self.read else h


def test_a_unit_kept_by_one_forward_is_freed_in_the_next(world_of_one, stage_file):
    """A forward that reads l1.weight outside l1 keeps l1 gathered until its backward; the next forward, which does
    not, frees l1 after l1's forward (each forward starts with no unit kept)."""
    Engine = any_model.load_engine(stage_file)
    if "units" not in inspect.signature(Engine).parameters:
        pytest.skip("stages 0-2 keep every parameter whole")
    model = ReadsOnRequest()
    engine = Engine(model, parse_args(Engine, ["--dtype", "fp32"]), world_of_one, units=[model.l1, model.l2])
    x = torch.ones(2, 4)
    out = engine.forward(x)
    assert model.l1.weight.untyped_storage().nbytes() > 0, "l1, read outside its unit, freed before its backward"
    engine.backward(out.sum(), sync=True)
    engine.step(1e-2)
    model.read = False
    out = engine.forward(x)
    assert model.l1.weight.untyped_storage().nbytes() == 0, (
        "l1 still gathered after a forward that read none of it outside l1 (kept by the forward before, or by l1's "
        "own read of its weight)")
    engine.backward(out.sum(), sync=True)
    engine.step(1e-2)


def test_sparse_gradients_are_refused(world_of_one, stage_file):
    """torch's test_sparse_gradients model: nn.EmbeddingBag(sparse=True), refused as the engine is built."""
    model = nn.Sequential(nn.EmbeddingBag(10, 4, sparse=True), nn.Linear(4, 2))
    refused(lambda: build(stage_file, world_of_one, model), Misuse.SPARSE.format("0", "EmbeddingBag"))
    assert "sparse=False" in Misuse.SPARSE


# ---- where ranks may differ (random_models.py trains each pattern at N = 1, 2, 4): the one-line refusals, here

class KeepsAView(nn.Module):
    """FSDP's test_access_params_after_forward: a unit keeps a view of its weight from its forward (self.u.cached),
    which the root uses after the unit ran."""
    def __init__(self):
        super().__init__()
        self.u = nn.Linear(4, 4)
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        h = torch.tanh(self.u(x))
        self.u.cached = self.u.weight.t()
        return self.head(h @ self.u.cached)


def test_a_view_kept_past_its_unit_trains_or_names_its_parameter(world_of_one, stage_file):
    """In engine.forward the kept view gathers its unit again, and trains as the reference; after the step (its unit
    freed) it fails in one line naming its parameter, never reading freed memory."""
    Engine = any_model.load_engine(stage_file)
    torch.manual_seed(0)
    model, reference = KeepsAView(), KeepsAView()
    reference.load_state_dict(model.state_dict())
    args = parse_args(Engine, ["--steps", "2", "--warmup", "1", "--lr", "1e-2", "--dtype", "fp32"])
    takes_units = "units" in inspect.signature(Engine).parameters
    engine = Engine(model, args, world_of_one, **({"units": [model.u]} if takes_units else {}))
    losses = []
    for e in (engine, SingleDeviceEngine(reference, args, world_of_one)):
        loss = e.forward(torch.ones(3, 4)).square().mean()
        e.backward(loss, sync=True)
        e.step(1e-2)
        losses.append(loss.item())
    assert losses[0] == pytest.approx(losses[1], rel=1e-6), losses
    master = gather_master(engine)
    for name, p in reference.named_parameters():
        assert torch.allclose(master[name].view_as(p), p.detach(), rtol=0, atol=1e-6), name
    if takes_units:
        with pytest.raises(RuntimeError, match=r"^u\.weight of unit u is freed") as e:
            model.u.cached.sum()
        assert "\n" not in str(e.value)


def test_a_write_between_steps_is_refused_before_the_update(world_of_one, stage_file):
    """with torch.no_grad(): a trained weight halved after a step: stages 0-2 refuse at the next step (their master
    would undo the write), stage 3 and offload at the write (the weight is freed); either way in one line, and the
    trained values stay the first step's."""
    (engine, model), _ = build_leaving(stage_file, world_of_one, "reads a weight")
    engine.backward(engine.forward(torch.ones(2, 4)).sum(), sync=True)
    engine.step(1e-2)
    before = gather_master(engine)
    try:
        with torch.no_grad():
            model.l1.weight.mul_(0.5)
        engine.backward(engine.forward(torch.ones(2, 4)).sum(), sync=True)
        refused(lambda: engine.step(1e-2), Misuse.WRITTEN)
    except RuntimeError as e:
        assert str(e).startswith("l1.weight of unit l1 is freed") and "\n" not in str(e), str(e)
    after = gather_master(engine)
    assert all(torch.equal(before[name], after[name]) for name in before)


def test_a_0d_parameter_in_gather_master_and_checkpoints(world_of_one, stage_file, tmp_path):
    """A LayerScale gain: a 0-d trained parameter comes back from gather_master as a 0-d tensor, and a checkpoint
    carries it into another engine."""
    engines = []
    for gain in (0.9, 0.5):
        model = any_model.SetClassifier()
        model.gain = nn.Parameter(torch.tensor(gain))
        engines.append(build(stage_file, world_of_one, model)[0])
    master = gather_master(engines[0])
    assert master["gain"].shape == () and master["gain"].item() == pytest.approx(0.9)
    where = save_checkpoint(str(tmp_path), engines[0], 0, {}, world_of_one)
    load_checkpoint(where, json.loads((Path(where) / "manifest.json").read_text()), engines[1], world_of_one)
    assert gather_master(engines[1])["gain"].item() == pytest.approx(0.9)


def test_a_nested_sparse_module_is_refused(world_of_one, stage_file):
    """An nn.EmbeddingBag(sparse=True) two levels down is refused by its path; frozen, it makes no gradient, and the
    engine is built."""
    model = nn.Sequential(nn.Sequential(nn.Linear(4, 4), nn.EmbeddingBag(10, 4, sparse=True)), nn.Linear(4, 2))
    with pytest.raises(RuntimeError, match=r"^0\.1 \(EmbeddingBag\) makes sparse gradients") as e:
        build(stage_file, world_of_one, model)
        pytest.fail("an engine was built on a nested nn.EmbeddingBag(sparse=True) (module 0.1)")
    assert str(e.value) == Misuse.SPARSE.format("0.1", "EmbeddingBag"), str(e.value)
    model[0][1].requires_grad_(False)
    try:
        build(stage_file, world_of_one, model)
    except RuntimeError as e:
        pytest.fail(f"a frozen nn.EmbeddingBag(sparse=True), which makes no gradient, refused: {e}")


# ---- the outside guards (outside.py) through each path, at N = 1 and 2, in runs of their own: a slip there can
# kill the process (a freed parameter's storage read as if it held values), which the test reports by name.
# Every rank trains on the same batch, so the averaged gradient is the single-process reference's.

OUTSIDE = """
import sys
import torch, torch.distributed as dist, torch.nn as nn, torch.nn.functional as F
sys.path.insert(0, {root!r})
sys.path.insert(0, {examples!r})
from any_model import load_engine
from checkpoint import gather_master
from options import parse_args
from train_gpt import PRESETS, GPTConfig, SingleDeviceEngine


class ReadBeforeHeld(nn.Module):
    # reads l1's weight before l1 runs, and uses it after l1 ran (l1 must stay gathered past its forward)
    def __init__(self):
        super().__init__()
        self.l1 = nn.Linear(4, 4)
        self.l2 = nn.Linear(4, 4)

    def forward(self, x):
        w = self.l1.weight
        return F.linear(torch.tanh(self.l2(self.l1(x))), w)


class ReadBeforeUsed(ReadBeforeHeld):
    # uses l1's weight before l1 runs: its backward, the last, needs it after l1's own backward
    def forward(self, x):
        h = torch.tanh(F.linear(x, self.l1.weight))
        return self.l2(self.l1(h))


class ViewOfBias(nn.Linear):
    def forward(self, x):
        return F.linear(x, self.weight), self.bias.view(1, -1)


class ReturnsAView(nn.Module):
    # a unit that returns a view of its bias for the caller to add
    def __init__(self):
        super().__init__()
        self.u = ViewOfBias(4, 4)
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        y, bias = self.u(x)
        return self.head(torch.tanh(y + bias))


CASES = {{"read before its unit, held": (ReadBeforeHeld, lambda m: [m.l1, m.l2]),
         "read before its unit, used": (ReadBeforeUsed, lambda m: [m.l1, m.l2]),
         "a view in the output": (ReturnsAView, lambda m: [m.u])}}
# a freed parameter inside an op's arguments: a list, a tuple, a list in the keyword arguments' dict
USES = {{"a list": lambda w: torch.cat([w]), "a tuple": lambda w: torch.stack((w,)),
        "a dict": lambda w: torch.cat(tensors=[w])}}

Engine = load_engine(sys.argv[1])
dist.init_process_group("gloo")
args = parse_args(Engine, PRESETS, GPTConfig, ["--steps", "3", "--warmup", "1", "--lr", "1e-2", "--dtype", "fp32"])
device = torch.device("cpu")
for case in sys.argv[2:]:
    print(f"case {{case}}", flush=True)
    if case == "freed":
        # after a step, l1's weight is freed: used inside an op's arguments, it names itself
        model = ReadBeforeHeld()
        engine = Engine(model, args, device, units=[model.l1, model.l2])
        engine.backward(engine.forward(torch.ones(2, 4)).sum(), sync=True)
        engine.step(1e-2)
        for inside, use in USES.items():
            print(f"case freed: l1.weight inside {{inside}} of an op's arguments", flush=True)
            try:
                use(model.l1.weight)
            except RuntimeError as e:
                if not str(e).startswith("l1.weight of unit l1 is freed"):
                    raise
                print(f"refused in {{inside}}", flush=True)
            else:
                sys.exit(f"error: a freed l1.weight inside {{inside}} of an op's arguments was read")
        continue
    make, units = CASES[case]
    torch.manual_seed(0)
    model, reference = make(), make()
    reference.load_state_dict(model.state_dict())
    engine = Engine(model, args, device, units=units(model))
    losses = []
    for e in (engine, SingleDeviceEngine(reference, args, device)):
        losses.append([])
        for step in range(3):
            x = torch.randn(5, 4, generator=torch.Generator().manual_seed(step))
            loss = e.forward(x).square().mean()
            e.backward(loss, sync=True)
            e.step(1e-2)
            losses[-1].append(loss.item())
    if any(abs(a - b) > 1e-5 * abs(b) for a, b in zip(*losses)):
        sys.exit(f"error: {{case}}: losses {{losses[0]}}, the reference's {{losses[1]}}")
    master = gather_master(engine)  # (rank 0's)
    for name, p in reference.named_parameters() if master is not None else []:
        if not torch.allclose(master[name].view_as(p), p.detach(), rtol=0, atol=1e-5 * p.abs().max().item()):
            sys.exit(f"error: {{case}}: {{name}} is not the reference's after 3 steps")
    print(f"trained as the reference: {{case}}", flush=True)
dist.barrier()
dist.destroy_process_group()
"""


def run_outside(runner, tmp_path, stage_file, nproc, cases):
    """The OUTSIDE script's `cases` at N = nproc, each trained as the reference (or, case "freed", refused in each of
    USES): a failure names the case, and how the run ended."""
    if "units" not in inspect.signature(any_model.load_engine(stage_file)).parameters:
        pytest.skip("stages 0-2 keep every parameter whole")
    script = tmp_path / "outside.py"
    script.write_text(OUTSIDE.format(root=str(ROOT), examples=str(ROOT / "examples")))
    p = runner.spawn(str(script), nproc, [stage_file, *cases], timeout=300)
    started = [ln[len("case "):] for ln in p.stdout.splitlines() if ln.startswith("case ")]
    errors = [ln for ln in p.stderr.splitlines() if "Error: " in ln or ln.startswith("error: ")]
    died = f"killed by signal {-p.returncode}" if p.returncode < 0 else f"exit code {p.returncode}"
    died += f" ({errors[-1].removeprefix('[rank0]: ')})" if errors else ""
    assert p.returncode == 0, (f"N={nproc}, {started[-1] if started else 'before the first case'}: {died}\n"
                               + "\n".join(last_lines(p.stdout + p.stderr, 12)))
    for case in cases:
        done = [f"refused in {inside}" for inside in ("a list", "a tuple", "a dict")] if case == "freed" else \
            [f"trained as the reference: {case}"]
        assert all(p.stdout.count(f"{line}\n") == nproc for line in done), p.stdout


@pytest.mark.parametrize("nproc", [1, 2])
def test_a_parameter_read_before_its_unit_runs_is_kept(runner, tmp_path, stage_file, nproc):
    """The root reads l1.weight before l1 runs: the read gathers l1 and keeps it past l1's forward, whether the
    weight is used then or held until after l1 ran (freed after l1's forward, the use fails in forward or backward)."""
    run_outside(runner, tmp_path, stage_file, nproc, ["read before its unit, held", "read before its unit, used"])


@pytest.mark.parametrize("nproc", [1, 2])
def test_a_view_of_a_parameter_in_a_units_output_keeps_the_unit(runner, tmp_path, stage_file, nproc):
    """A unit returns self.bias.view(1, -1): the view's storage is the unit's, which must stay gathered until its
    backward (freed, the caller adds a view of zero bytes)."""
    run_outside(runner, tmp_path, stage_file, nproc, ["a view in the output"])


@pytest.mark.parametrize("nproc", [1, 2])
def test_a_freed_parameter_inside_an_ops_arguments_names_itself(runner, tmp_path, stage_file, nproc):
    """After a step, l1.weight inside a list (torch.cat([w])), a tuple (torch.stack((w,))) or a list in the keyword
    arguments (torch.cat(tensors=[w])): one line naming it, not a read of its zero-byte storage."""
    run_outside(runner, tmp_path, stage_file, nproc, ["freed"])
