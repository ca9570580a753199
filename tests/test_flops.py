"""The model FLOPs a run reports (instruments.flops_per_token, speed): nanoGPT's estimate_mfu count held against a
count by hand for the tiny GPT, TFLOP/s per rank from the global tokens per second, MFU only where the device's dense
peak is known (never on a CPU), and one real run that carries them in its progress lines, its report and its JSON
summary (--out), and bench/peers.py's table with its TFLOP/s column. One single-process run of the tiny preset, and
one of stage 0 at N = 2, whose progress lines and report divide by the ranks alike."""
import json
import re
import subprocess
import sys
import types

import pytest
import torch

from conftest import ROOT, Runner
from instruments import flops_per_token, peak_tflops, speed, speed_text
from train_gpt import GPT, GPTConfig

sys.path.insert(0, str(ROOT / "bench"))
import peers  # noqa: E402


def hand_count(vocab_size):
    """The tiny preset (2 layers, 2 heads, width 64, 64 tokens) counted by hand. A block: c_attn 64 x 192, c_proj
    64 x 64, the MLP 64 x 256 and 256 x 64, two LayerNorm weights of 64. Then the token embedding (the LM head's
    matrix, tied), ln_f; not the position embedding. Attention: 12 x layers x heads x head width (32) x tokens."""
    block = 64 * 192 + 64 * 64 + 64 * 256 + 256 * 64 + 2 * 64
    psi = 2 * block + vocab_size * 64 + 64
    attention = 12 * 2 * 2 * 32 * 64
    return 6 * psi + attention


def test_flops_per_token_by_hand():
    cfg = GPTConfig(block_size=64, vocab_size=103, n_layer=2, n_head=2, n_embd=64)
    with torch.device("meta"):  # shapes only: the count reads numel
        model = GPT(cfg)
    assert flops_per_token(model, cfg) == hand_count(103) == 729_600


def test_tflops_per_rank_and_mfu(monkeypatch):
    """The global tokens per second over the ranks; MFU against the dense peak of the card's row, by its name."""
    cpu = speed(1e9, 4000.0, 2, torch.device("cpu"), "bf16")
    assert cpu["tflops_per_rank"] == pytest.approx(1e9 * 4000 / 2 / 1e12) and cpu["mfu"] is None
    cuda = torch.device("cuda", 0)
    for name, dtype, peak in [("NVIDIA H100 80GB HBM3", "bf16", 989), ("NVIDIA H100 PCIe", "bf16", 756),
                              ("NVIDIA H200", "fp32", 67), ("NVIDIA H200 NVL", "fp16", 835),
                              ("NVIDIA A100-SXM4-80GB", "bf16", 312), ("Tesla V100-SXM2-16GB", "fp16", 125),
                              ("Tesla V100-SXM2-16GB", "bf16", None), ("Some GPU", "bf16", None)]:
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
        assert peak_tflops(cuda, dtype)[0] == peak, name
        s = speed(1e9, 4e5, 2, cuda, dtype)
        assert s["mfu"] == (pytest.approx(200 / peak) if peak else None), name  # 200 TFLOP/s per rank
        mfu = f" (MFU {200 / peak:.1%} of the {name}'s dense {peak})" if peak else ""
        assert speed_text(s) == "200 TFLOP/s per rank" + mfu


def test_a_run_reports_tflops(tmp_path):
    """The progress lines, the report's line and the summary carry TFLOP/s per rank; the summary's is its own
    flops_per_token x tokens_per_s, and flops_per_token is the hand count of this run's vocabulary."""
    out = tmp_path / "run.json"
    p = subprocess.run([sys.executable, "train_gpt.py", "--preset", "tiny", "--steps", "4", "--sample_chars", "0",
                        "--eval_batches", "1", "--dtype", "fp32", "--out", str(out)],
                       capture_output=True, text=True, cwd=ROOT, env=Runner(tmp_path).env(), timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    s = json.loads(out.read_text())
    assert s["flops_per_token"] == hand_count(s["config"]["vocab_size"])
    assert s["tflops_per_rank"] == pytest.approx(s["flops_per_token"] * s["tokens_per_s"] / 1e12)
    assert s["mfu"] is None and s["peak_tflops"] is None
    progress = [line for line in p.stdout.splitlines() if line.startswith("reference: step ")]
    assert len(progress) == 4 and all(" TFLOP/s per rank" in line for line in progress), p.stdout
    assert f"tokens/s, {s['tflops_per_rank']:.3g} TFLOP/s per rank" in p.stdout, p.stdout


def test_peers_table_has_tflops():
    """bench/peers.py's row: each side's median TFLOP/s per rank, ours / peer."""
    run = lambda tok, tf: dict(tokens_per_s=tok, tflops_per_rank=tf, losses=[2.5])
    results = {("stage0", "ours"): [run(100.0, 0.25), run(110.0, 0.5), run(90.0, 0.125)],
               ("stage0", "peer"): [run(100.0, 1.5)]}
    row = [line for line in peers.report(["stage0"], results).splitlines() if line.startswith("| stage0")][0]
    assert row.split(" | ")[5] == "0.25 / 1.5", row


def test_progress_lines_and_report_agree_at_two_ranks(runner):
    """At N = 2 each progress line's TFLOP/s per rank is its own tokens/s (global) x FLOPs per token over the 2
    ranks, as the report's is: the same formula, not one per rank and one for the whole job."""
    run = runner.run(str(ROOT / "stage0_ddp.py"), 2, "--preset", "tiny", "--steps", "3", "--sample_chars", "0",
                     "--eval_batches", "1", "--dtype", "fp32")
    s = run.summary
    assert s["world_size"] == 2
    assert s["tflops_per_rank"] == pytest.approx(s["flops_per_token"] * s["tokens_per_s"] / 2 / 1e12), (
        f"the summary's TFLOP/s per rank at N=2, {s['tflops_per_rank']:.3g}, is not FLOPs x tokens/s over 2 ranks")
    # three progress lines, then the report's
    rates = re.findall(r"^stage0: (?:step \d+/3|val loss).* ([\d,]+) tokens/s, ([\d.e+-]+) TFLOP/s per rank$",
                       run.stdout, re.M)
    assert len(rates) == 4, run.stdout
    for tokens, tflops in rates:
        expected = s["flops_per_token"] * float(tokens.replace(",", "")) / 2 / 1e12
        # (3 significant figures printed: within 1%; a count per rank, or for the whole job, is 2x off)
        assert float(tflops) == pytest.approx(expected, rel=0.01), (
            f"at N=2 a line says {tflops} TFLOP/s per rank at {tokens} tokens/s; the report's formula gives "
            f"{expected:.3g}:\n{run.stdout}")
