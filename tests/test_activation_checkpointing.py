"""--checkpoint_activations: each block of the GPT runs under torch.utils.checkpoint (non-reentrant), so it keeps only
its input for backward, and its backward first runs its forward again (the recompute). Checkpointing must not change
the numbers: every stage with it matches the reference with it and the reference without it, in fp32, to
test_stages.py's tolerances (stages 0-2 at N = 2, unchanged by it; stage 3 and offload at N = 1, 2, 4).

ZeRO-3 (stage3.py, offload.py) must tell a unit's recompute from its forward: the recompute runs inside the unit's
backward, on the parameters gathered for that backward, which are freed when the unit's last gradient arrives. Each
run of stage 3 and offload here is checked after every micro-step's backward (CHECKED): no unit still holds gathered
parameters, and every unit was gathered exactly twice in that micro-step (its forward; its recompute and backward).
So the ledger's all-gather bytes per step stay the formula's without checkpointing (train_gpt.comm_theory):
    2 x grad_accum x Ψ' x param_bytes x (N-1)/N.
Without that handling, stage 3 either runs a block's backward on freed storage or gathers blocks the formula does not
count: both fail here. With the switch, the peak falls (stage 3 at N = 4)."""
import sys

import pytest

from conftest import ROOT, last_lines
from test_stages import BLOCK, BUCKETS, LOSS_ATOL, MODEL, NORM_RTOL, TRAIN, compare_params, first_difference
from test_stages import reference  # noqa: F401  (the fixture: the reference run without the switch)

sys.path.insert(0, str(ROOT / "course"))
from make_lessons import step as without_idea  # noqa: E402

SWITCH = ["--checkpoint_activations"]
ZERO3 = {"stage3": str(ROOT / "stage3.py"), "offload": str(ROOT / "offload.py")}
NO_EARLY_STOP = {"EARLY_STOP": "0"}  # the recompute runs the block's forward to its end, its forward hook included

# A stage file run with checks around its engine: after every micro-step's backward, no unit holds gathered parameters,
# and each was all-gathered exactly twice since the micro-step's forward began. EARLY_STOP=0 turns off
# torch.utils.checkpoint's early stop (by default a recompute stops once it has what backward needs, so the block's
# forward hook never fires in it; without early stop it does).
CHECKED = '''
import importlib.util, os, sys
sys.path.insert(0, {root!r})
import torch.utils.checkpoint
from comm import comm

spec = importlib.util.spec_from_file_location("checked_stage", {script!r})
stage = importlib.util.module_from_spec(spec)
spec.loader.exec_module(stage)
Engine = [v for k, v in vars(stage).items()
             if k.endswith("Engine") and isinstance(v, type) and v.__module__ == stage.__name__][-1]
gathers, done, all_gather = {{}}, [0], comm.all_gather


def counted_all_gather(out, inp, async_op=False):
    gathers[id(out)] = gathers.get(id(out), 0) + 1
    return all_gather(out, inp, async_op=async_op)


def forward(self, *args, original=Engine.forward, **kwargs):
    gathers.clear()
    return original(self, *args, **kwargs)


def backward(self, loss, sync, original=Engine.backward):
    original(self, loss, sync)
    done[0] += 1
    held = [k for k, b in enumerate(self.buckets) if b.param.untyped_storage().nbytes()]
    times = [gathers.get(id(b.param), 0) for b in self.buckets]
    if held or times != [2] * len(self.buckets):
        raise SystemExit(f"error: micro-step {{done[0]}}: after backward, units {{held}} hold gathered parameters "
                         f"(none should); units gathered {{times}} times (2 each: forward; recompute and backward)")
    print(f"checked micro-step {{done[0]}}: no unit gathered after backward, each gathered twice", flush=True)


comm.all_gather, Engine.forward, Engine.backward = counted_all_gather, forward, backward
with torch.utils.checkpoint.set_checkpoint_early_stop(os.environ.get("EARLY_STOP", "1") == "1"):
    stage.main(Engine, stage={name!r})
'''
MICRO_STEPS = 6 * 2  # TRAIN: 6 steps of grad_accum 2


def checked(tmp_path_factory, name, script):
    """The CHECKED script for stage file `script` (run as stage `name`)."""
    path = tmp_path_factory.mktemp("checked") / f"checked_{name}.py"
    path.write_text(CHECKED.format(root=str(ROOT), script=script, name=name))
    return str(path)


@pytest.fixture(scope="module")
def reference_with_switch(runner):
    return runner.run(str(ROOT / "train_gpt.py"), None, *MODEL, *TRAIN, *SWITCH)


@pytest.fixture(scope="module")
def checked_scripts(tmp_path_factory):
    return {name: checked(tmp_path_factory, name, script) for name, script in ZERO3.items()}


def problems(expected, run, where):
    """What differs between a run and a reference (losses, gradient norms, val loss, parameters), and any ledger that
    differs from its formula (model states, bytes sent per collective): a list of lines, empty if none."""
    ref, s, found = expected.summary, run.summary, []
    k = first_difference(ref["grad_norms"], s["grad_norms"], NORM_RTOL)
    if k is not None:
        found.append(f"{where}: gradient norm at step {k} is {s['grad_norms'][k]:.7g}, expected {ref['grad_norms'][k]:.7g}")
    k = first_difference(ref["losses"], s["losses"], LOSS_ATOL)
    if k is not None:
        found.append(f"{where}: loss at step {k} is {s['losses'][k]:.7f}, expected {ref['losses'][k]:.7f}")
    if abs(s["val_loss"] - ref["val_loss"]) > LOSS_ATOL * 10:
        found.append(f"{where}: val loss {s['val_loss']:.7f}, expected {ref['val_loss']:.7f}")
    try:
        compare_params(expected.master, run.master, where)
    except pytest.fail.Exception as e:
        found.append(str(e))
    for category, v in s["model_state_bytes"].items():
        if v["measured"] != v["theory"]:
            found.append(f"{where}: {category} {v['measured']:,} bytes, the formula says {v['theory']:,}")
    for op, v in s["comm_bytes_per_step"]["by_collective"].items():
        if abs(v["measured"] - v["theory"]) > 1e-6 + 1e-9 * v["theory"]:
            found.append(f"{where}: {op} sent {v['measured']:,.0f} bytes per step, the formula says {v['theory']:,.0f}")
    return found


def assert_checked(run, nproc, where):
    """Every rank checked every micro-step (CHECKED printed a line for each)."""
    lines = [ln for ln in run.stdout.splitlines() if ln.startswith("checked micro-step")]
    assert len(lines) == MICRO_STEPS * nproc, f"{where}: {len(lines)} micro-steps checked, expected {MICRO_STEPS * nproc}"


def test_the_reference_does_not_change(reference, reference_with_switch):
    """On one process, checkpointing recomputes the same operations on the same values: the same losses and weights."""
    assert not problems(reference, reference_with_switch, "reference --checkpoint_activations")
    assert reference_with_switch.summary["args"]["checkpoint_activations"]


@pytest.mark.parametrize("name", ["stage0", "stage1", "stage2"])
def test_stages_0_to_2_unchanged(runner, reference, reference_with_switch, name):
    """Stages 0-2 keep the whole model and hook only gradients: a recompute changes nothing for them."""
    script = str(ROOT / ("stage0_ddp.py" if name == "stage0" else f"{name}.py"))
    run = runner.run(script, 2, *MODEL, *TRAIN, *(BUCKETS if name != "stage0" else []), *SWITCH)
    for expected, which in ((reference_with_switch, "with"), (reference, "without")):
        found = problems(expected, run, f"{name} --checkpoint_activations at N=2 (reference {which} it)")
        assert not found, "\n".join(found)


@pytest.mark.parametrize("nproc", [1, 2, 4])
@pytest.mark.parametrize("name", ["stage3", "offload"])
def test_zero3_recompute(runner, reference, reference_with_switch, checked_scripts, name, nproc):
    """Stage 3 and offload with the switch: the reference's numbers (with and without the switch), model states and
    bytes sent equal to their formulas, and CHECKED's checks after every backward on every rank."""
    run = runner.run(checked_scripts[name], nproc, *MODEL, *TRAIN, *SWITCH)
    where = f"{name} --checkpoint_activations at N={nproc}"
    assert_checked(run, nproc, where)
    for expected, which in ((reference_with_switch, "with"), (reference, "without")):
        found = problems(expected, run, f"{where} (reference {which} it)")
        assert not found, "\n".join(found)
    s = run.summary
    gathered = s["comm_bytes_per_step"]["by_collective"]["all_gather"]["measured"]
    assert gathered == pytest.approx(2 * 2 * s["padded_numel"] * 4 * (nproc - 1) / nproc), where  # 2 x A x Ψ' x 4 B


@pytest.mark.parametrize("name", ["stage3", "offload"])
def test_zero3_recompute_without_early_stop(runner, reference, checked_scripts, name):
    """Without torch.utils.checkpoint's early stop, the recompute runs the block's forward to its end: its forward
    hook fires inside the backward, and must neither free the parameters nor wait for a gradient that never comes."""
    run = runner.run(checked_scripts[name], 2, *MODEL, *TRAIN, *SWITCH, env=NO_EARLY_STOP)
    assert_checked(run, 2, f"{name} without early stop")
    found = problems(reference, run, f"{name} --checkpoint_activations at N=2, without early stop")
    assert not found, "\n".join(found)


# ---- without the recompute handling (stage3.py less its [Recompute] regions), stage 3 goes wrong

@pytest.fixture(scope="module")
def unhandled(tmp_path_factory):
    """stage3.py without its [Recompute] regions (course/make_lessons.py's step before the recompute lesson), as a
    file, and CHECKED around it."""
    source = without_idea("stage3.py - Recompute")
    assert source != (ROOT / "stage3.py").read_text(), "stage3.py has no [Recompute] region"
    path = tmp_path_factory.mktemp("unhandled") / "stage3.py"
    path.write_text(source)
    return str(path), checked(tmp_path_factory, "stage3", str(path))


def test_without_the_handling_the_numbers_are_wrong(runner, reference, unhandled):
    """With early stop (torch's default) the recompute's pre-hook prefetches by the forward order: the next block,
    already through its backward, is gathered again and kept until step() frees it (no unit stays gathered across a
    step, so the next forward runs on the updated shard): a gather the formula does not count, every micro-step."""
    run = runner.run(unhandled[0], 2, *MODEL, *TRAIN, *SWITCH)
    found = problems(reference, run, "stage 3 without the recompute handling")
    assert any("loss at step" in p or "all_gather sent" in p for p in found), (
        "stage 3 without its recompute handling matched the reference and its ledger: the tests cannot see the handling")


@pytest.mark.parametrize("env, expected", [({}, "hold gathered parameters"),
                                           (NO_EARLY_STOP, "for storage of size 0")], ids=["early_stop", "no_early_stop"])
def test_without_the_handling_the_checks_fail(runner, unhandled, env, expected):
    """CHECKED catches the kept block after the first backward; without early stop, the recompute's forward hook frees
    the parameters the block's backward then needs, and the backward fails on storage of size 0 (never by luck)."""
    p = runner.spawn(unhandled[1], 2, [*MODEL, *TRAIN, *SWITCH], env)
    assert p.returncode != 0 and expected in p.stdout + p.stderr, (
        f"exit code {p.returncode}, expected a failure naming {expected!r}:\n" + "\n".join(last_lines(p.stdout + p.stderr, 15)))


PEAK = [*MODEL, "--dtype", "fp32", "--steps", "2", "--warmup", "1", "--batch_size", "16", "--eval_batches", "1",
        "--sample_chars", "0", "--no_progress"]  # 4 sequences per rank at N = 4: activations matter beside the states


def test_the_peak_falls(runner):
    """At N = 4, stage 3 with the switch peaks lower than without it, on every rank: a block keeps its input for
    backward, not its activations. (With test_stages.py's batch, one sequence per rank and micro-step, the peak is
    elsewhere: this batch is 4.)"""
    without = runner.run(ZERO3["stage3"], 4, *PEAK).summary
    with_switch = runner.run(ZERO3["stage3"], 4, *PEAK, *SWITCH).summary
    peaks = [(a, b) for a, b in zip(with_switch["peak_memory_bytes_per_rank"], without["peak_memory_bytes_per_rank"])]
    assert all(a < b for a, b in peaks), f"stage 3 at N=4, peak per rank (with the switch, without): {peaks}"
    kept = with_switch["activation_checkpoints"]  # per block, its input: 4 sequences per rank, in fp32
    assert kept["blocks"] == 2 and kept["bytes_per_block"] == 4 * BLOCK * 33 * 4, kept
    assert without["activation_checkpoints"] is None


def test_the_timeline_draws_a_recompute_as_backward(runner, tmp_path_factory):
    """--timeline with the switch: a block's recompute runs its forward hooks inside its backward; the timeline draws
    that time as the block's backward, and no block's forward after backward has begun."""
    import json
    out = tmp_path_factory.mktemp("timeline")
    runner.run(ZERO3["stage3"], 2, *MODEL, *TRAIN, *SWITCH, "--grad_accum", "1", "--timeline", str(out))  # 1 backward
    events = json.loads((out / "trace_rank0.json").read_text())["traceEvents"]
    names = [e["name"] for e in sorted(events, key=lambda e: e.get("ts", 0)) if e.get("cat") == "compute"]
    first = next(i for i, n in enumerate(names) if n.startswith("backward"))
    assert {"backward blocks.0", "backward blocks.1"} <= set(names[first:]), names
    assert not [n for n in names[first:] if n.startswith("forward")], names
