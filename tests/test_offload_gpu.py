"""bench/offload_gpu.py, the ZeRO-Offload paper's headline on one GPU, at its smallest size (--smallest: the tiny GPT)
on the fake CUDA device, every process it starts on it (tests/fake_cuda_site): each run finishes with no finding,
and the page has its three tables with a row per grad_accum, per offload run and per largest model, each largest
model confirmed by its run; the picture is drawn, and nothing goes to bench/results/ (no GPU ran it). Without CUDA it
stops with one line. The table's shape is checked, not its numbers: they are no GPU's."""
import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT, last_lines
from test_bench_fake_cuda import on_fake_cuda


def published():
    """bench/results/offload_gpu.md's text, or None."""
    path = ROOT / "bench" / "results" / "offload_gpu.md"
    return path.read_text() if path.exists() else None


def test_offload_gpu_smallest_on_the_fake_device(tmp_path):
    out = tmp_path / "out"
    before = published()
    p, reports = on_fake_cuda(tmp_path, "bench/offload_gpu.py", "--smallest", "--out_dir", str(out))
    output = "\n".join(last_lines(p.stdout + p.stderr, 40))
    refused = [f"{path}: {m}" for path, r in reports.items() for m in r["findings"]]
    assert not refused, "CUDA would refuse:\n" + "\n".join(refused) + "\n" + output
    assert p.returncode == 0, output
    result = json.loads((out / "offload_gpu.json").read_text())
    accums = result["size"]["accums"]
    runs = [f"{name}.ga{a}" for name in ("stage0", "offload", "offload_dpu") for a in accums]
    assert sorted(result["sweep"]) == sorted(runs), result["sweep"]
    assert all(r["tflops"] > 0 and r["note"] is None for r in result["sweep"].values()), result["sweep"]
    for name in runs[len(accums):]:  # offload's runs carry their timeline's fractions: it has copies and C++ AdamW
        assert all(0 <= result["sweep"][name][row] <= 1 for row in ("copies", "cpu adam")
                   if not (name.startswith("offload_dpu") and row == "cpu adam")), result["sweep"][name]
    # with --delayed_update the traced step holds the update of the step before only while it runs: on the fake
    # device's clock (the H200's host) the tiny GPT's takes microseconds, and may be over before the step begins
    for name in runs[2 * len(accums):]:
        assert result["sweep"][name]["cpu adam"] is None or 0 <= result["sweep"][name]["cpu adam"] <= 1
    assert list(result["largest"]) == ["stage0", "offload", "offload_nvme"], result["largest"]
    assert all(r["layers"] > 0 and r["tflops"] > 0 for r in result["largest"].values()), result["largest"]
    page = (out / "offload_gpu.md").read_text()
    tables = [block for block in page.split("\n\n") if block.startswith("| ")]
    # the sweep (each ratio beside its prediction), the time per micro-step and its slope, the overlaps, the largest
    assert [len(t.splitlines()) - 2 for t in tables] == [len(accums), 3, 2 * len(accums), 3], page
    assert all(r["step_s"] > 0 for r in result["sweep"].values()), result["sweep"]
    assert result["adam_rate"] > 0 and "(-)" not in tables[0], tables[0]
    assert (out / "offload_gpu.png").stat().st_size > 0
    assert published() == before, "--smallest wrote bench/results/offload_gpu.md: its numbers are no GPU's"


def test_offload_gpu_needs_cuda():
    p = subprocess.run([sys.executable, "bench/offload_gpu.py", "--smallest"], capture_output=True, text=True, cwd=ROOT,
                       env=dict(os.environ, CUDA_VISIBLE_DEVICES=""), timeout=120)
    assert p.returncode == 2 and "trains on a CUDA GPU" in p.stderr.splitlines()[-1], p.stderr


def test_the_estimator_by_hand():
    """The largest depth of gpt2-xl's width each row trains within made-up budgets (80 GB of device, 100 GB of host,
    40 GB of disk; the activations per layer as a sweep would measure them): the depth fits by the formula and one
    layer more does not, for the reason the row names. Stage 0 holds 16Ψ on the device, offload 2Ψ there and 12Ψ +
    the pinned buffers on the host, the NVMe tier 12Ψ on the disk."""
    sys.path.insert(0, str(ROOT / "bench"))
    import offload_gpu
    from train_gpt import pinned_theory
    cfg = dict(block_size=1024, vocab_size=50257, n_head=25, n_embd=1600)
    other = {"stage0": 250e6, "offload": 100e6}
    est = offload_gpu.Estimator(cfg, dict(device=80e9, host=100e9, disk=40e9), other, 4096)
    psi = est.params
    # gpt2-xl: 48 blocks of 12 x 1600^2 and two LayerNorms, the token and position embeddings, ln_f
    assert psi(48) == 48 * (12 * 1600**2 + 2 * 1600) + 50257 * 1600 + 1024 * 1600 + 1600 == 1_556_764_800
    needs = {"stage0": lambda d: 16 * psi(d) + other["stage0"] * d <= 80e9,
             "offload": lambda d: 2 * psi(d) + other["offload"] * d <= 80e9
             and 12 * psi(d) + pinned_theory("offload", psi(d), 1, 2) <= 100e9,
             "offload_nvme": lambda d: 12 * psi(d) <= 40e9}
    for row, limit in (("stage0", "device memory"), ("offload", "host memory"), ("offload_nvme", "disk")):
        depth, said = est.largest(row)
        assert needs[row](depth) and not needs[row](depth + 1) and said.startswith(limit), (row, depth, said)


def test_overlap_fractions_on_a_made_up_trace(monkeypatch):
    """offload_gpu.overlap on a trace whose answers are known: the gradient copies (40 µs, 30 of them under
    backward's kernels) 75% hidden; the C++ AdamW (130 µs: 30 under forward's kernels, 70 under backward's, 30 under
    the optimizer step's) 100/130 under forward's and backward's, neither phase left out."""
    sys.path.insert(0, str(ROOT / "bench"))
    import offload_gpu
    x = lambda cat, name, ts, dur: dict(ph="X", cat=cat, name=name, ts=ts, dur=dur, pid=0, tid=0, args={})
    events = [x("compute", "forward blocks.0", 0, 100), x("compute", "backward blocks.0", 100, 100),
              x("compute", "optimizer step", 200, 50),
              x("copies", "copy to host", 170, 40), x("copies", "copy to device", 210, 20),
              x("cpu adam", "adam_step", 70, 100), x("cpu adam", "adam_step", 215, 30)]
    monkeypatch.setattr(offload_gpu.timeline, "merge", lambda trace_dir: {"traceEvents": events})
    fractions = offload_gpu.overlap("made up")
    assert fractions["copies"] == pytest.approx(30 / 40), fractions
    assert fractions["cpu adam"] == pytest.approx(100 / 130), fractions


def test_the_table_divides_offload_by_stage0():
    """The sweep's ratio columns are offload / stage 0 (0.50 where offload runs at half stage 0's TFLOP/s), each
    beside its prediction from the measured parts (here: t = 0.1 s a micro-step, AdamW 0.1 s, upload negligible)."""
    sys.path.insert(0, str(ROOT / "bench"))
    import offload_gpu
    size = dict(offload_gpu.SMALLEST, accums=[1])
    sweep = {"stage0.ga1": dict(tflops=100.0, mfu=None, step_s=0.1), "offload.ga1": dict(tflops=50.0, mfu=None, step_s=0.2),
             "offload_dpu.ga1": dict(tflops=80.0, mfu=None, step_s=0.125)}
    result = dict(machine="made up", size=size, psi=10**8, block_size=64, n_embd=64, largest_steps=3, sweep=sweep,
                  largest={}, seconds=0, adam_rate=1e9, link_gb_s=1e9)
    row = next(line for line in offload_gpu.render(result).splitlines() if line.startswith("| 128 | 1 |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    # offload: 0.1 / (0.1 + 0.1); with the DPU: 0.1 / max(0.1, 0.1 + upload)
    assert cells[5] == "0.50 (0.50)" and cells[6] == "0.80 (1.00)", row
