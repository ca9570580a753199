"""The fake CUDA device held to a real GPU: tests/gpu_facts.py, the probes that read the CUDA facts the fake device
models off a GPU, run on the fake device (tests/fake_cuda.py), and each figure compared with the one an H200 gave
(tests/gpu_facts_h200.json: the machine, torch and date beside them). Where they differ, the fake device's model is
wrong: cuBLAS's workspaces (32 MiB per handle and stream, in memory_allocated, three in a forward and backward with a
side stream: the bytes PeakMemory takes out of the peak), resize_(0)'s free, zeros_like of a pinned tensor (not
pinned), which copies down return before they land (pinned) and which constructors sync (torch.tensor(x).to(cuda)
once, torch.full never), and the stream a collective's kernels run on (not the current one). What the fake device does
not model is listed in the file, and not compared. One process on the fake device, about 10 s; no assertion depends
on the CPU (the probes' figures are the fake device's model, not the host's speed)."""
import json
import os
import subprocess
import sys

from conftest import ROOT, last_lines
from devices import free_port

H200 = json.loads((ROOT / "tests" / "gpu_facts_h200.json").read_text())
MIB = 2**20


def test_fake_device_agrees_with_the_h200(tmp_path):
    out = tmp_path / "facts.json"
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    p = subprocess.run([sys.executable, str(ROOT / "tests" / "fake_cuda.py"), str(ROOT / "tests" / "gpu_facts.py"),
                        str(out)], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)
    assert p.returncode == 0 and out.exists(), "\n".join(last_lines(p.stdout + p.stderr, 30))
    fake = json.loads(out.read_text())
    errors = {name: v["error"].splitlines()[-1] for name, v in fake.items() if isinstance(v, dict) and "error" in v}
    assert set(errors) <= {"environment"}, f"probes that failed on the fake device: {errors}"
    disagree = []

    def held(fact, h200, ours):
        if h200 != ours:
            disagree.append(f"{fact}: the H200 {h200!r}, the fake device {ours!r}")

    for key, value in H200["matmul_workspace"].items():
        held(f"matmul_workspace.{key}", value, fake["matmul_workspace"][key])
    # the probe frees a 1 MiB-element fp32 tensor's storage: at once, memory_allocated drops by its 4 MiB
    held("resize_to_zero.frees_at_once", H200["resize_to_zero"]["frees_at_once"],
         fake["resize_to_zero"]["allocated_drop_bytes"] == 4 * MIB)
    for key, value in H200["pinned_and_syncs"].items():
        held(f"pinned_and_syncs.{key}", value, fake["pinned_and_syncs"][key])
    for key, value in H200["thread_copy"].items():
        held(f"thread_copy.{key}", value, fake["thread_copy"][key])
    current = fake["nccl_stream"]["current_stream"]
    held("nccl_stream.current_stream", H200["nccl_stream"]["current_stream"], current)
    collective = {stream for name, stream in fake["nccl_stream"]["kernels_and_streams"] if name.startswith("c10d::")}
    held("nccl_stream: a collective's kernels on another stream than the current one",
         H200["nccl_stream"]["collective_stream"] != H200["nccl_stream"]["current_stream"],
         bool(collective) and current not in collective)
    assert not disagree, "the fake device's model disagrees with the H200:\n" + "\n".join(disagree)
