"""Every stage on a fake CUDA device (tests/fake_cuda.py), on this CPU machine: each stage file and offload mode, in
fp16 and with gradient accumulation in bf16 (in fp32: test_gpu.py's runs on this device, which a refusal fails too),
trains 2 steps on 2 ranks through its CUDA code paths (nccl's
calls, pinned host buffers, streams, events), and nothing is refused: every op's tensors on one device, every
collective's on the GPU, the C++ AdamW's on the host, and no host synchronisation inside forward or backward
(offload's non_blocking copies into pinned memory are not one). Then the audit itself: copies of stage files with one
line changed to a mistake CUDA would refuse (a reduce-scatter into host memory, a collective on a host tensor, an op
mixing devices, a float() or a blocking copy to the host in backward) must fail it, naming the line and the devices;
and rank 1's in-place all-gather from rank 0's slice of the output, where each rank's own slice passes. Two nodes of
one GPU each: every rank on its node's cuda:0.
No assertion depends on the CPU: no timing, no numbers."""
import json
import re

import pytest

from conftest import ROOT, Runner, last_lines

FAKE_CUDA = str(ROOT / "tests" / "fake_cuda.py")
RUN = ["--preset", "tiny", "--steps", "3", "--eval_batches", "1", "--sample_chars", "0", "--no_progress"]
CONFIGS = {"stage0": ["stage0_ddp.py"], "stage1": ["stage1.py"], "stage2": ["stage2.py"], "stage3": ["stage3.py"],
           "offload": ["offload.py"], "offload_params": ["offload.py", "--offload_params"],
           "delayed_update": ["offload.py", "--delayed_update"]}


def audit(tmp_path, script, *args, grad_accum=1, dtype="fp32", nproc=2, env=None, nodes=1):
    """Train `script` on the fake CUDA device on nproc ranks (over `nodes` nodes); (the finished job, [each rank's
    report or None])."""
    out, batch = tmp_path / "findings", ["--batch_size", str(2 * nproc * grad_accum), "--grad_accum", str(grad_accum)]
    job = Runner(tmp_path).spawn(FAKE_CUDA, nproc, [str(script), *RUN, *batch, "--dtype", dtype, *args],
                                 env={"FAKE_CUDA_FINDINGS": str(out), **(env or {})}, timeout=300, nodes=nodes)
    reports = [json.loads(f.read_text()) if f.exists() else None for f in (out / f"rank{r}.json" for r in range(nproc))]
    return job, reports


def output(job):
    return "\n".join(last_lines(job.stdout + job.stderr, 30))


@pytest.mark.parametrize("grad_accum, dtype", [(2, "bf16"), (1, "fp16")], ids=["bf16_accum2", "fp16"])
@pytest.mark.parametrize("config", list(CONFIGS))
def test_stage_on_fake_cuda(tmp_path, config, grad_accum, dtype):
    """With --grad_accum 2 in bf16, what a GPU with bf16 runs (casts, fp32 master), at once; in fp16, what a V100 or a
    T4 runs (the loss scaled, the scale divided out in the clipping coefficient, fp16 shards into the C++ AdamW)."""
    script, *args = CONFIGS[config]
    job, reports = audit(tmp_path, ROOT / script, *args, grad_accum=grad_accum, dtype=dtype)
    refused = [m for r in reports if r for m in r["findings"]]
    syncs = [m for m in refused if "host sync" in m]
    assert not syncs, f"{config}: the host waits for the GPU inside forward or backward:\n" + "\n".join(syncs)
    assert not refused, f"{config}: CUDA would refuse:\n" + "\n".join(refused)
    assert job.returncode == 0 and all(reports), f"{config}: the run failed:\n{output(job)}"
    for r in reports:  # what was checked: not nothing
        seen = r["seen"]
        assert seen.get("forward ops") and seen.get("backward ops") and seen.get("collectives"), seen
        assert seen.get("device-host copies in batch"), seen  # each batch came up, checked: pinned, non_blocking
        assert not seen.get("compute waits for another stream in forward"), f"{config}: forward stood still: {seen}"
        if script == "offload.py":  # the gradient shards went down, non_blocking into pinned memory, under backward
            assert seen.get("device-host copies in backward") and seen.get("cpu_adam steps"), seen
        if "--offload_params" in args:  # the all-gathers wait for the parameters' copy up: issued on the copy stream
            assert seen.get("collectives issued on another stream"), seen


def changed(tmp_path, name, pattern, *new, after=None):
    """A copy of stage file `name`, alone in tmp_path (train_gpt and the rest come from the repository on PYTHONPATH),
    with the one line that matches the regular expression `pattern` replaced by the lines `new` (which may name its
    groups: \\1), indented as it was; (its path, the first new line's number). With `after` (a pattern of one line), the
    first line matching `pattern` below that line."""
    lines = (ROOT / name).read_text().splitlines(keepends=True)
    at = [i for i, line in enumerate(lines) if re.search(pattern, line)]
    if after is not None:
        start = [i for i, line in enumerate(lines) if re.search(after, line)]
        assert len(start) == 1, f"{name}: {len(start)} lines match {after!r}"
        at = [i for i in at if i > start[0]][:1]
    assert len(at) == 1, f"{name}: {len(at)} lines match {pattern!r}: this test's mistake needs another line to go in"
    indent, match = re.match(r"\s*", lines[at[0]]).group(), re.search(pattern, lines[at[0]])
    lines[at[0]:at[0] + 1] = [indent + match.expand(line) + "\n" for line in new]
    script = tmp_path / "stage" / name
    script.parent.mkdir()
    script.write_text("".join(lines))
    return script, at[0] + 1


def refused(tmp_path, script, *args, grad_accum=1, nproc=1):
    """The findings of a run that must fail the audit (one rank, which starts faster; two where the mistake is in a
    collective: a world of one calls none, comm.py)."""
    job, reports = audit(tmp_path, script, *args, grad_accum=grad_accum, nproc=nproc)
    found = sorted({m for r in reports if r for m in r["findings"]})
    assert job.returncode != 0 and found, f"{script.name}: the audit refused nothing:\n{output(job)}"
    return found


def test_reduce_scatter_into_host_memory(tmp_path):
    """Offload's old mistake: the reduce-scatter's output allocated like the host's gradient shard (empty_like of a
    pinned host tensor: host memory, not even pinned). gloo runs it; NCCL cannot."""
    script, line = changed(tmp_path, "offload.py", re.escape("b.reduced = torch.empty_like(self._my_shard_of(b.grad))"),
                           "b.reduced = torch.empty_like(self.grad_shard[self._shard_range(b)])")
    found = refused(tmp_path, script, nproc=2)
    assert any(re.search(rf"reduce_scatter\w*: output cpu\[\d+\] \(made at offload\.py:{line}\), input cuda\[\d+\]", m)
               for m in found), "\n".join(found)


def test_collective_on_a_host_tensor(tmp_path):
    """The global norm all-reduced from a host copy: a 0-dim host tensor is fine in a kernel, never in NCCL."""
    script, line = changed(tmp_path, "stage1.py", r"comm\.all_reduce\(norm, (op=.*?)\)",
                           r"comm.all_reduce(norm := norm.cpu(), \1)")
    found = refused(tmp_path, script, nproc=2)
    assert any(re.match(rf"stage1\.py:{line} .*c10d all_reduce: tensor cpu\[1\]", m) for m in found), "\n".join(found)


def test_op_mixing_devices(tmp_path):
    """A kernel given a GPU tensor and a host tensor of one element (not 0-dim: no scalar argument): the clipping
    factor, a 0-dim host tensor (the host reads the norm once a step), made 1-dim."""
    script, line = changed(tmp_path, "stage0_ddp.py", r"coef = (clip_coef\(.*\))",
                           r"coef = \1.view(1).clone()")
    found = refused(tmp_path, script)
    assert any(re.search(rf"aten\.mul_?\.Tensor: self cuda\[\d+\], other cpu\[1\] \(made at stage0_ddp\.py:{line}\)", m)
               for m in found), "\n".join(found)


@pytest.mark.parametrize("name, pattern, new, expected", [
    ("stage2.py", r"p\.grad = None", ["float(p.grad.sum())", "p.grad = None"],
     r"host sync in backward: aten\._local_scalar_dense .* of self cuda\[\d+\]"),
    ("offload.py", r"self\.copies\.\w+\((self\.grad_shard\[.*\]), (b\.\w+)\)",  # the gradient down, by Copies
     [r"\1.copy_(\2)"],
     r"host sync in backward: aten\.copy_ blocking to the host, pinned memory: self cpu\(pinned\)"),
], ids=["float_in_a_gradient_hook", "blocking_copy_to_host"])
def test_host_sync_in_backward(tmp_path, name, pattern, new, expected):
    """A float() of a gradient, or a copy to the host that blocks, in backward: the host waits for the GPU."""
    script, line = changed(tmp_path, name, pattern, *new)
    found = refused(tmp_path, script, grad_accum=2)
    assert any(re.match(rf"{re.escape(name)}:{line} .*{expected}", m) for m in found), "\n".join(found)


def test_parameters_come_up_beside_forward(tmp_path):
    """--offload_params: the compute stream waiting for the parameter shard's copy up (as the all-gather must) would
    serialise them; the audit records that wait, so the clean run's check above can fail."""
    script, _ = changed(tmp_path, "offload.py", r"(self\.copies\.copy\(shard, .*\))",
                        r"\1", "torch.cuda.current_stream().wait_stream(self.copies.stream)")
    job, reports = audit(tmp_path, script, "--offload_params", nproc=1)
    assert job.returncode == 0 and reports[0]["seen"].get("compute waits for another stream in forward"), output(job)


def test_a_batch_copied_from_pageable_memory_is_refused(tmp_path):
    """train_gpt's batches go up from pinned memory, non_blocking: from pageable memory the host waits for the copy."""
    script, line = changed(tmp_path, "train_gpt.py", r"return tuple\(t\.pin_memory\(\).*",
                           "return x.to(device), y.to(device)")
    (script.parent / "stage0_ddp.py").write_text((ROOT / "stage0_ddp.py").read_text())  # it imports this train_gpt
    found = refused(tmp_path, script.parent / "stage0_ddp.py")
    assert any(re.match(rf"train_gpt\.py:{line} .*host sync in batch: aten\._to_copy blocking to the device, pageable", m)
               for m in found), "\n".join(found)


def test_no_sample_where_the_whole_model_would_not_fit(tmp_path):
    """The end of a run builds the whole fp32 model on one GPU to print a sample: where it would not fit beside the
    run, the run says so in one line instead of running out of memory at its last line."""
    job, reports = audit(tmp_path / "roomy", ROOT / "stage3.py", nproc=1)  # (no sample: what the run itself takes)
    assert job.returncode == 0, output(job)
    whole = 4 * int(re.search(r"([\d,]+) parameters", job.stdout).group(1).replace(",", ""))  # its fp32 bytes
    budget = reports[0]["memory"]["0"]["peak_reserved"] + whole  # the run fits; the whole model twice does not
    job, _ = audit(tmp_path / "tight", ROOT / "stage3.py", "--sample_chars", "20", nproc=1,
                   env={"FAKE_CUDA_FREE_BYTES": str(budget)})
    assert job.returncode == 0 and "no sample: the whole fp32 model" in job.stdout, output(job)


IN_PLACE_GATHER = """
import os, sys
import torch, torch.distributed as dist
rank = int(os.environ["RANK"])
torch.cuda.set_device(rank)
dist.init_process_group("nccl")
# the input: this rank's slice of the output (NCCL's in-place rule), or rank 0's on every rank
at = rank if sys.argv[1] == "own" else 0
out = torch.zeros(2 * 4, device="cuda")
out[4 * at:4 * at + 4] = rank + 1
dist.all_gather_into_tensor(out, out[4 * at:4 * at + 4])
print("gathered", out.tolist(), flush=True)
dist.barrier()
dist.destroy_process_group()
"""


@pytest.mark.parametrize("slice_of", ["own", "rank 0's"])
def test_an_in_place_all_gather_from_another_ranks_slice_is_refused(tmp_path, slice_of):
    """An in-place all-gather's input is the rank's own slice of the output (at rank x its size): rank 1 gathering
    from rank 0's slice (offset 0 on both ranks) reads what rank 0 sends there; refused, naming the buffers by rank.
    Each rank gathering from its own slice: nothing refused."""
    script = tmp_path / "gather.py"
    script.write_text(IN_PLACE_GATHER)
    out = tmp_path / "findings"
    job = Runner(tmp_path).spawn(FAKE_CUDA, 2, [str(script), "own" if slice_of == "own" else "rank0"],
                                 env={"FAKE_CUDA_FINDINGS": str(out)}, timeout=120)
    reports = [json.loads(f.read_text()) for f in sorted(out.glob("rank*.json"))]
    found = sorted({m for r in reports for m in r["findings"]})
    if slice_of == "own":
        assert job.returncode == 0 and not found, f"each rank's own slice refused:\n{output(job)}"
        assert job.stdout.count("gathered [1.0, 1.0, 1.0, 1.0, 2.0, 2.0, 2.0, 2.0]") == 2, output(job)
        return
    assert job.returncode != 0 and found, f"rank 1's all-gather from rank 0's slice passed:\n{output(job)}"
    # rank 1's input named by where it lies (offset 0), against rank 0's own slice
    own = "input_tensor float32[4] in place: the rank's slice of output_tensor"
    assert any("differs across ranks" in m and own in m and "input_tensor float32[4] made at gather.py:9 +0" in m
               for m in found), "\n".join(found)


def test_two_nodes_each_rank_on_its_nodes_gpu(tmp_path):
    """Two nodes of one GPU each: rank 1 is local rank 0 of the second node, and takes that node's cuda:0 (by its
    rank it would ask for a cuda:1 the node does not have); nothing refused, every rank's memory on cuda:0."""
    job, reports = audit(tmp_path, ROOT / "stage1.py", nproc=2, nodes=2)
    assert job.returncode == 0 and all(reports), f"a two-node launch failed:\n{output(job)}"
    refused = [m for r in reports for m in r["findings"]]
    assert not refused, "CUDA would refuse:\n" + "\n".join(refused)
    for r in reports:
        assert list(r["memory"]) == ["0"] and r["memory"]["0"]["peak"] > 0, (r["rank"], r["memory"])
