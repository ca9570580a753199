"""Checkpoints lose nothing: a run stopped and resumed equals the run that never stopped, bit for bit, at every stage;
a checkpoint saved by stage 3 on 4 ranks continues under stage 1 on 2; a rank killed mid-step or mid-save costs only
the steps since the last complete checkpoint; damaged or mismatched checkpoints are refused with a one-line error;
ranks whose views of the checkpoint directory differ still resume one checkpoint, rank 0's, and refuse together; a
save's bytes and renames reach the disk before a name points at them; a CPU run touches no CUDA state."""
import hashlib
import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

from conftest import ROOT
from test_any_model import parse_args
from test_stages import LOSS_ATOL, MODEL, TRAIN, compare_params, first_difference, reference, train  # noqa: F401
from checkpoint import load_checkpoint, open_checkpoint, save_checkpoint
from train_gpt import GPT, GPTConfig, CharData, LossScaler, SingleDeviceEngine, load_text

STOP = ["--stop_after", "3"]  # TRAIN has 6 steps: stop after 3, resume for the other 3


def bucket_args(runner, stage_file):
    return ["--bucket_mb", "0.02"] if "--bucket_mb" in runner.options(stage_file) else []


def assert_same_run(expected, got, where):
    """Bit for bit: the same losses, gradient norms, validation losses and final parameters."""
    for key in ("losses", "grad_norms", "val_losses"):
        e, g = expected.summary[key], got.summary[key]
        assert e == g, f"{where}: {key} differ from the uninterrupted run's:\n  expected {e}\n  got      {g}"
    for name, e in expected.master.items():
        assert torch.equal(e, got.master[name]), f"{where}: parameter {name} differs from the uninterrupted run's " \
                                                 f"(max |diff| {(e - got.master[name]).abs().max():.3g})"


def test_stop_and_resume_is_exact(runner, stage_file, tmp_path):
    straight = train(runner, stage_file, 2)
    ckpt = str(tmp_path / "ckpt")
    stopped = runner.run(stage_file, 2, *MODEL, *TRAIN, *bucket_args(runner, stage_file), *STOP, "--ckpt_dir", ckpt)
    assert len(stopped.summary["losses"]) == 3 and (tmp_path / "ckpt" / "step_000003" / "manifest.json").exists()
    resumed = runner.run(stage_file, 2, *MODEL, *TRAIN, *bucket_args(runner, stage_file), "--resume", ckpt)
    assert "resumed from" in resumed.stdout and resumed.summary["resumed_from"] == 3
    assert_same_run(straight, resumed, f"{Path(stage_file).stem}, stopped after step 3 and resumed")


def test_reference_stop_and_resume_is_exact(runner, reference, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    runner.run(str(ROOT / "train_gpt.py"), None, *MODEL, *TRAIN, *STOP, "--ckpt_dir", ckpt)
    resumed = runner.run(str(ROOT / "train_gpt.py"), None, *MODEL, *TRAIN, "--resume", ckpt)
    assert_same_run(reference, resumed, "train_gpt.py, stopped after step 3 and resumed")
    # the memory table names the step its meter measured, counted from 1 as the log counts: a fresh run's second (the
    # first warms up), a resumed run's first
    for run, step in ((reference, 2), (resumed, 4)):
        assert f"; measured on step {step}; " in run.stdout, f"the memory table is not of step {step}:\n{run.stdout}"


@pytest.fixture(scope="module")
def stage3_on_4(runner, tmp_path_factory):
    """A checkpoint saved by stage 3 on 4 ranks after 3 of 6 steps, and its run."""
    ckpt = tmp_path_factory.mktemp("stage3_on_4") / "ckpt"
    run = runner.run(str(ROOT / "stage3.py"), 4, *MODEL, *TRAIN, *STOP, "--ckpt_dir", str(ckpt))
    return ckpt, run


def test_resume_at_another_stage_and_world_size(runner, reference, stage3_on_4, tmp_path):
    """Saved by stage 3 on 4 ranks, continued by stage 1 on 2: the loss curve continues the reference's."""
    ckpt, _ = stage3_on_4
    run = runner.run(str(ROOT / "stage1.py"), 2, *MODEL, *TRAIN, "--bucket_mb", "0.02", "--resume", str(ckpt),
                     "--ckpt_dir", str(tmp_path / "continued"))  # (by default it would save into the one it resumed)
    assert "saved by stage3 on 4 rank(s)" in run.stdout, run.stdout
    k = first_difference(reference.summary["losses"], run.summary["losses"], LOSS_ATOL)
    assert k is None, f"stage 1 on 2 ranks from stage 3's checkpoint: loss at step {k} is {run.summary['losses'][k]}, " \
                      f"the reference's {reference.summary['losses'][k]}"
    compare_params(reference.master, run.master, "stage 1 on 2 ranks, resumed from stage 3 on 4")


def test_consolidate_and_sample(runner, stage3_on_4, tmp_path):
    """A sharded checkpoint -> one fp32 state dict (equal to what the run itself gathered), which samples text."""
    ckpt, run = stage3_on_4
    out = tmp_path / "gpt.pt"
    p = runner.launch(str(ROOT / "train_gpt.py"), None, "--consolidate", str(ckpt), str(out))
    assert p.returncode == 0, p.stderr[-2000:]
    saved = torch.load(out, weights_only=True)
    assert saved["step"] == 3 and set(saved["state_dict"]) == set(run.master)
    for name, t in run.master.items():
        assert torch.equal(saved["state_dict"][name], t), f"consolidated {name} differs from the run's own parameters"
    p = runner.launch(str(ROOT / "train_gpt.py"), None, "--sample", str(out), "--sample_chars", "50")
    assert p.returncode == 0 and "--- sample ---" in p.stdout, p.stdout + p.stderr[-2000:]


def killed(runner, tmp_path, kill_at):
    """Stage 2 on 2 ranks, saving every 2 steps, with rank 1 SIGKILLed at `kill_at`: the job must die."""
    ckpt = tmp_path / "ckpt"
    env = {"PYTHONPATH": f"{ROOT / 'tests' / 'kill_point'}:{ROOT}", "KILL_RANK": "1", "KILL_AT": kill_at}
    p = runner.launch(str(ROOT / "stage2.py"), 2, *MODEL, *TRAIN, "--bucket_mb", "0.02", "--save_every", "2",
                      "--ckpt_dir", str(ckpt), "--no_progress", env=env)
    assert p.returncode != 0, f"the job survived the kill of rank 1 at {kill_at}:\n{p.stdout[-2000:]}"
    assert "SIGKILL" in p.stderr or "Signal 9" in p.stderr, f"rank 1 did not die of SIGKILL:\n{p.stderr[-2000:]}"
    return ckpt


@pytest.mark.parametrize("kill_at, complete", [("backward:9", [2, 4]), ("replace:step_000004", [2])],
                         ids=["mid-step", "mid-save"])
def test_killed_rank_loses_only_steps_since_the_last_checkpoint(runner, tmp_path, kill_at, complete):
    """9th backward = step 5's first micro-step (after the step-4 save); or rank 1 dies while saving step 4, its
    shard written but never renamed into place. Resuming gives the uninterrupted run's result exactly."""
    ckpt = killed(runner, tmp_path, kill_at)
    found = sorted(int(d.name[5:]) for d in ckpt.glob("step_*") if (d / "manifest.json").exists())
    assert found == complete, f"killed at {kill_at}: complete checkpoints at steps {found}, expected {complete}"
    straight = train(runner, str(ROOT / "stage2.py"), 2)
    resumed = runner.run(str(ROOT / "stage2.py"), 2, *MODEL, *TRAIN, "--bucket_mb", "0.02", "--resume", str(ckpt))
    assert f"step_{complete[-1]:06d}" in resumed.stdout, resumed.stdout
    assert_same_run(straight, resumed, f"stage 2 killed at {kill_at}, then resumed")


# ---- bad input: one line that says what is wrong and what to do; nothing written

@pytest.fixture(scope="module")
def good(stage3_on_4):
    """The step directory of a complete checkpoint, and the model and data it fits."""
    ckpt, _ = stage3_on_4
    cfg = GPTConfig(**json.loads((ckpt / "step_000003" / "manifest.json").read_text())["config"])
    return ckpt / "step_000003", cfg, CharData(load_text(None), cfg.block_size).chars


def damaged(good, tmp_path, damage):
    step_dir = tmp_path / "ckpt" / good[0].name
    shutil.copytree(good[0], step_dir)
    damage(step_dir)
    return step_dir


def flip_a_byte(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


SHARD = "shard_00001_of_00004.pt"
CASES = {
    "missing shard": (lambda d: (d / SHARD).unlink(), f"{SHARD} is missing"),
    "truncated shard": (lambda d: (d / SHARD).write_bytes((d / SHARD).read_bytes()[:1000]), f"{SHARD} is truncated"),
    "corrupt shard": (lambda d: flip_a_byte(d / SHARD), f"{SHARD} is corrupt"),
    "manifest of other shards": (lambda d: shutil.copy(d / "shard_00002_of_00004.pt", d / SHARD), f"{SHARD} is"),
    "no manifest (a save cut short)": (lambda d: (d / "manifest.json").unlink(), "no complete checkpoint there"),
    "manifest not JSON": (lambda d: (d / "manifest.json").write_text("{"), "is not a checkpoint manifest"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_damaged_checkpoint_is_refused(good, tmp_path, case):
    damage, message = CASES[case]
    step_dir = damaged(good, tmp_path, damage)
    with pytest.raises(SystemExit, match="^error: ") as e:
        open_checkpoint(str(step_dir.parent), good[1], good[2])
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_other_model_or_data_is_refused(good):
    step_dir, cfg, chars = good
    with pytest.raises(SystemExit, match=r"holds a different GPT: n_embd 33 \(this run: 48\); pass the --preset"):
        open_checkpoint(str(step_dir), GPTConfig(**{**vars(cfg), "n_embd": 48}), chars)
    with pytest.raises(SystemExit, match="trained on another text .* pass the --data"):
        open_checkpoint(str(step_dir), cfg, chars[:-1])


def tree_hash(path):
    return hashlib.sha256(b"".join(p.name.encode() + p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file())).hexdigest()


def test_bad_resume_from_the_command_line_writes_nothing(runner, good, tmp_path):
    """As a user would meet them: a checkpoint of another model, shards that hold less than the manifest promises,
    a --ckpt_dir holding another run's checkpoints. Each stops before training, and the directory is unchanged."""
    ref = str(ROOT / "train_gpt.py")
    step_dir = damaged(good, tmp_path, lambda d: None)
    before = tree_hash(step_dir.parent)
    p = runner.launch(ref, None, *MODEL[:-2], "--block_size", "16", *TRAIN, "--resume", str(step_dir.parent))
    assert p.returncode != 0 and "holds a different GPT: block_size" in p.stderr.strip().splitlines()[-1], p.stderr[-2000:]
    p = runner.launch(ref, None, *MODEL, *TRAIN, "--ckpt_dir", str(step_dir.parent))
    assert p.returncode != 0 and "already holds checkpoints" in p.stderr.strip().splitlines()[-1], p.stderr[-2000:]
    assert tree_hash(step_dir.parent) == before, "a refused run changed the checkpoint directory"

    # a manifest listing only 2 of the 4 shards, consistently: every file checks out, but half the state is absent
    manifest = json.loads((step_dir / "manifest.json").read_text())
    manifest.update(world_size=2, shards=manifest["shards"][:2])
    (step_dir / "manifest.json").write_text(json.dumps(manifest))
    p = runner.launch(ref, None, *MODEL, *TRAIN, "--resume", str(step_dir))
    last = p.stderr.strip().splitlines()[-1]
    assert p.returncode != 0 and "the shards do not match the manifest" in last and "elements" in last, p.stderr[-2000:]


# ---- several nodes: each rank reads the checkpoint directory through its own view of a shared file system, and a
# view can lag (attribute and directory caching). Simulated here by hiding the newest checkpoint from one rank.

LAGGING = '''
import os
import sys
sys.path.insert(0, {root!r})
import checkpoint
import train_gpt
from stage2 import ZeRO2Engine

if os.environ["RANK"] == {rank!r}:  # this rank's view of the checkpoint directory lags: its newest entry is not there yet
    listed = checkpoint.complete_checkpoints
    checkpoint.complete_checkpoints = lambda ckpt_dir: listed(ckpt_dir)[:-1]
train_gpt.main(ZeRO2Engine, stage="stage2")
'''


def lagging(tmp_path, rank):
    script = tmp_path / f"stage2_rank{rank}_lags.py"
    script.write_text(LAGGING.format(root=str(ROOT), rank=str(rank)))
    return str(script)


def test_a_rank_that_sees_another_newest_checkpoint_resumes_rank_0s(runner, tmp_path):
    """Checkpoints at steps 2 and 4; rank 1 sees only step 2. Both resume step 4, rank 0's choice, and the run equals
    the uninterrupted one (each rank picking its own newest would resume two different steps)."""
    stage2, ckpt = str(ROOT / "stage2.py"), str(tmp_path / "ckpt")
    runner.run(stage2, 2, *MODEL, *TRAIN, "--bucket_mb", "0.02", "--save_every", "2", "--stop_after", "4", "--ckpt_dir", ckpt)
    resumed = runner.run(lagging(tmp_path, 1), 2, *MODEL, *TRAIN, "--bucket_mb", "0.02", "--resume", ckpt)
    assert resumed.summary["resumed_from"] == 4, resumed.stdout
    assert_same_run(train(runner, stage2, 2), resumed, "stage 2 resumed while rank 1 saw only an older checkpoint")


def test_a_refusal_seen_by_one_rank_stops_every_rank(runner, tmp_path):
    """--ckpt_dir holding another run's checkpoint, which rank 0 does not see yet: rank 1 refuses, and rank 0 stops
    with the same line (a lone exit would leave rank 0 waiting in its next collective)."""
    ckpt = str(tmp_path / "ckpt")
    runner.run(str(ROOT / "stage2.py"), 2, *MODEL, *TRAIN, "--bucket_mb", "0.02", "--stop_after", "1", "--ckpt_dir", ckpt)
    p = runner.spawn(lagging(tmp_path, 0), 2, [*MODEL, *TRAIN, "--bucket_mb", "0.02", "--ckpt_dir", ckpt], grace=60)
    refusals = [ln for ln in p.stderr.splitlines() if ln.startswith("error: --ckpt_dir") and "already holds" in ln]
    assert p.returncode != 0 and len(refusals) == 2, f"expected the refusal from both ranks:\n{p.stderr[-2000:]}"


def test_cpu_run_leaves_cuda_alone(tmp_path, monkeypatch):
    """A run on the CPU saves and restores no CUDA random state, even where CUDA is available: that would create a
    CUDA context on GPU 0 in every rank. A run on CUDA saves and restores it."""
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device="cuda": calls.append("get") or torch.zeros(8, dtype=torch.uint8))
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device="cuda": calls.append("set"))
    cfg = GPTConfig(block_size=8, vocab_size=5, n_layer=1, n_head=1, n_embd=4)
    engine = SingleDeviceEngine(GPT(cfg), parse_args(SingleDeviceEngine, []), torch.device("cpu"))
    meta = dict(stage="reference", config=vars(cfg), chars="abcde", losses=[], grad_norms=[], val_losses=[], params={})
    for device, expected in ((torch.device("cpu"), []), (torch.device("cuda"), ["get", "set"])):
        calls.clear()
        where = save_checkpoint(str(tmp_path / device.type), engine, 1, meta, device)
        load_checkpoint(*open_checkpoint(where, cfg, list("abcde")), engine, device)
        assert calls == expected, f"a run on {device.type}: CUDA random state calls {calls}, expected {expected}"



def test_a_save_is_on_disk_before_a_name_points_at_it(tmp_path, monkeypatch):
    """What a crash or a power cut may leave: each file's bytes are fsynced before the rename that gives it its name;
    the shard's rename is on disk (its directory fsynced) before the manifest's name exists, and the manifest's
    rename and the step directory's own name are fsynced too (before older checkpoints are removed). The calls are
    recorded in order, by the path each fsynced descriptor names."""
    import os
    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def replace(src, dst):
        events.append(("rename", os.path.abspath(src), os.path.abspath(dst)))
        return real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    cfg = GPTConfig(block_size=8, vocab_size=5, n_layer=1, n_head=1, n_embd=4)
    engine = SingleDeviceEngine(GPT(cfg), parse_args(SingleDeviceEngine, []), torch.device("cpu"))
    meta = dict(stage="reference", config=vars(cfg), chars="abcde", losses=[], grad_norms=[], val_losses=[], params={})
    where = os.path.abspath(save_checkpoint(str(tmp_path), engine, 1, meta, torch.device("cpu")))
    renames = [i for i, e in enumerate(events) if e[0] == "rename"]
    assert [Path(events[i][2]).name for i in renames] == ["shard_00000_of_00001.pt", "manifest.json"], events
    for i in renames:
        assert ("fsync", events[i][1]) in events[:i], f"{Path(events[i][2]).name} renamed before its bytes were fsynced"
    shard, manifest = renames
    assert ("fsync", where) in events[shard + 1:manifest], (
        "the manifest is named before the shard's rename is on disk (no fsync of the step directory between them)")
    assert ("fsync", where) in events[manifest + 1:], "the manifest's rename is never fsynced (its directory)"
    assert ("fsync", str(tmp_path)) in events[manifest + 1:], (
        "the step directory's name in --ckpt_dir is never fsynced (older checkpoints go while it may yet be lost)")


def test_skipped_steps_survive_a_change_of_dtype(tmp_path):
    """Adam's step count on resume is the steps taken less those fp16 skipped. A run saved in fp16 after skipping 2
    steps and resumed in fp32 keeps that count, so that its own checkpoint, resumed again, still counts them."""
    cfg = GPTConfig(block_size=8, vocab_size=5, n_layer=1, n_head=1, n_embd=4)
    engine = SingleDeviceEngine(GPT(cfg), parse_args(SingleDeviceEngine, []), torch.device("cpu"))
    meta = dict(stage="reference", config=vars(cfg), chars="abcde", losses=[], grad_norms=[], val_losses=[], params={})
    fp16 = LossScaler(enabled=True)
    fp16.scale, fp16.skipped = 2.0**14, 2
    where = save_checkpoint(str(tmp_path / "fp16"), engine, 10, meta | dict(loss_scaler=vars(fp16)), torch.device("cpu"))
    fp32 = LossScaler(enabled=False)
    load_checkpoint(*open_checkpoint(where, cfg, list("abcde")), engine, torch.device("cpu"), scaler=fp32)
    assert engine.optimizers[0].t == 8 and fp32.skipped == 2 and fp32.scale == 1.0, (engine.optimizers[0].t, vars(fp32))
    where = save_checkpoint(str(tmp_path / "fp32"), engine, 15, meta | dict(loss_scaler=vars(fp32)), torch.device("cpu"))
    again = LossScaler(enabled=True)
    load_checkpoint(*open_checkpoint(where, cfg, list("abcde")), engine, torch.device("cpu"), scaler=again)
    assert engine.optimizers[0].t == 13 and again.skipped == 2 and again.scale == 2.0**16, vars(again)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
