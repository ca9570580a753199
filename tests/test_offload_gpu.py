"""bench/offload_gpu.py, the ZeRO-Offload paper's headline on one GPU, at its smallest size (--smallest: the tiny GPT)
on the fake CUDA device, every process it starts on it (tests/fake_cuda_site): each run finishes with no finding,
and the page has its three tables with a row per grad_accum, per offload run and per largest model, each largest
model confirmed by its run; the picture is drawn, and nothing goes to bench/results/ (no GPU ran it). Without CUDA it
stops with one line. The table's shape is checked, not its numbers: they are no GPU's."""
import json
import os
import subprocess
import sys

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
        assert all(0 <= result["sweep"][name][row] <= 1 for row in ("copies", "cpu adam")), result["sweep"][name]
    assert list(result["largest"]) == ["stage0", "offload", "offload_nvme"], result["largest"]
    assert all(r["layers"] > 0 and r["tflops"] > 0 for r in result["largest"].values()), result["largest"]
    page = (out / "offload_gpu.md").read_text()
    tables = [block for block in page.split("\n\n") if block.startswith("| ")]
    assert [len(t.splitlines()) - 2 for t in tables] == [len(accums), 2 * len(accums), 3], page
    assert (out / "offload_gpu.png").stat().st_size > 0
    assert published() == before, "--smallest wrote bench/results/offload_gpu.md: its numbers are no GPU's"


def test_offload_gpu_needs_cuda():
    p = subprocess.run([sys.executable, "bench/offload_gpu.py", "--smallest"], capture_output=True, text=True, cwd=ROOT,
                       env=dict(os.environ, CUDA_VISIBLE_DEVICES=""), timeout=120)
    assert p.returncode == 2 and "trains on a CUDA GPU" in p.stderr.splitlines()[-1], p.stderr
