"""A battery of one-line GPU mistakes, each planted in a copy of a stage file (test_fake_cuda.changed), each of which
must fail its run on the fake CUDA device (tests/fake_cuda.py, tests/fake_memory.py) with a finding that names the
planted line. The classes here: placement (a tensor the code puts on the host where CUDA needs it on the device),
host syncs (the host waiting for the GPU inside backward), device memory (a leak from step to step). Each entry says
what was planted and what caught it. One rank each (it calls every collective too); a leak needs 4 steps."""
import re

import pytest

from conftest import Runner
from test_fake_cuda import RUN, changed, refused
from train_gpt import host_categories

LEAK = ["--steps", "4"]  # the leak check compares what is allocated after each step with the step before, from step 3

# (id, file, the line's pattern, its replacement lines, extra options, the finding expected ({line}: the planted
# line's number), the mistake, what catches it)
BATTERY = [
    ("host_device_by_like", "stage2.py", r"b\.reduced = torch\.empty_like\(self\._my_shard_of\(b\.grad\)\)",
     ['b.reduced = torch.empty_like(self._my_shard_of(b.grad), device="cpu")'], [],
     r"c10d reduce_scatter\w*: output cpu\[\d+\] \(made at stage2\.py:{line}\)",
     "the reduce-scatter's output made on the host by empty_like(..., device='cpu') of a GPU tensor",
     "placement by intent (the project named cpu), then NCCL's rule: a collective's tensors on this rank's GPU"),
    ("dropped_to_device", "offload.py", r"norm = self\.squares\.sum\(\)$",
     [r"norm = torch.zeros((), dtype=torch.float64)"], [],
     r"offload\.py:{next} .*c10d all_reduce: tensor cpu\[1\]",
     "the global norm all-reduced from a host tensor (torch.zeros, not the device's squares)",
     "NCCL's rule: the all-reduce's tensor is on the host"),
    ("collective_output_on_host", "stage2.py", (r"def step\(self, lr", r"comm\.all_gather\(b\.param,(.*)"),
     [r"comm.all_gather(b.param.cpu(),\1"], [],
     r"stage2\.py:{line} .*c10d all_gather\w*: output(_tensor)? cpu\[\d+\] \(made at stage2\.py:{line}\)",
     "the parameters all-gathered into a host copy (.cpu()) of the bucket",
     "NCCL's rule: the all-gather's output is on the host"),
    ("item_in_a_hook", "stage3.py", r"p\.grad = None", ["p.grad.sum().item()", "p.grad = None"], [],
     r"stage3\.py:{line} .*host sync in backward: aten\._local_scalar_dense",
     ".item() of a gradient in the post-accumulate-grad hook",
     "the host-sync rule in backward: .item() waits for the GPU"),
    ("blocking_copy_in_backward", "stage3.py", r"(b\.work = comm\.reduce_scatter\(.*\))",
     ['b.grad.to("cpu")', r"\1"], [],
     r"stage3\.py:{line} .*host sync in backward: aten\._to_copy blocking to the host, pageable memory",
     "a blocking copy of the bucket's gradient to the host, in backward",
     "the host-sync rule in backward: a blocking copy waits for the GPU"),
    ("pageable_buffer", "offload.py", r"(return torch\.zeros\(.*)pin_memory=self\.cuda\)", [r"\1pin_memory=False)"], [],
     r"host sync in backward: aten\.copy_ non_blocking to the host, pageable memory: self cpu\[\d+\] "
     r"\(made at offload\.py:{line}\)",
     "offload's host buffers not pinned: the gradient copies go down into pageable memory",
     "the host-sync rule in backward: a copy into pageable memory returns only when done"),
    ("leak_of_gradient_buckets", "stage2.py", r"(b\.grad = torch\.zeros_like\(b\.param\))",
     [r"\1", "self.kept = getattr(self, 'kept', []) + [b.grad]"], LEAK,
     r"stage2\.py:{line} device memory leak: [\d.]+ KiB more allocated after step 3 than after step 2; "
     r"held: [\d.]+ KiB made at stage2\.py:{line}",
     "each step's gradient bucket kept in a list", "fake_memory's leak check: device memory grows step by step"),
    ("leak_of_reduced_shards", "stage3.py", r"(b\.reduced = torch\.empty_like\(self\._my_shard_of\(b\.grad\)\)).*",
     [r"\1", "self.kept = getattr(self, 'kept', []) + [b.reduced]"], LEAK,
     r"stage3\.py:{line} device memory leak: .* made at stage3\.py:{line}",
     "each step's reduce-scatter output kept in a list", "fake_memory's leak check: device memory grows step by step"),
]


@pytest.mark.parametrize("name, pattern, new, args, expected, mistake, caught_by", [b[1:] for b in BATTERY],
                         ids=[b[0] for b in BATTERY])
def test_planted_gpu_mistake_is_refused(tmp_path, name, pattern, new, args, expected, mistake, caught_by):
    # a pattern (after, pattern): the first line matching `pattern` below the one line matching `after`
    after, pattern = pattern if isinstance(pattern, tuple) else (None, pattern)
    script, line = changed(tmp_path, name, pattern, *new, after=after)
    # two ranks where the mistake is in a collective: a world of one calls none (comm.py)
    found = refused(tmp_path, script, *args, nproc=2 if "c10d" in expected else 1)
    want = expected.format(line=line, next=line + 1)
    assert any(re.search(want, m) for m in found), \
        f"planted in {name}:{line}: {mistake}; expected {caught_by}: /{want}/; found:\n" + "\n".join(found)


def test_summary_says_where_the_states_really_are(tmp_path):
    """The GPU suite's `where` check (test_gpu.test_gpu_ledgers_device_and_host) reads, per category, the device the
    run's summary says its tensors are on. Planted: --offload_params's parameter shard left on the device (its move to
    pinned host memory skipped); nothing else refuses it, and the bytes still equal the formula. Caught: the summary
    puts "params" on the device, where host_categories says host."""
    script, line = changed(tmp_path, "offload.py", r"if args\.offload_params:", "if False:  # (planted)")
    run = Runner(tmp_path, fake=True).run(str(script), 1, *RUN, "--batch_size", "2", "--offload_params")
    host = host_categories("offload", offload_params=True)
    s = run.summary["model_state_bytes"]
    wrong = {c: v["where"] for c, v in s.items() if v["where"] != ("host" if c in host else "device")}
    assert wrong == {"params": "device"}, f"planted at offload.py:{line}; the summary's placement: {s}"
