"""The course kit: an exercise made from each stage fails the suite and says what is missing; a stage broken in a
way students often break it fails with the message that names the mistake; the lessons (a diff per idea) are current,
apply one after another, and the steps between them train as the stages do. (The stages passing is test_stages.)"""
import os
import subprocess
import sys

import pytest

from conftest import ROOT, STAGES
from test_stages import LOSS_ATOL, MODEL, NORM_RTOL, TRAIN, compare_params, first_difference
from test_stages import reference  # noqa: F401  (the fixture: the single-process reference run)

sys.path.insert(0, str(ROOT / "course"))
from make_exercise import OPTIONS, make_exercise, newest_idea, tags_in  # noqa: E402
from make_lessons import LESSONS, file_name, lesson, step, unfenced  # noqa: E402


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
    one_rank = " or ".join(f"[{stem}-1]" for stem in tags)  # a world of one runs each stage's every line too
    code, out = grade(exercises, tmp_path, f"model_state and ({one_rank})")
    assert code != 0, f"the exercises passed the suite: the blanked ideas are not tested\n{out[-3000:]}"
    for stem, tag in tags.items():
        assert f"test_model_state_bytes_match_formula[{stem}-1]" in out, f"{stem} was not graded:\n{out[-3000:]}"
        assert f"NotImplementedError: TODO [{tag}]" in out, f"the {stem} failure does not name its TODO:\n{out[-3000:]}"
    assert "passed" not in out.splitlines()[-1], f"an exercise passed a check:\n{out[-3000:]}"
    # the grade's first lines name each file's first TODO not done, before the checks' failures
    head = out.splitlines()[:len(exercises) + 2]
    for exercise in exercises:
        first = next(line for line in exercise.read_text().splitlines() if "raise NotImplementedError" in line)
        todo = first[first.index("TODO ["):first.index(":", first.index("TODO ["))]
        named = [ln for ln in head if ln.startswith(f"{exercise}:") and "the first TODO not done" in ln and todo in ln]
        assert named, f"the grade's first lines do not name {exercise.name}'s first TODO:\n" + "\n".join(head)


def test_each_marker_blanks_on_its_own():
    """offload.py's ideas, the offload itself, the copy stream, the parameter shard in CPU memory, the delayed update
    and the states on NVMe, are fenced apart (the ideas it keeps from stage 3 are fenced in stage3.py): each one's
    exercise blanks its own regions and leaves every other idea's as they are."""
    source = (ROOT / "offload.py").read_text()
    assert tags_in(source) == ["Offload", "Copy stream", "ZeRO-3 Offload", "DPU", "NVMe"]
    assert newest_idea(source) == ["Offload"]
    for tag in tags_in(source):
        exercise = make_exercise(source, [tag])
        compile(exercise, f"offload_{tag}.py", "exec")
        assert f"# [{tag}]" not in exercise and f"TODO [{tag}]" in exercise, tag
        # a region that is a class keeps its line, its methods raising the TODO: the exercise still imports
        assert [ln for ln in exercise.splitlines() if ln.startswith("class ")] == \
            [ln for ln in source.splitlines() if ln.startswith("class ")], f"blanking {tag} dropped a class"
        for other in set(tags_in(source)) - {tag} - (set() if tag in OPTIONS else set(OPTIONS)):
            assert exercise.count(f"# [{other}]") == source.count(f"# [{other}]"), f"blanking {tag} touched {other}"


def code_tokens(source):
    """The source's tokens, comments and blank lines left out."""
    import io
    import tokenize
    return [(t.type, t.string) for t in tokenize.generate_tokens(io.StringIO(source).readline)
            if t.type not in (tokenize.COMMENT, tokenize.NL)]


@pytest.mark.parametrize("stage", STAGES)
def test_an_exercise_is_one_lesson(stage):
    """Each exercise blanks its own lesson only: another lesson's region nested in it (stage3.py's [Prefetch] and
    [Recompute] in [ZeRO-3]) stays as it is; the course's own answer, written where the exercise's TODOs ask for it
    (make_exercise(..., fill=True)), is the reference's code, token for token; and each misuse the blanked code
    refuses (a `require` the grade checks) is announced in the TODO."""
    source = (ROOT / stage).read_text()
    for tag in tags_in(source):
        exercise = make_exercise(source, [tag])
        compile(exercise, f"{stage}:{tag}", "exec")
        for other in set(tags_in(source)) - {tag}:
            assert exercise.count(f"# [{other}]") <= source.count(f"# [{other}]")
        answer = make_exercise(source, [tag], fill=True)
        assert code_tokens(answer) == code_tokens(source), f"{stage} [{tag}]: the answer is not the reference's code"
        for line in source.splitlines():
            if line.strip().startswith("require(") and line.strip() not in exercise:
                assert False, f"{stage} [{tag}]: the exercise drops `{line.strip()}` and no TODO announces it"
    if stage == "stage3.py":
        exercise = make_exercise(source, ["ZeRO-3"])
        for nested in ("Prefetch", "Recompute"):
            assert exercise.count(f"# [{nested}]") == source.count(f"# [{nested}]"), f"[ZeRO-3] blanks [{nested}]"


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


def test_the_first_screen_names_the_slip(tmp_path):
    """Three slips planted in stage 3's answer, graded as a teacher grades (the checks that name a slip, at N = 2):
    each file's slip is said on the grade's first screen, above the failures; a run that a slip made diverge says
    nothing of the learning rate (the suite's settings are the reference's)."""
    reduce = "            comm.reduce_scatter(b.reduced, b.grad, op=dist.ReduceOp.AVG)\n"
    late = ("        if backward and not b.waiting:\n"
            "            require(any(n.waiting for n in self.buckets), Misuse.OUTSIDE_BACKWARD)\n            return\n")
    slips = {"no_wait": ("        self._gather(b)\n        self._wait(b)\n", "        self._gather(b)\n",
                         "the slip: parameters used before their all-gather landed"),
             "late": (late, "", "the slip: a unit gathered after its backward was over"),
             "twice": ("            b.work = comm.reduce_scatter(", reduce + "            b.work = comm.reduce_scatter(",
                       "the slip: each gradient reduced 2 times a step")}
    source = (ROOT / "stage3.py").read_text()
    paths = {}
    for name, (old, new, _) in slips.items():
        assert source.count(old) == 1, f"stage3.py no longer contains {old!r}: update this test"
        paths[name] = tmp_path / f"{name}_stage3.py"
        paths[name].write_text(source.replace(old, new))
    tests = [str(ROOT / "tests" / f) for f in ("test_call_patterns.py", "test_stages.py")]
    cmd = [sys.executable, "-m", "pytest", *tests, *[a for p in paths.values() for a in ("--stage", str(p))], "-q",
           "-m", "slip", "-k", "not -4]", "-p", "no:cacheprovider", "--basetemp", str(tmp_path / "pytest")]
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=900)
    out = p.stdout + p.stderr
    first_screen = out[:out.index("= FAILURES =")] if "= FAILURES =" in out else out
    for name, (_, _, said) in slips.items():
        named = [line for line in first_screen.splitlines() if f"[{name}_stage3" in line and said in line]
        assert named, f"{name}: the grade's first screen does not say {said!r}:\n{first_screen[-3000:]}"
    assert "lower --lr" not in out, out[-3000:]


def test_a_copy_without_record_stream_is_named(tmp_path):
    """Lesson 7's answer less its record_stream passes the suite's runs on the CPU, and at --grad_accum 2 on the fake
    device (the copy's source, grad_acc, lives on); the grade fails it, naming the missing record_stream."""
    source = step("offload.py - ZeRO-3 Offload - DPU - NVMe")
    kept = "        for t in spent:\n            t.record_stream(self.stream)\n"  # the reduce-scatter's tensors
    assert source.count(kept) == 1, "offload.py's record_stream changed: update this test"
    path = tmp_path / "answer" / "offload.py"
    path.parent.mkdir()
    path.write_text(source.replace(kept, "        pass\n"))
    test = f"{ROOT / 'tests' / 'test_ideas.py'}::test_the_idea_is_there[offload-Copy_stream]"
    cmd = [sys.executable, "-m", "pytest", test, "--stage", str(path), "--lesson", "7_copy_stream", "-q",
           "-p", "no:cacheprovider", "--basetemp", str(tmp_path / "pytest")]
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=900)
    out = p.stdout + p.stderr
    assert p.returncode != 0 and "1 failed" in out, f"the answer without record_stream was not failed:\n{out[-3000:]}"
    assert "[Copy stream]" in out and "memory freed" in out and "no record_stream" in out, out[-3000:]


def test_steps_and_exercises_run_by_hand(tmp_path):
    """As course/README.md shows them, from the repository root with no PYTHONPATH: a step that make_lessons.py --files
    wrote trains under torchrun and prints its table; an exercise that make_exercise.py wrote stops at its TODO."""
    import make_exercise
    import make_lessons
    make_lessons.main(["--out", str(tmp_path / "lessons"), "--files", str(tmp_path / "steps")])
    make_exercise.main([str(ROOT / "stage2.py"), "-o", str(tmp_path / "exercises" / "stage2.py")])
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    quiet = ["--preset", "tiny", "--steps", "2", "--no_progress", "--sample_chars", "0", "--eval_batches", "1"]
    step_run = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                str(tmp_path / "steps" / "offload_without_NVMe.py"), *quiet]
    p = subprocess.run(step_run, capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    assert p.returncode == 0 and "memory per rank" in p.stdout, f"the step did not run:\n{(p.stdout + p.stderr)[-3000:]}"
    exercise = [sys.executable, str(tmp_path / "exercises" / "stage2.py"), *quiet]
    p = subprocess.run(exercise, capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    assert p.returncode != 0 and "NotImplementedError: TODO [ZeRO-2]" in p.stderr, (
        f"the exercise did not stop at its TODO:\n{(p.stdout + p.stderr)[-3000:]}")


def test_lessons_are_current_and_apply_in_turn(tmp_path):
    """course/lessons/ holds each lesson as course/make_lessons.py writes it, and `patch` takes stage0_ddp.py through
    every step to offload.py, one lesson at a time: each diff is one idea, and the ideas add up to the ladder."""
    work = tmp_path / "step.py"
    work.write_text(step(LESSONS[0][1]))
    for name, before, after, _ in LESSONS:
        published = ROOT / "course" / "lessons" / f"{name}.diff"
        assert published.exists() and published.read_text() == lesson(before, after)[0], (
            f"{published.relative_to(ROOT)} is not the diff of {before} and {after}: run python course/make_lessons.py")
        assert work.read_text() == step(before)
        p = subprocess.run(["patch", "--silent", "--no-backup-if-mismatch", str(work), str(published)],
                           capture_output=True, text=True, timeout=60)
        assert p.returncode == 0 and work.read_text() == step(after), f"{name}.diff does not apply:\n{p.stdout}{p.stderr}"
    # the last step is offload.py itself, its fences read as plain comments
    assert work.read_text() == unfenced((ROOT / "offload.py").read_text())


BETWEEN = sorted({s for _, before, after, _ in LESSONS for s in (before, after) if " - " in s})


@pytest.mark.parametrize("name", BETWEEN)
def test_the_steps_between_match_the_reference(runner, reference, tmp_path_factory, name):
    """A step between two files (a file less an idea's regions) is a stage of its own: it trains on 2 ranks to the
    single-process reference's numbers, as the stage files do (test_stages.py's tolerances)."""
    path = tmp_path_factory.mktemp("steps") / file_name(name)
    path.write_text(step(name))
    run = runner.run(str(path), 2, *MODEL, *TRAIN)
    where = f"{name} at N=2"
    k = first_difference(reference.summary["grad_norms"], run.summary["grad_norms"], NORM_RTOL)
    assert k is None, f"{where}: gradient norm at step {k}"
    k = first_difference(reference.summary["losses"], run.summary["losses"], LOSS_ATOL)
    assert k is None, f"{where}: loss at step {k}"
    compare_params(reference.master, run.master, where)


STEPS = list(dict.fromkeys(s for _, before, after, _ in LESSONS for s in (before, after)))


def with_grad_accum(train, grad_accum):
    """TRAIN with --grad_accum grad_accum instead of its own."""
    at = train.index("--grad_accum")
    return [*train[:at + 1], str(grad_accum), *train[at + 2:]]


@pytest.mark.parametrize("grad_accum", [1, 2])
@pytest.mark.parametrize("name", STEPS)
def test_every_step_keeps_its_own_ledger(runner, tmp_path_factory, name, grad_accum):
    """Every step of the ladder, the files between two lessons too, is right by the formula it prints: on 2 ranks, at
    --grad_accum 1 and 2, each memory category it measures and each collective's bytes equal the formula's."""
    path = tmp_path_factory.mktemp("steps") / file_name(name)
    path.write_text(step(name))
    s = runner.run(str(path), 2, *MODEL, *with_grad_accum(TRAIN, grad_accum)).summary
    where = f"{name} at N=2, --grad_accum {grad_accum}"
    for category, v in s["model_state_bytes"].items():
        assert v["measured"] == v["theory"], (
            f"{where}: this rank holds {v['measured']:,} bytes of {category}, the formula says {v['theory']:,}")
    for op, v in s["comm_bytes_per_step"]["by_collective"].items():
        assert v["measured"] == pytest.approx(v["theory"], rel=1e-9, abs=1e-6), (
            f"{where}: {op} sent {v['measured']:,.0f} bytes per step, the formula says {v['theory']:,.0f}")


@pytest.mark.parametrize("lesson", [name for name, *_ in LESSONS])
def test_every_lesson_is_graded(tmp_path, lesson):
    """`pytest --stage FILE --lesson NAME` grades FILE as the step after lesson NAME: the step before, which lacks the
    lesson's idea, fails tests/test_ideas.py's check of that idea, naming it; the step after passes it."""
    _, before, after, _ = next(row for row in LESSONS if row[0] == lesson)
    from test_ideas import IDEAS, LESSON_IDEAS
    idea = IDEAS[LESSON_IDEAS[lesson] - 1]
    paths = []
    for name, where in ((before, "before"), (after, "after")):
        path = tmp_path / where / file_name(name)
        path.parent.mkdir()
        path.write_text(step(name))
        paths.append(path)
    test = f"{ROOT / 'tests' / 'test_ideas.py'}::test_the_idea_is_there"
    ids = [f"{test}[{path.stem}-{idea.replace(' ', '_')}]" for path in paths]
    cmd = [sys.executable, "-m", "pytest", *ids, *[a for p in paths for a in ("--stage", str(p))], "--lesson", lesson,
           "-q", "-p", "no:cacheprovider", "-rfEs", "--basetemp", str(tmp_path / "pytest")]
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=900)
    out = p.stdout + p.stderr
    assert f"FAILED {ids[0].removeprefix(str(ROOT) + '/')}" in out, (
        f"{lesson}: {before}, graded as {after}, did not fail:\n{out[-3000:]}")
    assert f"[{idea}]" in out, f"{lesson}: the failure does not name [{idea}]:\n{out[-3000:]}"
    assert "1 failed, 1 passed" in out, f"{lesson}: {after} did not pass its own idea's check:\n{out[-3000:]}"
