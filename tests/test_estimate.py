"""bench/estimate.py against train_gpt's formulas and the ZeRO paper's worked examples; bench/compare.py --from_dir on
schema-correct summaries built here from the formulas, and on one real (tiny, 2-rank) stage-1 run."""
import importlib.util
import json
import math

import pytest

from conftest import ROOT
from instruments import pinned_bytes
from train_gpt import (CharData, GPT, GPTConfig, PRESETS, comm_theory, host_categories, load_text, model_state_theory,
                       pinned_theory)


def _load(name):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


estimate = _load("estimate")
compare = _load("compare")
STAGES = ["stage0", "stage1", "stage2", "stage3", "offload"]
CATS = ["params", "grads", "master", "adam_m", "adam_v"]
# The ZeRO paper's model, written out here apart from train_gpt's code (which bench/estimate.py calls): bytes per
# parameter by category, and the categories each stage divides by N
PAPER_BYTES = {"params": None, "grads": None, "master": 4, "adam_m": 4, "adam_v": 4}  # None: the dtype's bytes
PAPER_SHARDED = {"stage0": (), "stage1": ("master", "adam_m", "adam_v"),
                 "stage2": ("grads", "master", "adam_m", "adam_v"), "stage3": tuple(CATS), "offload": tuple(CATS)}


# ---------------------------------------------------------------------------------------------------------------
# The estimator is the formula

@pytest.mark.parametrize("world_size", [1, 2, 4, 8, 64])
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("offload_params", [False, True])
def test_estimate_equals_model_state_theory(world_size, dtype, offload_params):
    pb = estimate.PARAM_BYTES[dtype]
    for n_params in (1_234_560, 7_777_777):  # a multiple of every N, and a count each sharded stage pads
        est = estimate.estimate(n_params, world_size, pb, offload_params)
        assert list(est) == STAGES
        for stage, r in est.items():
            padded = n_params if stage == "stage0" else math.ceil(n_params / world_size) * world_size
            paper = {k: (b or pb) * padded // (world_size if k in PAPER_SHARDED[stage] else 1)
                     for k, b in PAPER_BYTES.items()}
            assert r["by_category"] == paper, (stage, n_params, r["by_category"], paper)
            host = sum(v for k, v in r["by_category"].items() if k in host_categories(stage, offload_params))
            assert r["host"] == host and r["device"] + r["host"] == r["total"] == sum(r["by_category"].values())
            assert r["host_per_node"] == host * world_size  # no --gpus_per_node: one node of N ranks
        assert est["stage0"]["total"] == (pb + pb + 12) * n_params
        assert est["offload"]["total"] == est["stage3"]["total"]  # the same partitioning, split between device and host
        assert est["offload"]["device"] == (0 if offload_params else est["offload"]["by_category"]["params"])


def test_pinned_memory_as_pytorch_allocates_it():
    """With CUDA, PyTorch's pinned-memory cache rounds each allocation up to a power of two (checked against
    torch.cuda.host_memory_stats by tests/test_gpu.py). ZeRO-Offload pins the gradient shard (two with
    --delayed_update, and the global norm's float64 that its update's thread reads), the staging buffer and, with
    --offload_params, the parameter shard: one allocation each."""
    assert [pinned_bytes(n) for n in (0, 1, 2, 3, 1000, 1024, 1025, 3 * 2**20, 2**30 + 1)] == \
        [0, 1, 2, 4, 1024, 1024, 2048, 4 * 2**20, 2**31]
    shard = 2 * 7_777_780 // 4  # bf16 shard of Ψ' = 7,777,780 on 4 ranks: 3,888,890 bytes, pinned as 4 MiB
    for offload_params, delayed_update, buffers in ((False, False, 2), (True, False, 3), (False, True, 3), (True, True, 4)):
        norm = 8 * delayed_update
        order = 16  # ZeRO-3's unit-order check at N > 1 (outside.Order)
        assert pinned_theory("offload", 7_777_780, 4, 2, offload_params, delayed_update) == buffers * 4 * 2**20 + norm + order
        assert buffers * shard <= pinned_theory("offload", 7_777_780, 4, 2, offload_params, delayed_update) < 2 * buffers * shard
    assert pinned_theory("stage3", 7_777_780, 4) == 16 and pinned_theory("stage3", 7_777_780, 1) == 0
    for offload_params in (False, True):
        est = estimate.estimate(7_777_777, 4, 2, offload_params, delayed_update=True)
        assert est["offload"]["host_used"] == 12 * 7_777_780 // 4 + pinned_theory("offload", 7_777_780, 4, 2, offload_params, True)
        assert all(est[s]["host_used"] == 16 * (s == "stage3") for s in STAGES[:4])  # (stage 3's order check)


def test_paper_worked_example():
    """ZeRO paper: Ψ = 7.5B, N = 64: 120, 31.4, 16.6, 1.88 GB; Ψ = 1T, N = 1024, ZeRO-3: 15.6 GB (fp16, K = 12)."""
    est = estimate.estimate(7.5e9, 64, 2)
    got = [round(est[s]["total"] / 1e9, 2) for s in ("stage0", "stage1", "stage2", "stage3")]
    assert got == [120.0, 31.41, 16.64, 1.88]
    assert [f"{g:.3g}" for g in got] == ["120", "31.4", "16.6", "1.88"]
    assert f"{estimate.estimate(1e12, 1024, 2)['stage3']['total'] / 1e9:.3g}" == "15.6"
    ok, text = estimate.check_paper()
    assert ok and "MISMATCH" not in text


def test_cli_prints_the_paper_numbers(capsys):
    assert estimate.main(["--params", "7.5e9", "--world_size", "64", "--gpu_mem", "80"]) == 0
    out = capsys.readouterr().out
    for stage, gb in (("stage0", "120"), ("stage1", "31.4"), ("stage2", "16.6"), ("stage3", "1.88")):
        row = next(l for l in out.splitlines() if l.startswith(f"| {stage} |"))
        assert row.rstrip(" |").endswith(gb), row
    assert "5B parameters" in out  # stage 0 in 80 GB: 80e9 / 16 bytes
    assert estimate.main(["--params", "1e12", "--nodes", "128", "--gpus_per_node", "8"]) == 0
    row = next(l for l in capsys.readouterr().out.splitlines() if l.startswith("| stage3 |"))
    assert row.rstrip(" |").endswith("15.6"), row
    assert estimate.main(["--params", "7.5e9", "--world_size", "64", "--gib"]) == 0
    row = next(l for l in capsys.readouterr().out.splitlines() if l.startswith("| stage0 |"))
    assert row.rstrip(" |").endswith(f"{120e9 / 2**30:,.3g}"), row  # 112 GiB


def test_largest_model_fits():
    n, gpu = 16, 80e9
    fit = estimate.largest_model(gpu, n, 2)
    assert fit["stage0"] == 5_000_000_000 and fit["stage3"] == 80_000_000_000
    for stage, psi in fit.items():
        if stage == "offload":
            continue
        assert estimate.estimate(psi - psi % n, n, 2)[stage]["device"] <= gpu
        assert estimate.estimate(psi + 2 * n, n, 2)[stage]["device"] > gpu
    assert estimate.largest_model(gpu, n, 2, offload_params=True)["offload"] is None  # nothing on the device
    # with a host limit: 1 TB per node of 8 ranks, 14 host bytes per param per rank / 16 ranks
    assert estimate.largest_model(gpu, n, 2, host_mem_bytes=1e12, gpus_per_node=8)["offload"] == math.floor(1e12 / (14 / n * 8))


def test_preset_params_on_meta_matches_a_real_model():
    n_layer, n_head, n_embd, block_size, _ = PRESETS["tiny"]
    vocab = len(CharData(load_text(None), block_size).chars)
    real = sum(p.numel() for p in GPT(GPTConfig(block_size, vocab, n_layer, n_head, n_embd)).parameters())
    assert estimate.preset_params("tiny") == real
    assert 1.5e9 < estimate.preset_params("gpt2-xl") < 1.6e9  # GPT-2 XL without biases, head tied


# ---------------------------------------------------------------------------------------------------------------
# compare.py renders from JSON only

def fake_summary(stage, world_size, n_params=10_000, dtype="fp32", loss=3.25):
    """A summary with train_gpt's schema whose measured numbers are the formulas' (peak: model states + 1 MiB)."""
    pb = 4 if dtype == "fp32" else 2
    padded = n_params if stage == "stage0" else math.ceil(n_params / world_size) * world_size
    formula = "stage3" if stage == "offload" else stage
    theory = model_state_theory(stage, padded, world_size, pb)
    comm = comm_theory(formula, padded, world_size, pb, 1)
    cfg = dict(block_size=64, vocab_size=103, n_layer=2, n_head=2, n_embd=64)
    return dict(stage=stage, world_size=world_size, n_params=n_params, padded_numel=padded, dtype=dtype, device="cpu",
                config=cfg, args=dict(steps=4, batch_size=8, grad_accum=1, preset="tiny"),
                losses=[4.0, 3.5, loss], grad_norms=[1.0] * 3, val_losses=[[3, loss + 0.1]], val_loss=loss + 0.1,
                unigram_loss=3.25, tokens_per_s=1000.0 * world_size, peak_memory_bytes=sum(theory.values()) + 2**20,
                other_tensor_bytes=0, model_state_bytes={k: {"measured": v, "theory": v} for k, v in theory.items()},
                model_state_bytes_per_rank=[dict(theory)] * world_size,
                comm_bytes_per_step={"measured": sum(comm.values()), "theory": sum(comm.values()),
                                     "by_collective": {k: {"measured": v, "theory": v} for k, v in comm.items()}})


def test_from_dir_renders_fake_runs(tmp_path, capsys):
    for n in (1, 2):
        for stage in STAGES:
            (tmp_path / f"{stage}_n{n}.json").write_text(json.dumps(fake_summary(stage, n)))
    (tmp_path / "notes.json").write_text(json.dumps({"not": "a run"}))  # ignored: not a summary
    assert compare.main(["--from_dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    table = (tmp_path / "table.md").read_text()
    assert table.strip() in out
    rows = [l for l in table.splitlines() if l.startswith("| stage") or l.startswith("| offload")]
    assert len(rows) == 1 + 10  # header + 5 stages x 2 N
    assert [r.split("|")[1].strip() for r in rows[1:6]] == STAGES  # sorted by N, then stage
    mib = lambda b: f"{b / 2**20:.2f}"
    s3 = fake_summary("stage3", 2)
    row = next(r for r in rows if r.startswith("| stage3 | 2 |"))
    cell = mib(s3["model_state_bytes"]["master"]["theory"])
    assert f"{cell} / {cell}" in row and "3.25000" in row
    off = next(r for r in rows if r.startswith("| offload | 2 |"))
    assert off.count("ᴴ") == len(host_categories("offload"))
    assert "Model states equal to the formula in 10 of 10 runs" in table
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert len(summary["rows"]) == 10 and summary["rows"][0]["stage"] == "stage0"
    if importlib.util.find_spec("matplotlib"):
        assert (tmp_path / "memory.png").stat().st_size > 10_000
    else:
        assert "pip install matplotlib" in out


def test_from_dir_without_runs_fails_clearly(tmp_path):
    with pytest.raises(SystemExit, match="no run summaries"):
        compare.main(["--from_dir", str(tmp_path)])


def test_from_dir_renders_a_real_run(runner, tmp_path, capsys):
    out = tmp_path / "stage1_n2.json"
    run = runner.run(str(ROOT / "stage1.py"), 2, "--preset", "tiny", "--steps", "2", "--batch_size", "4", "--dtype", "fp32",
                     "--eval_batches", "1", "--sample_chars", "0", "--no_progress")
    out.write_text(json.dumps(run.summary))
    assert compare.main(["--from_dir", str(tmp_path)]) == 0
    table = (tmp_path / "table.md").read_text()
    row = next(l for l in table.splitlines() if l.startswith("| stage1 | 2 |"))
    s = json.loads(out.read_text())
    total = sum(v["theory"] for v in s["model_state_bytes"].values())
    assert f"{total / 2**20:.2f} / {total / 2**20:.2f}" in row
    assert "Model states equal to the formula in 1 of 1 runs" in table


def test_cli_help_and_bad_world_size(capsys):
    """--help's description is a whole sentence, names only flags that exist; N < 1 is refused, not taken as 1."""
    with pytest.raises(SystemExit):
        estimate.main(["--help"])
    out = capsys.readouterr().out
    description = out.split("\n\n")[1]
    assert description.rstrip().endswith("."), description
    assert "--unit" not in out and "--gib" in out
    for bad in (["--world_size", "0"], ["--world_size", "-2"], ["--nodes", "0", "--gpus_per_node", "8"]):
        with pytest.raises(SystemExit) as e:
            estimate.main(["--params", "1e9", *bad])
        assert e.value.code == 2
        assert "must be at least 1" in capsys.readouterr().err
