"""The pages: README.md is a first page a learner can read (its size, its first screen, a README in every folder);
bench/README.md's tables are exactly what the bench scripts wrote in bench/results/; no page or comment tells history;
every formula and ratio bench/README.md and bench/largest.py's headline print is computed again from train_gpt.py's
formulas and from the published results' tables. (test_readme.py checks README's table of lessons and its numbers;
test_commands.py runs every command the pages show.)"""
import re
import sys
import types
from pathlib import Path

import pytest
import torch

from conftest import ROOT
import train_gpt

sys.path.insert(0, str(ROOT / "bench"))
import largest  # noqa: E402
import results  # noqa: E402


def test_readme_is_a_first_page():
    """README.md is a learner's page: at most 200 lines and 16 KB; its first screen opens with what a learner types, a
    line each: the CPU build of torch, the install, the training command, the learner's check (saying that its first
    run compiles the C++ AdamW) and the test command that .ci/run calls; its first 40 lines, the reading order, with Ψ
    defined where it is first used."""
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 200 and len(text.encode()) <= 16 * 1024, (
        f"README.md is {len(text.splitlines())} lines, {len(text.encode()):,} bytes: at most 200 and 16 KB; move "
        "detail into the folder that it documents")
    first_screen = "\n".join(text.splitlines()[:24])
    lines = re.search(r"^```bash\n(.*?)^```", first_screen, re.S | re.M).group(1).splitlines()
    commands = [re.sub(r"\s+#.*$", "", line) for line in lines]
    assert commands[0].startswith("pip install torch==") and commands[0].endswith("download.pytorch.org/whl/cpu")
    assert "without a GPU" in lines[0], "README's first line must say that the CPU build is for a machine without a GPU"
    assert commands[1] == "pip install -r requirements.txt" and commands[2].startswith("OMP_NUM_THREADS=1 torchrun ")
    assert commands[3:] == ["python -m pytest tests -m quick", "python -m pytest tests -n 2 --dist loadfile"], commands
    assert "compiles the C++ AdamW" in lines[3], "README's learner's check must say that its first run compiles"
    path = "\n".join(text.splitlines()[:40])  # the first 40 lines: a path through the files
    assert all(s in path for s in ("## Reading order", "1. `train_gpt.py`", "2. `stage0_ddp.py`", "course/lessons")), (
        "README's reading order is not in its first 40 lines")
    assert text.index("Ψ") == text.index("Ψ parameters"), "README uses Ψ before it says what Ψ is"
    for folder in ("bench", "tests", "course", "examples"):
        assert f"]({folder}/README.md)" in text and (ROOT / folder / "README.md").exists(), folder


def test_bench_page_shows_the_results():
    """bench/README.md shows every table in bench/results/ exactly as its script wrote it, and nothing else
    (`python bench/results.py` copies the files into the page)."""
    files = {p.relative_to(results.RESULTS).with_suffix("").as_posix(): p.read_text()
             for p in results.RESULTS.rglob("*.md")}
    shown = results.blocks()
    assert sorted(shown) == sorted(files), (
        f"bench/README.md shows {sorted(set(shown) - set(files))} that bench/results/ lacks, and lacks "
        f"{sorted(set(files) - set(shown))}")
    for name, text in files.items():
        assert shown[name] == text, (f"bench/README.md's block of bench/results/{name}.md differs from the file: "
                                     "re-run the script with --results, or `python bench/results.py`; never edit either")


HISTORY = re.compile(r"issue [0-9]|predate|used to be|re-run since|need re-running|this session", re.I)


def test_no_history():
    """Pages and comments describe the code as it is: no issue numbers, no diary of what was tried or when it ran."""
    found = []
    for path in sorted(ROOT.rglob("*")):
        parts = path.relative_to(ROOT).parts
        if path.suffix not in (".md", ".py", ".cpp") or path == Path(__file__) or not path.is_file() or any(
                p.startswith(".") or p in ("runs", "exercises", "__pycache__") for p in parts):
            continue
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if HISTORY.search(line):
                found.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()[:120]}")
    assert not found, "history in the files:\n" + "\n".join(found)


# ---- every ratio and formula the pages and a bench's headline print, computed again from the code's formulas

def states_per_param(stage, param_bytes, world_size=1, nvme=False, grad_accum=1):
    """train_gpt.theory's model states for Ψ = N (so that a sharded category's bytes are its bytes per Ψ/N, and a
    whole one's N times its bytes per Ψ), with the categories it puts in host memory, and the bytes on disk per Ψ/N."""
    args = types.SimpleNamespace(grad_accum=grad_accum, offload_optimizer="nvme" if nvme else "cpu",
                                 nvme_buffer_count=largest.NVME_BUFFERS, offload_params=False, delayed_update=False)
    dtype = {2: torch.bfloat16, 4: torch.float32}[param_bytes]
    th = train_gpt.theory(stage, world_size, world_size, dtype, args, torch.device("cpu"), largest_bucket=0)
    return th["states"], th["host"], th["disk"]


def host_bytes_per_param(param_bytes, nvme):
    """Offload's host memory per parameter at N = 1 by the code's formulas: its host categories of model states (the
    NVMe tier's buffers aside: a bucket's worth, not a parameter's), plus the staging buffer of updated parameters
    (param_bytes each; pinned_theory counts it beside the gradient shard)."""
    states, host, _ = states_per_param("offload", param_bytes, nvme=nvme)
    return sum(states[k] for k in host) + param_bytes


def ratio_text(x, digits):
    return f"{x:.{digits}f}x"


@pytest.mark.parametrize("dtype, param_bytes", [("bf16", 2), ("fp32", 4)])
def test_largest_headline_states_the_codes_formulas(dtype, param_bytes):
    """bench/largest.py's headline lines: each ratio of model states it prints beside the measured one is the ratio
    train_gpt's formulas give (stage 0 against stage 3 at N = 4; against offload's device states; offload's host
    memory with the states against the NVMe tier's)."""
    rows = [dict(stage=s, world_size=n, largest_params=10, dtype=dtype)
            for s, n in [("stage0", 1), ("stage0", 4), ("stage3", 4), ("offload", 1), ("offload_nvme", 1)]]
    lines = largest.headline(rows, "host")
    whole = sum(states_per_param("stage0", param_bytes)[0].values())
    states, host, _ = states_per_param("offload", param_bytes)
    device = sum(v for k, v in states.items() if k not in host)
    ram = host_bytes_per_param(param_bytes, False)
    disk = host_bytes_per_param(param_bytes, True)
    expected = {"stage 3 at N=4": f": {whole}Ψ against {train_gpt.formula_text('stage3', param_bytes)}, 4x)",
                "offload at N=1": f": {whole}Ψ against {device}Ψ, {ratio_text(whole / device, 0)})",
                "offload with the optimizer states on NVMe": f": {ram}Ψ against {disk}Ψ and {largest.NVME_BUFFERS} "
                                                              f"buffers, {ratio_text(ram / disk, 1)})"}
    for start, formula in expected.items():
        [line] = [ln for ln in lines if ln.startswith(start)]
        printed = line[line.rindex("("):]
        assert printed.endswith(formula), (
            f"{dtype}: bench/largest.py prints {printed!r}; the code's formulas give {formula[2:]!r}")


NUMBER = re.compile(r"\d+(?:\.\d+)?")


def table_of(text):
    """A bench/largest.py result's rows as headline() reads them, from its table; Ψ is printed in millions to 2
    decimals. With the printed ratio column (the row's Ψ over its base stage's at the same N)."""
    header = next(ln for ln in text.splitlines() if ln.startswith("| stage | N |"))
    cells = [c.strip() for c in header.split("|")[1:-1]]
    col = next(i for i, c in enumerate(cells) if c.startswith("× "))
    dtype = "fp32" if "(fp32," in text else "bf16"
    rows = []
    for ln in text.splitlines():
        if re.match(r"\| \w+ \| \d+ \|", ln):
            c = [x.strip() for x in ln.split("|")[1:-1]]
            rows.append(dict(stage=c[0], world_size=int(c[1]), largest_params=float(c[3].rstrip("M")) * 1e6,
                             dtype=dtype, ratio=float(c[col]), limit=c[cells.index("limit")]))
    return rows, cells[col][2:].split(" at N")[0].replace("stage ", "stage")


def close_numbers(printed, computed, where):
    """Two lines alike but for their numbers, each computed one within the rounding of Ψ to 0.01M of the printed."""
    assert NUMBER.sub("#", printed) == NUMBER.sub("#", computed), f"{where}: {printed!r}, recomputed {computed!r}"
    for a, b in zip(NUMBER.findall(printed), NUMBER.findall(computed)):
        assert abs(float(a) - float(b)) <= 0.01 + 0.005 * float(b), f"{where}: {printed!r}, recomputed {computed!r}"


@pytest.mark.parametrize("name", ["largest", "largest_checkpointed", "largest_host_checkpointed"])
def test_published_largest_numbers_follow_their_tables(name):
    """A published bench/largest.py result: each row's ratio column is its Ψ over its base stage's at the same N, and
    the headline lines are what headline() prints from the table's rows (the measured ratios to the rounding of Ψ)."""
    text = (results.RESULTS / f"{name}.md").read_text()
    rows, base = table_of(text)
    psi = {(r["stage"], r["world_size"]): r["largest_params"] for r in rows}
    for r in rows:
        expected = r["largest_params"] / psi[base, r["world_size"]]
        assert abs(r["ratio"] - expected) <= 0.01 + 0.005 * expected, (
            f"{name}: {r['stage']} at N={r['world_size']} prints {r['ratio']}x {base}, its Ψ gives {expected:.3f}")
    limit = "host" if any(r["limit"] == "host memory" for r in rows) else "device"
    lines = largest.headline(rows, limit)
    assert lines, f"{name}: no headline from its rows"
    for line in lines:
        [printed] = [ln for ln in text.splitlines() if NUMBER.sub("#", ln) == NUMBER.sub("#", line)] or [None]
        assert printed is not None, f"{name} lacks the headline line bench/largest.py prints from its table: {line!r}"
        close_numbers(printed, line, name)


def test_bench_readme_numbers_are_the_results():
    """bench/README.md's sentences on the NVMe tier's result: its ratios from the published table, the formula's ratio
    and the host's formulas from train_gpt's."""
    rows, _ = table_of((results.RESULTS / "largest_host_checkpointed.md").read_text())
    ratio = {r["world_size"]: r["ratio"] for r in rows if r["stage"] == "offload_nvme"}
    bench = " ".join((ROOT / "bench" / "README.md").read_text().split())
    ram = host_bytes_per_param(2, False)
    disk = host_bytes_per_param(2, True)
    expected = (f"the tier trains {ratio[1]:.2f}x offload's parameters at N = 1 and {ratio[2]:.2f}x at N = 2, short "
                f"of the formula's {ram / disk:g}x")
    assert expected in bench, f"bench/README.md's sentence on the NVMe tier's result is not {expected!r}"
    states, _, _ = states_per_param("offload", 2)
    expected = (f"({states['master'] + states['adam_m'] + states['adam_v']}Ψ/N of them, {ram}Ψ/N with the gradient "
                f"shard and staging, in bf16)")
    assert expected in bench, f"bench/README.md's host formula of offload is not {expected!r}"
    assert f"`--offload_optimizer nvme` ({disk}Ψ/N and three buffers" in bench, (
        f"bench/README.md's host formula of the NVMe tier is not {disk}Ψ/N and three buffers")


def test_bench_readme_nvme_tier_sentences_are_its_table():
    """bench/README.md's sentences on the NVMe tier's published run: each step time, the disk's spread of writes, the
    range of the 1-buffer transfers' shares of the disk's and the states' MB, as bench/results/nvme_tier.md prints
    them."""
    table = (results.RESULTS / "nvme_tier.md").read_text()
    cell = lambda start: next(ln.split("|")[2].strip() for ln in table.splitlines() if ln.startswith(f"| {start}"))
    ms = lambda start: f"{float(cell(start).split()[0]):.0f} ms"
    bench = " ".join((ROOT / "bench" / "README.md").read_text().split())
    said = re.search(r"the step in RAM took (\d+ ms), the disk's own writes moved between ([\d,]+ and [\d,]+) MB/s "
                     r".*? a step with three buffers \((\d+ ms)\) came out (slower|faster) than with one \((\d+ ms)\)",
                     bench)
    assert said, "bench/README.md's sentence on the NVMe tier's step times is not where it was"
    three = float(ms("step, NVMe, 3 buffers")[:-3])
    one = float(ms("step, NVMe, 1 buffer")[:-3])
    spread = re.search(r"\(([\d,]+)–([\d,]+) MB/s\)", next(ln for ln in table.splitlines()
                                                           if ln.startswith("| disk's own sequential write")))
    expected = (ms("step, states in RAM"), f"{spread.group(1)} and {spread.group(2)}", ms("step, NVMe, 3 buffers"),
                "slower" if three > one else "faster", ms("step, NVMe, 1 buffer"))
    assert said.groups() == expected, f"bench/README.md says {said.groups()}; bench/results/nvme_tier.md: {expected}"
    shares = [int(re.search(r"\((\d+)% of the disk's\)", ln).group(1)) for ln in table.splitlines()
              if re.match(r"\| tier's (read|write), 1 buffer", ln)]
    assert f"({min(shares)}% to {max(shares)}% of them)" in bench, f"bench/README.md's range is not {shares}'s"
    states = re.search(r"the optimizer states ([\d,]+) MB", table).group(1)
    assert f"{states} MB written and read again within a step" in bench, f"bench/README.md: not the {states} MB"
