"""The fake CUDA device's stream model (tests/fake_streams.py) and its check of collective sequences, each shown to
catch one planted mistake: a copy of a stage file with one line changed, trained on the fake device, must fail naming
the line where the unordered access (or the mismatched collective, or the free) happens, and the line it races with.

    planted (offload.py unless named)                          caught by
    Copies.copy without wait_stream                            the copy reads the reduce-scatter's output unordered
    Copies.copy without record_stream                          the device buffer freed while the copy stream reads it
    compute_waits without wait_event (the update's copies up)  the next all-gather reads parameters the copy writes
    step without the host's wait for the gradients' event      the host reads the pinned gradient shard unordered
    --delayed_update without the wait after the copies up      the next update rewrites staging under the copy
    the global norm's all-reduce on rank 0 only (N = 2)        the collective sequences differ across ranks
    stage1.py: the norm all-reduced at another size on rank 1  the collective sequences differ across ranks
One rank each, but the collective mismatches (two). No assertion depends on the CPU: no timing, no numbers."""
import re

import pytest

from conftest import ROOT
from test_fake_cuda import audit, changed, output

COPY_LINE = r"dst\.copy_\(src, non_blocking=True\)"  # Copies.copy's copy, on the copy stream
BATTERY = {  # id: (file, the line's pattern, its replacement, flags, nproc, (line pattern, what the finding says))
    "missing_wait_stream": (
        "offload.py", r"self\.stream\.wait_stream\(torch\.cuda\.current_stream\(\)\)", ["pass  # no wait_stream"], [], 1,
        (COPY_LINE, r"stream order: aten\.copy_ on the stream made at offload\.py:\d+: touches memory that the nccl "
                    r"stream wrote in c10d reduce_scatter\w* at offload\.py:\d+")),
    "missing_record_stream": (
        "offload.py", r"t\.record_stream\(self\.stream\)", ["pass  # no record_stream"], [], 1,
        (r"b\.grad = b\.reduced = b\.work = None", r"stream order: memory freed: the stream made at offload\.py:\d+ "
                                                   r"may still use it \(aten\.copy_ at offload\.py:\d+\)")),
    "missing_wait_event": (
        "offload.py", r"torch\.cuda\.current_stream\(\)\.wait_event\(event\)", ["pass  # no wait_event"], ["--steps", "3"], 1,
        (r"b\.gather = comm\.all_gather\(b\.param, self\.param_shard", r"stream order: c10d all_gather\w* on the nccl "
         r"stream: touches memory that the stream made at offload\.py:\d+ wrote in aten\.copy_ at offload\.py:\d+")),
    "host_reads_pinned_before_event": (
        "offload.py", r"self\.copies\.host_waits\(self\.grads_on_host\)", ["pass  # no host_waits"], [], 1,
        (r"self\.adam\.adam_step\(self\.master", r"stream order: cpu_adam\.adam_step on the host: touches memory that "
                                                 r"the stream made at offload\.py:\d+ wrote in aten\.copy_")),
    "staging_reused_under_its_copy": (
        "offload.py", r"self\.copies\.host_waits\(self\.copies\.event\(\)\)  # for the next forward",
        ["pass  # no host_waits"], ["--delayed_update"], 1,
        (r"self\.adam\.adam_step\(self\.master", r"stream order: cpu_adam\.adam_step on the host: touches memory that "
                                                 r"the stream made at offload\.py:\d+ reads in aten\.copy_")),
    "collective_on_rank0_only": (
        "offload.py", r"(comm\.all_reduce\(norm, op=dist\.ReduceOp\.SUM\))", ["if self.rank == 0:", r"    \1"], [], 2,
        (r"    comm\.all_reduce\(norm", r"c10d all_reduce: collective #\d+ differs across ranks: rank \d all_\w+\(")),
    "collective_size_differs": (
        "stage1.py", r"(comm\.all_reduce\(norm, op=dist\.ReduceOp\.SUM\))", ["norm = norm.repeat(1 + self.rank)", r"\1"],
        [], 2,
        (r"comm\.all_reduce\(norm", r"c10d all_reduce: collective #\d+ differs across ranks: rank \d all_reduce\(tensor "
                                    r"float\d+\[\d\]\), rank \d all_reduce\(tensor float\d+\[\d\]\) at stage1\.py:\d+")),
}


@pytest.mark.parametrize("mistake", list(BATTERY))
def test_planted_stream_mistake_is_refused(tmp_path, mistake):
    name, pattern, new, flags, nproc, (at, expected) = BATTERY[mistake]
    script, planted = changed(tmp_path, name, pattern, *new)
    lines = script.read_text().splitlines()
    at_lines = [i + 1 for i, text in enumerate(lines) if re.search(at, text)]
    assert len(at_lines) == 1, f"{mistake}: {len(at_lines)} lines of {name} match {at!r}: update this test"
    line = at_lines[0]
    job, reports = audit(tmp_path, script, *flags, nproc=nproc, env={"FAKE_CUDA_COLLECTIVE_TIMEOUT": "30"})
    found = sorted({m for r in reports if r for m in r["findings"]})
    assert job.returncode != 0 and found, f"{mistake}: planted at {name}:{planted}, refused nothing:\n{output(job)}"
    caught = [m for m in found if re.match(rf"{re.escape(name)}:{line}\b.*{expected}", m)]
    print(f"planted {mistake} at {name}:{planted} ({new[0]!r}); caught: {caught[:1]}")
    assert caught, f"{mistake}: planted at {name}:{planted}, expected at {name}:{line}: {expected}\n" + "\n".join(found)
