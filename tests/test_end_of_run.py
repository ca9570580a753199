"""The end of a run and the host's part in every step. The end: gathering the fp32 master on rank 0 for the sample
(or --save_master) costs the host little beside the run itself (pickled views of each rank's shard would multiply
it: each view pickles its whole storage). Every step: stages 0-3 wait for the GPU once a step (the decision to skip
fp16's overflowed step), offload twice (the gradient shard on the host, the global norm), and read the loss and the
gradient norm for the log only at the steps that log (counted on the fake CUDA device, tests/fake_cuda.py). No
assertion depends on the CPU's speed or math library."""
import os
import subprocess
import sys
import tempfile
import time

import pytest

from conftest import ROOT, Runner, last_lines
from devices import free_port


def peak_rss(tmp_path, script, nproc, *args):
    """Run `script` on nproc ranks (as torchrun would on one node); (each rank's peak resident memory in bytes, output).
    os.wait4 reads each rank's own peak as the kernel counted it."""
    port, procs, out = free_port(), [], tempfile.TemporaryFile("w+")
    for rank in range(nproc):
        env = dict(Runner(tmp_path).env(), RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc),
                   LOCAL_WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append(subprocess.Popen([sys.executable, str(ROOT / script), *args], stdout=out, stderr=out, cwd=ROOT,
                                      env=env))
    peaks, codes, deadline = {}, {}, time.monotonic() + 600
    while len(peaks) < nproc:
        for p in procs:
            if p.pid not in peaks:
                pid, status, usage = os.wait4(p.pid, os.WNOHANG)
                if pid:
                    peaks[p.pid] = usage.ru_maxrss * 1024  # (Linux counts it in KiB)
                    codes[p.pid] = os.waitstatus_to_exitcode(status)
        if any(codes.values()) or time.monotonic() > deadline:
            for p in procs:  # a failed rank leaves the others waiting in a collective: stop them
                if p.pid not in peaks:
                    p.kill()
        time.sleep(0.05)
    out.seek(0)
    text = "\n".join(last_lines(out.read(), 25))
    assert not any(codes.values()), f"the run failed ({codes}):\n{text}"
    return [peaks[p.pid] for p in procs], text


@pytest.mark.parametrize("script, nproc", [("stage1.py", 2), ("offload.py", 1)])
def test_the_sample_at_the_end_costs_little_host_memory(tmp_path, script, nproc):
    """stage1 on 2 ranks, and offload (whose master is on the host) on 1; the `small` GPT (~10M parameters: a 43 MB
    fp32 master), fp32, 2 steps of 4 sequences: the peak resident memory of each rank with the end-of-run sample
    (which gathers the whole fp32 master on rank 0) against the same run without it. The gathered master is 43 MB;
    pickled as views of the shards, it would make rank 0's peak several times the run's. A batch of 4, not the
    preset's 16: the activations of 16 sequences raise the run's peak above what its end costs, and would hide part
    of it (on a 2-core AMD EPYC Zen 3, rank 0's ratio was 1.08 for stage1 and 0.90 for offload at 16, 1.25 and 1.21
    at 4; the master pickled as views: 4.4 and 6.1 at 16, 6.9 and 10.4 at 2)."""
    run = ["--preset", "small", "--steps", "2", "--batch_size", "4", "--dtype", "fp32", "--eval_batches", "1",
           "--no_progress"]
    without, _ = peak_rss(tmp_path, script, nproc, *run, "--sample_chars", "0")
    sampled, text = peak_rss(tmp_path, script, nproc, *run, "--sample_chars", "20")
    assert "--- sample ---" in text, text
    for rank, (a, b) in enumerate(zip(without, sampled)):
        assert b <= 1.5 * a, (f"{script}, rank {rank}: peak resident memory {b / 2**20:.0f} MiB with the sample, "
                              f"{a / 2**20:.0f} MiB without: the end of the run multiplies the host's memory")


@pytest.mark.parametrize("script, most, steps", [("stage1.py", 1, 20), ("stage3.py", 1, 20), ("offload.py", 1, 6),
                                                 ("offload.py --delayed_update", 0, 6)])
def test_one_host_sync_per_step(tmp_path, script, most, steps):
    """On the fake CUDA device (N = 2, fp32), the host synchronisations outside forward, backward and the batches:
    inside each optimizer step at most one (clip_coef's: skip the step or not; offload's read of the norm also finds
    its gradient shard on the host, the compute stream having waited for the copies); two more at each step that
    logs (every steps // 10th: the losses and the norms since the last, read at once), and a few more at the run's
    start, its evaluation, its measured step and its end, besides those of its object collectives (all_gather_object
    and the like, which NCCL runs through the device: their bytes copied up and down); never the loss's and the
    norm's at every step. (Offload runs 6 steps: the count inside each step needs no more.) With --delayed_update none
    inside a step: the update's thread waits for the gradient and reads the norm, and its waits are counted apart."""
    from test_fake_cuda import audit
    script, *options = script.split()
    job, reports = audit(tmp_path, ROOT / script, *options, "--steps", str(steps), "--eval_every", "1000")
    assert job.returncode == 0 and all(reports), "\n".join(last_lines(job.stdout + job.stderr, 30))
    logged = steps // max(1, steps // 10)  # the steps that log: every max(1, steps // 10)th; the last is one of them
    for r in reports:
        in_step = r["seen"].get("most host syncs in one step", 0)
        assert in_step <= most, f"{script}, rank {r['rank']}: {in_step} host syncs in one optimizer step, not {most}"
        syncs = r["seen"].get("host syncs in the rest", 0) - r["seen"].get("host syncs in object collectives", 0)
        assert syncs <= most * steps + 2 * logged + 20, (f"{script}, rank {r['rank']}: {syncs} host syncs in {steps} "
                                                         f"steps ({logged} of them logged): more than {most} a step")
        if options:  # the update's thread waited for each step's gradient (counted: so a wait seen nowhere fails)
            threads = r["seen"].get("host syncs in other threads", 0)
            assert threads >= steps - 1, f"{script} {options}: {threads} host syncs in the update's thread"
