"""The course kit: an exercise made from each stage fails the suite and says what is missing; a stage broken in a
way students often break it fails with the message that names the mistake. (The reference passing is test_stages.)"""
import subprocess
import sys

from conftest import ROOT, STAGES

sys.path.insert(0, str(ROOT / "course"))
from make_exercise import OPTIONS, make_exercise, newest_idea, tags_in  # noqa: E402


def grade(paths, tmp_path, select):
    """Run the stage tests against `paths`, as a teacher would; return pytest's exit code and output."""
    stages = [arg for path in paths for arg in ("--stage", str(path))]
    cmd = [sys.executable, "-m", "pytest", str(ROOT / "tests" / "test_stages.py"), *stages, "-q", "-p", "no:cacheprovider",
           "-k", select, "--basetemp", str(tmp_path / "pytest")]
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=900)
    return p.returncode, p.stdout + p.stderr


def test_exercises_import_and_fail_with_their_todo(tmp_path):
    """One grading session over every stage's exercise (as a teacher would grade a class): each fails, naming its TODO."""
    exercises, tags = [], {}
    for stage in STAGES:
        source = (ROOT / stage).read_text()
        tag = newest_idea(source)[0]
        exercise = tmp_path / "exercises" / stage
        exercise.parent.mkdir(exist_ok=True)
        exercise.write_text(make_exercise(source, [tag]))
        assert f"# [{tag}]" not in exercise.read_text() and f"TODO [{tag}]" in exercise.read_text()
        compile(exercise.read_text(), str(exercise), "exec")  # it still parses, signatures kept
        exercises.append(exercise)
        tags[exercise.stem] = tag
    code, out = grade(exercises, tmp_path, "model_state and 2")
    assert code != 0, f"the exercises passed the suite: the blanked ideas are not tested\n{out[-3000:]}"
    for stem, tag in tags.items():
        assert f"test_model_state_bytes_match_formula[{stem}-2]" in out, f"{stem} was not graded:\n{out[-3000:]}"
        assert f"NotImplementedError: TODO [{tag}]" in out, f"the {stem} failure does not name its TODO:\n{out[-3000:]}"
    assert "passed" not in out.splitlines()[-1], f"an exercise passed a check:\n{out[-3000:]}"


def test_each_marker_blanks_on_its_own():
    """offload.py's options, the parameter shard in CPU memory and the delayed update, are ideas of their own: each
    one's exercise blanks its own regions and leaves every other idea's as they are. (An idea's exercise may take an
    option's region that lies inside its own: ZeRO-3's gather holds the parameter shard's way up.)"""
    source = (ROOT / "offload.py").read_text()
    assert set(OPTIONS) <= set(tags_in(source)) and newest_idea(source) == ["Offload"]
    for tag in tags_in(source):
        exercise = make_exercise(source, [tag])
        compile(exercise, f"offload_{tag}.py", "exec")
        assert f"# [{tag}]" not in exercise and f"TODO [{tag}]" in exercise, tag
        for other in set(tags_in(source)) - {tag} - (set() if tag in OPTIONS else set(OPTIONS)):
            assert exercise.count(f"# [{other}]") == source.count(f"# [{other}]"), f"blanking {tag} touched {other}"


def broken(tmp_path, stage, old, new):
    source = (ROOT / stage).read_text()
    assert source.count(old) == 1, f"{stage} no longer contains {old!r}: update this test"
    path = tmp_path / f"broken_{stage}"
    path.write_text(source.replace(old, new))
    return path


def test_common_mistakes_are_named(tmp_path):
    """Summing instead of averaging (stage 0), and keeping the full gradient after backward (stage 2)."""
    summed = broken(tmp_path, "stage0_ddp.py", "comm.all_reduce(b.grad, op=dist.ReduceOp.AVG, async_op=True)",
                    "comm.all_reduce(b.grad, op=dist.ReduceOp.SUM, async_op=True)")
    kept = broken(tmp_path, "stage2.py", "b.grad = b.reduced = b.work = None", "b.reduced = b.work = None")
    code, out = grade([summed, kept], tmp_path, "(parity and broken_stage0 and 2) or (freed and broken_stage2 and 2)")
    assert code != 0 and "summed over the ranks, not averaged" in out, out[-3000:]
    assert "memory of the full gradient" in out, out[-3000:]
