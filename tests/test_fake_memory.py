"""The fake CUDA device's memory model (tests/fake_memory.py): device blocks rounded as CUDA's caching allocator rounds
them, cached until empty_cache; pinned host blocks rounded to a power of two and reused as torch's host allocator
reuses them; a free budget per rank, past which an allocation raises torch.cuda.OutOfMemoryError naming the line. The
model is driven directly here (its own state, reloaded per test), and once through a run on two ranks."""
import importlib
import re

import pytest
import torch

import fake_memory
from conftest import ROOT, Runner
from test_fake_cuda import audit, output

MiB = 2**20


@pytest.fixture
def fm(monkeypatch):
    monkeypatch.delenv("FAKE_CUDA_FREE_BYTES", raising=False)
    return importlib.reload(fake_memory)


def storage(nbytes):
    return torch.empty(nbytes, dtype=torch.uint8).untyped_storage()


def test_device_blocks_round_and_stay_reserved(fm):
    small = storage(1)
    fm.allocated(small, "cuda:0", "here:1")
    m = fm.memory(0)
    assert (m.allocated, m.reserved) == (512, 2 * MiB)  # a 512-byte block, in a 2 MiB segment of the small pool
    large = storage(MiB + 1)
    fm.allocated(large, "cuda:0", "here:2")
    assert (m.allocated, m.reserved, m.peak) == (512 + MiB + 512, 4 * MiB, 512 + MiB + 512)
    del large
    assert (m.allocated, m.reserved, m.peak) == (512, 4 * MiB, 512 + MiB + 512)  # freed: cached, still reserved
    fm.reset_peak(0)
    fm.empty_cache()
    assert (m.peak, m.reserved, fm.mem_get_info(0)) == (512, 2 * MiB, (fm.BUDGET - 2 * MiB, fm.BUDGET))
    del small
    assert m.allocated == 0


def test_pinned_blocks_are_powers_of_two_and_cached(fm):
    a = storage(3000)
    fm.allocated(a, "pinned", "here:1")
    s = fm.host_memory_stats()
    assert (s["allocated_bytes.current"], s["active_bytes.current"], s["num_host_alloc"]) == (4096, 4096, 1)
    del a
    s = fm.host_memory_stats()
    assert (s["allocated_bytes.current"], s["active_bytes.current"]) == (4096, 0)  # kept, cached
    b = storage(2049)
    fm.allocated(b, "pinned", "here:2")  # a request of the same block size takes the cached block
    s = fm.host_memory_stats()
    assert (s["allocated_bytes.current"], s["active_bytes.current"], s["num_host_alloc"]) == (4096, 4096, 1)
    del b
    fm.empty_cache()
    assert fm.host_memory_stats()["allocated_bytes.current"] == 0


def test_out_of_memory_past_a_rank_budget(fm, monkeypatch):
    monkeypatch.setenv("FAKE_CUDA_FREE_BYTES", "1e9,3e6")  # rank 1 has less free memory than rank 0
    assert fm.mem_get_info(0) == (10**9, 10**9) and fm.mem_get_info(1) == (3 * 10**6, 3 * 10**6)
    kept = storage(MiB)
    fm.allocated(kept, "cuda:1", "here:1")
    fm.allocated(storage(2 * MiB), "cuda:0", "here:2")  # rank 0's budget holds it
    with pytest.raises(torch.cuda.OutOfMemoryError, match=r"^CUDA out of memory\. Tried to allocate 2\.00 MiB\. GPU 1 "
                       r"has a total capacity of 2\.86 MiB of which 881\.69 KiB is free\..*asked at here:3"):
        fm.allocated(storage(2 * MiB), "cuda:1", "here:3")
    assert fm.memory(1).allocated == MiB  # the refused block was not counted


def test_the_job_ends_when_any_rank_fails(tmp_path):
    """The harness stops a job as torchrun does: when rank 1 fails first, at once, with rank 1's exit code (not when
    rank 0, waiting in a collective, would time out: the test below would wait a minute for it)."""
    script = tmp_path / "ranks.py"
    script.write_text("import os, sys, time\n"
                      "if os.environ['RANK'] == '1':\n    sys.exit(3)\n"
                      "time.sleep(120)\nprint('rank 0 finished')\n")
    job = Runner(tmp_path).spawn(str(script), 2, [], timeout=60)
    assert job.returncode == 3 and "rank 0 finished" not in job.stdout, (job.returncode, job.stdout, job.stderr)


def test_a_run_out_of_memory_on_one_rank(tmp_path):
    """Two ranks, rank 1 with 3 MB free: it runs out of memory at the first line that needs more, and names it."""
    job, _ = audit(tmp_path, ROOT / "stage2.py", env={"FAKE_CUDA_FREE_BYTES": "1e10,3e6"})
    text = job.stdout + job.stderr
    assert job.returncode != 0 and "OutOfMemoryError: CUDA out of memory" in text, output(job)
    assert re.search(r"GPU 1 has a total capacity of 2\.86 MiB .*asked at \w+\.py:\d+", text), output(job)
