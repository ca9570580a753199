"""Every command a README shows runs in CI, at the smallest size that still exercises it, and does what the page says
it does: a file written, a table with every row, exit code 0. COVERED says what runs each command: `.ci/run` itself
("ci": it runs the command verbatim), a smoke test in this file (its name), or a test elsewhere that runs the same
command at a smaller size ("file::test"). test_every_command_is_covered fails when a README shows a command that
nothing runs, and when COVERED names one that no README shows any more."""
import json
import os
import re
import shlex
import shutil
import subprocess
import sys

import pytest

from conftest import ROOT, STAGES, last_lines
from devices import free_port

sys.path.insert(0, str(ROOT / "bench"))
import results  # noqa: E402

READMES = ["README.md", "bench/README.md", "tests/README.md", "course/README.md", "examples/README.md"]
COMMAND = re.compile(r"^(\w+=\S+ )*(python|torchrun|pip|pytest) ")  # an inline code span that is a command
CPU_TORCH = "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"
INSTALL = "pip install -r requirements.txt"
FIRST = "OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 2 stage3.py --preset tiny --steps 300 --dtype fp32"
STUDENT = "path/to/student_stage2.py"
QUIET = ["--sample_chars", "0", "--no_progress", "--eval_every", "1000", "--eval_batches", "1"]

COVERED = {
    CPU_TORCH: "ci",
    INSTALL: "ci",
    FIRST: "test_first_command",
    "python -m pytest tests -n 2 --dist loadfile": "ci",
    "python -m pytest tests -m quick": "test_quick_check",
    "python tests/mutations.py": "test_mutations",
    "python bench/compare.py": "test_compare",
    "python train_gpt.py": "tests/test_inputs.py::test_reference_learns_real_text",
    "torchrun --nnodes 2 --nproc_per_node 8 --rdzv_backend c10d --rdzv_endpoint HOST:29500 stage3.py --preset gpt2-xl":
        "test_two_nodes",
    "torchrun --standalone --nproc_per_node 4 stage3.py --preset tiny --steps 300 --save_every 50 --ckpt_dir runs/ck "
    "--stop_after 150": "tests/test_checkpoint.py::test_resume_at_another_stage_and_world_size",
    "torchrun --standalone --nproc_per_node 2 stage1.py --preset tiny --steps 300 --resume runs/ck":
        "tests/test_checkpoint.py::test_resume_at_another_stage_and_world_size",
    "python train_gpt.py --consolidate runs/ck gpt.pt": "tests/test_checkpoint.py::test_consolidate_and_sample",
    "python train_gpt.py --sample gpt.pt --sample_chars 500": "tests/test_checkpoint.py::test_consolidate_and_sample",
    # bench/README.md
    "python bench/results.py": "test_results_copies_files_into_the_page",
    "python bench/compare.py --results": "test_compare",
    "python bench/largest.py --results": "tests/test_largest.py::test_largest_quick",
    "python bench/largest.py --quick": "tests/test_largest.py::test_largest_quick",
    "python bench/largest.py --checkpoint_activations --beside runs/largest/largest.json --results":
        "tests/test_largest.py::test_largest_checkpointed",
    "python bench/largest.py --limit host --world_sizes 1 2 --n_embd 128 --checkpoint_activations --dtype bf16 --results":
        "tests/test_largest.py::test_largest_host",
    "python bench/peers.py --steps 10 --rounds 2 --results": "test_peers",
    "python bench/bench_adam.py --sizes 22 24 26 --repeats 7 --results": "test_bench_adam",
    "python bench/bench_norm.py --sizes 24 26 --repeats 7 --results": "test_bench_norm",
    "python bench/timeline.py stage0_ddp.py --nproc 2 --preset small --steps 8 --out runs/tl/stage0_buckets --results":
        "tests/test_timeline.py::test_stage0_buckets_reduce_while_backward_runs",
    "python bench/timeline.py stage0_ddp.py --nproc 2 --preset small --steps 8 --bucket_mb 1000 --out "
    "runs/tl/stage0_one_bucket --results": "tests/test_timeline.py::test_stage0_buckets_reduce_while_backward_runs",
    "python bench/timeline.py stage3.py --nproc 2 --preset small --steps 8 --out runs/tl/stage3_prefetch --results":
        "tests/test_timeline.py::test_stage3_no_prefetch_gathers_nothing_during_forward",
    "python bench/timeline.py stage3.py --nproc 2 --preset small --steps 8 --no_prefetch --out "
    "runs/tl/stage3_no_prefetch --results": "tests/test_timeline.py::test_stage3_no_prefetch_gathers_nothing_during_forward",
    "python bench/timeline.py offload.py --nproc 2 --preset small --steps 8 --out runs/tl/offload --results":
        "tests/test_timeline.py::test_compute_waiting_for_copies_is_a_wait",
    "python bench/timeline.py offload.py --nproc 2 --preset small --steps 8 --delayed_update --out "
    "runs/tl/offload_delayed_update --results": "test_timeline_results",
    "python bench/estimate.py --params 7.5e9 --world_size 64 --results": "test_estimate",
    "python bench/animate.py stage3.py --nproc 2 --preset tiny --dtype fp32 --frames 8,21,37 --results":
        "tests/test_animate.py::test_the_command_draws_the_gif",
    "python bench/animate.py stage3.py --nproc 2 --preset tiny --dtype fp32 --frames 8,21,37":
        "tests/test_animate.py::test_the_command_draws_the_gif",
    "python bench/bench_nvme.py --results": "tests/test_nvme.py::test_bench_quick",
    "python bench/bench_nvme.py --quick": "tests/test_nvme.py::test_bench_quick",
    "python bench/offload_gpu.py": "tests/test_offload_gpu.py::test_offload_gpu_smallest_on_the_fake_device",
    "python bench/host_cost.py --results": "tests/test_offload.py::test_host_cost_at_its_smallest",
    # tests/README.md, course/README.md
    f"python -m pytest tests --stage {STUDENT}": "test_grading",
    f'python -m pytest "tests/test_stages.py::test_parity_with_reference[student_stage2-2]" --stage {STUDENT}':
        "test_grading",
    "python -m pytest tests --stage path/to/student_offload.py --lesson 7_copy_stream":
        "tests/test_course.py::test_every_lesson_is_graded",
    "python -m pytest tests --gpu": "test_gpu_suite_skips_without_cuda",
    "bash tests/gpu_check.sh runs/gpu_check": "tests/test_gpu_check.py::test_gpu_check_without_a_gpu",
    "python course/make_exercise.py stage2.py": "test_make_exercise",
    "python course/make_lessons.py": "test_make_lessons",
    "python course/make_lessons.py --files steps": "tests/test_course.py::test_steps_and_exercises_run_by_hand",
    "torchrun --standalone --nproc_per_node 2 steps/offload_without_NVMe.py --preset tiny --dtype fp32":
        "tests/test_course.py::test_steps_and_exercises_run_by_hand",
    # examples/README.md
    "torchrun --standalone --nproc_per_node 2 examples/any_model.py --stage stage2.py":
        "tests/test_any_model.py::test_any_model_matches_the_reference",
}


def readme_commands():
    """{command: README files that show it}: every line of a ```bash block, and every inline code span that starts
    as a command does."""
    found = {}
    for name in READMES:
        text = re.sub(r"^<!-- (bench/results/\S+) -->\n.*?^<!-- end \1 -->$", "", (ROOT / name).read_text(),
                      flags=re.S | re.M)  # what the bench scripts wrote: their commands are in their headers
        for block in re.findall(r"^```bash\n(.*?)^```", text, re.S | re.M):
            for line in block.replace("\\\n", " ").splitlines():
                line = re.sub(r"\s+#.*$", "", line).strip()
                if line and not line.startswith("#"):
                    found.setdefault(line, []).append(name)
        prose = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
        for span in re.findall(r"`([^`\n]+)`", prose):
            if COMMAND.match(span):
                found.setdefault(span.strip(), []).append(name)
    return found


def test_every_command_is_covered():
    shown, ci = readme_commands(), (ROOT / ".ci" / "run").read_text().splitlines()
    missing = {c: where for c, where in shown.items() if c not in COVERED}
    assert not missing, f"commands in READMEs that no test runs (add each to COVERED, with its smoke test): {missing}"
    assert not set(COVERED) - set(shown), f"COVERED names commands no README shows: {sorted(set(COVERED) - set(shown))}"
    for command, by in COVERED.items():
        if by == "ci":
            assert any(line.strip().endswith(command) for line in ci), f".ci/run does not run `{command}`"
        elif "::" in by:
            path, test = by.split("::")
            assert f"def {test}(" in (ROOT / path).read_text(), f"{by} (which runs `{command}`) does not exist"
        else:
            assert callable(globals().get(by)), f"no smoke test {by} in this file (for `{command}`)"
    assert ci[-1] == "python -m pytest tests -n 2 --dist loadfile", ".ci/run must end with README.md's test command"
    assert any(line.strip() == INSTALL for line in ci), ".ci/run does not run README.md's install"


def run(command, *more, cwd=ROOT, timeout=600, env=None):
    """A README command (a string, as shown) with arguments appended (argparse: the last value of an option wins);
    returns its output, after checking that it exited 0."""
    argv = [sys.executable if a == "python" else a for a in shlex.split(command)] + [str(m) for m in more]
    while "=" in argv[0]:  # VAR=value before the command
        name, value = argv.pop(0).split("=", 1)
        env = {**(env or {}), name: value}
    if argv[0] == "torchrun":
        argv[:1] = [sys.executable, "-m", "torch.distributed.run"]
    p = subprocess.run(argv, capture_output=True, text=True, cwd=cwd, timeout=timeout,
                       env={**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(ROOT),
                            **(env or {})})
    assert p.returncode == 0, (f"`{command}` (+ {' '.join(map(str, more))}) exited {p.returncode}:\n"
                               + "\n".join(last_lines(p.stdout + p.stderr, 30)))
    return p.stdout + p.stderr


def command_of(test):
    """The README command that `test` runs."""
    return next(c for c, by in COVERED.items() if by == test)


def swap(command, option, value):
    """The command with the value after `option` replaced."""
    argv = command.split()
    argv[argv.index(option) + 1] = value
    return " ".join(argv)


def memory_table(text):
    """The table a run ends with: from its title to the end of the sentence on `other` and the peak below it."""
    lines = text.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("memory per rank, MiB"))
    end = next(i for i, line in enumerate(lines) if i > at and line.endswith("activations and working set"))
    return lines[at:end + 1]


def test_first_command():
    """README.md's first command, 3 steps instead of 300: the table it ends with is README's sample (the peak, which
    moves from run to run, within 10%). The command names its dtype, so the table is the same on every CPU; README's
    sample is in that dtype."""
    said = re.search(r"memory per rank, MiB \(stage3, (\w+),", (ROOT / "README.md").read_text()).group(1)
    assert FIRST.endswith(f"--dtype {said}"), f"README's first command does not ask for its sample's dtype, {said}"
    out = run(FIRST, "--steps", "3", *QUIET)
    got = memory_table(out)
    sample = memory_table(re.search(r"ended with:\n\n```\n(.*?)```", (ROOT / "README.md").read_text(), re.S).group(1))
    assert got[0].startswith("memory per rank") and got[2].split()[0] == "0-1" and got[3].split()[0] == "formula"
    assert f"stage3: {said} (--dtype {said})" in out, out
    assert len(got) == len(sample), f"README.md's sample has {len(sample)} lines, the run printed:\n" + "\n".join(got)
    for line, want in zip(got, sample):
        if line.split("|")[0].strip() == "0-1":
            *cells, peak = line.split("|")
            *want_cells, want_peak = want.split("|")
            assert cells == want_cells and abs(float(peak) - float(want_peak)) <= 0.1 * float(want_peak), (line, want)
        else:
            assert line == want, f"README.md's sample says\n{want}\nthe run printed\n{line}"


def test_two_nodes(tmp_path):
    """The multi-node command as two torchrun agents on this machine, 2 ranks each, c10d rendezvous: one job of 4."""
    command = swap(swap(command_of("test_two_nodes"), "--rdzv_endpoint", f"127.0.0.1:{free_port()}"),
                   "--nproc_per_node", "2")
    out = tmp_path / "run.json"
    argv = [sys.executable, "-m", "torch.distributed.run", *command.split()[1:], "--preset", "tiny", "--steps", "3",
            *QUIET, "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(ROOT)}
    logs = [open(tmp_path / f"node{k}.log", "w+") for k in range(2)]
    nodes = [subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env) for log in logs]
    codes = [node.wait(timeout=300) for node in nodes]
    for log in logs:
        log.seek(0)
    assert codes == [0, 0], "\n".join(f"node {k} (exit {c}):\n" + "\n".join(last_lines(log.read(), 15))
                                      for k, (c, log) in enumerate(zip(codes, logs)))
    summary = json.loads(out.read_text())
    assert summary["world_size"] == 4 and len(summary["losses"]) == 3


def test_compare(tmp_path):
    """bench/compare.py: every stage (at N = 2, on a 2-layer GPT, 3 steps) in one table, the summary and the picture."""
    run("python bench/compare.py", "--nproc", "2", "--steps", "3", "--n_layer", "2", "--out_dir", tmp_path)
    table = (tmp_path / "table.md").read_text()
    rows = [line.split("|")[1].strip() for line in table.splitlines() if re.match(r"^\| \w+ \| 2 \|", line)]
    assert rows == ["stage0", "stage1", "stage2", "stage3", "offload"], table
    assert "Model states equal to the formula in 5 of 5 runs" in table, table
    assert (tmp_path / "summary.json").exists() and (tmp_path / "memory.png").stat().st_size > 10_000


def published(path, command):
    """A file bench/results.py wrote: its header names the machine, torch and the command; returns the body."""
    text = path.read_text()
    head, body = text.split("\n\n", 1)
    assert head.startswith("Machine: ") and "; torch " in head and f"Command: `python {command}" in head, head
    return body


def test_peers(tmp_path):
    """bench/peers.py, one pair, one round of 3 steps of the tiny GPT: both runs finish (a peer ends its run as our
    stages do) and the table, written with its header, has the pair's row with numbers."""
    run("python bench/peers.py --steps 10 --rounds 2 --results", "--pairs", "stage0", "--steps", "3", "--rounds", "1",
        "--preset", "tiny", "--outdir", tmp_path / "runs", "--results", tmp_path, "--", "--eval_batches", "1")
    body = published(tmp_path / "peers.md", "bench/peers.py")
    rows = [line for line in body.splitlines() if line.startswith("| stage")]
    assert len(rows) == 1 and re.match(r"^\| stage0 vs DDP \| [\d,]+ \| [\d,]+ \| [\d.]+ \|", rows[0]), body


PEERS_WORLD = """
import os, sys, torch, torch.distributed as dist
sys.path[:0] = [{root!r}, {bench!r}]
import peers
from checkpoint import gather_master
from options import parse_args
from train_gpt import GPT, GPTConfig, PRESETS, CharData, load_text, train_step
dist.init_process_group("gloo")
data = CharData(load_text(None), 32)
for name, (Engine, _) in peers.PEERS.items():
    args = parse_args(Engine, PRESETS, GPTConfig, ["--dtype", "fp32", "--batch_size", "4", "--steps", "2"])
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=32, vocab_size=len(data.chars), n_layer=2, n_head=2, n_embd=34))
    engine = Engine(model, args, torch.device("cpu"))
    for step in range(2):
        train_step(engine, data, args, step, torch.device("cpu"))
    master = gather_master(engine)  # every rank's state_pieces, assembled on rank 0
    for n, p in model.named_parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p.detach()
        if dist.get_rank() == 0:
            assert torch.equal(master[n], full), (name, n)
    if dist.get_rank() == 0:
        print(name, "pieces ok", flush=True)
dist.barrier()
dist.destroy_process_group()
sys.stdout.flush()
os._exit(0)  # as instruments.finish: gloo ranks of torch 2.13 sometimes abort (SIGABRT) in exit-time destructors
"""


def test_every_peer_lists_its_pieces(tmp_path):
    """Each torch peer's state_pieces (what train_gpt's end of a run and --save_master read) covers its parameters:
    gathered over 2 ranks they equal the model's own, for DDP, ZeroRedundancyOptimizer and both FSDP2 modes (odd
    sizes, so FSDP2's shards are uneven)."""
    script = tmp_path / "peers_world.py"
    script.write_text(PEERS_WORLD.format(root=str(ROOT), bench=str(ROOT / "bench")))
    out = run(f"torchrun --standalone --nproc_per_node 2 {script}")
    assert [line.split()[0] for line in out.splitlines() if line.endswith("pieces ok")] == ["ddp", "zero1", "fsdp2", "fsdp3"]


def test_bench_adam(tmp_path):
    """bench/bench_adam.py: at one size (2^20), one sample, no retakes: a row for the size, every candidate with a rate."""
    run("python bench/bench_adam.py --sizes 22 24 26 --repeats 7 --results", "--sizes", "20", "--repeats", "1",
        "--retakes", "0", "--results", tmp_path)
    body = published(tmp_path / "adam.md", "bench/bench_adam.py")
    assert re.search(r"^\| 2\^20 \| [\d,]+ \(.*GB/s\) \| .* \| [\d,]+ \| [\d.]+% \|", body, re.M), body
    assert "| size | vs torch foreach | vs torch fused" in body, body


def test_bench_norm(tmp_path):
    """bench/bench_norm.py: at one size (2^16), one sample, no retakes: a row per gradient dtype, each with a speed-up."""
    run("python bench/bench_norm.py --sizes 24 26 --repeats 7 --results", "--sizes", "16", "--repeats", "1",
        "--retakes", "0", "--results", tmp_path)
    body = published(tmp_path / "norm.md", "bench/bench_norm.py")
    for dtype in ("bfloat16", "float32"):
        assert re.search(rf"^\| 2\^16 \| {dtype} \| [\d.]+ \| [\d.]+ \| [\d.]+ \| [\d.]+x \| [\d.]+x \|", body, re.M), body


def test_timeline_results(tmp_path):
    """bench/timeline.py --results (offload with --delayed_update, tiny GPT): the report, the picture and the trace
    under the run's name, and the C++ AdamW's row in the report."""
    command = command_of("test_timeline_results").replace("runs/tl", str(tmp_path / "tl"))
    run(command, "--preset", "tiny", "--n_layer", "2", "--steps", "3", "--results", tmp_path / "results")
    where = tmp_path / "results" / "timeline"
    body = published(where / "offload_delayed_update.md", "bench/timeline.py offload.py")
    assert body.startswith("offload (") and "- rank 1: step" in body and "cpu adam overlapped by compute" in body, body
    assert (where / "offload_delayed_update.png").stat().st_size > 10_000
    assert json.loads((where / "offload_delayed_update.trace.json").read_text())["traceEvents"]


def test_estimate(tmp_path):
    """bench/estimate.py on the paper's worked example: a row per stage, the paper's totals."""
    import estimate
    argv = shlex.split(command_of("test_estimate"))[2:-1]
    assert estimate.main([*argv, "--results", str(tmp_path)]) == 0
    body = published(tmp_path / "estimate.md", "bench/estimate.py --params 7.5e9 --world_size 64")
    totals = {line.split("|")[1].strip(): line.split("|")[-2].strip() for line in body.splitlines() if line.startswith("| ")}
    assert [totals[s] for s in ("stage0", "stage1", "stage2", "stage3", "offload")] == ["120", "31.4", "16.6", "1.88", "1.88"]


def test_results_copies_files_into_the_page(tmp_path, monkeypatch):
    """bench/results.py puts each file of bench/results/ into its block of bench/README.md, and says which file or
    block has no counterpart (on copies of the page and the files)."""
    page, files = tmp_path / "README.md", tmp_path / "results"
    shutil.copytree(results.RESULTS, files)
    page.write_text(results.PAGE.read_text())
    monkeypatch.setattr(results, "PAGE", page)
    monkeypatch.setattr(results, "RESULTS", files)
    name = sorted(results.blocks())[0]
    (files / f"{name}.md").write_text("a new table\n")
    assert results.main() == 0 and results.blocks()[name] == "a new table\n"
    (files / "extra.md").write_text("x\n")
    assert results.main() == 1


def summary(out):
    """pytest's closing line (a plugin's warnings may follow it: pytest-benchmark's under xdist)."""
    return next(line for line in reversed(out.splitlines()) if re.search(r"\d+ (passed|failed|skipped|error)", line))


def test_grading(tmp_path):
    """Grading a student's file: exactly the stage checks, every one on that file; one of them passes alone."""
    student = tmp_path / "student_stage2.py"
    shutil.copyfile(ROOT / "stage2.py", student)
    everything, one = [c.replace(STUDENT, str(student)) for c, by in COVERED.items() if by == "test_grading"]
    out = run(everything, "--collect-only", "-q", "-p", "no:cacheprovider")
    ids = [line for line in out.splitlines() if "::" in line]
    assert ids and all("student_stage2" in i for i in ids), out
    out = run(one, "-q", "-p", "no:cacheprovider", "--basetemp", tmp_path / "pytest")
    assert re.search(r"^1 passed", summary(out)), out


def test_gpu_suite_skips_without_cuda():
    """python -m pytest tests --gpu, on the GPU suite's file: without CUDA every GPU test skips, and it exits 0."""
    out = run("python -m pytest tests --gpu".replace(" tests ", " tests/test_gpu.py "), "-q", "-p", "no:cacheprovider",
              "-rs")
    assert "skipped" in summary(out) and "failed" not in summary(out), out


def test_quick_check():
    """python -m pytest tests -m quick, the learner's check: it selects every stage's parity with the reference on 2
    ranks, and nothing else (the full suite runs those tests too, so here they are only collected)."""
    out = run("python -m pytest tests -m quick", "--collect-only", "-q", "-p", "no:cacheprovider")
    selected = sorted(ln.split("::")[-1] for ln in out.splitlines() if "::" in ln)
    assert selected == sorted(f"test_parity_with_reference[{s.removesuffix('.py')}-2]" for s in STAGES), selected


def test_mutations():
    """python tests/mutations.py at its smallest: one slip whose claiming tests start no run (lr_at's warmup off by
    one, against tests/test_shared.py) is caught; and every slip's text is in its file exactly once (a slip out of
    date would plant nothing)."""
    sys.path.insert(0, str(ROOT / "tests"))
    import mutations
    for name, (file, old, *_) in mutations.SLIPS.items():
        count = (ROOT / file).read_text(encoding="utf-8").count(old)
        assert count == 1, f"tests/mutations.py's slip {name}: its text is in {file} {count} times, not once"
    out = run("python tests/mutations.py", "lr_warmup_off_by_one")
    assert "caught  lr_warmup_off_by_one" in out and "1 of 1 slips caught" in out, out


def test_make_lessons(tmp_path):
    """python course/make_lessons.py: a diff per lesson in course/lessons/ (here: --out elsewhere), and the table README
    shows (tests/test_course.py checks the diffs apply, tests/test_readme.py the table)."""
    out = run("python course/make_lessons.py", "--out", tmp_path / "lessons")
    written = sorted(p.name for p in (tmp_path / "lessons").iterdir())
    assert written == sorted(p.name for p in (ROOT / "course" / "lessons").glob("*.diff")) and len(written) >= 7, written
    assert len(re.findall(r"^\| `\d+_\w+` \|", out, re.M)) == len(written), out


def test_make_exercise(tmp_path):
    """course/make_exercise.py stage2.py, from a directory holding the course and the stage: exercises/stage2.py, its
    newest idea a TODO, still importable Python."""
    (tmp_path / "course").symlink_to(ROOT / "course")
    shutil.copyfile(ROOT / "stage2.py", tmp_path / "stage2.py")
    run("python course/make_exercise.py stage2.py", cwd=tmp_path)
    exercise = (tmp_path / "exercises" / "stage2.py").read_text()
    assert "# TODO [ZeRO-2]" in exercise and "raise NotImplementedError" in exercise and "# [ZeRO-2]" not in exercise
    compile(exercise, "stage2.py", "exec")
