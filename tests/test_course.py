"""The course kit: an exercise made from each stage fails the suite and says what is missing; a stage broken in a
way students often break it fails with the message that names the mistake. (The reference passing is test_stages.)"""
import subprocess
import sys

import pytest

from conftest import ROOT, STAGES

sys.path.insert(0, str(ROOT / "course"))
from make_exercise import make_exercise, tags_in  # noqa: E402


def grade(path, tmp_path, select):
    """Run the stage tests against `path`, as a teacher would; return pytest's output."""
    cmd = [sys.executable, "-m", "pytest", str(ROOT / "tests" / "test_stages.py"), "--stage", str(path), "-x", "-q",
           "-p", "no:cacheprovider", "-k", select, "--basetemp", str(tmp_path / "pytest")]
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=600)
    return p.returncode, p.stdout + p.stderr


@pytest.mark.parametrize("stage", STAGES)
def test_exercise_imports_and_fails_with_its_todo(stage, tmp_path):
    source = (ROOT / stage).read_text()
    tag = tags_in(source)[-1]
    exercise = tmp_path / stage
    exercise.write_text(make_exercise(source, [tag]))
    assert f"# [{tag}]" not in exercise.read_text() and f"TODO [{tag}]" in exercise.read_text()
    compile(exercise.read_text(), str(exercise), "exec")  # it still parses, signatures kept
    code, out = grade(exercise, tmp_path, "model_state and 2")
    assert code != 0, f"the {stage} exercise passed the suite: the blanked idea is not tested\n{out[-2000:]}"
    assert f"NotImplementedError: TODO [{tag}]" in out, f"the failure does not say what is missing:\n{out[-2000:]}"


def broken(tmp_path, stage, old, new):
    source = (ROOT / stage).read_text()
    assert source.count(old) == 1, f"{stage} no longer contains {old!r}: update this test"
    path = tmp_path / f"broken_{stage}"
    path.write_text(source.replace(old, new))
    return path


def test_summing_instead_of_averaging_is_named(tmp_path):
    path = broken(tmp_path, "stage0_ddp.py", "comm.all_reduce(b.grad, async_op=True)",
                  "comm.all_reduce(b.grad, op=dist.ReduceOp.SUM, async_op=True)")
    code, out = grade(path, tmp_path, "parity and 2")
    assert code != 0 and "summed over the ranks, not averaged" in out, out[-2000:]


def test_full_gradient_kept_after_backward_is_named(tmp_path):
    path = broken(tmp_path, "stage2.py", "b.grad = b.reduced = b.work = None", "b.reduced = b.work = None")
    code, out = grade(path, tmp_path, "freed and 2")
    assert code != 0 and "memory of the full gradient" in out, out[-2000:]
