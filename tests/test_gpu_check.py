"""tests/gpu_check.sh, the command for the minutes a GPU is lent, end to end on this machine without one: the steps
that need a real GPU say "skipped" with the reason, and the others pass, on the fake CUDA device where they touch
CUDA. Its timeline steps are bench/timeline.py's check on the fake device: one traced step of stage 3 (gathers in
flight under compute) and of offload (its copies, named by their direction, and C++ AdamW) at N = 2 on a 2-layer
GPT, every process on the fake device (tests/fake_cuda_site), no process reporting a finding."""
import json
import os
import subprocess

from conftest import ROOT

STEPS = ["env", "facts", "cpu_adam", "first", "offload_gpu", "suite", "overlap", "timeline_stage3", "timeline_offload",
         "repeat"]
NEED_A_GPU = ["first", "repeat", "overlap", "offload_gpu"]


def test_gpu_check_without_a_gpu(tmp_path):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    p = subprocess.run(["bash", str(ROOT / "tests" / "gpu_check.sh"), str(tmp_path)], capture_output=True, text=True,
                       cwd=ROOT, env=env, timeout=1200)
    summary = (tmp_path / "summary.txt").read_text().splitlines()
    assert p.returncode == 0, "\n".join(summary) + "\n" + p.stdout[-3000:] + p.stderr[-2000:]
    assert [line.split(":")[0] for line in summary] == STEPS, summary
    for line in summary:
        name = line.split(":")[0]
        expected = "skipped (no CUDA GPU" if name in NEED_A_GPU else "ok (exit 0"
        assert expected in line, f"{line}\n--- {name}.log ---\n{(tmp_path / f'{name}.log').read_text()[-2000:]}"
    assert json.loads((tmp_path / "facts.json").read_text()) == {"cuda": False}
    assert " passed" in (tmp_path / "suite.log").read_text()
    reports = [json.loads(f.read_text()) for f in (tmp_path / "fake_findings").rglob("rank*.json")]
    refused = [m for r in reports for m in r["findings"]]
    assert not refused, "CUDA would refuse:\n" + "\n".join(refused)
    assert sum(1 for r in reports if r["seen"].get("collectives")) == 2 * 2, "each timeline's 2 ranks on the fake device"
    for name in ("timeline_stage3", "timeline_offload"):
        trace = json.loads((tmp_path / name / "trace.json").read_text())
        for rank in (0, 1):
            seen = {e["name"].split()[0] for e in trace["traceEvents"] if e.get("ph") == "X" and e["pid"] == rank}
            assert {"forward", "backward", "all_gather"} <= seen, f"{name}, rank {rank}: {sorted(seen)}"
        assert (tmp_path / name / "timeline.png").exists()
        assert "overlapped by compute" in (tmp_path / f"{name}.log").read_text()
    # offload's copies named by where they go: the gradient shards down in backward, then the updated parameters up
    trace = json.loads((tmp_path / "timeline_offload" / "trace.json").read_text())
    for rank in (0, 1):
        copies = sorted((e["ts"], e["name"]) for e in trace["traceEvents"]
                        if e.get("ph") == "X" and e["pid"] == rank and e["cat"] == "copies")
        names = [n for _, n in copies]
        assert set(names) == {"copy to host", "copy to device"} and names == sorted(names, reverse=True), (
            f"offload, rank {rank}: its copies in order {names}: the gradients go to the host before the parameters "
            "come up")
