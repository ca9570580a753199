"""README's numbers that come from the files themselves (the table of lessons, the formulas, the NVMe tier's figures
from the published bench result), and the size of the ladder's steps: each diff must carry its one idea and little
else, each file must fit a reading."""
import re
import sys

import pytest

from conftest import ROOT

sys.path.insert(0, str(ROOT / "course"))
from make_lessons import LESSONS, lesson, table  # noqa: E402

# each lesson (course/make_lessons.py): the most code lines, and the most other lines, it may change
# every lesson: at most 60 code lines, but three ideas that need more room: ZeRO-3 (it also trades stage 2's
# bucket-order reductions for one unit order on every rank, checked at each step: outside.Order), offload (the norm on
# the device, each copy down behind its reduce-scatter) and the delayed update (its own thread, a second parameter
# shard): each is more than one idea, which lessons of their own would hold
LESSON_LIMITS = {"1_zero1": (50, 60), "2_zero2": (40, 40), "3_zero3": (70, 60), "4_prefetch": (10, 5),
                 "5_recompute": (5, 5), "6_offload": (85, 75), "7_copy_stream": (20, 10), "8_offload_params": (26, 10),
                 "9_delayed_update": (71, 25), "10_nvme": (60, 20)}
# the fenced lessons (an idea inside a file): the most regions each may fence, in the file that holds it
FENCED_REGIONS = {("stage3.py", "Prefetch"): 2, ("stage3.py", "Recompute"): 2, ("offload.py", "Copy stream"): 2,
                  ("offload.py", "ZeRO-3 Offload"): 1, ("offload.py", "DPU"): 1, ("offload.py", "NVMe"): 1}
# offload.py fences its own ideas only (the exercise's [Offload] and the three lessons after it); the ideas it keeps
# from stage 3 are fenced in stage1.py to stage3.py, whose exercises blank them
MOST_FENCE_LINES = {"offload.py": 20}
# Loose on purpose: room for clarity, never a budget to pack lines into (no tuple of unrelated values, no long calls).
MOST_LINES = {"train_gpt.py": 570, "stage0_ddp.py": 300, "stage1.py": 300, "stage2.py": 300, "stage3.py": 300,
              "offload.py": 600}
WIDTH = 120


def test_lesson_table_matches_the_files():
    """README's table of lessons is what course/make_lessons.py counts in the files as they are, row for row."""
    rows = [ln for ln in (ROOT / "README.md").read_text().splitlines() if re.match(r"\| `\d+_\w+` \|", ln)]
    expected = [ln for ln in table().splitlines() if ln.startswith("| `")]
    assert rows == expected, ("README's table of lessons differs from the files; paste `python course/make_lessons.py`'s "
                              "table:\n" + "\n".join(expected))
    wide = [row for row in rows if len(row) > WIDTH]
    assert not wide, f"rows of README's table of lessons wider than {WIDTH} columns (shorten the idea):\n" + "\n".join(wide)


@pytest.mark.parametrize("name, before, after", [lesson[:3] for lesson in LESSONS], ids=[n for n, *_ in LESSONS])
def test_each_lesson_is_small(name, before, after):
    """A lesson shows its idea and little else: at most LESSON_LIMITS' code lines and other lines changed."""
    _, code, prose = lesson(before, after)
    most_code, most_prose = LESSON_LIMITS[name]
    assert code <= most_code and prose <= most_prose, (
        f"{name}: {before} -> {after} changes {code} code lines (at most {most_code}) and {prose} others (at most "
        f"{most_prose})")


# each lesson's question in README's "Questions for students", and its answer in course/ANSWERS.md, by this label
QUESTION_OF = {"1_zero1": "Stage 1", "2_zero2": "Stage 2", "3_zero3": "Stage 3", "4_prefetch": "Prefetch",
               "5_recompute": "Recompute", "6_offload": "Offload", "7_copy_stream": "Copy stream",
               "8_offload_params": "Offload params", "9_delayed_update": "Delayed update",
               "10_nvme": "NVMe"}


def test_every_lesson_has_a_question_and_its_answer():
    """Each lesson of course/make_lessons.py asks the student something (README) that ANSWERS.md answers."""
    text = readme()
    questions = text[text.index("## Questions for students"):]
    questions = questions[:questions.index("\n## ")]
    answers = (ROOT / "course" / "ANSWERS.md").read_text(encoding="utf-8")
    assert set(QUESTION_OF) == {name for name, *_ in LESSONS}, "a lesson without a label here: add it to QUESTION_OF"
    for name, label in QUESTION_OF.items():
        assert f"\n- {label}: " in questions, f"lesson {name}: no question for students labelled {label!r} in README"
        assert f"\n**{label}: " in answers, f"lesson {name}: no answer labelled {label!r} in course/ANSWERS.md"


@pytest.mark.parametrize("file, tag", FENCED_REGIONS)
def test_each_fenced_lesson_is_in_few_places(file, tag):
    """An idea fenced inside a file lives in at most FENCED_REGIONS' regions of it, so its lesson reads in one or two
    places, beside the code it changes."""
    regions = (ROOT / file).read_text(encoding="utf-8").count(f"# [{tag}]")
    assert 0 < regions <= FENCED_REGIONS[(file, tag)], f"{file}: [{tag}] in {regions} regions (at most " \
        f"{FENCED_REGIONS[(file, tag)]})"


@pytest.mark.parametrize("name", MOST_FENCE_LINES)
def test_few_fence_lines(name):
    """A file's fences (`# [TAG] ...` and `# [/TAG]`) are at most MOST_FENCE_LINES of its lines: markers for the
    exercises and the lessons, not a second structure for the reader."""
    fences = [ln for ln in (ROOT / name).read_text(encoding="utf-8").splitlines() if re.match(r"\s*# \[/?[\w -]+\]", ln)]
    assert len(fences) <= MOST_FENCE_LINES[name], f"{name}: {len(fences)} fence lines (at most {MOST_FENCE_LINES[name]})"


@pytest.mark.parametrize("name", MOST_LINES)
def test_files_fit_a_reading(name):
    """train_gpt.py, the stage files and offload.py: at most MOST_LINES lines, none wider than WIDTH columns."""
    lines = (ROOT / name).read_text(encoding="utf-8").splitlines()
    wide = [f"{name}:{i}: {len(ln)} columns" for i, ln in enumerate(lines, 1) if len(ln) > WIDTH]
    assert len(lines) <= MOST_LINES[name] and not wide, (
        f"{name}: {len(lines)} lines (at most {MOST_LINES[name]}); wider than {WIDTH}: " + ("; ".join(wide) or "none"))


# ---- README's numbers, computed here from the code that makes them

def readme():
    return (ROOT / "README.md").read_text(encoding="utf-8")


def first_command_model():
    """The first command's GPT (--preset tiny on the built-in corpus) and its data: Ψ without training it."""
    import torch
    from train_gpt import GPT, PRESETS, CharData, GPTConfig, load_text
    n_layer, n_head, n_embd, block_size, vocab_size = PRESETS["tiny"]
    cfg = GPTConfig(block_size, vocab_size, n_layer, n_head, n_embd)
    data = CharData(load_text(None), cfg.block_size)
    cfg.vocab_size = max(cfg.vocab_size, len(data.chars))
    with torch.device("meta"):
        model = GPT(cfg)
    return sum(p.numel() for p in model.parameters()), data


def test_stage0_model_states_of_the_first_command():
    """"Run stage0_ddp.py the same way and the model states read X MiB per rank (20Ψ)": the formula's total for the
    first command's GPT at N = 2 in the dtype of README's sample table (stage 0 pads nothing)."""
    from train_gpt import formula_text, model_state_theory
    n, _ = first_command_model()
    dtype = re.search(r"memory per rank, MiB \(stage3, (\w+),", readme()).group(1)
    param_bytes = 4 if dtype == "fp32" else 2
    said = re.search(r"model states read ([\d.]+) MiB per rank \((\S+)\)", readme())
    assert said, "README no longer says what stage 0's model states read"
    mib = sum(model_state_theory("stage0", n, 2, param_bytes=param_bytes).values()) / 2**20
    assert said.group(1) == f"{mib:.2f}", f"README: stage 0 holds {said.group(1)} MiB per rank; the formula, {mib:.2f}"
    assert said.group(2) == formula_text("stage0", param_bytes=param_bytes), f"README says {said.group(2)}"


def test_unigram_loss_of_the_first_command():
    """"(X for a guess from the characters' frequencies alone)": the built-in corpus's unigram loss."""
    _, data = first_command_model()
    said = re.search(r"\(([\d.]+) for a guess from the characters' frequencies alone\)", readme())
    assert said and said.group(1) == f"{data.unigram_loss:.2f}", (
        f"README says {said.group(1) if said else None}, the corpus's unigram loss is {data.unigram_loss:.2f}")


def ladder_sends(stage):
    """The ladder's "sends per step" as k for kΨ: comm_theory's elements per rank over Ψ(N-1)/N, at a size where
    the gradient norm's 8 bytes vanish."""
    from train_gpt import comm_theory
    n, world = 10**9, 2
    return round(sum(comm_theory(stage, n, world, param_bytes=1).values()) / (n * (world - 1) / world))


def test_ladder_formulas_are_the_code_formulas():
    """The ladder's model states and sends per step, the figure's sentence and the fp32 formulas: each as
    train_gpt.formula_text and comm_theory compute them."""
    from train_gpt import formula_text
    text = readme()
    ladder = text[text.index("## The ladder"):]
    ladder = ladder[:ladder.index("\n\n", ladder.index("| file |"))]
    rows = {m.group(1): [c.strip() for c in m.group(2).split("|")]
            for m in re.finditer(r"^\| `(\w+)\.py` \|(.*)\|$", ladder, re.M)}
    for stage, file in (("stage0", "stage0_ddp"), ("stage1", "stage1"), ("stage2", "stage2"), ("stage3", "stage3")):
        _, states, sends = rows[file]
        want = formula_text(stage, param_bytes=2)
        assert states == want or states.endswith(f"= {want}") or states.startswith(f"{want} +"), (
            f"README's ladder: {file}.py holds {states!r}, the formula is {want}")
        want = f"{ladder_sends(stage)}Ψ"
        assert sends == want, f"README's ladder: {file}.py sends {sends!r}, comm_theory says {want}"
    _, offload, sends = rows["offload"]
    device = re.search(r"device (\d+)Ψ/N", offload)
    host = re.search(r"host (\d+)Ψ/N", offload)
    accum = re.search(r"\+ (\d+)Ψ/N with `--grad_accum`", offload)
    assert f"{int(device.group(1)) + int(host.group(1))}Ψ/N" == formula_text("offload", param_bytes=2), offload
    extra = int(formula_text("offload", 2, grad_acc=True)[:-3]) - int(formula_text("offload", 2)[:-3])
    assert int(accum.group(1)) == extra, f"README: --grad_accum adds {accum.group(1)}Ψ/N, the formula {extra}Ψ/N"
    assert sends.startswith(f"{ladder_sends('offload')}Ψ"), sends
    chain = " → ".join(formula_text(s, param_bytes=2) for s in ("stage0", "stage1", "stage2", "stage3"))
    assert f"model states fall as {chain}," in text, f"README's figure sentence should read: {chain}"
    comm = f"{ladder_sends('stage0')}Ψ(N−1)/N for stages 0-2 and rises to {ladder_sends('stage3')}Ψ(N−1)/N"
    assert ladder_sends("stage1") == ladder_sends("stage2") == ladder_sends("stage0") and comm in text, comm
    fp32 = ", ".join(formula_text(s, param_bytes=4) for s in ("stage0", "stage1", "stage2"))
    fp32 += f" and {formula_text('stage3', param_bytes=4)}"
    assert f"formulas read {fp32};" in " ".join(text.split()), f"README's fp32 formulas should read: {fp32}"


def test_offload_and_nvme_numbers_are_the_codes():
    """README's offload row, split by place, and its NVMe tier's (host, disk, what a step reads and writes) from
    train_gpt.theory. (bench/README's headline of the tier, from its published result, is test_docs'.)"""
    from test_docs import states_per_param
    text = readme()
    states, host, _ = states_per_param("offload", 2, world_size=2)
    on_host = sum(states[k] for k in host)
    device = sum(v for k, v in states.items() if k not in host)
    summed = states_per_param("offload", 2, world_size=2, grad_accum=2)[0]["grad_acc"]
    offload_row = next(ln for ln in text.splitlines() if ln.startswith("| `offload.py`"))
    expected = (f"device {device}Ψ/N (0 with `--offload_params`; + {summed}Ψ/N with `--grad_accum` > 1), "
                f"host {on_host}Ψ/N")
    assert expected in offload_row, (
        f"README's offload row: {offload_row.split('|')[3].strip()!r}; the code's formulas: {expected!r}")
    states, host, disk = states_per_param("offload", 2, world_size=2, nvme=True)
    on_host = sum(states[k] for k in host if k != "nvme_buffers")
    nvme_row = next(ln for ln in text.splitlines() if ln.startswith("| `--offload_optimizer nvme`"))
    expected = f"host {on_host}Ψ/N + buffers, disk {disk}Ψ/N | as offload, plus {disk}Ψ/N read and written"
    assert expected in nvme_row, f"README's NVMe row: {'|'.join(nvme_row.split('|')[3:5])!r}; the code's: {expected!r}"
    assert f"master and moments ({disk}Ψ/N) live in a file" in text, f"README's NVMe paragraph: not {disk}Ψ/N on disk"
