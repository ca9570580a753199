"""What every stage's parity shares with the reference, tested on its own: the learning-rate schedule (lr_at: a slip
there moves the reference and the stages alike, so parity cannot see it) against values written by hand, and the lr
train_step hands each step's engine (lr_at of that step); the meters the ledgers read: the peak meter against a
buffer of known size allocated and freed inside the measured window, and bench/compare.py's count of runs equal to the
formula against summaries that disagree. No run is started: each test takes well under a second beside the import of
torch."""
import json
import sys
import types

import pytest
import torch

from conftest import ROOT
import instruments
from instruments import PeakMemory
from train_gpt import lr_at, train_step

sys.path.insert(0, str(ROOT / "bench"))
import compare  # noqa: E402

SCHEDULE = types.SimpleNamespace(lr=1e-3, min_lr=1e-4, warmup=4, steps=10)


@pytest.mark.parametrize("step, want", [
    (0, 2.5e-4),  # warmup's first step: lr / warmup, never 0 (a step with lr 0 would train nothing)
    (1, 5e-4),
    (3, 1e-3),  # warmup's last step: the full lr
    (4, 1e-3),  # cosine's first step: t = 0
    (6, 1e-4 + 0.5 * (1 + 0.30901699437494745) * 9e-4),  # t = 2/5: cos(0.4 pi) = (sqrt(5) - 1) / 4
    (9, 1e-4),  # the last step: min_lr
])
def test_lr_at_warmup_then_cosine(step, want):
    got = lr_at(step, SCHEDULE)
    assert got == pytest.approx(want, rel=1e-12), f"lr_at({step}), warmup 4 of 10 steps: {got!r}, expected {want!r}"


def test_lr_at_without_warmup():
    """--warmup 0: the full lr at step 0, min_lr at the last step."""
    args = types.SimpleNamespace(lr=1e-3, min_lr=1e-4, warmup=0, steps=10)
    assert lr_at(0, args) == pytest.approx(1e-3, rel=1e-12), f"lr_at(0) with no warmup is {lr_at(0, args)!r}"
    assert lr_at(9, args) == pytest.approx(1e-4, rel=1e-12), f"lr_at(9) of 10 steps is {lr_at(9, args)!r}, not min_lr"
    assert lr_at(0, args) > lr_at(5, args) > lr_at(9, args), "the cosine must fall from lr to min_lr"


class Recorder:
    """An engine that trains nothing and records the lr each step() is given; a scalar parameter makes the loss."""
    def __init__(self):
        self.w = torch.ones((), requires_grad=True)
        self.lrs = []

    def forward(self, x, y):
        return self.w * 1.0

    def backward(self, loss, sync):
        loss.backward()

    def step(self, lr, scaler=None):
        self.lrs.append(lr)
        return torch.zeros(())


class Tokens:
    def batch(self, split, batch_seed, global_batch, part, n_parts, device):
        return torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, 1, dtype=torch.long)


def test_train_step_uses_lr_at_of_its_own_step():
    """The lr the shared loop hands each stage's step() is lr_at(step): warmup's first step included. (The reference
    shares the call, so parity cannot see it.)"""
    engine = Recorder()
    args = types.SimpleNamespace(**vars(SCHEDULE), grad_accum=1, seed=0, batch_size=1)
    for step in range(args.steps):
        train_step(engine, Tokens(), args, step, torch.device("cpu"))
    expected = [lr_at(step, args) for step in range(args.steps)]
    assert engine.lrs == expected, f"train_step's lr by step: {engine.lrs}, expected lr_at(step): {expected}"


def test_peak_meter_sees_a_buffer_freed_inside_the_window():
    """A buffer of 4 MiB allocated and freed inside the window: the peak must show it (a meter of the net change,
    or of the live bytes at the end, would not), and not much more: nothing else runs here."""
    size = 4 * 2**20
    with PeakMemory(torch.device("cpu")) as meter:
        buffer = torch.ones(size, dtype=torch.uint8)
        del buffer
    rise = meter.peak - meter.base
    assert size <= rise < size + 2**16, f"a {size:,}-byte buffer freed inside the window: the peak rose {rise:,}"
    assert meter.largest >= size, f"the largest allocation seen is {meter.largest:,} bytes, not the buffer's {size:,}"


def test_peak_meter_counts_what_lives_at_entry():
    """The peak starts from the live tensor bytes at entry: a tensor held throughout is in it."""
    held = torch.ones(2**20, dtype=torch.uint8)
    with PeakMemory(torch.device("cpu")) as meter:
        pass
    assert meter.peak >= held.numel(), f"a {held.numel():,}-byte tensor alive throughout, peak {meter.peak:,}"


class Wrapper(torch.Tensor):
    """A tensor subclass that wraps another, as DTensor (FSDP2's parameters, gradients and Adam moments) wraps its
    local shard: its own storage has no memory behind it."""
    @staticmethod
    def __new__(cls, inner):
        return torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype, device=inner.device)

    def __init__(self, inner):
        self.inner = inner

    def __tensor_flatten__(self):
        return ["inner"], None

    @staticmethod
    def __tensor_unflatten__(inner, meta, size, stride):
        return Wrapper(inner["inner"])

    @classmethod
    def __torch_dispatch__(cls, func, types_, args=(), kwargs=None):
        raise NotImplementedError(f"{func}: this wrapper only holds a tensor")


def test_memory_meter_reads_a_wrapper_through_the_tensor_it_holds():
    """The storage that stopped bench/peers.py's FSDP2 runs: a wrapper subclass's, whose data_ptr() raises. The meter
    never reads it, and counts the tensor it wraps instead (once, beside that tensor itself): in storage_bytes, and in
    unlisted's walk of an engine, which still names a wrapped tensor the engine's list leaves out."""
    shard, hidden = torch.zeros(1000), torch.zeros(250)
    wrapped = Wrapper(shard)
    with pytest.raises(RuntimeError, match="invalid python storage"):
        wrapped.untyped_storage().data_ptr()
    assert instruments.storage_bytes([wrapped]) == 4000, "a wrapper counts the tensor it wraps"
    assert instruments.storage_bytes([wrapped, shard]) == 4000, "the wrapped tensor counts once"
    engine = types.SimpleNamespace(params=[wrapped], copy=Wrapper(hidden))
    cpu = torch.device("cpu")
    assert instruments.unlisted(engine, [shard], cpu) == {"copy": 1000}, "a listed shard's wrapper is listed"
    assert instruments.unlisted(engine, [], cpu) == {"params[*]": 4000, "copy": 1000}


def summary(stage, states_measured, comm_measured):
    """A run's summary as compare.load_rows reads it, with model states and bytes sent as given (theory 1000, 500)."""
    return dict(stage=stage, world_size=2, n_params=100, padded_numel=100, dtype="fp32", device="cpu",
                config=dict(n_layer=2, n_embd=8, n_head=2, vocab_size=10, block_size=4),
                args=dict(steps=2, batch_size=4, grad_accum=1),
                model_state_bytes={"params": {"measured": states_measured, "theory": 1000}},
                model_state_bytes_per_rank=[{"params": states_measured}] * 2, peak_memory_bytes=5000,
                comm_bytes_per_step={"measured": comm_measured, "theory": 500.0}, tokens_per_s=1.0, losses=[2.0],
                val_loss=2.0)


def test_compare_counts_runs_that_disagree(tmp_path):
    """bench/compare.py's "equal to the formula in k of n runs": one run of three holds more than its formula, and
    another sends more; k counts them out."""
    runs = {"stage0_n2.json": summary("stage0", 1000, 500.0), "stage1_n2.json": summary("stage1", 1200, 500.0),
            "stage2_n2.json": summary("stage2", 1000, 700.0)}
    for name, s in runs.items():
        (tmp_path / name).write_text(json.dumps(s))
    table = compare.render_table(compare.load_rows(tmp_path))
    assert "Model states equal to the formula in 2 of 3 runs" in table, table
    assert "communication within 0.1% of the formula in 2." in table, table
