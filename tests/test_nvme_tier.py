"""offload.py --offload_optimizer nvme, ZeRO-Infinity's NVMe tier, against offload with the optimizer states in host
memory: the same C++ AdamW on the same numbers in the same order, so every loss, gradient norm and final weight is
bit-identical, at N = 1 and 2, in fp32, bf16 and fp16, with --offload_params, --delayed_update, --grad_accum 2 and
every buffer count's overlap. The memory table measures the tier (the state file's size on disk, the host buffers
instead of the states); the files are gone at the end; a checkpoint's host copy of the states goes at the next
update; checkpoints move between the tiers; a run killed mid-step, or one whose disk fills up mid-run, resumes from its
last checkpoint bit for bit (those with fewer buffers than buckets); a disk that fails one rank stops every rank with
that rank's line; bad paths get one line."""
import os
import re

import pytest
import torch

from conftest import ROOT
from instruments import unlisted
from test_any_model import any_model, loss_of, parse_args, world_of_one  # noqa: F401 (a fixture)
from test_checkpoint import assert_same_run
from test_stages import LOSS_ATOL, MODEL, TRAIN, compare_params, first_difference
from test_stages import reference  # noqa: F401  (the fixture: the single-process reference run)

OFFLOAD = str(ROOT / "offload.py")
BUCKETS = 3  # MODEL's units: its 2 blocks and the root, a bucket each


def with_options(options):
    """TRAIN with `options`: its --dtype replaced, the others added."""
    train = list(TRAIN)
    options = list(options)
    if "--dtype" in options:
        at = options.index("--dtype")
        train[train.index("--dtype") + 1] = options[at + 1]
        del options[at:at + 2]
    return train + options


def nvme(path, buffers=None):
    """The NVMe tier's options; `buffers`: its --nvme_buffer_count (default 3, one per bucket of MODEL)."""
    count = ["--nvme_buffer_count", str(buffers)] if buffers is not None else []
    return ["--offload_optimizer", "nvme", "--nvme_path", str(path), *count]


# Fewer buffers than buckets: bucket 2 passes through bucket 0's buffer, so what a buffer holds after a step is not each
# bucket's states, and a checkpoint or a resume that read a buffer in place of the file would save or train on another
# bucket's (with a buffer per bucket each bucket's states never leave their buffer, and such a slip passes).
FEWER = BUCKETS - 1


CASES = {
    "fp32-N1": (1, ["--dtype", "fp32"]),
    "fp32-N2-one_buffer": (2, ["--dtype", "fp32", "--nvme_buffer_count", "1"]),
    "bf16-N2-offload_params-two_buffers": (2, ["--dtype", "bf16", "--offload_params", "--nvme_buffer_count", "2"]),
    "fp16-N2-delayed_update": (2, ["--dtype", "fp16", "--delayed_update"]),
    "bf16-N1-offload_params-delayed_update": (1, ["--dtype", "bf16", "--offload_params", "--delayed_update"]),
    "fp16-N1-offload_params": (1, ["--dtype", "fp16", "--offload_params"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bit_identical_to_the_states_in_memory(runner, tmp_path, case):
    """Every case at --grad_accum 2 (TRAIN's), against the same run with the states in host memory."""
    nproc, options = CASES[case]
    # (--nvme_buffer_count is the tier's option: the run in memory takes the rest)
    in_memory = [o for o in options if o not in ("--nvme_buffer_count", "1", "2")]
    ram = runner.run(OFFLOAD, nproc, *MODEL, *with_options(in_memory))
    disk = runner.run(OFFLOAD, nproc, *MODEL, *with_options(options), *nvme(tmp_path))
    assert_same_run(ram, disk, f"offload with its states on NVMe ({case})")
    assert os.listdir(tmp_path) == [], f"the state files outlived the run: {os.listdir(tmp_path)}"
    s = disk.summary
    for category, v in s["model_state_bytes"].items():
        assert v["measured"] == v["theory"], f"{category}: measured {v['measured']:,}, formula {v['theory']:,}"
    placed = {k: v["where"] for k, v in s["model_state_bytes"].items()}
    assert not {"master", "adam_m", "adam_v"} & set(placed) and placed["nvme_buffers"] == "host", placed
    # nor does the engine keep them unlisted: nothing of theirs among what else it holds
    kept = [k for k in s["other_named"] if "master" in k or "exp_avg" in k]
    assert not kept, f"the host still holds optimizer states: {kept} ({s['other_named']})"
    # the state file, as the filesystem sizes it: 12Ψ/N, each bucket's from an offset aligned to 4 KiB
    d = s["disk_bytes"]
    assert d["theory"] == 12 * s["padded_numel"] // nproc
    assert d["theory"] <= d["measured"] < d["theory"] + 4096 * BUCKETS, d
    assert re.search(r"^on disk: the state file [\d.]+ MiB \(formula 12Ψ/N", disk.stdout, re.M), disk.stdout[-2000:]
    # the run says when its buffers outweigh the states they keep off the host, and only then
    outweigh = s["model_state_bytes"]["nvme_buffers"]["theory"] > d["theory"]
    assert ("the tier's buffers" in disk.stdout) == outweigh, (outweigh, disk.stdout[-2000:])
    # the table's columns are as wide as their headers (nvme_buffers)
    table = [ln for ln in disk.stdout.splitlines() if re.match(r"^\s+(rank|formula|[\d-]+) \|", ln)]
    widths = [[len(cell) for cell in ln.split("|")[:-1]] for ln in table]
    assert all(w == widths[0][:len(w)] for w in widths), "\n".join(table)


def test_checkpoints_move_between_the_tiers(runner, reference, tmp_path):
    """Steps 1-2 with the states in memory, 3-4 on NVMe, 5-6 in memory again, each leg resuming the last one's
    checkpoint: the uninterrupted run's result, bit for bit; and from the NVMe leg's checkpoint, stage 3 on one rank
    continues the reference's curve."""
    train = with_options(["--offload_params"])
    straight = runner.run(OFFLOAD, 2, *MODEL, *train)
    first, second = tmp_path / "first", tmp_path / "second"
    runner.run(OFFLOAD, 2, *MODEL, *train, "--stop_after", "2", "--ckpt_dir", str(first))
    runner.run(OFFLOAD, 2, *MODEL, *train, *nvme(tmp_path, FEWER), "--resume", str(first), "--stop_after", "4",
               "--ckpt_dir", str(second))
    assert not list(tmp_path.glob("*.states")), "the NVMe leg left its state files"
    last = runner.run(OFFLOAD, 2, *MODEL, *train, "--resume", str(second), "--ckpt_dir", str(tmp_path / "last"))
    assert "step_000004" in last.stdout, last.stdout
    assert_same_run(straight, last, "offload: memory, then NVMe, then memory, resumed from each other's checkpoints")
    # the NVMe leg's checkpoint continued by another stage on another N: the reference's curve, to its tolerances
    other = runner.run(str(ROOT / "stage3.py"), 1, *MODEL, *TRAIN, "--resume", str(second),
                       "--ckpt_dir", str(tmp_path / "third"))
    k = first_difference(reference.summary["losses"], other.summary["losses"], LOSS_ATOL)
    assert k is None, f"stage 3 on 1 rank from the NVMe leg's checkpoint: the loss at step {k} differs"
    compare_params(reference.master, other.master, "stage 3 on 1 rank, resumed from offload on NVMe on 2")


def test_a_saves_host_copy_of_the_states_goes_at_the_next_update(world_of_one, tmp_path):
    """A checkpoint reads the states from the file into host memory (state_pieces); the next update drops that copy:
    after it the engine holds no master or Adam moment in host memory, only the tier's buffers (a copy kept would be
    the 12Ψ/N the tier exists to save). In this process, a world of one."""
    import offload
    args = parse_args(offload.OffloadEngine, [*nvme(tmp_path), "--nvme_buffer_count", "2"])
    engine = offload.OffloadEngine(any_model.SetClassifier(), args, world_of_one)

    def states_held():
        listed = sum(engine.model_states().values(), [])
        return {path: n for path, n in unlisted(engine, listed, world_of_one).items()
                if any(name in path for name in ("master", "exp_avg", "held"))}  # held: the checkpoint's copy

    for step in range(3):
        engine.backward(loss_of(engine, step), sync=True)
        engine.step(1e-3)
        if step == 0:
            assert not states_held(), f"before any save, the host holds optimizer states: {states_held()}"
            engine.state_pieces()  # what a save reads
            # (the check sees a copy where there is one)
            assert sum(states_held().values()) == 3 * 4 * engine.padded_numel, states_held()
    engine.close()
    assert not states_held(), (f"two updates after a save, the host still holds its copy of the optimizer states: "
                               f"{states_held()}")


def test_a_rank_killed_mid_step_resumes_bit_for_bit(runner, tmp_path):
    """Rank 1 SIGKILLed at its 9th backward (step 5's first micro-step, after the step-4 save): resumed, on NVMe
    again, the run equals the uninterrupted one."""
    ckpt = tmp_path / "ckpt"
    env = {"PYTHONPATH": f"{ROOT / 'tests' / 'kill_point'}:{ROOT}", "KILL_RANK": "1", "KILL_AT": "backward:9"}
    p = runner.launch(OFFLOAD, 2, *MODEL, *TRAIN, *nvme(tmp_path, FEWER), "--save_every", "2", "--ckpt_dir", str(ckpt),
                      env=env)
    assert p.returncode != 0 and ("SIGKILL" in p.stderr or "Signal 9" in p.stderr), p.stderr[-2000:]
    straight = runner.run(OFFLOAD, 2, *MODEL, *TRAIN)
    again = tmp_path / "again"
    again.mkdir()
    resumed = runner.run(OFFLOAD, 2, *MODEL, *TRAIN, *nvme(again, FEWER), "--resume", str(ckpt))
    assert "step_000004" in resumed.stdout, resumed.stdout
    assert_same_run(straight, resumed, "offload on NVMe, rank 1 killed mid-step, then resumed")


def test_a_full_disk_mid_run_stops_with_one_line(runner, tmp_path):
    """The disk fills up during step 4's writes (tests/disk_full): the run stops with one line naming the operation
    and the file, no traceback; the step-2 checkpoint is intact, and resuming from it gives the uninterrupted run."""
    ckpt = tmp_path / "ckpt"
    states = tmp_path / "states"
    states.mkdir()
    # 3 buckets written at the start and at each step: the 13th write is step 4's first
    env = {"PYTHONPATH": f"{ROOT / 'tests' / 'disk_full'}:{ROOT}", "DISK_FULL_AFTER": str(BUCKETS * 4)}
    p = runner.launch(OFFLOAD, None, *MODEL, *TRAIN, *nvme(states, FEWER), "--save_every", "2", "--ckpt_dir",
                      str(ckpt),
                      env=env)
    errors = [line for line in p.stderr.splitlines() if line.startswith("error:")]
    assert p.returncode != 0 and "Traceback" not in p.stderr, p.stderr[-3000:]
    assert len(errors) == 1 and re.search(rf"write of [\d,]+ bytes at offset [\d,]+ of {states}/\S+ failed: disk full",
                                          errors[0]), p.stderr[-3000:]
    # (a write's error shows where its buffer is next waited for: here at the step-4 save, which stays incomplete)
    assert (ckpt / "step_000002" / "manifest.json").exists() and not (ckpt / "step_000004" / "manifest.json").exists()
    straight = runner.run(OFFLOAD, None, *MODEL, *TRAIN)
    resumed = runner.run(OFFLOAD, None, *MODEL, *TRAIN, *nvme(states, FEWER), "--resume", str(ckpt),
                         "--ckpt_dir", str(tmp_path / "continued"))
    assert_same_run(straight, resumed, "offload on NVMe, its disk full in step 4, then resumed from step 2")


def test_a_full_disk_on_one_rank_stops_every_rank_with_its_line(runner, tmp_path):
    """At N = 2 rank 1's disk fills up in step 4: rank 1 stops with its line, and rank 0, left waiting for it in a
    collective, stops with the same line naming rank 1, the operation and the file (not a guess at the cause)."""
    states = tmp_path / "states"
    states.mkdir()
    env = {"PYTHONPATH": f"{ROOT / 'tests' / 'disk_full'}:{ROOT}", "DISK_FULL_AFTER": str(BUCKETS * 4),
           "DISK_FULL_RANK": "1"}
    p = runner.launch(OFFLOAD, 2, *MODEL, *TRAIN, *nvme(states), env=env)
    errors = [line for line in p.stderr.splitlines() if line.startswith("error:")]
    # (the one traceback is torchrun's agent's, reporting the ranks that failed)
    tracebacks = p.stderr.split("Traceback")[1:]
    assert p.returncode != 0 and all("ChildFailedError" in t for t in tracebacks) and len(tracebacks) <= 1, \
        p.stderr[-3000:]
    failed = rf"write of [\d,]+ bytes at offset [\d,]+ of {states}/rank1\S+ failed: disk full"
    assert len(errors) == 2 and re.match(rf"error: {failed}$", errors[0] if "rank 0" not in errors[0] else errors[1]), \
        p.stderr[-3000:]
    assert any(re.match(rf"error: rank 0: rank 1 stopped: {failed}$", line) for line in errors), p.stderr[-3000:]


@pytest.mark.parametrize("options, expected", [
    (["--offload_optimizer", "nvme"], "needs --nvme_path DIR"),
    (["--nvme_path", "/tmp"], "is for --offload_optimizer nvme"),
    (["--offload_optimizer", "nvme", "--nvme_path", "/tmp", "--nvme_buffer_count", "0"], "must be at least 1"),
    (["--offload_optimizer", "nvme", "--nvme_path", "/no/such/dir"], "/no/such/dir does not exist"),
    (["--offload_optimizer", "nvme", "--nvme_path", "/proc"], "/proc is not writable"),
], ids=["no_path", "path_without_nvme", "no_buffer", "missing_dir", "read_only"])
def test_bad_paths_get_one_line(runner, options, expected):
    p = runner.launch(OFFLOAD, None, "--preset", "tiny", "--steps", "1", "--no_progress", *options)
    errors = [line for line in p.stderr.splitlines() if line.startswith("error:")]
    assert p.returncode != 0 and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert len(errors) == 1 and expected in errors[0], p.stderr[-2000:]


def test_too_little_free_space_is_refused_at_the_start(runner, tmp_path):
    """A disk with less free space than the state file needs (tests/disk_full reports 64 KiB): one line naming the
    path and the bytes, before training; nothing left in the directory."""
    env = {"PYTHONPATH": f"{ROOT / 'tests' / 'disk_full'}:{ROOT}", "DISK_FREE_BYTES": str(64 * 1024)}
    p = runner.launch(OFFLOAD, None, *MODEL, *TRAIN, *nvme(tmp_path), env=env)
    errors = [line for line in p.stderr.splitlines() if line.startswith("error:")]
    assert p.returncode != 0 and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert len(errors) == 1 and re.search(rf"nvme path {tmp_path} has 65,536 bytes .* free, and a state file there "
                                          rf"needs [\d,]+ bytes", errors[0]), p.stderr[-2000:]
    assert "parameters (Ψ)" not in p.stdout and os.listdir(tmp_path) == [], (p.stdout[-2000:], os.listdir(tmp_path))


def test_a_delayed_update_saved_mid_update_resumes_as_the_straight_run(runner, tmp_path):
    """--delayed_update on NVMe, saved after step 3 while step 3's CPU update is in flight: the save lands the update
    before it reads the state file, so resumed from that checkpoint the run is bit for bit the run that saved it (a
    save that read the file under the update would keep step 2's states, or a torn mix)."""
    delayed = [*MODEL, *with_options(["--delayed_update"])]
    straight = runner.run(OFFLOAD, 1, *delayed, *nvme(tmp_path), "--save_every", "3",
                          "--ckpt_dir", str(tmp_path / "straight"))
    resumed = runner.run(OFFLOAD, 1, *delayed, *nvme(tmp_path), "--resume", str(tmp_path / "straight" / "step_000003"),
                         "--ckpt_dir", str(tmp_path / "resumed"))
    assert resumed.summary["resumed_from"] == 3
    assert_same_run(straight, resumed, "offload --delayed_update on NVMe, saved mid-update after step 3 and resumed")
