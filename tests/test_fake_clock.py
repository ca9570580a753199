"""The fake CUDA device's modelled clock (tests/fake_clock.py, fake_streams.py): a step's GPU timeline predicted on
the CPU, read by --timeline (instruments.Timeline) as on a GPU and measured by bench/timeline.py's readers, so that a
schedule that is right but serial fails here, without a GPU. The host is the ideal one (FAKE_CUDA_HOST=ideal: it
queues all it can at once, as a host far ahead of a busy GPU does), so every number below is the same on any CPU.

The size: the smallest at which the overlaps mean something. A kernel costs at least a small kernel's 7.31 µs on the
H200, so with the tiny preset every collective and copy is that floor and ends before the kernels it could hide
under have begun. At width 256, 3 blocks, 8 x 128 tokens in fp32 (50.8 TFLOP/s on the H200), a block's forward is
~100 µs and its backward ~160 µs, its fp32 gradient (3.1 MB) 57 µs down a pinned link: each has room to hide.

Offload's two tests (its gradient copies under backward, the delayed update's AdamW under the next forward and
backward) are tests/test_gpu.py's thresholds and arithmetic. On the H200 at 6cbbd50 both failed (25.5% and 0%); here,
with the ideal host, this offload.py passes them: each bucket's copy waits for the compute queued when it is released,
which is backward up to the next bucket, not all of it. With the host measured (FAKE_CUDA_HOST=measured) the step is
host-bound and both fractions fall to 0, as on the H200: the model puts that failure in the host's time, which the
ideal host leaves out. Each test names what is serial when it fails; tests/mutations.py plants a serial schedule for
each."""
import json
import sys
from pathlib import Path

import pytest

from conftest import ROOT, Runner
from test_gpu import ADAM_UNDER_FORWARD_BACKWARD, COPIES_BEGUN_IN_BACKWARD, COPIES_UNDER_BACKWARD, copy_fractions

sys.path.insert(0, str(ROOT / "bench"))
import timeline  # noqa: E402  (bench/timeline.py: merge, under_phases)

RATES = json.loads((ROOT / "tests" / "gpu_facts_h200.json").read_text())["rates"]
IDEAL = {"FAKE_CUDA_HOST": "ideal"}
MODEL = ["--preset", "tiny", "--n_layer", "3", "--n_head", "4", "--n_embd", "256", "--block_size", "128",
         "--batch_size", "8", "--dtype", "fp32", "--steps", "3", "--eval_every", "1000", "--eval_batches", "1",
         "--sample_chars", "0", "--no_progress"]
BUCKETS = ["--bucket_mb", "0.5"]  # a bucket a block (0.79M parameters, 3.1 MB) or less: 4 or more buckets
DELAYED = ["--delayed_update", "--grad_accum", "4", "--batch_size", "32"]  # 4 micro-steps for the update to hide under
COMPUTE = ("forward", "backward", "optimizer", "other")  # every compute kernel ("other": the engine's hooks')
# Each bucket's collective can hide under the compute that follows its issue: every one but the last (the
# embedding's, whose gradient is complete when backward's last kernel is). "Mostly": more than half of their time.
COLLECTIVES_UNDER_COMPUTE = 0.5


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    """traced(script, nproc, *flags): the merged --timeline trace of the run's last step on the fake device."""
    runner = Runner(tmp_path_factory.mktemp("fake_clock"), fake=True)
    def run(script, nproc, *flags):
        out = runner.tmp / f"timeline_{Path(script).stem}_{nproc}{''.join(flags)}"
        runner.run(str(ROOT / script), nproc, *MODEL, *flags, "--timeline", str(out), env=IDEAL)
        return timeline.merge(out)
    return run


def collective_share(trace, name):
    over, total = timeline.under_phases(trace, "communication", COMPUTE, name)
    assert total, f"no {name} in the traced step"
    return over / total


@pytest.mark.parametrize("script, name", [("stage0_ddp.py", "all_reduce"), ("stage2.py", "reduce_scatter")])
def test_reductions_under_backward(traced, script, name):
    """Each bucket's reduction, issued as its gradient completes, runs on NCCL's stream while backward goes on."""
    share = collective_share(traced(script, 2, *BUCKETS), name)
    assert share >= COLLECTIVES_UNDER_COMPUTE, (f"{script}: only {share:.1%} of the {name}s ran under compute: the "
                                                f"reductions are serial with backward")


def test_stage3_prefetched_gathers_under_compute(traced):
    """Stage 3's gathers, each prefetched while the unit before runs, run under that unit's compute."""
    share = collective_share(traced("stage3.py", 2), "all_gather")
    assert share >= COLLECTIVES_UNDER_COMPUTE, (f"only {share:.1%} of stage 3's all-gathers ran under compute: each "
                                                f"is issued after the compute before it, none prefetched")


def test_offload_gradient_copies_under_backward(traced):
    hidden, begun = copy_fractions(traced("offload.py", 1))
    assert begun >= COPIES_BEGUN_IN_BACKWARD, (f"only {begun:.1%} of the gradient-copy time began during backward: "
                                               f"the copies wait for all of backward")
    assert hidden >= COPIES_UNDER_BACKWARD, (f"{hidden:.1%} of the gradient copies begun in backward ran under it: "
                                             f"they are serial with backward")


def test_delayed_update_under_forward_and_backward(traced):
    trace = traced("offload.py", 1, *DELAYED)
    over, total = timeline.under_phases(trace, "cpu adam", ("forward", "backward"))
    assert total, "no C++ AdamW in the traced step"
    assert over / total >= ADAM_UNDER_FORWARD_BACKWARD, (f"{over / total:.1%} of the C++ AdamW ran under forward's and "
                                                         f"backward's kernels: the update is serial with them")


def test_copy_spans_are_the_copy_streams(traced):
    """Offload's copy spans are timed by CUDA events on its copy stream: each lasts at least its bytes at the link's
    rate (pinned memory, each way). Timed on the compute stream instead, a span measures whatever compute did
    meanwhile (with the host far ahead: nothing, and the span vanishes); events made without enable_timing=True
    cannot be timed at all (elapsed_time raises, as CUDA's does), and the run fails."""
    trace = traced("offload.py", 1)
    for name, rate in (("copy to host", "d2h_pinned_gb_s"), ("copy to device", "h2d_pinned_gb_s")):
        spans = [e for e in trace["traceEvents"] if e.get("cat") == "copies" and e["name"] == name]
        assert spans, f"no '{name}' span in the traced step"
        short = [e for e in spans if e["dur"] < e["args"]["bytes"] / (RATES[rate] * 1e3) - 1e-3]  # (µs)
        assert not short, (f"{len(short)} of {len(spans)} '{name}' spans are shorter than their bytes at "
                           f"{RATES[rate]} GB/s: not timed on the copy stream")


def test_costs_at_the_h200s_rates():
    """The clock's costs by hand (tests/fake_clock.py, the H200's rates): a bf16 and an fp32 matmul by their FLOPs, an
    elementwise op by its bytes, a view none, a small op the small kernel's floor, pinned and pageable copies each
    way by their bytes, an all-reduce at N = 2 by the bytes each GPU sends, the C++ AdamW by its parameters."""
    import torch
    import fake_clock
    aten = torch.ops.aten
    def seconds(func, *args, ends=None):
        out = func(*args)
        return fake_clock.work(func, args, {}, out, [*args, out], ends=ends)
    n = 2048  # (a bf16 matmul of 1024 would be below the small kernel's floor)
    for dtype, rate in ((torch.bfloat16, "matmul_bfloat16_tflops"), (torch.float32, "matmul_float32_tflops")):
        a = torch.ones(n, n, dtype=dtype)
        assert seconds(aten.mm.default, a, a)[0] == pytest.approx(2 * n**3 / (RATES[rate] * 1e12))
    big = torch.ones(2**24)
    assert seconds(aten.add.Tensor, big, big)[0] == pytest.approx(3 * big.nbytes / (RATES["device_copy_gb_s"] * 1e9))
    assert seconds(aten.view.default, big, [-1]) is None
    assert seconds(aten.add.Tensor, big[:4], big[:4])[0] == RATES["small_kernel_device_us"] * 1e-6
    for ends, rate in ((("cuda:0", "pinned"), "d2h_pinned_gb_s"), (("pinned", "cuda:0"), "h2d_pinned_gb_s"),
                       (("cuda:0", "cpu"), "d2h_pageable_gb_s"), (("cpu", "cuda:0"), "h2d_pageable_gb_s")):
        cost, _, kind = fake_clock.work(aten.copy_.default, (big, big), {}, big, [big], ends=ends)
        assert (cost, kind) == (pytest.approx(big.nbytes / (RATES[rate] * 1e9)), "gpu_memcpy"), ends
    sent = big.nbytes  # an all-reduce sends 2(N - 1)/N of its buffer: at N = 2, all of it
    assert fake_clock.collective("all_reduce", [big], 2) == pytest.approx(sent / (RATES["nvlink_gb_s"] * 1e9))
    assert fake_clock.adam(4.18e9) == pytest.approx(1.0)
