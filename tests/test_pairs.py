"""Every pair of options runs: an all-pairs (covering array) matrix over what a run takes, each row 2 steps of the tiny
GPT that must end with its report: exit 0, the memory table printed, --out's JSON written, every file asked for
there (--save_master, --timeline's and --profile's traces, one per rank), and on the fake CUDA device
(tests/fake_cuda.py, the CUDA paths on this CPU) nothing refused; and with numbers that hold (check_numbers): the
ledgers equal to their formulas, losses finite and plausible, a resumed row equal to the same row run straight.

The factors: the stage or offload mode, the dtype, N, --grad_accum, --checkpoint_activations, --timeline, --profile,
resume (the row run straight for 4 steps with --ckpt_dir, then resumed from its checkpoint after step 2),
--save_master, --grad_clip 1 or 0, --warmup 0 or the default, --no_prefetch (stage 3 and offload only), and the
device. A two-option mistake (a KeyError for one dtype under one switch) needs only its pair in some row:
`pairwise` below makes rows that hold every allowed pair of values, greedily and deterministically, and
test_rows_cover_every_pair checks that they do. Some triples are asked for too (REQUIRED): on the fake device,
checkpoint save and resume under every stage and offload mode, and --checkpoint_activations in every dtype. Each
row's pytest id names its options."""
import itertools
import json
import math
import shutil

import pytest

from conftest import ROOT, Runner, last_lines

FAKE_CUDA = str(ROOT / "tests" / "fake_cuda.py")
ENGINES = {"stage0": ["stage0_ddp.py"], "stage1": ["stage1.py"], "stage2": ["stage2.py"], "stage3": ["stage3.py"],
           "offload": ["offload.py"], "offload_params": ["offload.py", "--offload_params"],
           "delayed_update": ["offload.py", "--delayed_update"],
           "nvme": ["offload.py", "--offload_optimizer", "nvme", "--nvme_path", "{nvme_path}"]}
FACTORS = {"engine": list(ENGINES), "dtype": ["fp32", "bf16", "fp16"], "nproc": [1, 2, 4], "grad_accum": [1, 2],
           "device": ["cpu", "fake_cuda"], "resume": [False, True], "checkpoint_activations": [False, True],
           "timeline": [False, True], "profile": [False, True], "save_master": [False, True],
           "no_clip": [False, True], "warmup0": [False, True], "no_prefetch": [False, True]}
GATHERS = ("stage3", "offload", "offload_params", "delayed_update", "nvme")  # the engines that take --no_prefetch
REQUIRED = ([{"engine": e, "device": "fake_cuda", "resume": True} for e in ENGINES]
            + [{"dtype": d, "device": "fake_cuda", "checkpoint_activations": True} for d in FACTORS["dtype"]])
BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
RUN = ["--preset", "tiny", "--eval_batches", "1", "--sample_chars", "8", "--no_progress"]


def allowed(row):
    """A row, or part of one (a dict of some factors), that a run can take: only ZeRO-3's files take --no_prefetch."""
    return not (row.get("no_prefetch") and row.get("engine", GATHERS[0]) not in GATHERS)


def pairs(row, factors):
    """Every pair of (factor, value) a row holds, each pair in the order of `factors`."""
    held = [(f, row[f]) for f in factors if f in row]
    return set(itertools.combinations(held, 2))


def pairwise(factors, required=(), allowed=allowed):
    """Rows (dicts) holding every allowed pair of values, and every part-row in `required`. Greedy: a row starts from
    the first part-row not yet covered (a required one, else an uncovered pair), then takes, factor by factor, the
    allowed value that covers the most uncovered pairs with the values already chosen (the first such, on a tie)."""
    todo = [dict(r) for r in required]
    uncovered = set()
    for (f, vs), (g, ws) in itertools.combinations(factors.items(), 2):
        uncovered |= {((f, v), (g, w)) for v in vs for w in ws if allowed({f: v, g: w})}
    rows = []
    while todo or uncovered:
        row = todo.pop(0) if todo else dict(min(uncovered, key=lambda p: order(p, factors)))
        for f, values in factors.items():
            if f not in row:
                options = [v for v in values if allowed({**row, f: v})]
                row[f] = max(options, key=lambda v: len(pairs({**row, f: v}, factors) & uncovered))
        row = {f: row[f] for f in factors}
        rows.append(row)
        uncovered -= pairs(row, factors)
        todo = [r for r in todo if not r.items() <= row.items()]
    return rows


def order(pair, factors):
    """A pair's place in a fixed order (factors', then values'): the generator is deterministic."""
    return tuple(i for f, v in pair for i in (list(factors).index(f), factors[f].index(v)))


def name(row):
    """A row's pytest id: the options it runs with."""
    words = [row["engine"], row["dtype"], f"n{row['nproc']}", f"accum{row['grad_accum']}", row["device"]]
    words += [f for f in ("resume", "checkpoint_activations", "timeline", "profile", "save_master", "no_clip",
                          "warmup0", "no_prefetch") if row[f]]
    return "-".join(words)


ROWS = pairwise(FACTORS, REQUIRED)


def test_rows_cover_every_pair():
    """The generator's rows: each allowed, together every allowed pair of values and every required triple, and few."""
    assert all(allowed(r) for r in ROWS)
    held = set().union(*(pairs(r, FACTORS) for r in ROWS))
    for (f, vs), (g, ws) in itertools.combinations(FACTORS.items(), 2):
        for v, w in itertools.product(vs, ws):
            if allowed({f: v, g: w}):
                assert ((f, v), (g, w)) in held, f"no row runs {f}={v} with {g}={w}"
    for part in REQUIRED:
        assert any(part.items() <= r.items() for r in ROWS), f"no row runs {part}"
    assert not allowed({"engine": "stage2", "no_prefetch": True})  # the constraint is one, and holds
    assert len(ROWS) <= 30, f"{len(ROWS)} rows: the matrix would run too long for CI"


def command(row):
    """The script and arguments of a row's run (the run that reports, after a straight one when it resumes)."""
    script, *args = ENGINES[row["engine"]]
    args = [*args, *RUN, "--dtype", row["dtype"], "--grad_accum", str(row["grad_accum"]),
            "--batch_size", str(row["nproc"] * row["grad_accum"])]
    args += ["--checkpoint_activations"] * row["checkpoint_activations"] + ["--no_prefetch"] * row["no_prefetch"]
    args += ["--grad_clip", "0"] * row["no_clip"] + ["--warmup", "0"] * row["warmup0"]
    if row["device"] == "fake_cuda":
        return FAKE_CUDA, [str(ROOT / script), *args]
    return str(ROOT / script), [*args, "--device", "cpu"]


def train(tmp, script, args, row, findings):
    """Run on the row's N ranks; (the finished job, its last lines). What CUDA would refuse fails the test."""
    job = Runner(tmp).spawn(script, row["nproc"], args, env={"FAKE_CUDA_FINDINGS": str(findings)}, timeout=300)
    refused = [m for r in range(row["nproc"]) if (findings / f"rank{r}.json").exists()
               for m in json.loads((findings / f"rank{r}.json").read_text())["findings"]]
    assert not refused, "CUDA would refuse:\n" + "\n".join(refused)
    if row["device"] == "fake_cuda":  # every rank reported
        assert all((findings / f"rank{r}.json").exists() for r in range(row["nproc"])), job.stdout + job.stderr
    return job, "\n".join(last_lines(job.stdout + job.stderr, 30))


@pytest.mark.parametrize("row", ROWS, ids=[name(r) for r in ROWS])
def test_every_pair_runs(tmp_path, row):
    script, args = command(row)
    # the NVMe tier's state files: a directory of the row's own, empty again at every run's end
    nvme_path = tmp_path / "nvme"
    nvme_path.mkdir()
    args = [str(nvme_path) if a == "{nvme_path}" else a for a in args]
    findings = tmp_path / "findings"
    if row["resume"]:  # the row run straight for 4 steps, saving after step 2; the run below resumes from there
        # (and trains 2 steps, as every row: --profile needs one the memory meter leaves alone)
        straight_out = tmp_path / "straight.json"
        first, text = train(tmp_path, script, [*args, "--steps", "4", "--save_every", "2", "--ckpt_dir",
                                               str(tmp_path / "ck"), "--out", str(straight_out)], row,
                            tmp_path / "findings_straight")
        assert first.returncode == 0, f"the straight run failed:\n{text}"
        saved = tmp_path / "ck" / "step_000002"
        shutil.copytree(saved, tmp_path / "resume" / saved.name)  # a directory of its own: the resumed run saves too
        args += ["--steps", "4", "--resume", str(tmp_path / "resume")]
    else:
        args += ["--steps", "2"]
    files = {"--out": tmp_path / "summary.json"}
    files |= {"--save_master": tmp_path / "master.pt"} if row["save_master"] else {}
    files |= {"--timeline": tmp_path / "timeline"} if row["timeline"] else {}
    files |= {"--profile": tmp_path / "profile"} if row["profile"] else {}
    job, text = train(tmp_path, script, [*args, *(a for k, v in files.items() for a in (k, str(v)))], row, findings)
    assert job.returncode == 0, f"the run failed (exit code {job.returncode}):\n{text}"
    assert "memory per rank, MiB" in job.stdout, f"no memory table:\n{text}"
    assert "--- sample ---" in job.stdout, f"no sample at the end:\n{text}"
    summary = json.loads(files["--out"].read_text())
    assert summary["dtype"] == row["dtype"] and summary["world_size"] == row["nproc"], summary
    assert summary["resumed_from"] == (2 if row["resume"] else 0), summary["resumed_from"]  # the step it resumed
    check_numbers(summary, row)
    if row["resume"]:  # the resumed run's history and last step: the straight run's, bit for bit
        straight = json.loads(straight_out.read_text())
        for key in ("losses", "grad_norms", "val_loss"):
            assert summary[key] == straight[key], f"resumed at step 2, {key} {summary[key]}; straight {straight[key]}"
    if row["checkpoint_activations"]:  # what each block keeps: one micro-batch's input, in the run's dtype
        kept = summary["activation_checkpoints"]["bytes_per_block"]
        assert kept == summary["config"]["block_size"] * summary["config"]["n_embd"] * BYTES[row["dtype"]], summary
        assert "activations checkpointed" in job.stdout, text
    if row["save_master"]:
        assert files["--save_master"].stat().st_size > 0
    assert not list(nvme_path.iterdir()), f"state files left after the run: {list(nvme_path.iterdir())}"
    for option, trace in (("--timeline", "trace_rank{}.json"), ("--profile", "rank{}.json")):
        for r in range(row["nproc"] if option in files else 0):
            assert (files[option] / trace.format(r)).exists(), f"{option}: no {trace.format(r)} in {files[option]}"


def check_numbers(summary, row):
    """A row's numbers: its ledgers equal their formulas (model states category by category, bytes sent collective by
    collective, and on the CPU the process group's count equal to the ledger's), and its losses are finite, above
    the unigram loss (a GPT two steps from its initialisation cannot know more than the characters' frequencies:
    below it, the loss is mis-scaled, halved by a second division by grad_accum say, or the targets leak into the
    inputs) and below twice the loss of a uniform guess (ln V: a run that diverges)."""
    where = name(row)
    for category, v in summary["model_state_bytes"].items():
        assert v["measured"] == v["theory"], f"{where}: {category} {v['measured']:,} bytes, formula {v['theory']:,}"
    comm = summary["comm_bytes_per_step"]
    for op, v in comm["by_collective"].items():
        assert v["measured"] == pytest.approx(v["theory"], rel=1e-9, abs=1e-6), (
            f"{where}: {op} sent {v['measured']:,.0f} bytes per step, the formula says {v['theory']:,.0f}")
    seen = comm.get("process_group")
    if seen is not None:
        assert seen["calls"] == comm["calls"], f"{where}: the process group saw {seen['calls']}, ledger {comm['calls']}"
    uniform = math.log(summary["config"]["vocab_size"])
    for k, loss in enumerate(summary["losses"] + [summary["val_loss"]]):
        assert math.isfinite(loss) and summary["unigram_loss"] < loss < 2 * uniform, (
            f"{where}: loss {loss} ({k}: {len(summary['losses'])} steps, then validation), expected finite and between "
            f"the unigram loss {summary['unigram_loss']:.3f} and 2 ln V = {2 * uniform:.3f}")


def test_fp16_with_checkpointed_activations(tmp_path):
    """--dtype fp16 --checkpoint_activations (what --dtype auto picks on a V100 or a T4, with the switch) ends with its
    report, the activations each block keeps counted at fp16's 2 bytes."""
    out = tmp_path / "summary.json"
    job = Runner(tmp_path).spawn(str(ROOT / "train_gpt.py"), 1, [*RUN, "--steps", "1", "--batch_size", "2", "--dtype",
                                 "fp16", "--checkpoint_activations", "--out", str(out)])
    text = "\n".join(last_lines(job.stdout + job.stderr, 30))
    assert job.returncode == 0 and "memory per rank, MiB" in job.stdout, text
    summary = json.loads(out.read_text())
    assert summary["activation_checkpoints"]["bytes_per_block"] == 2 * 64 * 64 * 2, summary["activation_checkpoints"]
    assert "activations checkpointed: each of the 2 blocks keeps only its input for backward (2 x 64 x 64, 16.0 KiB)" \
        in job.stdout, text


def test_profile_of_a_one_step_run_is_refused(tmp_path):
    """--profile traces a step the memory meter leaves alone (their profilers cannot run one inside the other): a run
    of one step has none, and says so in one line instead of writing no trace."""
    job = Runner(tmp_path).spawn(str(ROOT / "train_gpt.py"), 1, [*RUN, "--steps", "1", "--batch_size", "1", "--profile",
                                 str(tmp_path / "profile")])
    assert job.returncode == 1 and job.stderr.strip().splitlines()[-1] == (
        f"error: --profile {tmp_path / 'profile'}: this run trains one step (from step 0 to 1), which the memory meter "
        "measures; train 2 steps or more to profile one"), job.stdout + job.stderr
