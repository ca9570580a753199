"""Bad input gets one clear line that names the fix, before any work starts; and the reference really learns.
(On CPU, as the whole suite: the runs see no GPU. The GPU suite, tests/test_gpu.py, runs with --gpu.)"""
import os
import re
import subprocess
import sys
import time

import pytest

from conftest import ROOT, Runner

TINY = ["--preset", "tiny", "--steps", "2", "--no_progress", "--sample_chars", "0"]
CPU_ONLY = dict(os.environ, CUDA_VISIBLE_DEVICES="")
PYTHON = Runner(None)  # `python script args`, forked from the suite's fork server


def python(cmd):
    """`cmd` ([sys.executable, script, *args]) to its end, as the suite runs a script: output captured, no GPU."""
    return PYTHON.finish(cmd[1:], PYTHON.env(), timeout=120)


def fails_fast(cmd, expected):
    start = time.perf_counter()
    p = python(cmd)
    elapsed = time.perf_counter() - start
    lines = [ln for ln in p.stderr.strip().splitlines() if ln.startswith("error:") or ": error:" in ln]
    assert p.returncode != 0, f"{' '.join(cmd)} should fail, but exited 0"
    assert "Traceback" not in p.stderr, f"a traceback instead of a one-line error:\n{p.stderr}"
    assert len(lines) >= 1 and expected in lines[-1], f"expected an error line with {expected!r}, got:\n{p.stderr}"
    assert "parameters (Ψ)" not in p.stdout, "the error came after the model was built: check inputs first"
    return elapsed


@pytest.mark.parametrize("args, expected", [
    (["--batch_size", "9", "--grad_accum", "2"], "use a multiple of 2"),
    (["--preset", "huge"], "invalid choice: 'huge'"),
    (["--data", "/no/such/file.txt"], "no such file"),
    (["--n_embd", "65", "--n_head", "2"], "not divisible by --n_head"),
])
def test_bad_input_one_line_error(args, expected):
    fails_fast([sys.executable, str(ROOT / "stage0_ddp.py"), *TINY, *args], expected)


def test_batch_not_divisible_by_world_size_under_torchrun():
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4",
           str(ROOT / "stage1.py"), *TINY, "--batch_size", "6"]
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=CPU_ONLY, timeout=120)
    assert p.returncode != 0 and "--batch_size 6 is not divisible by world_size 4" in p.stderr + p.stdout


def test_cuda_requested_without_gpu():
    fails_fast([sys.executable, str(ROOT / "train_gpt.py"), *TINY, "--device", "cuda"], "--device cuda, but torch sees no CUDA GPU")


def test_reference_learns_real_text(runner):
    """A few seconds of training take the tiny GPT clearly below the unigram baseline, and it writes a sample."""
    run = runner.run(str(ROOT / "train_gpt.py"), None, "--preset", "tiny", "--steps", "150", "--no_progress",
                     "--sample_chars", "100", "--eval_every", "150")
    s = run.summary
    assert s["val_loss"] < s["unigram_loss"] - 0.4, f"val loss {s['val_loss']:.3f} vs unigram {s['unigram_loss']:.3f}"
    assert "--- sample ---" in run.stdout



@pytest.mark.parametrize("script", ["train_gpt.py", "stage0_ddp.py", "stage3.py", "offload.py"])
def test_help_shows_every_default(script):
    """--help (options.py's docstring promises it) explains every option and shows the default of each that has one,
    never a default of None."""
    p = python([sys.executable, str(ROOT / script), "--help"])
    text = " ".join(p.stdout.split())  # argparse wraps the help: one line of words
    options = [o for o in dict.fromkeys(re.findall(r"\[(--\w+)", p.stdout))]
    assert p.returncode == 0 and len(options) > 20, p.stdout + p.stderr
    assert "(default: None)" not in text, text
    for name in ("--steps", "--lr", "--grad_accum", "--beta1", "--warmup", "--seed", "--eval_every"):
        assert re.search(rf"{name} \S+ [^-][^(]*\(default: [^)]+\)", text), f"{script} --help: no default for {name}"
    metavar = r"(?: (?:\{[^}]*\}|[A-Z_]+))*"  # --preset {tiny,...}, --out OUT, --consolidate DIR OUT
    words = r" (?!--)(?![A-Z_]+ )\S"  # then words of help: not the next option, not an option's metavar
    silent = [o for o in options if not re.search(re.escape(o) + metavar + words, text)]
    assert not silent, f"{script} --help says nothing about {silent}"


@pytest.mark.parametrize("args, expected", [
    (["--save_every", "2"], "error: --save_every needs --ckpt_dir DIR"),
    (["--save_every=-1", "--ckpt_dir", "runs/ck"], "error: --save_every -1: must be 0 or more"),
    (["--stop_after", "0"], "error: --stop_after 0: must be at least 1"),
])
def test_checkpoint_options_are_refused_in_one_line(args, expected):
    """The checkpoint options' refusals (options.check_args, in this process: a world of one raises its line): a
    save with nowhere to go, a negative period, a stop before the first step."""
    from options import check_args, parse_args
    from train_gpt import PRESETS, GPTConfig
    parsed = parse_args(None, PRESETS, GPTConfig, [*TINY, *args])
    with pytest.raises(SystemExit) as e:
        check_args(parsed, world_size=1)
    assert str(e.value).startswith(expected) and "\n" not in str(e.value), str(e.value)


@pytest.mark.parametrize("args, expected", [
    (["--steps", "0"], "error: --steps 0: must be at least 1"),
    (["--eval_batches", "0"], "error: --eval_batches 0: must be at least 1"),
    (["--beta1", "1"], "error: --beta1 1.0: must be in [0, 1) (1 would divide by 1 - 1 = 0"),
    (["--beta2", "1.0"], "error: --beta2 1.0: must be in [0, 1)"),
    (["--beta2", "-0.1"], "error: --beta2 -0.1: must be in [0, 1)"),
    (["--lr", "nan"], "error: --lr nan: must be 0 or more"),
    (["--weight_decay", "-0.1"], "error: --weight_decay -0.1: must be 0 or more"),
    (["--grad_clip", "-1"], "error: --grad_clip -1.0: must be 0 or more (0: no clipping)"),
], ids=["steps_0", "eval_batches_0", "beta1_1", "beta2_1", "beta2_negative", "lr_nan", "weight_decay_negative",
        "grad_clip_negative"])
def test_recipe_options_are_refused_in_one_line(args, expected):
    """The recipe's refusals (options.check_args, in this process): a count under 1, Adam's beta of 1 (its bias
    correction divides by 1 - beta^t = 0: every weight NaN), a negative or NaN rate, decay or clip."""
    from options import check_args, parse_args
    from train_gpt import PRESETS, GPTConfig
    parsed = parse_args(None, PRESETS, GPTConfig, [*TINY, *args])
    with pytest.raises(SystemExit) as e:
        check_args(parsed, world_size=1)
        pytest.fail(f"{' '.join(args)} accepted")
    assert str(e.value).startswith(expected) and "\n" not in str(e.value), str(e.value)
