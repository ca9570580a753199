"""The torch a run gets: one below the floor, or a process group whose AVG does not average (gloo in older torch), is
refused at start with one line that names the fix; the memory meter's scan of live tensors survives any tensor."""
import os
import subprocess
import sys

import pytest
import torch

from conftest import ROOT
from devices import TORCH_FLOOR, torch_too_old
from instruments import live_tensor_bytes

TINY = ["--preset", "tiny", "--steps", "2", "--no_progress", "--sample_chars", "0"]


def test_torch_below_the_floor_refused():
    floor = f"{TORCH_FLOOR[0]}.{TORCH_FLOOR[1]}"
    below = f"{TORCH_FLOOR[0]}.{TORCH_FLOOR[1] - 1}.1+cu126"
    assert f"pip install 'torch>={floor}'" in torch_too_old(below)
    assert "torch >= " + floor in torch_too_old("1.13.1")
    for fine in (f"{floor}.0", f"{floor}.0a0+git1234", "2.15.0", "3.0.0", torch.__version__):
        assert torch_too_old(fine) is None, fine
    assert f"torch >= {floor} " in (ROOT / "requirements.txt").read_text(), "requirements.txt states another floor"


@pytest.mark.parametrize("fault, expected", [
    ("reduce_scatter_sums", "does not average: reduce_scatter(op=AVG) of 1..2 over 2 ranks gave 3, not 1.5"),
    ("all_reduce_refuses", "cannot average (RuntimeError: Cannot use ReduceOp.AVG with Gloo)"),
])
def test_backend_that_does_not_average_refused(fault, expected):
    """torch 2.8's gloo trained stages 1-3 with N times the gradients and exited 0; here that fault (faked by
    tests/broken_avg/sitecustomize.py) stops both ranks before the model is built, with one line, printed once."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", BROKEN_AVG=fault,
               PYTHONPATH=os.pathsep.join([str(ROOT / "tests" / "broken_avg"), str(ROOT)]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(ROOT / "stage2.py"),
           *TINY]
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    lines = [ln for ln in (p.stdout + p.stderr).splitlines() if ln.startswith("error:")]
    assert p.returncode != 0, f"trained with a process group whose AVG does not average:\n{p.stdout[-2000:]}"
    assert len(lines) == 1 and expected in lines[0], f"expected one line with {expected!r}:\n{p.stderr[-3000:]}"
    assert "pip install 'torch>=" in lines[0]
    assert "parameters (Ψ)" not in p.stdout, "the refusal came after the model was built"


def test_live_tensor_scan_survives_a_tensor_without_device():
    """torch 2.8 and 2.9 hold tensors whose .device raises; the gc walk of the memory meter meets them on every rank."""
    class NoDevice(torch.Tensor):
        @property
        def device(self):
            raise RuntimeError("tensor does not have a device")

    cpu = torch.device("cpu")
    before = live_tensor_bytes(cpu)
    odd = torch.Tensor._make_subclass(NoDevice, torch.zeros(4))
    counted = torch.zeros(2**20, dtype=torch.uint8)  # 1 MiB that the scan must still count
    grown = live_tensor_bytes(cpu) - before
    assert 2**20 <= grown < 2**20 + 2**16, grown
    del odd, counted
