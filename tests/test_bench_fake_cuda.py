"""The bench scripts on the fake CUDA device (tests/fake_cuda.py), on this CPU machine: bench/largest.py --quick,
bench/compare.py and bench/peers.py at N = 2, as a GPU owner runs them (--device cuda), each stage process they start
on the fake device (tests/fake_cuda_site/sitecustomize.py installs it in every Python process that runs a script,
FAKE_CUDA=2 GPUs). Each ends with exit code 0 and its table, and no process reports a finding: every op's tensors on
one device, every collective's on the GPU and the same on both ranks, no host sync in a batch's copy up, no
stream-order mistake, no device memory past a rank's budget (FAKE_CUDA_FREE_BYTES). bench/largest.py also with one
rank's free memory far below the other's: the ranks agree on every decision (a collective that differs between them
is a finding) and the search ends with its row. No assertion depends on the CPU: no timing, no numbers beyond the
rows' agreement."""
import json
import os
import re
import subprocess
import sys


from conftest import ROOT, last_lines

sys.path.insert(0, str(ROOT / "bench"))
from peers import PAIRS  # noqa: E402

SITE = str(ROOT / "tests" / "fake_cuda_site")


def on_fake_cuda(tmp_path, script, *args, free_bytes=None):
    """`python script args` with the fake device in it and in every process it starts; (the finished process, each
    process's report: {path under the findings folder: report})."""
    findings = tmp_path / "findings"
    env = dict(os.environ, FAKE_CUDA="2", FAKE_CUDA_FINDINGS=str(findings),
               PYTHONPATH=os.pathsep.join(p for p in (SITE, os.environ.get("PYTHONPATH")) if p))
    env.pop("FAKE_CUDA_FREE_BYTES", None)
    if free_bytes:
        env["FAKE_CUDA_FREE_BYTES"] = free_bytes
    p = subprocess.run([sys.executable, str(ROOT / script), *args], capture_output=True, text=True, cwd=ROOT,
                       env=env, timeout=300)
    reports = {str(f.relative_to(findings)): json.loads(f.read_text()) for f in findings.rglob("rank*.json")}
    return p, reports


def check(p, reports, ranks):
    """Exit 0, no finding in any process, and `ranks` processes that ran collectives (each stage's ranks)."""
    output = "\n".join(last_lines(p.stdout + p.stderr, 30))
    refused = [f"{path}: {m}" for path, r in reports.items() for m in r["findings"]]
    assert not refused, "CUDA would refuse:\n" + "\n".join(refused) + "\n" + output
    assert p.returncode == 0, f"exit code {p.returncode}:\n{output}"
    ran = [path for path, r in reports.items() if r["seen"].get("collectives")]
    assert len(ran) == ranks, f"{len(ran)} processes ran on the fake device, not {ranks}: {sorted(reports)}"


def test_largest_quick_at_n2(tmp_path):
    """Every stage's search at N = 2 (--quick's width, within a quarter of its budget: fewer layers to probe; each
    stage still probes a depth that fits and one that does not)."""
    out = tmp_path / "out"
    p, reports = on_fake_cuda(tmp_path, "bench/largest.py", "--quick", "--budget_mb", "6", "--world_sizes", "2",
                              "--device", "cuda", "--out_dir", str(out))
    check(p, reports, ranks=2)
    rows = json.loads((out / "largest.json").read_text())["rows"]
    assert [(r["stage"], r["device"]) for r in rows] == [(s, "cuda") for s in
                                                         ("stage0", "stage1", "stage2", "stage3", "offload")], rows
    assert all(r["largest_layers"] > 0 for r in rows), rows
    assert (out / "table.md").exists()


def test_largest_with_one_rank_short_of_memory(tmp_path):
    """Rank 1 has 102 MiB free (38 MiB once the warm-up's two cuBLAS workspaces, 32 MiB each, hold theirs), rank 0
    56 GiB: the ranks take the lower reading and every verdict together, and the
    search ends with its row. Each probe's engine must be let go of before the next: held (its gradient hooks keep it
    alive), a probe that no longer fits leaves its states on rank 1, whose next, smaller probe then runs out of memory
    in the engine, where rank 0 waits for it in a collective, and the run stops."""
    out = tmp_path / "out"
    p, reports = on_fake_cuda(tmp_path, "bench/largest.py", "--quick", "--world_sizes", "2", "--stages", "stage3",
                              "--device", "cuda", "--out_dir", str(out), free_bytes="6e10,1.07e8")
    check(p, reports, ranks=2)
    rows = json.loads((out / "largest.json").read_text())["rows"]
    assert len(rows) == 1 and rows[0]["largest_layers"] > 0, rows


def test_compare_at_n2(tmp_path):
    """Every stage at N = 2 on a 2-layer GPT, 3 steps (its smallest run), --device cuda passed to every run."""
    out = tmp_path / "out"
    p, reports = on_fake_cuda(tmp_path, "bench/compare.py", "--nproc", "2", "--steps", "3", "--n_layer", "2",
                              "--out_dir", str(out), "--", "--device", "cuda")
    check(p, reports, ranks=2 * 5)
    assert "| offload | 2 |" in (out / "table.md").read_text()
    for stage in ("stage0", "stage1", "stage2", "stage3", "offload"):
        assert json.loads((out / f"{stage}_n2.json").read_text())["device"] == "cuda", stage


def test_peers_at_n2(tmp_path):
    """Every pair of bench/peers.py at its smallest size (tiny preset, 2 steps, one round) with --device cuda: each
    stage and its torch peer (DDP, whose C++ Reducer makes its buckets; ZeroRedundancyOptimizer; FSDP2, whose
    all-gathers run in place, its input each rank's own slice of the output, on streams of its own) refused nothing,
    and the table has every pair's ratio."""
    out = tmp_path / "out"
    p, reports = on_fake_cuda(tmp_path, "bench/peers.py", "--preset", "tiny", "--steps", "2", "--rounds", "1",
                              "--batch_size", "4", "--outdir", str(out), "--", "--eval_batches", "1",
                              "--device", "cuda")
    check(p, reports, ranks=2 * 8)
    for _, peer, _, _, label in PAIRS.values():
        assert json.loads((out / f"r0_{peer_pair(peer)}_peer.json").read_text())["device"] == "cuda", peer
        assert re.search(rf"^\| {re.escape(label)} \| [\d,]+ \| [\d,]+ \| \d+\.\d{{3}} \|", p.stdout, re.M), label


def peer_pair(peer):
    """The pair whose peer is `peer` (bench/peers.py names each run's files after its pair)."""
    return next(pair for pair, (_, name, _, _, _) in PAIRS.items() if name == peer)


# bench/timeline.py at N = 2 on the fake device is a step of tests/gpu_check.sh (tests/test_gpu_check.py).
