"""Numbers a user can trust at any model size, and options that cannot silently ruin a run: the gradient norm at GPT-2
size, the optimizer step without an fp32 copy of the whole gradient, --grad_clip 0, a non-finite norm, out-of-range
options; and --dtype auto's choice, from the facts it reads (never from which CPU runs the test)."""
import importlib
import json
import math
import os
import random
import sys
import time
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from conftest import ROOT, STAGES
from test_inputs import TINY, fails_fast
import train_gpt
import devices
from devices import free_port
from instruments import PeakMemory
from train_gpt import GPT, GPTConfig, clip_coef, sum_of_squares


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_is_accurate_at_gpt2_size(dtype):
    """A GPT-2-size (124M) shard of gradient: the norm agrees with a float64 one to 1e-6 (one fp32 vector_norm over
    such a vector was 1.3-2.7% off on this project's CPUs)."""
    g = torch.randn(124_439_808, generator=torch.Generator().manual_seed(0)).mul_(1e-3).to(dtype)
    exact = math.sqrt(sum(float(part.double().square().sum()) for part in g.split(1 << 24)))
    ours = float(sum_of_squares(g).sqrt())
    assert abs(ours / exact - 1) < 1e-6, f"norm {ours!r}, float64 {exact!r}: {abs(ours / exact - 1):.2e} relative"


def test_norm_of_pieces_adds_up():
    """Summing per bucket and then over ranks is the same sum (what every stage does), at any split."""
    g = torch.randn(3 * (1 << 20) + 12345, generator=torch.Generator().manual_seed(1))
    whole = float(sum_of_squares(g))
    pieces = sum(float(sum_of_squares(p)) for p in g.split(70_001))
    assert pieces == pytest.approx(whole, rel=1e-7)  # each block summed in fp32: ~1e-8 apart
    assert sum_of_squares(g).dtype == torch.float64


def test_grad_clip_zero_means_no_clipping():
    norm = torch.tensor(7.3, dtype=torch.float64)
    assert float(clip_coef(norm, 0.0)) == 1.0
    assert float(clip_coef(norm, 1.0)) == pytest.approx(1 / 7.3, rel=1e-6)
    assert float(clip_coef(torch.tensor(0.5, dtype=torch.float64), 1.0)) == 1.0


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_clip_coef_refuses_a_non_finite_norm(bad):
    with pytest.raises(train_gpt.NonFiniteGradNorm):
        clip_coef(torch.tensor(bad, dtype=torch.float64), 1.0)


@pytest.fixture(scope="module")
def world_of_one():
    """A gloo process group of one rank in this process, for engines driven directly."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def engine_class(script):
    module = importlib.import_module(script[:-3])
    return [v for v in vars(module).values() if isinstance(v, type) and v.__module__ == module.__name__
               and hasattr(v, "state_pieces")][-1]


@pytest.mark.parametrize("script", STAGES[:4])
def test_step_holds_one_bucket_in_fp32(world_of_one, script):
    """bf16 model, several buckets: during the optimizer step no allocation is larger than one bucket's gradient in
    fp32, and all of the step's temporaries together stay below one fp32 copy of the rank's gradient (4 bytes x Ψ/N;
    a step that widened the whole gradient at once would make 6Ψ bytes of them in stage 0, 4Ψ/N in stages 1-3)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=16, vocab_size=96, n_layer=4, n_head=2, n_embd=64)).to(torch.bfloat16)
    args = SimpleNamespace(bucket_mb=0.02, beta1=0.9, beta2=0.99, weight_decay=0.1, grad_clip=1.0, no_prefetch=False,
                           grad_accum=1)
    engine = engine_class(script)(model, args, torch.device("cpu"))
    x = torch.randint(0, 96, (2, 16))
    engine.backward(engine.forward(x, x), sync=True)
    with PeakMemory(torch.device("cpu")) as meter:
        engine.step(1e-3)
    largest_bucket = max(b.end - b.start for b in engine.buckets) // dist.get_world_size()
    full_fp32_grad = 4 * engine.padded_numel
    assert meter.largest <= 4 * largest_bucket, (f"{script}: an allocation of {meter.largest:,} bytes during the step; "
                                                 f"one bucket's fp32 gradient is {4 * largest_bucket:,}")
    assert meter.peak - meter.base < full_fp32_grad, (f"{script}: {meter.peak - meter.base:,} bytes of temporaries "
                                                      f"in the step, as much as an fp32 copy of the gradient")


@pytest.mark.parametrize("script", ["train_gpt.py"] + STAGES)
def test_non_finite_norm_stops_before_the_update(runner, tmp_path, script):
    """lr 1e30 makes step 1's gradient non-finite: the run stops there with one line naming the step and the norm,
    exits non-zero, and the checkpoint saved after step 1 (the newest) holds no NaN."""
    ckpt = tmp_path / "ck"
    args = [*TINY, "--steps", "6", "--lr", "1e30", "--warmup", "1", "--dtype", "fp32", "--ckpt_dir", str(ckpt),
            "--save_every", "1"]
    # two ranks as torchrun starts them, without torchrun's agent (which adds its own report of any failed child)
    p = runner.launch(str(ROOT / script), None, *args) if script == "train_gpt.py" else runner.spawn(str(ROOT / script), 2, args)
    errors = [ln for ln in (p.stdout + p.stderr).splitlines() if ln.startswith("error:")]
    assert p.returncode != 0, f"{script}: a non-finite gradient norm did not stop the run:\n{p.stdout[-2000:]}"
    assert len(errors) == 1 and "global gradient norm is" in errors[0] and "step 1" in errors[0], p.stdout + p.stderr
    assert "Traceback" not in p.stderr, p.stderr[-3000:]
    newest = sorted(ckpt.glob("step_*/manifest.json"))[-1].parent
    assert json.loads((newest / "manifest.json").read_text())["step"] == 1
    for shard in newest.glob("shard_*.pt"):
        state = torch.load(shard, weights_only=True)
        for k in ("master", "exp_avg", "exp_avg_sq"):
            assert torch.isfinite(state[k]).all(), f"{script}: {shard.name} holds a non-finite {k}"


@pytest.mark.parametrize("args, expected", [
    (["--beta1", "1.0"], "--beta1 1.0: must be in [0, 1)"),
    (["--beta2=-0.1"], "--beta2 -0.1: must be in [0, 1)"),
    (["--lr=-1e-3"], "--lr -0.001: must be 0 or more"),
    (["--min_lr=-1"], "--min_lr -1.0: must be 0 or more"),
    (["--weight_decay=-0.1"], "--weight_decay -0.1: must be 0 or more"),
    (["--grad_clip=-1"], "--grad_clip -1.0: must be 0 or more"),
    (["--warmup=-1"], "--warmup -1: must be 0 or more"),
    (["--steps", "0"], "--steps 0: must be at least 1"),
    (["--eval_every", "0"], "--eval_every 0: must be at least 1"),
    (["--batch_size", "0"], "--batch_size 0: must be at least 1"),
    (["--grad_accum", "0"], "--grad_accum 0: must be at least 1"),
    (["--bucket_mb", "0"], "--bucket_mb 0.0: must be more than 0"),
    (["--bucket_mb=-4"], "--bucket_mb -4.0: must be more than 0"),
])
def test_out_of_range_options_refused_at_start(args, expected):
    fails_fast([sys.executable, str(ROOT / "stage0_ddp.py"), *TINY, *args], expected)


# ---------------------------------------------------------------------------------------------------------------
# --dtype auto: the choice follows from what it reads; no assertion here depends on the CPU that runs it

def fake_cpu(monkeypatch, flags, onednn=True):
    """A CPU whose /proc/cpuinfo lists these bf16 flags, and whose oneDNN says it has (or lacks) a bf16 path."""
    monkeypatch.setattr(devices, "native_bf16", lambda: flags)
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: onednn, raising=False)


@pytest.mark.parametrize("flags, onednn, expected", [
    ([], False, torch.float32),                           # AVX2 only: torch's bf16 is a fallback, ~80x slower
    ([], True, torch.float32),                            # AVX-512 without BF16: oneDNN only emulates bf16
    (["avx512_bf16"], True, torch.bfloat16),              # AMD Zen 4, Zen 5
    (["amx_bf16", "avx512_bf16"], True, torch.bfloat16),  # Intel Sapphire Rapids
    (["avx512_bf16"], False, torch.float32),              # a torch whose oneDNN has no bf16 path
])
def test_auto_dtype_on_cpu(monkeypatch, flags, onednn, expected):
    fake_cpu(monkeypatch, flags, onednn)
    dtype, why = devices.pick_dtype("auto", torch.device("cpu"))
    assert dtype == expected and why.startswith("auto: ")
    assert all(flag in why for flag in flags) if expected == torch.bfloat16 else "no native bf16" in why


def test_auto_dtype_is_the_same_on_every_run(monkeypatch):
    """On a CPU with native bf16, under a clock that jumps (a loaded machine), ten choices in a row are one: auto
    reads what the CPU has, and times nothing."""
    fake_cpu(monkeypatch, ["avx512_bf16"])
    noise = random.Random(0)
    monkeypatch.setattr(time, "perf_counter", lambda: noise.uniform(0, 1e3))
    monkeypatch.setattr(time, "time", lambda: noise.uniform(0, 1e3))
    picked = {devices.pick_dtype("auto", torch.device("cpu")) for _ in range(10)}
    assert len(picked) == 1, picked


def test_explicit_dtype_is_never_overridden(monkeypatch):
    fake_cpu(monkeypatch, [], False)
    assert devices.pick_dtype("bf16", torch.device("cpu"))[0] == torch.bfloat16
    assert devices.pick_dtype("fp32", torch.device("cpu"))[0] == torch.float32
    assert devices.pick_dtype("fp16", torch.device("cpu"))[0] == torch.float16  # slow on a CPU, but asked for


def test_the_cpus_flags_are_read():
    """native_bf16 reads this machine's /proc/cpuinfo: what it returns is among the flags listed there."""
    found = devices.native_bf16()
    assert set(found) <= {"amx_bf16", "avx512_bf16"}
    if found:
        assert all(f" {flag}" in open("/proc/cpuinfo").read() for flag in found)


def test_first_line_names_the_dtype_and_the_formula(runner):
    """The first line says which dtype was chosen and why; the formula follows the parameter bytes (20Ψ in fp32)."""
    p = runner.launch(str(ROOT / "train_gpt.py"), None, *TINY)
    first, second = p.stdout.splitlines()[:2]
    assert first.startswith("reference: bf16 (auto: ") or first.startswith("reference: fp32 (auto: "), first
    # (the reason for fp32 can name bf16: the formula follows the dtype chosen)
    assert ("16Ψ" if first.startswith("reference: bf16") else "20Ψ") in second, (first, second)
    p = runner.launch(str(ROOT / "stage1.py"), None, *TINY, "--dtype", "fp32")
    assert "fp32 (--dtype fp32)" in p.stdout.splitlines()[0] and "8Ψ + 12Ψ/N" in p.stdout.splitlines()[1], p.stdout


def test_formula_text():
    assert train_gpt.formula_text("stage0", 2) == "16Ψ"
    assert train_gpt.formula_text("stage0", 4) == "20Ψ"
    assert train_gpt.formula_text("stage1", 2) == "4Ψ + 12Ψ/N"
    assert train_gpt.formula_text("stage2", 2) == "2Ψ + 14Ψ/N"
    assert train_gpt.formula_text("stage3", 4) == "20Ψ/N"
    assert train_gpt.formula_text("offload", 2, grad_shards=2) == "18Ψ/N"
