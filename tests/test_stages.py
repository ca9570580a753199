"""Every stage against the single-process reference (train_gpt.py), on CPU with gloo at N = 1, 2, 4, in fp32:
the same losses, gradient norms and parameters; model-state bytes and communication bytes equal to the stage's
formula; and what each stage promises to free, freed."""
import pytest
import torch

from conftest import ROOT, STAGES
from train_gpt import CharData, load_text

# A GPT whose parameter count divides by neither 2 nor 4 (with the built-in corpus), with its tied head.
VOCAB = len(CharData(load_text(None), 32).chars)
BLOCK = 33 if (33 * (VOCAB + 33 + 1)) % 2 else 32  # n_params = C(V + T + 1) + L(12C^2 + 2C): odd when C and V+T+1 are
MODEL = ["--preset", "tiny", "--n_layer", "2", "--n_head", "3", "--n_embd", "33", "--block_size", str(BLOCK)]
# Several steps of fp32 with gradient accumulation, through warmup, with clipping that clips (checked below).
TRAIN = ["--dtype", "fp32", "--steps", "6", "--batch_size", "8", "--grad_accum", "2", "--warmup", "2",
         "--eval_every", "3", "--eval_batches", "2", "--sample_chars", "0", "--no_progress"]
BUCKETS = ["--bucket_mb", "0.02"]  # about 5,000 fp32 elements: several buckets, each padded on its own

# Tolerances. fp32 summed in a different order (across ranks, in buckets) differs in the last bits: losses agree to
# 2e-6 and gradient norms to 1e-5 relative. Parameters: 99.9% of elements agree to 1e-6 of their tensor's largest
# value; Adam divides by the root of the squared gradient, so where a gradient is near zero its rounding noise becomes
# a step of up to lr, and a few elements may differ by up to ATOL_ANY.
LOSS_ATOL, NORM_RTOL, BULK_RTOL, BULK_SHARE, ATOL_ANY = 2e-6, 1e-5, 1e-6, 0.999, 1e-5


def train(runner, stage_file, nproc):
    extra = BUCKETS if "--bucket_mb" in runner.options(stage_file) else []
    return runner.run(stage_file, nproc, *MODEL, *TRAIN, *extra)


@pytest.fixture(scope="session")
def reference(runner):
    ref = runner.run(str(ROOT / "train_gpt.py"), None, *MODEL, *TRAIN)
    assert ref.summary["n_params"] % 2 == 1, "the test model must have an odd parameter count"
    assert max(ref.summary["grad_norms"]) > 1.0, "clipping at 1.0 must really clip in this test"
    return ref


def compare_params(expected, got, where, bulk_rtol=BULK_RTOL, bulk_share=BULK_SHARE, atol_any=ATOL_ANY,
                   median_rtol=None):
    """Every tensor of `got` against `expected`: bulk_share of its elements within bulk_rtol of its largest value, all
    within atol_any, and (median_rtol) its median element within median_rtol of its largest value."""
    for name, e in expected.items():
        assert name in got, f"{where}: parameter {name} is missing from the final parameters"
        g = got[name]
        assert g.shape == e.shape, f"{where}: parameter {name} has shape {tuple(g.shape)}, expected {tuple(e.shape)}"
        diff = (g - e).abs()
        bulk = (diff <= bulk_rtol * e.abs().max()).float().mean().item()
        if bulk < bulk_share or diff.max() > atol_any:
            i = tuple(int(j) for j in torch.unravel_index(diff.argmax(), diff.shape))
            pytest.fail(f"{where}: parameter {name}{list(i)} is {g[i]:.8g}, expected {e[i]:.8g} (|diff| {diff[i]:.2e}); "
                        f"{100 * (1 - bulk):.2f}% of its elements differ by more than {bulk_rtol} x its largest value",
                        pytrace=False)
        median = (diff.median() / e.abs().max()).item()
        if median_rtol is not None and median > median_rtol:
            pytest.fail(f"{where}: parameter {name}: its median element differs by {median:.2e} x its largest value, "
                        f"more than {median_rtol:.0e}: a small error in every element (a weight decay lost?)",
                        pytrace=False)


def first_difference(expected, got, tol):
    return next((i for i, (e, g) in enumerate(zip(expected, got)) if abs(e - g) > tol * max(1.0, abs(e))), None)


@pytest.mark.parametrize("nproc", [1, pytest.param(2, marks=pytest.mark.quick), 4])  # -m quick: the learner's check
def test_parity_with_reference(runner, reference, stage_file, nproc):
    run = train(runner, stage_file, nproc)
    ref, s = reference.summary, run.summary
    where = f"{s['stage']} at N={nproc}"
    assert len(s["losses"]) == len(ref["losses"]), f"{where}: {len(s['losses'])} losses, expected {len(ref['losses'])}"
    k = first_difference(ref["grad_norms"], s["grad_norms"], NORM_RTOL)
    if k is not None:
        e, g = ref["grad_norms"][k], s["grad_norms"][k]
        hint = ""
        if abs(g / e - nproc) < 0.01 * nproc and nproc > 1:
            hint = f" The norm is {nproc}x too large: the gradients were summed over the ranks, not averaged."
        elif abs(g / e - 1 / 2) < 0.01:
            hint = " The norm is half: was the loss divided by grad_accum twice, or a micro-step's gradient lost?"
        pytest.fail(f"{where}: global gradient norm at step {k} is {g:.7g}, expected {e:.7g}.{hint}", pytrace=False)
    k = first_difference(ref["losses"], s["losses"], LOSS_ATOL)
    assert k is None, f"{where}: loss at step {k} is {s['losses'][k]:.7f}, expected {ref['losses'][k]:.7f}"
    assert abs(s["val_loss"] - ref["val_loss"]) <= LOSS_ATOL * 10, f"{where}: val loss {s['val_loss']} != {ref['val_loss']}"
    compare_params(reference.master, run.master, where)


@pytest.mark.parametrize("nproc", [1, 2, 4])
def test_model_state_bytes_match_formula(runner, stage_file, nproc):
    s = train(runner, stage_file, nproc).summary
    where = f"{s['stage']} at N={nproc}"
    n, padded = s["n_params"], s["padded_numel"]
    assert padded % nproc == 0 or s["stage"] == "stage0", f"{where}: padded count {padded} is not a multiple of N"
    assert n <= padded <= n + 0.01 * n, f"{where}: {padded - n} padding elements for {n} parameters: too many"
    for category, v in s["model_state_bytes"].items():
        assert v["measured"] == v["theory"], (f"{where}: this rank holds {v['measured']:,} bytes of {category}, the "
                                              f"formula says {v['theory']:,}")
    for rank, states in enumerate(s["model_state_bytes_per_rank"]):
        assert states == s["model_state_bytes_per_rank"][0], f"{where}: rank {rank} holds {states}, rank 0 " \
            f"{s['model_state_bytes_per_rank'][0]}: shards must be equal"


@pytest.mark.slip
@pytest.mark.parametrize("nproc", [2, 4])  # at N = 1 a ring sends nothing: the formula and the ledger both say 0
def test_communication_bytes_match_formula(runner, stage_file, nproc):
    s = train(runner, stage_file, nproc).summary
    for op, v in s["comm_bytes_per_step"]["by_collective"].items():
        where = (f"{s['stage']} at N={nproc}: {op} sent {v['measured']:,.0f} bytes per step, the formula says "
                 f"{v['theory']:,.0f}")
        # the gradients' collective (not the norm's scalar) at a whole multiple of the formula: each gradient reduced
        # that many times
        gradients = op == "reduce_scatter" or op == "all_reduce" and v["theory"] > 64
        times = v["measured"] / v["theory"] if gradients else 1
        assert not (times >= 2 and times == round(times)), (
            f"the slip: each gradient reduced {times:.0f} times a step ({where}): a bucket's {op} issued again (a hook "
            f"that reduces the same bucket twice, or backward reducing what a hook already did)")
        assert v["measured"] == pytest.approx(v["theory"], rel=1e-9, abs=1e-6), where


@pytest.mark.parametrize("nproc", [1, 2, 4])
def test_every_collective_goes_through_the_ledger(runner, stage_file, nproc):
    """The ledger counts the calls made through `comm`; the process group (tests/count_collectives wraps
    torch.distributed's collectives in every run) counts every collective the rank issues, whoever calls it. On the
    measured step the two agree, call for call and byte for byte: a collective called on torch.distributed directly
    is sent but not in the ledger. At N = 1 nothing is called at all (comm.py's world of one: every result is the
    rank's own), so both count none."""
    s = train(runner, stage_file, nproc).summary
    where = f"{s['stage']} at N={nproc}"
    comm = s["comm_bytes_per_step"]
    seen = comm["process_group"]
    assert seen is not None, f"{where}: no count at the process group in this run (tests/count_collectives)"
    if nproc == 1:
        assert not any(seen["calls"].values()), f"{where}: a world of one called collectives: {seen['calls']}"
    ledger = {op: v["measured"] for op, v in comm["by_collective"].items() if v["measured"] or op in seen["sent"]}
    for op in sorted(set(seen["calls"]) | set(comm["calls"])):
        got = seen["calls"].get(op, 0)
        want = comm["calls"].get(op, 0)
        assert got == want, (f"{where}: the process group saw {got} call(s) of {op} in the measured step, the ledger "
                             f"{want}: a collective called outside comm.py (on torch.distributed directly?)")
    for op in sorted(set(seen["sent"]) | set(ledger)):
        got = seen["sent"].get(op, 0.0)
        want = ledger.get(op, 0.0)
        assert got == pytest.approx(want, rel=1e-9, abs=1e-6), (
            f"{where}: the process group sent {got:,.0f} bytes of {op} in the measured step, the ledger {want:,.0f}")


# What a rank may hold beyond its model states right after backward (other = live tensors - states - data), from
# what the stage is: activations are freed by then; the last micro-batch's tokens (x and y, int64) are alive; stage 1
# keeps the reduced shard of the gradient (Ψ/N in the gradient's dtype) for its step, and offload the staging buffer
# of its updated parameters (Ψ/N, in host memory, which on a CPU is the device's too). Beyond that, scalars only (the
# loss sum, the norm, Adam's step tensors): SCALARS bounds them.
SCALARS = 4096


def micro_batch_tokens(s):
    """The bytes of the last micro-batch's x and y (int64), alive in train_step when the meter reads the rank."""
    n = s["world_size"]
    args = s["args"]
    micro_batch = args["batch_size"] // (n * args["grad_accum"])
    return 2 * micro_batch * s["config"]["block_size"] * 8


def other_allowed(s):
    """The bytes of tensors beyond model states a run of summary s may hold right after backward, by the formula."""
    n = s["world_size"]
    tokens = micro_batch_tokens(s)
    element = {"fp32": 4, "bf16": 2, "fp16": 2}[s["dtype"]]
    shard = s["padded_numel"] // n * element
    kept = {"stage1": shard, "offload": shard}.get(s["stage"], 0)
    return tokens + kept + SCALARS


def check_other(s):
    """None if s's other_tensor_bytes is within other_allowed(s), and counts at least the micro-batch's tokens (which
    any stage holds then: a meter that misses them sees nothing), else the failure's message."""
    if s["other_tensor_bytes"] < micro_batch_tokens(s):
        return (f"{s['stage']} at N={s['world_size']}: {s['other_tensor_bytes']:,} bytes of tensors beyond model "
                f"states, fewer than the micro-batch's tokens alone ({micro_batch_tokens(s):,}): the meter misses them")
    allowed = other_allowed(s)
    if s["other_tensor_bytes"] <= allowed:
        return None
    full_gradient = s["n_params"] * 4
    return (f"{s['stage']} at N={s['world_size']}: {s['other_tensor_bytes']:,} bytes of tensors beyond model states "
            f"after backward, the formula allows {allowed:,} (a full fp32 gradient or copy of the parameters is "
            f"{full_gradient:,}): memory of the full gradient, or gathered parameters, still held, or a copy outside "
            f"model_states()")


@pytest.mark.parametrize("nproc", [2, 4])
def test_freed_what_the_stage_promises(runner, stage_file, nproc):
    """Beyond model states and data, what tensors does a rank hold right after backward? No more than the formula
    allows (other_allowed): no copy of the parameters outside model_states(), and from stage 2 on no full gradient,
    in stage 3 no gathered parameter either."""
    s = train(runner, stage_file, nproc).summary
    problem = check_other(s)
    assert problem is None, problem


LEAKY_STAGE1 = """import torch

import stage1
from train_gpt import main


class Leaky(stage1.ZeRO1Engine):
    def __init__(self, *args):
        super().__init__(*args)
        self.copy = torch.cat([b.param.float() for b in self.buckets])  # a whole fp32 copy, outside model_states()


main(Leaky, stage="stage1")
"""


def test_other_bound_fails_a_stage_that_keeps_a_copy(runner, tmp_path, request):
    """The positive control of test_freed_what_the_stage_promises: stage 1 with a whole fp32 copy of its parameters
    kept outside model_states() (4Ψ more per rank) exceeds the bound; and the table the run ends with shows it without
    the engine's word: `other` counts its bytes, and names the attribute that holds them (engine.copy)."""
    if request.config.getoption("stage"):
        pytest.skip("a control on the repository's stage 1")
    leaky = tmp_path / "leaky_stage1.py"
    leaky.write_text(LEAKY_STAGE1)
    run = runner.run(str(leaky), 2, *MODEL, *TRAIN, *BUCKETS)
    s = run.summary
    assert check_other(s) is not None, (f"a stage 1 that keeps a whole fp32 copy holds {s['other_tensor_bytes']:,} "
                                        f"bytes beyond its states, within the bound {other_allowed(s):,}")
    copy = s["padded_numel"] * 4
    assert s["other_named"].get("copy") == copy, f"the copy ({copy:,} bytes) is not named in {s['other_named']}"
    assert s["live_tensor_bytes"] >= sum(v["measured"] for v in s["model_state_bytes"].values()) + copy, s
    assert f"engine.copy {copy / 2**20:.2f} MiB" in " ".join(run.stdout.split()), run.stdout


def test_peak_memory_falls_stage_by_stage(runner, request):
    """At N = 4, with a model deep enough that stage 3's working set (root + two blocks) is small, the measured peak
    falls from stage 0 to stage 3, as the formulas say."""
    files = [str(ROOT / f) for f in STAGES[:4]]  # offload trades device memory for host memory: on a CPU, both are one
    if request.config.getoption("stage"):
        pytest.skip("compares the repository's stages 0 to 3")
    model = ["--preset", "tiny", "--n_layer", "8", "--n_embd", "64", "--n_head", "2", "--block_size", "16"]
    args = [*model, "--dtype", "fp32", "--steps", "2", "--batch_size", "4", "--sample_chars", "0", "--no_progress"]
    peaks = {}
    for f in files:
        s = runner.run(f, 4, *args, *(["--bucket_mb", "0.05"] if "--bucket_mb" in runner.options(f) else [])).summary
        peaks[s["stage"]] = (s["peak_memory_bytes"], sum(v["theory"] for v in s["model_state_bytes"].values()))
    table = ", ".join(f"{k}: peak {p:,} (states {t:,})" for k, (p, t) in peaks.items())
    values = [p for p, _ in peaks.values()]
    assert values == sorted(values, reverse=True) and len(set(values)) == 4, f"peaks must fall stage by stage: {table}"
    for k, (p, t) in peaks.items():
        assert p >= t, f"{k}: measured peak {p:,} is below its own model states {t:,}: the peak meter is wrong"
