"""The fake CUDA device's stream model (tests/fake_streams.py) and its check of collective sequences, each shown to
catch one planted mistake: a copy of a stage file with one line changed, trained on the fake device, must fail naming
the line where the unordered access (or the mismatched collective, or the free) happens, and the line it races with.

    planted (offload.py unless named)                          caught by
    Copies.copy without wait_stream                            the copy reads the reduce-scatter's output unordered
    Copies.copy without record_stream                          the device buffer freed while the copy stream reads it
    compute_waits without wait_event (the update's copies up)  the next all-gather reads parameters the copy writes
      (step without its one compute_waits call: the same mistake)
    step without the host's wait for the gradients' event      the host reads the pinned gradient shard unordered
      (Copies.host_waits without event.synchronize(): the same, found at the same line first)
    --delayed_update without the wait after the copies up      the next update rewrites staging under the copy
    _use without b.gather.wait()                               forward reads parameters the all-gather writes
    _release without b.work.wait()                             the copy reads the reduce-scatter's output unordered
    the global norm's all-reduce on rank 0 only (N = 2)        the collective sequences differ across ranks
    stage1.py: the norm all-reduced at another size on rank 1  the collective sequences differ across ranks
One rank each, but the collective mismatches (two). No assertion depends on the CPU: no timing, no numbers."""
import re

import pytest

from conftest import ROOT
from test_fake_cuda import audit, changed, output

COPY = r"at offload\.py:\d+"  # a call site
COPY_STREAM = r"the stream made at offload\.py:\d+"  # Copies' copy stream, named by where it was made
# each: the file, its one line to change (a pattern) and the lines put there, the run's options and ranks; then the
# line the finding must name (a pattern, in the changed file) and what it must say there
BATTERY = {
    "missing_wait_stream": dict(
        file="offload.py", line=r"self\.stream\.wait_stream\(torch\.cuda\.current_stream\(\)\)",
        new=["pass  # no wait_stream"], flags=[], nproc=1,
        at=r"dst\.copy_\(src, non_blocking=True\)",
        says=rf"stream order: aten\.copy_ on {COPY_STREAM}: touches memory that the nccl stream wrote in "
             rf"c10d reduce_scatter\w* {COPY}"),
    "missing_record_stream": dict(
        file="offload.py", line=r"t\.record_stream\(self\.stream\)", new=["pass  # no record_stream"],
        flags=[], nproc=1,
        at=r"b\.grad = b\.reduced = b\.work = None",
        says=rf"stream order: memory freed: {COPY_STREAM} may still use it \(aten\.copy_ {COPY}\)"),
    "missing_wait_event": dict(  # 3 steps: the ledger's synchronize() after the measured step 1 would cover for it
        file="offload.py", line=r"torch\.cuda\.current_stream\(\)\.wait_event\(event\)", new=["pass  # no wait_event"],
        flags=["--steps", "3"], nproc=1,
        at=r"b\.gather = comm\.all_gather\(b\.param, self\.param_shard",
        says=rf"stream order: c10d all_gather\w* on the nccl stream: touches memory that {COPY_STREAM} wrote in "
             rf"aten\.copy_ {COPY}"),
    "host_reads_pinned_before_event": dict(
        file="offload.py", line=r"self\.copies\.host_waits\(self\.grads_on_host\)", new=["pass  # no host_waits"],
        flags=[], nproc=1,
        at=r"self\.adam\.adam_step\(self\.master",
        says=rf"stream order: cpu_adam\.adam_step on the host: touches memory that {COPY_STREAM} wrote in aten\.copy_"),
    "staging_reused_under_its_copy": dict(
        file="offload.py", line=r"self\.copies\.host_waits\(self\.copies\.event\(\)\)  # for the next forward",
        new=["pass  # no host_waits"], flags=["--delayed_update"], nproc=1,
        at=r"self\.adam\.adam_step\(self\.master",
        says=rf"stream order: cpu_adam\.adam_step on the host: touches memory that {COPY_STREAM} reads in aten\.copy_"),
    "gather_not_waited": dict(
        file="offload.py", line=r"^\s*b\.gather\.wait\(\)$", new=["pass  # no wait"], flags=[], nproc=1,
        at_file="train_gpt.py", at=r"x = x \+ self\.attn\(self\.ln_1\(x\)\)",
        says=rf"stream order: aten\.native_layer_norm on the compute stream: touches memory that the nccl stream wrote "
             rf"in c10d all_gather\w* {COPY}"),
    "reduce_scatter_not_waited": dict(
        file="offload.py", line=r"b\.work\.wait\(\)", new=["pass  # no wait"], flags=[], nproc=1,
        at=r"dst\.copy_\(src, non_blocking=True\)",
        says=r"stream order: aten\.copy_ on the stream made at offload\.py:\d+: touches memory that the nccl stream "
             r"wrote in c10d reduce_scatter"),
    "collective_on_rank0_only": dict(
        file="offload.py", line=r"(comm\.all_reduce\(norm, op=dist\.ReduceOp\.SUM\))",
        new=["if self.rank == 0:", r"    \1"], flags=[], nproc=2,
        at=r"    comm\.all_reduce\(norm",
        says=r"c10d all_reduce: collective #\d+ differs across ranks: rank \d all_\w+\("),
    "collective_size_differs": dict(
        file="stage1.py", line=r"(comm\.all_reduce\(norm, op=dist\.ReduceOp\.SUM\))",
        new=["norm = norm.repeat(1 + self.rank)", r"\1"], flags=[], nproc=2,
        at=r"comm\.all_reduce\(norm",
        says=r"c10d all_reduce: collective #\d+ differs across ranks: rank \d all_reduce\(tensor float\d+\[\d\]\), "
             r"rank \d all_reduce\(tensor float\d+\[\d\]\) at stage1\.py:\d+"),
}


@pytest.mark.parametrize("mistake", list(BATTERY))
def test_planted_stream_mistake_is_refused(tmp_path, mistake):
    m = BATTERY[mistake]
    script, planted = changed(tmp_path, m["file"], m["line"], *m["new"])
    at_file = m.get("at_file", m["file"])  # where the finding is: the changed file, or one it calls
    text = script.read_text() if at_file == m["file"] else (ROOT / at_file).read_text()
    lines = [i + 1 for i, line in enumerate(text.splitlines()) if re.search(m["at"], line)]
    assert len(lines) == 1, f"{mistake}: {len(lines)} lines of {at_file} match {m['at']!r}: update this test"
    at = f"{at_file}:{lines[0]}"
    job, reports = audit(tmp_path, script, *m["flags"], nproc=m["nproc"], env={"FAKE_CUDA_COLLECTIVE_TIMEOUT": "30"})
    found = sorted({f for r in reports if r for f in r["findings"]})
    planted = f"{m['file']}:{planted} ({m['new'][0]!r})"
    assert job.returncode != 0 and found, f"{mistake}: planted at {planted}, refused nothing:\n{output(job)}"
    caught = [f for f in found if re.match(rf"{re.escape(at)}\b.*{m['says']}", f)]
    print(f"\nplanted {mistake} at {planted}; caught: {caught[:1]}")
    assert caught, f"{mistake}: planted at {planted}; expected at {at}: {m['says']}; found:\n" + "\n".join(found)
