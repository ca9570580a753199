"""fp16 with dynamic loss scaling, as the ZeRO papers trained: every stage and offload against the fp16 single-process
reference; an overflow on one rank only (an inf in one gradient element of rank 1), which every rank skips with
nothing changed, the scale halved, and the steps after it matching a reference that skipped the same step; a run
stopped and resumed across that overflow, bit for bit the straight run; the ledgers' fp16 formulas (16Ψ) against what
is measured; an overflow at the scale's floor stopping the run with one line; and the scaler's own rules."""
import json
import math
import re
from pathlib import Path

import pytest
import torch

from conftest import ROOT
from test_checkpoint import assert_same_run
from test_stages import BUCKETS, MODEL, TRAIN, compare_params
from test_stages import reference  # noqa: F401  (the fixture: the fp32 reference run)
import train_gpt
from train_gpt import LossScaler, clip_coef

FP16 = [a if a != "fp32" else "fp16" for a in TRAIN]  # TRAIN's 6 steps, grad_accum 2 and clipping, in fp16
# Tolerances. fp16 keeps 11 significant bits to fp32's 24, so gradients summed in another order (over ranks, in
# buckets) and rounded to fp16 differ by up to 2^-11 relative, where fp32's differ by 2^-24 (test_stages.py's
# tolerances are for those); Adam turns the noise of a near-zero gradient into a step of up to lr (1e-3 here), and in
# fp16 more gradients are near zero relative to their noise. Measured at N = 2 and 4 (AMD EPYC, AVX-512): losses
# within 1.4e-5, gradient norms within 1.0e-4 relative, 99.8% of each tensor's elements within 1e-3 of its largest,
# none more than 5.0e-4 apart. Measured again on an AMD EPYC with AVX2 only (Zen 3), every stage at N = 2, stage 0
# and offload at N = 1 and 4: losses within 1.4e-5, norms 8.6e-5, none more than 5.02e-4 apart, and the median
# element of every tensor within 2.21e-5 of its largest value. The margins keep real mistakes visible: a sum instead
# of an average moves the norm by a factor N, a lost micro-step halves it, and an update skipped or applied twice
# moves many elements by lr. ATOL_ANY is twice the largest difference measured (that one element is Adam's noise, up
# to lr / 2); MEDIAN_RTOL, about twice the median measured, is what a small systematic error moves: offload's C++
# AdamW without its weight decay (measured there) moves the median of every tensor by 6.4e-5 to 3.7e-4 (the norms'
# weights, which sit at 1.0, by lr x weight_decay each step), 1.3x to 7x past it.
LOSS_ATOL, NORM_RTOL, BULK_RTOL, BULK_SHARE, ATOL_ANY, MEDIAN_RTOL = 1e-4, 1e-3, 1e-3, 0.99, 1e-3, 5e-5
# The paper's model-state formulas in fp16 (2 + 2 + 12 bytes per parameter), per rank; offload's 16Ψ/N plus the
# gradient shard it sums on the device over FP16's 2 micro-steps (2Ψ/N)
PAPER = {"stage0": "16Ψ", "stage1": "4Ψ + 12Ψ/N", "stage2": "2Ψ + 14Ψ/N", "stage3": "16Ψ/N", "offload": "18Ψ/N"}
PAPER_BYTES = {"stage0": lambda n, N: 16 * n, "stage1": lambda n, N: 4 * n + 12 * n // N,
               "stage2": lambda n, N: 2 * n + 14 * n // N, "stage3": lambda n, N: 16 * n // N,
               "offload": lambda n, N: 18 * n // N}
# fp16's gradient norm against fp32's, the same steps from the same weights: within 3.8e-4 relative over the 6 steps
# (AMD EPYC Zen 4, AVX-512); a norm left loss-scaled is 2^16 times it, one unscaled twice or by the wrong scale 2x off.
FP16_NORM_RTOL = 5e-3
STEP, RANK = 1, 1  # the overflow: an inf in one gradient element of rank 1, on the first micro-step of step 1

# A stage (or the reference) whose engine sets one gradient element to inf at step OVERFLOW_STEP on rank OVERFLOW_RANK
# only, and records, on every rank, what that step did: the global norm it returned, whether the gradient this rank
# holds (its reduced shard) was finite, and whether the step changed anything this rank holds.
OVERFLOW = '''
import importlib.util, json, os, re, sys, threading
sys.path.insert(0, {root!r})
import torch
import torch.distributed as dist
from train_gpt import SingleDeviceEngine, main, trained

SCRIPT, OUT = os.environ["OVERFLOW_SCRIPT"], os.environ["OVERFLOW_OUT"]
STEP, RANK = int(os.environ["OVERFLOW_STEP"]), int(os.environ["OVERFLOW_RANK"])
if SCRIPT.endswith("train_gpt.py"):
    Engine, stage, distributed = SingleDeviceEngine, "reference", False
else:  # the stage file's engine, and the stage name its main() runs under
    spec = importlib.util.spec_from_file_location("stage_under_test", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    Engine = [v for v in vars(module).values() if isinstance(v, type) and v.__module__ == module.__name__
                 and hasattr(v, "state_pieces")][-1]
    stage, distributed = re.search(r'main\\(\\w+, stage="(\\w+)"', open(SCRIPT).read()).group(1), True


def held(engine):
    """Bit patterns of everything a step may change on this rank: the model's parameters it holds, its fp32 master
    weights and Adam moments; and its optimizer's step counter(s)."""
    tensors = list(engine.model_states()["params"]) + [t for *_, views in engine.state_pieces() for t in views]
    counters = [o.t for o in getattr(engine, "optimizers", [getattr(engine, "optimizer", None)]) if o is not None]
    return [t.detach().clone().reshape(-1).view(torch.uint8) for t in tensors], counters


class Overflowing(Engine):
    step_now, injected = 0, False

    def backward(self, loss, sync):
        rank, hook = dist.get_rank() if dist.is_initialized() else 0, None
        if self.step_now == STEP and rank == RANK and not self.injected:  # before the engine's hooks see it
            self.injected, (_, p) = True, trained(self.model)[0]
            hook = p.register_hook(lambda g: g.flatten().index_fill(0, torch.tensor([0]), float("inf")).view_as(g))
        super().backward(loss, sync)
        if hook is not None:
            hook.remove()

    def step(self, lr, scaler=None):
        if self.step_now == STEP:
            finite = all(bool(torch.isfinite(self.grad(p)[1]).all()) for _, p in trained(self.model))
            before = held(self)
            # ranks that disagree on skipping wait forever in a collective one of them skipped: stop the job instead
            watchdog = threading.Timer(60, lambda: (print(f"error: step {{STEP}} did not end in 60 s on this rank: do "
                                                          "the ranks disagree on skipping it?", flush=True), os._exit(3)))
            watchdog.start()
        norm = super().step(lr, scaler)
        if self.step_now == STEP:
            watchdog.cancel()
            after = held(self)
            rank = dist.get_rank() if dist.is_initialized() else 0
            record = dict(norm=float(norm), held_finite=finite, counters=[before[1], after[1]],
                          unchanged=len(before[0]) == len(after[0]) and all(torch.equal(a, b) for a, b in
                                                                          zip(before[0], after[0])))
            with open(os.path.join(OUT, f"rank{{rank}}.json"), "w") as f:
                json.dump(record, f)
        self.step_now += 1
        return norm

    def resume(self, step):
        super().resume(step)
        self.step_now = step


main(Overflowing, stage=stage, distributed=distributed)
'''


def stem(script):
    return Path(script).stem


def fp16_run(runner, script, nproc, *extra, env=None):
    buckets = BUCKETS if "--bucket_mb" in runner.options(script) else []
    return runner.run(script, nproc, *MODEL, *FP16, *buckets, *extra, env=env)


def assert_matches(expected, got, where):
    """got trains as expected does, to fp16's tolerances (non-finite norms, of skipped steps, must match too)."""
    e, g = expected.summary, got.summary
    assert len(g["losses"]) == len(e["losses"]), f"{where}: {len(g['losses'])} steps, expected {len(e['losses'])}"
    for k, (a, b) in enumerate(zip(e["grad_norms"], g["grad_norms"])):
        ok = (math.isfinite(a) == math.isfinite(b)) and (not math.isfinite(a) or abs(a - b) <= NORM_RTOL * abs(a))
        assert ok, f"{where}: global gradient norm at step {k} is {b:.7g}, expected {a:.7g}"
    for k, (a, b) in enumerate(zip(e["losses"], g["losses"])):
        assert abs(a - b) <= LOSS_ATOL, f"{where}: loss at step {k} is {b:.7f}, expected {a:.7f}"
    assert abs(g["val_loss"] - e["val_loss"]) <= 10 * LOSS_ATOL, f"{where}: val loss {g['val_loss']} != {e['val_loss']}"
    compare_params(expected.master, got.master, where, BULK_RTOL, BULK_SHARE, ATOL_ANY, MEDIAN_RTOL)


def check_ledgers(run, nproc, where):
    """Model states and bytes sent equal their formulas, and the formulas are the paper's, in fp16 (16 bytes a
    parameter in all, 2 + 2 of them in fp16)."""
    s, stage = run.summary, run.summary["stage"]
    assert s["dtype"] == "fp16", f"{where}: the run's dtype is {s['dtype']}"
    for category, v in s["model_state_bytes"].items():
        assert v["measured"] == v["theory"], f"{where}: {category} measured {v['measured']:,}, formula {v['theory']:,}"
    for op, v in s["comm_bytes_per_step"]["by_collective"].items():
        assert v["measured"] == pytest.approx(v["theory"], rel=1e-9, abs=1e-6), f"{where}: {op} sent {v['measured']}"
    theory, n = s["model_state_bytes"], s["padded_numel"]
    assert theory["params"]["theory"] * (nproc if stage in ("stage3", "offload") else 1) == 2 * n, where
    assert sum(v["theory"] for v in theory.values()) == PAPER_BYTES[stage](n, nproc), where
    assert f"model states per rank {PAPER[stage]} =" in run.stdout, f"{where}: the formula printed is not the paper's"


@pytest.fixture(scope="session")
def fp16_reference(runner):
    ref = runner.run(str(ROOT / "train_gpt.py"), None, *MODEL, *FP16)
    assert all(math.isfinite(n) for n in ref.summary["grad_norms"]), "the fp16 reference must not overflow by itself"
    assert max(ref.summary["grad_norms"]) > 1.0, "clipping at 1.0 must really clip in this test"
    return ref


@pytest.fixture(scope="session")
def overflow_wrapper(tmp_path_factory):
    script = tmp_path_factory.mktemp("overflow") / "overflowing.py"
    script.write_text(OVERFLOW.format(root=str(ROOT)))
    return str(script)


def overflow_env(runner, script, name="straight"):
    out = runner.tmp / f"overflow_{stem(script)}_{name}"
    out.mkdir(exist_ok=True)
    return dict(OVERFLOW_SCRIPT=script, OVERFLOW_STEP=str(STEP), OVERFLOW_RANK=str(RANK), OVERFLOW_OUT=str(out))


@pytest.fixture(scope="session")
def overflow_reference(runner, overflow_wrapper):
    """The reference with the same overflow at the same step (on its one rank), run with its progress lines."""
    script = str(ROOT / "train_gpt.py")
    env = {**overflow_env(runner, script), "OVERFLOW_RANK": "0"}
    return runner.run(overflow_wrapper, None, *MODEL, *[a for a in FP16 if a != "--no_progress"], env=env)


# ---- parity and ledgers

def test_fp16_parity_and_ledgers(runner, fp16_reference, stage_file):
    """At N = 2: the same training as the fp16 reference, to fp16's tolerances; the ledgers equal the paper's fp16
    formulas."""
    run = fp16_run(runner, stage_file, 2)
    assert_matches(fp16_reference, run, f"{stem(stage_file)} in fp16 at N=2")
    check_ledgers(run, 2, f"{stem(stage_file)} in fp16 at N=2")


@pytest.mark.parametrize("nproc", [1, 4])
@pytest.mark.parametrize("script", ["stage0_ddp.py", "offload.py"])
def test_fp16_parity_and_ledgers_at_one_and_four(runner, fp16_reference, script, nproc):
    """At N = 1 and 4, stage 0 (fp16 all-reduce) and offload (fp16 reduce-scatter and gathers, the C++ AdamW's fp16
    paths): the other stages share these collectives and differ from them at N = 2 only in what they keep."""
    run = fp16_run(runner, str(ROOT / script), nproc)
    assert_matches(fp16_reference, run, f"{script} in fp16 at N={nproc}")
    check_ledgers(run, nproc, f"{script} in fp16 at N={nproc}")


def test_reference_says_fp16_and_its_formula(fp16_reference):
    first, second = fp16_reference.stdout.splitlines()[:2]
    assert first == "reference: fp16 (--dtype fp16); loss scale from 65536", first
    assert "model states per rank 16Ψ =" in second, second


# ---- an overflow on one rank only

def test_overflow_on_one_rank_is_skipped_by_every_rank(runner, overflow_wrapper, overflow_reference, stage_file):
    """Rank 1 alone gets an inf in one gradient element at step 1. Every rank's global norm is non-finite (in the
    sharded stages, one rank's reduced shard holds the inf and the other's does not: the norm's all-reduce tells it),
    every rank skips the step: its parameters, master weights, Adam moments and step counter bit for bit as before;
    the scale halves; and the steps after it match the reference that skipped the same step."""
    env = overflow_env(runner, stage_file)
    run = fp16_run(runner, overflow_wrapper, 2, env=env)
    where = f"{stem(stage_file)} at N=2, an inf on rank {RANK} at step {STEP}"
    records = [json.loads((Path(env["OVERFLOW_OUT"]) / f"rank{r}.json").read_text()) for r in range(2)]
    for r, rec in enumerate(records):
        assert not math.isfinite(rec["norm"]), f"{where}: rank {r}'s global gradient norm is {rec['norm']}: finite"
        assert rec["unchanged"], f"{where}: the skipped step changed what rank {r} holds (parameters, master or moments)"
        assert rec["counters"][0] == rec["counters"][1], f"{where}: rank {r}'s step counter moved: {rec['counters']}"
    if run.summary["stage"] != "stage0":  # stage 0 all-reduces the whole gradient: every rank holds the inf
        holders = [r for r, rec in enumerate(records) if not rec["held_finite"]]
        assert len(holders) == 1, f"{where}: ranks {holders} hold the inf in their reduced gradient; expected one"
    norms = run.summary["grad_norms"]
    assert [k for k, n in enumerate(norms) if not math.isfinite(n)] == [STEP], f"{where}: norms {norms}"
    scaler = run.summary["loss_scaler"]
    assert scaler["scale"] == 2.0**15 and scaler["skipped"] == 1, f"{where}: the scaler ends as {scaler}"
    assert_matches(overflow_reference, run, f"{where} (against the reference that skipped step {STEP})")


def test_the_run_lines_show_the_scale_and_the_skipped_steps(overflow_reference):
    out = overflow_reference.stdout
    assert (f"reference: step {STEP + 1}: the fp16 gradient overflowed (on some rank), so every rank skipped the step; "
            "loss scale now 32768") in out, out
    assert "loss scale 65536, 0 steps skipped" in out and "loss scale 32768, 1 step skipped" in out, out
    assert "fp16 loss scale 32768, 1 step skipped" in out, out


def test_resume_across_an_overflow_is_exact(runner, overflow_wrapper, stage_file, tmp_path):
    """Stopped after 3 steps (the overflow was step 1 of 0, 1, 2) and resumed: bit for bit the straight run, the
    scaler's state (scale, steps since the overflow, steps skipped) included, carried by the checkpoint's manifest."""
    straight = fp16_run(runner, overflow_wrapper, 2, env=overflow_env(runner, stage_file))
    env, ckpt = overflow_env(runner, stage_file, "stopped"), str(tmp_path / "ckpt")
    fp16_run(runner, overflow_wrapper, 2, "--stop_after", "3", "--ckpt_dir", ckpt, env=env)
    manifest = json.loads((tmp_path / "ckpt" / "step_000003" / "manifest.json").read_text())
    assert manifest["loss_scaler"] == dict(enabled=True, scale=2.0**15, window=1000, floor=1.0, good_steps=1,
                                           skipped=1), manifest["loss_scaler"]
    resumed = fp16_run(runner, overflow_wrapper, 2, "--resume", ckpt, env=env)
    assert resumed.summary["resumed_from"] == 3
    assert_same_run(straight, resumed, f"{stem(stage_file)} in fp16, stopped after the overflow and resumed")
    assert resumed.summary["loss_scaler"] == straight.summary["loss_scaler"]


# ---- an overflow at the floor stops the run

@pytest.mark.parametrize("script, nproc", [("train_gpt.py", None), ("stage2.py", 2)])
def test_overflow_at_the_floor_stops_the_run(runner, tmp_path, script, nproc):
    """lr 1e30 turns the fp16 weights into inf at step 0: every later gradient is NaN. Steps 1 to 16 are skipped, the
    scale halving from 2^16 to the floor, 1; step 17 overflows at the floor and stops the run with one line, and the
    checkpoints hold no NaN."""
    ckpt = tmp_path / "ck"
    args = ["--preset", "tiny", "--steps", "20", "--lr", "1e30", "--warmup", "1", "--dtype", "fp16", "--no_progress",
            "--sample_chars", "0", "--ckpt_dir", str(ckpt), "--save_every", "5"]
    path = str(ROOT / script)
    p = runner.launch(path, None, *args) if nproc is None else runner.spawn(path, nproc, args)
    errors = [ln for ln in (p.stdout + p.stderr).splitlines() if ln.startswith("error:")]
    assert p.returncode != 0 and "Traceback" not in p.stderr, (p.stdout + p.stderr)[-3000:]
    assert len(errors) == 1 and re.match(r"error: step 17: the global gradient norm is (nan|inf) at the loss scale's "
                                         r"floor \(1\), so no update was made", errors[0]), errors
    newest = sorted(ckpt.glob("step_*/manifest.json"))[-1].parent
    assert json.loads((newest / "manifest.json").read_text())["loss_scaler"]["skipped"] == 14  # steps 1-14, saved at 15
    for shard in newest.glob("shard_*.pt"):
        state = torch.load(shard, weights_only=True)
        assert all(torch.isfinite(state[k]).all() for k in ("master", "exp_avg", "exp_avg_sq")), shard


# ---- the scaler's rules (DeepSpeed's defaults), and the clipping coefficient that unscales

def test_scaler_doubles_after_a_window_halves_on_overflow_and_keeps_its_floor():
    s = LossScaler(enabled=True)
    assert (s.scale, s.window, s.floor) == (2.0**16, 1000, 1.0)
    for _ in range(999):
        s.update(True)
    assert s.scale == 2.0**16
    s.update(True)
    assert s.scale == 2.0**17  # after 1000 steps without overflow
    s.update(False)
    assert (s.scale, s.good_steps, s.skipped) == (2.0**16, 0, 1)
    for _ in range(999):
        s.update(True)
    s.update(False)  # 999 good steps, then an overflow: the count starts again
    assert (s.scale, s.skipped) == (2.0**15, 2)
    for _ in range(40):
        s.update(False)
    assert s.scale == 1.0  # never below the floor
    off = LossScaler()
    off.update(False)
    assert (off.scale, off.skipped) == (1.0, 0)  # bf16 and fp32: no scaling, nothing skipped


def test_clip_coef_unscales_exactly_and_skips_above_the_floor():
    scaler = LossScaler(enabled=True)
    for true_norm, max_norm in [(7.3, 1.0), (0.2, 1.0), (7.3, 0.0)]:
        unscaled = clip_coef(torch.tensor(true_norm, dtype=torch.float64), max_norm, LossScaler())
        scaled = clip_coef(torch.tensor(true_norm * 2.0**16, dtype=torch.float64), max_norm, scaler)
        assert float(scaled) == float(unscaled) / 2.0**16, (true_norm, max_norm)  # a power of two: exact
    assert clip_coef(torch.tensor(math.inf, dtype=torch.float64), 1.0, scaler) is None
    assert clip_coef(torch.tensor(math.nan, dtype=torch.float64), 1.0, scaler) is None
    scaler.scale = 1.0  # at the floor: an overflow stops the run
    with pytest.raises(train_gpt.NonFiniteGradNorm, match=r"at the loss scale's floor \(1\)"):
        clip_coef(torch.tensor(math.inf, dtype=torch.float64), 1.0, scaler)


def test_clip_coef_at_the_scalers_window_divides_by_the_scale_the_gradient_has():
    """The window's last good step: the gradient was scaled by 2^16, and the factor must unscale by 2^16, while the
    scaler doubles to 2^17 only for the steps after it (a factor that divided by the doubled scale would apply half the
    gradient there)."""
    for true_norm, max_norm in [(0.2, 1.0), (7.3, 1.0), (0.2, 0.0)]:
        scaler = LossScaler(enabled=True)
        scaler.good_steps = scaler.window - 1
        unscaled = clip_coef(torch.tensor(true_norm, dtype=torch.float64), max_norm, LossScaler())
        coef = clip_coef(torch.tensor(true_norm * 2.0**16, dtype=torch.float64), max_norm, scaler)
        assert float(coef) == float(unscaled) / 2.0**16, (
            f"norm {true_norm}, clip {max_norm}, at the window's step: the factor is {float(coef)!r}, "
            f"{float(unscaled) / 2.0**16 / float(coef):g}x off the gradient's scale 2^16")
        assert scaler.scale == 2.0**17, f"the window's step done, the scale is {scaler.scale:g}, not 2^17"


def test_fp16_logs_the_true_gradient_norm(fp16_reference, reference):
    """The gradient norm fp16 logs is the true gradient's, unscaled: the fp32 reference's at every step, to fp16's
    rounding (every other fp16 comparison is against the fp16 reference, which logs through the same line)."""
    fp16, fp32 = fp16_reference.summary["grad_norms"], reference.summary["grad_norms"]
    for step, (a, b) in enumerate(zip(fp32, fp16)):
        assert abs(b - a) <= FP16_NORM_RTOL * a, (
            f"step {step}: fp16 logs the gradient norm {b:.6g}, fp32 {a:.6g} ({b / a:.4g}x): is it unscaled?")
