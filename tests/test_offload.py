"""offload.py beyond the checks every stage gets (test_stages.py runs those on it too): the parameter shard offloaded
as well, the one-step-delayed update against a reference that applies each update one step late (and stopped and
resumed at N = 2, against its straight run), and where each model state lives; one copy down per bucket a step
under --grad_accum; every device-host copy's host end allocated to be pinned; and a failed background update stopping
the run. (Stream order, a missing wait among them, is the fake CUDA device's: test_fake_mutations_streams.py.)"""
import json
import os
import sys

import pytest
import torch

from conftest import ROOT, Runner
from test_stages import LOSS_ATOL, MODEL, TRAIN, compare_params, first_difference, reference  # noqa: F401

OFFLOAD = str(ROOT / "offload.py")
# Copies' simulated stream (tests/simulated_stream/sitecustomize.py): a copy lands when a wait covers it (for
# test_any_model.py's example, which reads gradients through grad())
SIMULATED = {"PYTHONPATH": os.pathsep.join([str(ROOT / "tests" / "simulated_stream"), str(ROOT)])}

DELAYED_REFERENCE = '''
import sys
sys.path.insert(0, {root!r})
from train_gpt import SingleDeviceEngine, main


class DelayedReference(SingleDeviceEngine):
    """The reference, updated one step late: step t's update is computed from step t's gradients as usual, but the
    model goes on with the weights of the update before it, so step t+1 runs on the weights of update t-1."""
    def step(self, lr, scaler=None):
        previous = [m.clone() for m in self.master]
        norm = super().step(lr, scaler)
        for p, m in zip(self.params, previous):
            p.data.copy_(m)
        return norm


main(DelayedReference, stage="reference", distributed=False)
'''


def assert_same_training(expected, got, where):
    k = first_difference(expected.summary["losses"], got.summary["losses"], LOSS_ATOL)
    assert k is None, (f"{where}: loss at step {k} is {got.summary['losses'][k]:.7f}, its reference has "
                       f"{expected.summary['losses'][k]:.7f}")
    compare_params(expected.master, got.master, where)


@pytest.mark.parametrize("nproc", [1, 2])
def test_offload_params_parity_and_placement(runner, reference, nproc):
    run = runner.run(OFFLOAD, nproc, *MODEL, *TRAIN, "--offload_params")
    assert_same_training(reference, run, f"offload --offload_params at N={nproc}")
    for category, v in run.summary["model_state_bytes"].items():
        assert v["measured"] == v["theory"], f"{category}: measured {v['measured']:,}, formula {v['theory']:,}"
        if category != "grad_acc":  # (TRAIN's --grad_accum 2 sums the gradient shard on the device: see below)
            assert v["where"] == "host", f"with --offload_params every model state is on the host; {category} is not"


def test_default_placement(runner):
    s = runner.run(OFFLOAD, 2, *MODEL, *TRAIN).summary
    where = {k: v["where"] for k, v in s["model_state_bytes"].items()}
    assert where == {"params": "device", "grads": "host", "master": "host", "adam_m": "host", "adam_v": "host",
                     "grad_acc": "device"}, where  # grad_acc: TRAIN's --grad_accum 2


# ---- --grad_accum > 1: the micro-steps' gradient shards are summed on the device, in a buffer the ledger counts

@pytest.mark.parametrize("flags", [[], ["--offload_params"]], ids=["plain", "offload_params"])
def test_accumulated_gradient_shard_is_a_device_state_in_the_formula(runner, flags):
    """The summed shard (2Ψ/N in bf16, 4Ψ/N in fp32) is a model state of its own, measured equal to the formula and
    placed on the device, with --offload_params too; with one micro-step a step there is no such buffer."""
    s = runner.run(OFFLOAD, 2, *MODEL, *TRAIN, *flags).summary
    acc, pb = s["model_state_bytes"].get("grad_acc"), 4  # TRAIN: fp32
    assert acc is not None, f"--grad_accum 2: no grad_acc in the ledger: {sorted(s['model_state_bytes'])}"
    assert acc["measured"] == acc["theory"] == pb * s["padded_numel"] // 2, acc
    assert acc["where"] == "device", acc
    at = TRAIN.index("--grad_accum")
    one = runner.run(OFFLOAD, 2, *MODEL, *TRAIN[:at], "--grad_accum", "1", *TRAIN[at + 2:], *flags).summary
    assert "grad_acc" not in one["model_state_bytes"], one["model_state_bytes"]


def test_compare_counts_the_accumulated_shard(runner, tmp_path):
    """bench/compare.py's model-state total counts grad_acc (which has no column of its own): the total is the
    formula's, all categories, and more than its columns add up to."""
    sys.path.insert(0, str(ROOT / "bench"))
    import compare
    s = runner.run(OFFLOAD, 2, *MODEL, *TRAIN).summary
    (tmp_path / "offload.json").write_text(json.dumps(s))
    row, = compare.load_rows(tmp_path)
    assert row["states_measured"] == sum(v["measured"] for v in s["model_state_bytes"].values()), row
    assert row["states_measured"] == sum(v["theory"] for v in s["model_state_bytes"].values()), row
    assert row["states_measured"] > sum(row["measured"].values()), f"grad_acc missing from the total: {row}"


PLACEMENT = '''
import json, os, sys
sys.path.insert(0, {root!r})
import offload
from train_gpt import host_categories


def model_states(self, original=offload.OffloadEngine.model_states):
    """model_states, and where each of its tensors lives (on the fake CUDA device: tests/fake_cuda.py's tags)."""
    states = original(self)
    host = host_categories("offload", self.args.offload_params)
    where = {{k: sorted({{t.device.type for t in ts}}) for k, ts in states.items()}}
    with open(os.path.join(os.environ["PLACEMENT_OUT"], f"rank{{os.environ['RANK']}}.json"), "w") as f:
        json.dump(dict(where=where, host=list(host)), f)
    return states


offload.OffloadEngine.model_states = model_states
offload.main(offload.OffloadEngine, stage="offload")
'''


@pytest.mark.parametrize("flags", [[], ["--offload_params"]], ids=["plain", "offload_params"])
def test_accumulated_gradient_shard_lives_on_the_device(tmp_path, flags):
    """On the fake CUDA device, at N = 2 with --grad_accum 2 in bf16: each model state lives where host_categories
    puts it (the summed shard on the device), and the device's other tensors after backward (the ledger's "other")
    hold no second copy of the summed shard."""
    script, out = tmp_path / "placement.py", tmp_path / "placement"
    script.write_text(PLACEMENT.format(root=str(ROOT)))
    out.mkdir()
    run = ["--preset", "tiny", "--steps", "2", "--eval_batches", "1", "--sample_chars", "0", "--no_progress",
           "--batch_size", "8", "--grad_accum", "2", "--dtype", "bf16", "--out", str(tmp_path / "summary.json"), *flags]
    job = Runner(tmp_path).spawn(str(ROOT / "tests" / "fake_cuda.py"), 2, [str(script), *run],
                                 env={"PLACEMENT_OUT": str(out)}, timeout=300)
    assert job.returncode == 0, (job.stdout + job.stderr)[-3000:]
    for rank in range(2):
        seen = json.loads((out / f"rank{rank}.json").read_text())
        assert "grad_acc" in seen["where"], seen
        for category, devices in seen["where"].items():
            assert devices == (["cpu"] if category in seen["host"] else ["cuda"]), (rank, category, devices)
    s = json.loads((tmp_path / "summary.json").read_text())
    acc = s["model_state_bytes"]["grad_acc"]
    assert acc["measured"] == acc["theory"] == 2 * s["padded_numel"] // 2 and acc["where"] == "device", acc
    assert s["other_tensor_bytes"] < acc["measured"], (s["other_tensor_bytes"], acc)


@pytest.fixture(scope="module")
def world_of_one():
    """A process group of one, in this process (test_any_model.py's; that file imports this one)."""
    import torch.distributed as dist
    from devices import free_port
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield torch.device("cpu")
    dist.destroy_process_group()


def test_one_copy_down_per_bucket_per_step(world_of_one):
    """With --grad_accum 2 the micro-steps' shards are summed on the device and only the sum goes down: each step copies
    each bucket's shard to the host once, on its last micro-step (a copy on every micro-step gives the same numbers
    on a CPU, and costs a device-host transfer a micro-step on a GPU). In this process, a world of one."""
    import offload
    from test_any_model import any_model, loss_of, parse_args
    engine = offload.OffloadEngine(any_model.SetClassifier(), parse_args(offload.OffloadEngine, ["--grad_accum", "2"]),
                                   world_of_one)
    down = []
    copy = engine.copies.copy

    def counted(dst, src):
        down.append(dst.untyped_storage().data_ptr() == engine.grad_shard.untyped_storage().data_ptr())
        return copy(dst, src)

    engine.copies.copy = counted
    for step in range(2):
        down.clear()
        for k in range(2):
            engine.backward(loss_of(engine, 2 * step + k) / 2, sync=k == 1)
        engine.step(1e-3)
        assert sum(down) == len(engine.buckets), (
            f"step {step}: {sum(down)} copies into the host's gradient shard, one per bucket ({len(engine.buckets)}) "
            "expected: only the last micro-step's sum goes down")


@pytest.fixture(scope="module")
def delayed_reference(runner, tmp_path_factory):
    script = tmp_path_factory.mktemp("delayed") / "delayed_reference.py"
    script.write_text(DELAYED_REFERENCE.format(root=str(ROOT)))
    return runner.run(str(script), None, *MODEL, *TRAIN)


@pytest.mark.parametrize("nproc", [1, 2])
def test_delayed_update_is_exactly_one_step_stale(runner, delayed_reference, nproc):
    got = runner.run(OFFLOAD, nproc, *MODEL, *TRAIN, "--delayed_update")
    assert_same_training(delayed_reference, got, f"offload --delayed_update (against a reference updated one step late) at N={nproc}")


def test_delayed_update_differs_from_exact(runner, reference):
    """The staleness is real: step 0 is the same, but step 1 already runs on the initial weights again."""
    got = runner.run(OFFLOAD, 1, *MODEL, *TRAIN, "--delayed_update").summary["losses"]
    exact = reference.summary["losses"]
    assert got[0] == pytest.approx(exact[0], abs=LOSS_ATOL)
    assert all(abs(g - e) > 1e-4 for g, e in zip(got[1:], exact[1:])), (got, exact)


def test_delayed_update_stopped_and_resumed_at_two_ranks(runner, tmp_path):
    """--delayed_update at N = 2, stopped after step 3 and resumed: bit for bit the straight run that saves after step
    3 too (a save lands the update in flight, in both runs alike)."""
    from test_checkpoint import assert_same_run
    delayed = [*MODEL, *TRAIN, "--delayed_update"]
    straight = runner.run(OFFLOAD, 2, *delayed, "--save_every", "3", "--ckpt_dir", str(tmp_path / "straight"))
    runner.run(OFFLOAD, 2, *delayed, "--stop_after", "3", "--ckpt_dir", str(tmp_path / "stopped"))
    resumed = runner.run(OFFLOAD, 2, *delayed, "--resume", str(tmp_path / "stopped"))
    assert resumed.summary["resumed_from"] == 3
    assert_same_run(straight, resumed, "offload --delayed_update at N=2, stopped after step 3 and resumed")


def test_delayed_update_second_gradient_shard_is_in_the_formula(runner):
    """--delayed_update holds two gradient shards (one filling, one read by the CPU update) and two parameter shards
    (one gathered from, one written by the update): the formula counts both, so measured equals theory for this option
    too."""
    s = runner.run(OFFLOAD, 1, *MODEL, *TRAIN, "--delayed_update").summary
    for category, v in s["model_state_bytes"].items():
        assert v["measured"] == v["theory"], f"{category}: measured {v['measured']:,}, formula {v['theory']:,}"
    assert s["model_state_bytes"]["grads"]["theory"] == s["model_state_bytes"]["params"]["theory"]
    plain = runner.run(OFFLOAD, 1, *MODEL, *TRAIN).summary["model_state_bytes"]
    assert s["model_state_bytes"]["params"]["theory"] == 2 * plain["params"]["theory"]


# ---- --delayed_update: an exception in the update's thread stops the run, in the main thread, with one line

def assert_stops_with_one_line(p, expected=""):
    errors = [ln for ln in p.stderr.splitlines() if ln.startswith("error:")]
    assert p.returncode != 0, f"the run exited 0:\n{p.stderr[-2000:]}"
    assert "Traceback" not in p.stderr and len(errors) == 1 and expected in errors[0], p.stderr[-2000:]


def test_delayed_update_nan_stops_the_run(runner):
    """lr 1e30: the weights blow up, the gradient norm is NaN, and the update fails: the run must not go on."""
    p = runner.launch(OFFLOAD, None, "--preset", "tiny", "--steps", "6", "--delayed_update", "--lr", "1e30",
                      "--warmup", "1", "--no_progress", "--sample_chars", "0")
    assert_stops_with_one_line(p)


INJECTED = '''
import sys
sys.path.insert(0, {root!r})
import offload


class FailingAdam:
    """The C++ AdamW, failing halfway through step 3's update, after one bucket's shard of it."""
    def __init__(self, adam):
        self.adam, self.calls = adam, 0

    def __getattr__(self, name):  # the rest (sum_of_squares, threads, ...) is the kernel's own
        return getattr(self.adam, name)

    def adam_step(self, *args, **kwargs):
        self.calls += kwargs["step"] == 3
        if self.calls == 2:
            raise RuntimeError("injected failure halfway through the update of step 3")
        return self.adam.adam_step(*args, **kwargs)


def init(self, *args, original=offload.OffloadEngine.__init__):
    original(self, *args)
    self.adam = FailingAdam(self.adam)


offload.OffloadEngine.__init__ = init
offload.main(offload.OffloadEngine, stage="offload")
'''


def test_delayed_update_failure_in_its_thread_stops_the_run(runner, tmp_path):
    script = tmp_path / "failing_update.py"
    script.write_text(INJECTED.format(root=str(ROOT)))
    p = runner.launch(str(script), None, *MODEL, *TRAIN, "--delayed_update")
    assert_stops_with_one_line(p, "RuntimeError: injected failure halfway through the update of step 3")


HOST_PASSES = '''
import os, sys
sys.path[:0] = [{root!r}, {bench!r}]
import torch, torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from devices import free_port
import host_cost
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{{free_port()}}", rank=0, world_size=1)
engine, x = host_cost.build("offload", torch.device("cpu"))
shard = engine.grad_shard.untyped_storage()
calls = []
adam = engine.adam
class Counted:  # the C++ AdamW's entry points, each call's tensors that share the gradient shard's memory counted
    def __getattr__(self, name):
        def call(*args, **kwargs):
            read = sum(t.numel() for t in [*args, *kwargs.values()]
                       if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() == shard.data_ptr())
            calls.append((name, read))
            return getattr(adam, name)(*args, **kwargs)
        return call
engine.adam = Counted()
class Touches(TorchDispatchMode):  # every aten op of the step that reads or writes the host gradient shard
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        flat = torch.utils._pytree.tree_leaves((args, kwargs or {{}}))
        touches = any(isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() == shard.data_ptr() for t in flat)
        if touches and not func.is_view:  # (a view reads no element)
            calls.append((str(func), 0))
        return func(*args, **(kwargs or {{}}))
for _ in range(2):
    loss = engine.forward(x, x)
    engine.backward(loss, sync=True)
    calls.clear()
    with Touches():
        engine.step(1e-4)
print("CALLS", calls, "SHARD", engine.grad_shard.numel())
dist.barrier()
dist.destroy_process_group()
'''


def test_the_step_passes_over_the_host_gradient_once(tmp_path):
    """ZeRO-Offload's host work per step is AdamW's: the global norm comes from the device (each bucket's squares
    summed before its shard goes down), and nothing zeroes the host's gradient shard (the next copies down overwrite
    all of it). In one rank's step (CPU, world of one): the C++ AdamW reads every element of the shard once, and no
    other call, C++ or torch's, reads or writes it."""
    import ast
    import subprocess
    script = tmp_path / "passes.py"
    script.write_text(HOST_PASSES.format(root=str(ROOT), bench=str(ROOT / "bench")))
    p = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    line = next((x for x in p.stdout.splitlines() if x.startswith("CALLS")), None)
    assert p.returncode == 0 and line, p.stdout[-2000:] + p.stderr[-2000:]
    calls = ast.literal_eval(line.split("CALLS", 1)[1].split("SHARD")[0].strip())
    numel = int(line.split("SHARD")[1])
    others = [name for name, _ in calls if name != "adam_step"]
    assert not others, f"the step touches the host gradient shard besides AdamW: {others}"
    read = sum(n for name, n in calls if name == "adam_step")
    assert read == numel, f"AdamW read {read:,} elements of the {numel:,}-element gradient shard in one step"


def test_host_cost_at_its_smallest(tmp_path):
    """bench/host_cost.py at its smallest (one round of two micro-steps per engine, FSDP2 included): a row per engine,
    stage 0's ratio 1.00, and its last line as bench/README.md quotes it. Its numbers are this CPU's, not checked."""
    import re
    import subprocess
    out = tmp_path / "results"
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "host_cost.py"), "--rounds", "1", "--micro", "2",
                        "--results", str(out)], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    text = (out / "host_cost.md").read_text()
    rows = re.findall(r"^\| (stage 0|stage 3|offload|FSDP2) \| ([\d.]+) \| ([\d.]+) \|$", text, re.M)
    assert [r[0] for r in rows] == ["stage 0", "stage 3", "offload", "FSDP2"], text
    assert rows[0][2] == "1.00" and all(float(ms) > 0 for _, ms, _ in rows), text
    last = p.stdout.strip().splitlines()[-1]
    assert re.fullmatch(r"host time per micro-step: offload / stage 0 \d+\.\d\d, stage 3 / FSDP2 \d+\.\d\d", last), last
