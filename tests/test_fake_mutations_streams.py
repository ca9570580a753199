"""The fake CUDA device's stream model (tests/fake_streams.py) and its check of collective sequences, each shown to
catch one planted mistake: a copy of a stage file with one line changed, trained on the fake device, must fail naming
the line where the unordered access (or the mismatched collective, or the free) happens, and the line it races with.

    planted (offload.py unless named)                          caught by
    Copies.copy without wait_stream (--delayed_update)         the norm's copy down reads it unordered
    Copies.copy without record_stream (--delayed_update)       the norm freed while the copy stream reads it
    Copies.after without record_stream of its tensors (N = 2)  the reduce-scatter's tensors freed unordered
    _update without its joined() after the copies up (N = 2)   the next all-gather reads parameters the copy writes
    step without its joined() before the norm                  the compute stream reads the squares unordered
    --delayed_update: its thread without the wait for landed   the thread's AdamW reads the pinned gradient shard
    _use without b.gather.wait() (N = 2)                       forward reads parameters the all-gather writes
    Copies.after without work.wait() (N = 2)                   the norm's squares read the reduce-scatter's output
    the global norm's all-reduce on rank 0 only (N = 2)        the collective sequences differ across ranks
    stage1.py: the norm all-reduced at another size on rank 1  the collective sequences differ across ranks
    stage3.py: the bucket's gradient resize_(0) after its      a free by resize_(0): the nccl stream may still read
      reduce-scatter is issued, before its wait (N = 2)          it, naming the free and the collective
    offload: the same, the wait then in _release (N = 2)       the same, in offload
    --delayed_update: the shard zeroed while the update reads  the update's thread against the main thread
    _release: a tolist() of the gradient shard just sent down  a host read below the dispatcher, under the copy
    step: a numpy() read of the gradient shard before joined() a host read below the dispatcher, under the copy
    stage3.py: rank 1 prefetches the unit after the next one   collectives differ by buffer (equal-size units): the
                                                                 all-gather's output made by another storage
    the norm all-reduced with another ReduceOp on rank 1       collectives differ by ReduceOp
    stage3.py: the first broadcast's root is each rank itself  collectives differ by root
    devices.py: no torch.cuda.set_device (stage1.py, N = 2)    rank 1's first object collective goes through cuda:0,
                                                                 its process group bound to cuda:1
Where a mistake is about a collective, two ranks: a world of one calls none (comm.py). Not caught here: the delayed
update without its swap to the spare gradient shard, a race only where the update's thread is still reading when the
next step's copies come (a large model; the tiny GPT's update is done long before).
No assertion depends on the CPU: no
timing, no numbers (a race with the update's thread is caught at either of its two lines, whichever runs second: both
name each other)."""
import re
import shutil

import pytest

from conftest import ROOT
from test_fake_cuda import audit, changed, output

COPY = r"at offload\.py:\d+"  # a call site
COPY_STREAM = r"the stream made at offload\.py:\d+"  # Copies' copy stream, named by where it was made
# each: the file, its one line to change (a pattern) and the lines put there, the run's options and ranks; then the
# line the finding must name (a pattern, in the changed file) and what it must say there
BATTERY = {
    # (two ranks where the mistake is about a collective: a world of one calls none, comm.py)
    "missing_wait_stream": dict(
        file="offload.py", line=r"self\.stream\.wait_stream\(torch\.cuda\.current_stream\(\)\)",
        new=["pass  # no wait_stream"], flags=["--delayed_update"], nproc=1,
        at=r"dst\.copy_\(src, non_blocking=True\)",
        says=rf"stream order: aten\.copy_ on {COPY_STREAM}: touches memory that the compute stream wrote in "
             rf"aten\.sqrt {COPY}"),
    "missing_record_stream": dict(
        file="offload.py", line=r"t\.record_stream\(self\.stream\)", after=r"self\.stream\.wait_stream\(torch\.cuda\.current_stream\(\)\)",
        new=["pass  # no record_stream"], flags=["--delayed_update"], nproc=1,
        at_file="train_gpt.py", at=r"grad_norm = engine\.step\(",
        says=rf"stream order: memory freed: {COPY_STREAM} may still use it \(aten\.copy_ {COPY}\)"),
    "collective_tensors_not_recorded": dict(
        file="offload.py", line=r"t\.record_stream\(self\.stream\)", after=r"for t in spent:",
        new=["pass  # no record_stream"], flags=[], nproc=2,
        at=r"b\.grad = b\.reduced = b\.work = None",
        says=r"stream order: memory freed: the nccl stream may still use it \(c10d reduce_scatter\w* at offload\.py"),
    "params_not_joined": dict(  # 2 steps: the memory meter around step 1 must not order the streams across it
        file="offload.py", line=r"^\s*self\.copies\.joined\(\)$", after=r"# coef as a number on the host: the C\+\+ AdamW reads no device memory",
        new=["pass  # no joined()"], flags=["--steps", "2"], nproc=2,
        at=r"b\.gather = comm\.all_gather\(b\.param, self\.param_shard",
        says=rf"stream order: c10d all_gather\w* on the nccl stream: touches memory that {COPY_STREAM} wrote in "
             rf"aten\.copy_ {COPY}"),
    "norm_read_before_the_copies": dict(
        file="offload.py", line=r"^\s*self\.copies\.joined\(\)$", after=r"the global norm on the device, from the squares",
        new=["pass  # no joined()"], flags=[], nproc=1,
        at=r"norm = self\.squares\.sum\(\)",
        says=rf"stream order: aten\.sum\w* on the compute stream: touches memory that {COPY_STREAM} wrote"),
    "update_without_waiting_for_the_gradient": dict(
        file="offload.py", line=r"^\s*landed\.synchronize\(\)$", new=["pass  # no wait"],
        flags=["--delayed_update"], nproc=1,
        at=r"self\.adam\.adam_step\(self\.master",
        says=rf"stream order: cpu_adam\.adam_step on the host thread \S+: touches memory that {COPY_STREAM} wrote in "
             rf"aten\.copy_"),
    "gather_not_waited": dict(
        file="offload.py", line=r"^\s*b\.gather\.wait\(\)$", new=["pass  # no wait"], flags=[], nproc=2,
        at_file="train_gpt.py", at=r"x = x \+ self\.attn\(self\.ln_1\(x\)\)",
        says=rf"stream order: aten\.native_layer_norm on the compute stream: touches memory that the nccl stream wrote "
             rf"in c10d all_gather\w* {COPY}"),
    "reduce_scatter_not_waited": dict(
        file="offload.py", line=r"^\s*work\.wait\(\)$", after=r"# the copy stream waits for the collective, and the compute stream goes on",
        new=["pass  # no wait"], flags=[], nproc=2,
        at_file="train_gpt.py", at=r"return torch\.linalg\.vector_norm",
        says=r"stream order: \S+ on the stream made at offload\.py:\d+: touches memory that the nccl stream "
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
        says=r"c10d all_reduce: collective #\d+ differs across ranks: rank \d all_reduce\(tensor float\d+\[\d\] "
             r"made at [^)]*\), rank \d all_reduce\(tensor float\d+\[\d\] made at [^)]*\) at stage1\.py:\d+"),
    # a storage resized to zero is freed at once: c10d's reference to a collective's tensor does not hold its memory
    "free_under_reduce_scatter": dict(
        file="stage3.py", line=r"(b\.work = comm\.reduce_scatter\(.*\))",
        new=[r"\1", "b.grad.untyped_storage().resize_(0)  # (planted: freed before the wait)"], flags=[], nproc=2,
        at=r"b\.grad\.untyped_storage\(\)\.resize_\(0\)",
        says=r"stream order: memory freed by resize_\(0\): the nccl stream may still use it "
             r"\(c10d reduce_scatter\w* at stage3\.py:{planted}\b"),
    # (freed just before its wait, the memory is safe by order: nothing runs on its stream in between)
    "free_before_wait": dict(
        file="offload.py", line=r"(b\.work = comm\.reduce_scatter\(.*\))",
        new=[r"\1", "b.grad.untyped_storage().resize_(0)  # (planted: freed before the wait)"], flags=[], nproc=2,
        at=r"b\.grad\.untyped_storage\(\)\.resize_\(0\)",
        says=rf"stream order: memory freed by resize_\(0\): the nccl stream may still use it \(c10d reduce_scatter\w* "
             rf"{COPY}\b"),
    # a host thread is a host stream of its own, its work ordered only by what the main thread waits on
    "zero_of_the_shard_in_update": dict(
        file="offload.py", line=r"self\.update = self\.updater\.submit\(self\._cpu_update, self\.spare_grad_shard,.*",
        new=[r"\g<0>", "self.spare_grad_shard.zero_()  # (planted: zeroed while the update reads it)"],
        flags=["--delayed_update"], nproc=1,
        at=[r"self\.spare_grad_shard\.zero_\(\)  # \(planted", r"self\.adam\.adam_step\(self\.master"],
        says=rf"stream order: \S+ on (the host|the host thread \S+): touches memory that "
             rf"(the host|the host thread \S+) \w+ in \S+ {COPY}"),
    # host reads below the dispatcher read the tensor's memory
    "tolist_of_the_shard_sent_down": dict(
        file="offload.py", line=r"^\s*self\.copies\.copy\(self\.grad_shard\[where\], b\.reduced\)$",
        new=["self.copies.copy(self.grad_shard[where], b.reduced)",
             "self.first_grads = self.grad_shard[where][:4].tolist()  # (planted: a look)"],
        flags=[], nproc=1,
        at=r"self\.first_grads = ",
        says=rf"stream order: Tensor\.tolist on the host: touches memory that {COPY_STREAM} wrote in "
             rf"aten\.copy_ {COPY}"),
    "numpy_before_the_wait": dict(
        file="offload.py", line=r"(self\.copies\.joined\(\))", after=r"the global norm on the device, from the squares",
        new=["self.largest_grad = self.grad_shard.numpy().max()  # (planted: a look before the wait)", r"\1"],
        flags=[], nproc=1,
        at=r"self\.largest_grad = ",
        says=rf"stream order: Tensor\.numpy on the host: touches memory that {COPY_STREAM} wrote in "
             rf"aten\.copy_ {COPY}"),
    # each collective compared across ranks by its buffers, ReduceOp and root too
    "units_gathered_in_another_order": dict(  # (forward's order: the root, then the blocks, equal in size)
        file="stage3.py", line=r"self\._gather\(after\[0\]\)",
        new=["self._gather(after[min(self.rank, len(after) - 1)])  # (planted)"], flags=[],
        nproc=2,
        at=r"b\.gather = comm\.all_gather\(",
        says=r"c10d all_gather\w*: collective #\d+ differs across ranks: rank \d all_gather\w*\(output_tensor "
             r"\w+\[(\d+)\] made at stage3\.py:\d+ #(\d+) [^)]*\), rank \d all_gather\w*\(output_tensor \w+\[\1\] made at "
             r"stage3\.py:\d+ #(?!\2 )\d+ [^)]*\) at stage3\.py:\d+ < stage3\.py:{planted}\b"),
    "reduce_op_differs": dict(
        file="offload.py", line=r"comm\.all_reduce\(norm, op=dist\.ReduceOp\.SUM\)",
        new=["comm.all_reduce(norm, op=dist.ReduceOp.SUM if self.rank == 0 else dist.ReduceOp.MAX)  # (planted)"],
        flags=[], nproc=2,
        at=r"comm\.all_reduce\(norm",
        says=r"c10d all_reduce: collective #\d+ differs across ranks: rank \d all_reduce\(.*op=RedOpType\.\w+\), "
             r"rank \d all_reduce\(.*op=RedOpType\.\w+\) at offload\.py:\d+"),
    "broadcast_root_differs": dict(
        file="stage3.py", line=r"dist\.broadcast\(b\.param, src=0\)",
        new=["dist.broadcast(b.param, src=self.rank)  # (planted)"], flags=[], nproc=2,
        at=r"dist\.broadcast\(b\.param",
        says=r"c10d broadcast: collective #\d+ differs across ranks: rank \d broadcast\(.*src=\d\), "
             r"rank \d broadcast\(.*src=\d\) at stage3\.py:\d+"),
    # a rank is bound to no GPU of its own until it sets one; torch's object collectives go through the current one
    "set_device_dropped": dict(
        file="devices.py", line=r"^\s*torch\.cuda\.set_device\(device\)$", new=["pass  # (planted: no set_device)"],
        run="stage1.py", flags=[], nproc=2,
        at_file="train_gpt.py", at=r"dtype, why = from_rank0\(pick_dtype",  # the first: rank 0's dtype
        says=r"\(via devices\.py:\d+\) c10d broadcast: tensor cuda:0\[\d+\] \(the process group is bound to "
             r"cuda:1, the current device is cuda:0\)"),
}


@pytest.mark.parametrize("mistake", list(BATTERY))
def test_planted_stream_mistake_is_refused(tmp_path, mistake):
    m = BATTERY[mistake]
    script, planted = changed(tmp_path, m["file"], m["line"], *m["new"], after=m.get("after"))
    run = script
    if m.get("run"):  # a stage run beside the changed file, which it imports in its place
        run = script.parent / m["run"]
        shutil.copy(ROOT / m["run"], run)
    at_file = m.get("at_file", m["file"])  # where the finding is: the changed file, or one it calls
    text = script.read_text() if at_file == m["file"] else (ROOT / at_file).read_text()
    at = []  # the line the finding names; for a race with a thread, either of its lines (whichever ran second)
    for pattern in m["at"] if isinstance(m["at"], list) else [m["at"]]:
        lines = [i + 1 for i, line in enumerate(text.splitlines()) if re.search(pattern, line)]
        assert len(lines) == 1, f"{mistake}: {len(lines)} lines of {at_file} match {pattern!r}: update this test"
        at.append(f"{at_file}:{lines[0]}")
    says = m["says"].replace("{planted}", str(planted)).replace("{next}", str(planted + 1))
    job, reports = audit(tmp_path, run, *m["flags"], nproc=m["nproc"], env={"FAKE_CUDA_COLLECTIVE_TIMEOUT": "30"})
    found = sorted({f for r in reports if r for f in r["findings"]})
    new_lines = script.read_text().splitlines()[planted - 1:planted - 1 + len(m["new"])]
    planted = f"{m['file']}:{planted} ({' / '.join(line.strip() for line in new_lines)!r})"
    assert job.returncode != 0 and found, f"{mistake}: planted at {planted}, refused nothing:\n{output(job)}"
    caught = [f for f in found if any(re.match(rf"{re.escape(a)}\b.*{says}", f) for a in at)]
    print(f"\nplanted {mistake} at {planted}; caught: {caught[:1]}")
    assert caught, f"{mistake}: planted at {planted}; expected at {at}: {says}; found:\n" + "\n".join(found)
