"""Each idea of the ladder where it shows, for grading: `pytest tests --stage FILE` runs these beside the stage checks,
one test per idea the file should hold, and a file without an idea fails naming it. Which ideas a file should hold:
those of the stage it declares (`main(Engine, stage="...")`), or, with `--lesson NAME`, those of the ladder up to that
lesson (course/make_lessons.py), so that a step between two lessons is graded as the step it should be.

    ZeRO-1, -2, -3    the optimizer states, the gradients, the parameters: this rank holds its 1/N shard of each
    Prefetch          bench/timeline.py's trace: the next unit's all-gather is in flight while a unit computes forward
    Recompute         with --checkpoint_activations it trains as the reference does, sending the formula's bytes
    Offload           the optimizer on the CPU: on the fake CUDA device, the gradient shards go down under backward
                      into pinned memory without blocking the host, and the C++ AdamW steps
    Copy stream       on the fake CUDA device at --grad_accum 1 and 2, the copies between device and host run on a
                      stream of their own, and what they read is not freed under them (record_stream)
    ZeRO-3 Offload    --offload_params: on the fake CUDA device, the all-gathers are issued beside compute
    DPU               --delayed_update: it trains exactly one step stale (test_offload.py's reference)
    NVMe              --offload_optimizer nvme: it trains as the reference does, the host holds no optimizer state, and
                      the state file holds 12Ψ/N and is gone at the end

The fake-device runs (tests/fake_cuda.py) also refuse what CUDA would (a copy from pageable memory, an unordered
access between streams). tests/test_course.py grades each lesson's step before as if it were the step after: it fails
here, naming the lesson's idea."""
import os
import re
import sys
from pathlib import Path

import pytest

from conftest import ROOT
from test_fake_cuda import audit, output
from test_offload import delayed_reference  # noqa: F401  (the fixture: the reference updated one step late)
from test_stages import LOSS_ATOL, MODEL, NORM_RTOL, TRAIN, compare_params, first_difference
from test_stages import reference  # noqa: F401  (the fixture: the single-process reference run)
from test_timeline import gathered_during_forward, take_timeline
from train_gpt import model_state_theory

sys.path.insert(0, str(ROOT / "course"))
from make_lessons import LESSONS  # noqa: E402

# the ideas in the ladder's order, and the first k a stage holds
IDEAS = ["ZeRO-1", "ZeRO-2", "ZeRO-3", "Prefetch", "Recompute", "Offload", "Copy stream", "ZeRO-3 Offload", "DPU",
         "NVMe"]
STAGE_IDEAS = {"stage0": 0, "stage1": 1, "stage2": 2, "stage3": 5, "offload": 10}
LESSON_IDEAS = {name: k + 1 for k, (name, *_) in enumerate(LESSONS)}
assert len(LESSONS) == len(IDEAS), "a lesson per idea: update IDEAS"
# ZeRO-k: the categories that must be this rank's 1/N shard, as the stage that brings the idea counts them
SHARDED = {"ZeRO-1": ("stage1", ["master", "adam_m", "adam_v"]), "ZeRO-2": ("stage2", ["grads"]),
           "ZeRO-3": ("stage3", ["params"])}
WHAT = {"ZeRO-1": "the optimizer states are not partitioned", "ZeRO-2": "the gradients are not partitioned",
        "ZeRO-3": "the parameters are not partitioned"}
FAKE = {}  # (file, options) -> the fake-device run's (job, reports), once per session


def test_the_graders_own_configuration_is_the_ladders():
    """What the grader believes: each stage holds the ideas of every lesson up to the one that ends in its whole file
    (course/make_lessons.py's LESSONS), and each ZeRO-k idea shards the categories its stage adds to the stage before
    it in train_gpt.SHARDED, the formulas' own list."""
    import train_gpt
    files = {"stage0": "stage0_ddp.py", "stage1": "stage1.py", "stage2": "stage2.py", "stage3": "stage3.py",
             "offload": "offload.py"}
    for stage, file in files.items():
        ending = [k + 1 for k, (_, _, after, _) in enumerate(LESSONS) if after == file]
        assert STAGE_IDEAS[stage] == max(ending, default=0), (
            f"the grader expects {STAGE_IDEAS[stage]} ideas in {file}; the lessons put {max(ending, default=0)} there")
    before = {"stage1": "stage0", "stage2": "stage1", "stage3": "stage2"}
    for idea, (stage, categories) in SHARDED.items():
        adds = set(train_gpt.SHARDED[stage]) - set(train_gpt.SHARDED[before[stage]])
        assert set(categories) == adds, f"the grader checks {idea} on {categories}; {stage} shards {sorted(adds)} more"


def expected_ideas(config, stage_file):
    """The ideas stage_file should hold: --lesson's, or its declared stage's."""
    lesson = config.getoption("lesson")
    if lesson:
        return IDEAS[:LESSON_IDEAS[lesson]]
    declared = re.search(r"""\bstage\s*=\s*["'](\w+)["']""", Path(stage_file).read_text())
    return IDEAS[:STAGE_IDEAS.get(declared.group(1) if declared else "", 0)]


def run_or_fail(idea, call):
    """call(); a run that failed fails the test naming the idea it checked."""
    try:
        return call()
    except pytest.fail.Exception as e:
        pytest.fail(f"[{idea}] the run for this idea failed: {e}", pytrace=False)


def fake_run(idea, stage_file, tmp_path, *options, grad_accum=2, nproc=1):
    """The file trained on the fake CUDA device, one rank (or nproc), at --grad_accum 2 (or grad_accum): rank 0's
    report; failing, naming the idea."""
    key = (stage_file, options, grad_accum, nproc)
    if key not in FAKE:
        (tmp_path / f"accum{grad_accum}_{nproc}").mkdir()
        FAKE[key] = audit(tmp_path / f"accum{grad_accum}_{nproc}", stage_file, *options, grad_accum=grad_accum,
                          nproc=nproc)
    job, reports = FAKE[key]
    findings = [m for r in reports if r for m in r["findings"]]
    if job.returncode != 0 or not reports[0] or findings:
        flags = " ".join(["--grad_accum", str(grad_accum), *options])
        pytest.fail(f"[{idea}] on the fake CUDA device with {flags}, the run "
                    f"failed or CUDA would refuse it:\n" + ("\n".join(findings) or output(job)), pytrace=False)
    return reports[0]["seen"]


def check_sharded(idea, runner, stage_file, **_):
    s = run_or_fail(idea, lambda: runner.run(stage_file, 2, *MODEL, *TRAIN)).summary
    stage, categories = SHARDED[idea]
    shard = model_state_theory(stage, s["padded_numel"], 2, param_bytes=4)
    for category in categories:
        held = s["model_state_bytes"].get(category, {}).get("measured")
        assert held == shard[category], (f"[{idea}] {WHAT[idea]}: at N=2 this rank holds {held} bytes of "
                                         f"{category}, its shard is {shard[category]:,}")


def check_prefetch(idea, stage_file, tmp_path, **_):
    try:
        _, trace, _ = take_timeline(stage_file, tmp_path)
    except AssertionError as e:
        pytest.fail(f"[{idea}] the timeline run failed: {e}", pytrace=False)
    assert gathered_during_forward(trace) > 0, (
        f"[{idea}] no all-gather was in flight while a unit computed its forward: the next unit is gathered only "
        f"when it is about to run (bench/timeline.py's trace, N=2)")


def check_recompute(idea, runner, stage_file, reference, **_):
    s = run_or_fail(idea, lambda: runner.run(stage_file, 2, *MODEL, *TRAIN, "--checkpoint_activations")).summary
    where = f"[{idea}] with --checkpoint_activations at N=2"
    k = first_difference(reference.summary["grad_norms"], s["grad_norms"], NORM_RTOL)
    assert k is None, f"{where}: the gradient norm at step {k} differs from the reference's"
    k = first_difference(reference.summary["losses"], s["losses"], LOSS_ATOL)
    assert k is None, f"{where}: the loss at step {k} differs from the reference's"
    for op, v in s["comm_bytes_per_step"]["by_collective"].items():
        assert v["measured"] == pytest.approx(v["theory"], rel=1e-9, abs=1e-6), (
            f"{where}: {op} sent {v['measured']:,.0f} bytes per step, the formula says {v['theory']:,.0f}: a unit "
            f"gathered again for its recompute, or its parameters freed under it")


def check_offload(idea, stage_file, tmp_path, **_):
    seen = fake_run(idea, stage_file, tmp_path)
    assert seen.get("cpu_adam steps"), f"[{idea}] the C++ AdamW never stepped: the optimizer is not on the CPU ({seen})"
    assert seen.get("device-host copies in backward"), (
        f"[{idea}] no gradient shard went down to the host under backward ({seen})")


def check_copy_stream(idea, stage_file, tmp_path, **_):
    # at --grad_accum 1 too: there a copy's source is the bucket's reduced shard, freed under the copy (record_stream);
    # at 2 it is grad_acc, which lives on
    for grad_accum in (1, 2):
        seen = fake_run(idea, stage_file, tmp_path, grad_accum=grad_accum)
        assert seen.get("device-host copies on another stream"), (
            f"[{idea}] every copy between device and host ran on the compute stream: no copy stream ({seen})")


def check_offload_params(idea, stage_file, tmp_path, **_):
    # two ranks: a world of one issues no all-gather (comm.py)
    seen = fake_run(idea, stage_file, tmp_path, "--offload_params", nproc=2)
    assert seen.get("collectives issued on another stream"), (
        f"[{idea}] with --offload_params no all-gather was issued beside compute, after its shard's copy up ({seen})")


def check_delayed_update(idea, runner, stage_file, delayed_reference, **_):
    s = run_or_fail(idea, lambda: runner.run(stage_file, 2, *MODEL, *TRAIN, "--delayed_update"))
    where = f"[{idea}] with --delayed_update at N=2, against a reference updated one step late"
    k = first_difference(delayed_reference.summary["losses"], s.summary["losses"], LOSS_ATOL)
    assert k is None, f"{where}: the loss at step {k} differs"
    compare_params(delayed_reference.master, s.master, where)


def check_nvme(idea, runner, stage_file, tmp_path, reference, **_):
    run = run_or_fail(idea, lambda: runner.run(stage_file, 2, *MODEL, *TRAIN, "--offload_optimizer", "nvme",
                                                "--nvme_path", str(tmp_path)))
    s = run.summary
    where = f"[{idea}] with --offload_optimizer nvme at N=2"
    k = first_difference(reference.summary["losses"], s["losses"], LOSS_ATOL)
    assert k is None, f"{where}: the loss at step {k} differs from the reference's"
    compare_params(reference.master, run.master, where)
    held = {"master", "adam_m", "adam_v"} & set(s["model_state_bytes"])
    assert not held, f"{where}: the host still holds {sorted(held)}: the optimizer states are not on disk"
    on_disk = s.get("disk_bytes", {}).get("measured", 0)
    assert on_disk >= 12 * s["padded_numel"] // 2, (
        f"{where}: the state file holds {on_disk:,} bytes, less than 12Ψ/N = {12 * s['padded_numel'] // 2:,}")
    assert not os.listdir(tmp_path), f"{where}: the state files outlived the run: {os.listdir(tmp_path)}"


CHECKS = {"ZeRO-1": check_sharded, "ZeRO-2": check_sharded, "ZeRO-3": check_sharded, "Prefetch": check_prefetch,
          "Recompute": check_recompute, "Offload": check_offload, "Copy stream": check_copy_stream, "ZeRO-3 Offload": check_offload_params,
          "DPU": check_delayed_update, "NVMe": check_nvme}
FIXTURES = {"Recompute": "reference", "DPU": "delayed_reference", "NVMe": "reference"}  # the reference runs only the ideas that need one


@pytest.mark.parametrize("idea", IDEAS, ids=[idea.replace(" ", "_") for idea in IDEAS])
def test_the_idea_is_there(request, runner, stage_file, tmp_path, idea):
    if idea not in expected_ideas(request.config, stage_file):
        pytest.skip(f"{Path(stage_file).name} is not expected to hold [{idea}]")
    extra = {FIXTURES[idea]: request.getfixturevalue(FIXTURES[idea])} if idea in FIXTURES else {}
    CHECKS[idea](idea, runner=runner, stage_file=stage_file, tmp_path=tmp_path, **extra)
