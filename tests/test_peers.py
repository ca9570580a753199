"""bench/peers.py at its smallest size on this CPU: every pair (each stage beside its torch peer: DDP,
DDP + ZeroRedundancyOptimizer, FSDP2 without and with resharding after forward) at N = 2, tiny preset, 2 steps, one
round, as README's command runs them. Each run ends with its summary (the memory meter walks each engine, FSDP2's
DTensors among them), and the table has a ratio and both final losses for every pair. The fake CUDA device runs the
same pairs (tests/test_bench_fake_cuda.py). No assertion depends on the CPU: the ratios are not read, and the losses
of a pair (same weights, data and recipe, two steps) are held to each other, not to a number."""
import re
import subprocess
import sys

from conftest import ROOT, last_lines

sys.path.insert(0, str(ROOT / "bench"))
from peers import PAIRS  # noqa: E402

SMALLEST = ["--preset", "tiny", "--steps", "2", "--rounds", "1", "--batch_size", "4"]


def test_every_pair_runs_on_the_cpu(tmp_path):
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "peers.py"), *SMALLEST, "--outdir", str(tmp_path),
                        "--", "--eval_batches", "1"], capture_output=True, text=True, cwd=ROOT, timeout=600)
    output = "\n".join(last_lines(p.stdout + p.stderr, 40))
    assert p.returncode == 0, f"exit code {p.returncode}:\n{output}"
    # the table's columns by their headers
    header = next(line for line in p.stdout.splitlines() if line.startswith("| pair |"))
    header = [c.strip() for c in header.strip("|").split("|")]
    for pair, (_, _, _, _, label) in PAIRS.items():
        row = [line for line in p.stdout.splitlines() if line.startswith(f"| {label} |")]
        assert len(row) == 1, f"{pair}: no row in the table:\n{output}"
        cells = dict(zip(header, [c.strip() for c in row[0].strip("|").split("|")]))
        assert "failed" not in cells.values() and re.fullmatch(r"\d+\.\d{3}", cells["ours/peer"]), f"{pair}: {row[0]}"
        ours, peer = float(cells["final loss ours"]), float(cells["final loss peer"])
        assert abs(ours - peer) <= 0.02 * peer, f"{pair}: final losses {ours} (ours) and {peer} (peer) apart"
