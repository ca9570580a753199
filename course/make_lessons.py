"""
make_lessons.py: the ladder as lessons, one idea each, as diffs a student reads and a teacher hands out.

Most steps of the ladder are whole files: `diff stage1.py stage2.py` is ZeRO-2. Two files carry more than one idea,
each fenced as the exercises are (`# [TAG] ...` to `# [/TAG]`): stage3.py holds the prefetch of the next unit
([Prefetch]) and the recompute that activation checkpointing needs ([Recompute]); offload.py the copies on a stream of their own ([Copy stream]) and its two options
([ZeRO-3 Offload], [DPU]). Without an idea's
regions such a file still runs, without that idea; each lesson is the diff between two steps:

    python course/make_lessons.py                    # writes course/lessons/NN_name.diff, and prints the table
    python course/make_lessons.py --files DIR        # also writes the files between the steps, to run or read

The counts split the changed lines into code and the rest (comments, docstrings, blank lines), as README's table
shows them; tests/test_course.py checks that the lessons here are current and apply, one after the other.
"""
import argparse
import difflib
import io
import re
import sys
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "course"))
from make_exercise import BEGIN, END, link_helpers, replace_regions  # noqa: E402

# (lesson, the step before, the step after, the idea). A step is a file, less the regions of the ideas after " - ".
LESSONS = [
    ("1_zero1", "stage0_ddp.py", "stage1.py", "optimizer states partitioned (ZeRO-1)"),
    ("2_zero2", "stage1.py", "stage2.py", "gradients partitioned (ZeRO-2)"),
    ("3_zero3", "stage2.py", "stage3.py - Prefetch - Recompute", "parameters partitioned (ZeRO-3): gathered, freed"),
    ("4_prefetch", "stage3.py - Prefetch - Recompute", "stage3.py - Recompute",
     "the next unit gathered while this one computes"),
    ("5_recompute", "stage3.py - Recompute", "stage3.py", "a unit gathered again for its recompute (activation checkpointing)"),
    ("6_offload", "stage3.py", "offload.py - Copy stream - ZeRO-3 Offload - DPU - NVMe",
     "the optimizer on the CPU (ZeRO-Offload)"),
    ("7_copy_stream", "offload.py - Copy stream - ZeRO-3 Offload - DPU - NVMe", "offload.py - ZeRO-3 Offload - DPU - NVMe",
     "the copies on a stream of their own, beside compute"),
    ("8_offload_params", "offload.py - ZeRO-3 Offload - DPU - NVMe", "offload.py - DPU - NVMe",
     "the parameter shard on the CPU too (--offload_params)"),
    ("9_delayed_update", "offload.py - DPU - NVMe", "offload.py - NVMe",
     "the CPU update during the next step (--delayed_update)"),
    ("10_nvme", "offload.py - NVMe", "offload.py", "the optimizer states on NVMe (ZeRO-Infinity)"),
]


def without(source, tags):
    """source less every region fenced with one of `tags` (the fences too)."""
    return "".join(replace_regions(source.splitlines(keepends=True), tags, lambda match, body: []))


def unfenced(source):
    """source with its other fences as plain comments: `# [ZeRO-3] what it does` reads `# what it does`, and a closing
    `# [/ZeRO-3]` goes. The fences mark the exercises' regions; a lesson shows the code and its comments."""
    lines = []
    for line in source.splitlines(keepends=True):
        if END.match(line):
            continue
        m = BEGIN.match(line.rstrip("\n"))
        lines.append(f"{m.group('indent')}# {m.group('todo')}\n" if m else line)
    return "".join(lines)


def step(name, root=ROOT):
    """The text of a step: 'stage3.py', or 'offload.py - DPU' (offload.py without its [DPU] regions), unfenced."""
    path, *less = [part.strip() for part in name.split(" - ")]
    return unfenced(without((root / path).read_text(), less))


def shown(name):
    """A step as README's table names it: 'offload.py - ZeRO-3 Offload - DPU' -> 'offload.py less [ZeRO-3 Offload],
    [DPU]'."""
    path, *less = [part.strip() for part in name.split(" - ")]
    return path + (" less " + ", ".join(f"[{tag}]" for tag in less) if less else "")


def file_name(name):
    """Where --files writes a step: 'offload.py - ZeRO-3 Offload - DPU' -> offload_without_ZeRO-3_Offload_DPU.py."""
    path, *less = [part.strip() for part in name.split(" - ")]
    if not less:
        return path
    return path.removesuffix(".py") + "_without_" + "_".join(less).replace(" ", "_") + ".py"


def split(text):
    """Each line's code tokens and its prose (comments, docstrings), as two lists of non-empty lines."""
    code, prose, before = {}, {}, tokenize.NEWLINE
    skip = (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENCODING, tokenize.ENDMARKER)
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type in skip:
            before = tok.type
        elif tok.type == tokenize.COMMENT:
            prose.setdefault(tok.start[0], []).append(tok.string)
        elif tok.type == tokenize.STRING and before in skip:  # a string that is a statement of its own: a docstring
            for k, line in enumerate(tok.string.splitlines()):
                prose.setdefault(tok.start[0] + k, []).append(line.strip())
            before = tokenize.NEWLINE
        else:
            code.setdefault(tok.start[0], []).append(tok.string)
            before = tok.type
    return [" ".join(code[k]) for k in sorted(code)], [" ".join(prose[k]) for k in sorted(prose)]


def changed(a, b):
    """How many lines a line diff of the lists a and b removes and adds."""
    return sum(i2 - i1 + j2 - j1 for op, i1, i2, j1, j2 in
               difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes() if op != "equal")


def lesson(before, after):
    """(the unified diff of two steps, code lines changed, prose lines changed). Code lines are compared by their
    tokens alone, so a line whose comment changed counts as prose only."""
    a, b = step(before), step(after)
    diff = "".join(difflib.unified_diff(a.splitlines(keepends=True), b.splitlines(keepends=True), before, after))
    (code_a, prose_a), (code_b, prose_b) = split(a), split(b)
    return diff, changed(code_a, code_b), changed(prose_a, prose_b)


def diffs(before, after):
    """What a lesson's diff compares, as README's table says it: 'stage0_ddp.py → stage1.py'; the idea fenced in one
    file, 'offload.py: [DPU]'; between two files, the later lessons' regions left out of the second: 'stage3.py →
    offload.py, less lessons 6-9'."""
    path_a, *less_a = [part.strip() for part in before.split(" - ")]
    path_b, *less_b = [part.strip() for part in after.split(" - ")]
    if path_a == path_b:
        return f"{path_b}: " + ", ".join(f"[{tag}]" for tag in less_a if tag not in less_b)
    later = [name.split("_")[0] for name, a, b, _ in LESSONS if a.split(" - ")[0] == b.split(" - ")[0] == path_b
             and set(less_b) & set(a.split(" - ")[1:]) - set(b.split(" - ")[1:])]
    if not later:
        return f"{path_a} → {path_b}"
    numbers = later[0] if len(later) == 1 else f"{later[0]}-{later[-1]}"
    return f"{path_a} → {path_b}, less lesson{'s' * (len(later) > 1)} {numbers}"


def table():
    """README's rows: | `NN_name` | what its diff compares | code lines changed, comment and docstring lines | the idea |,
    each within 120 columns."""
    rows = ["| lesson (`course/lessons/*.diff`) | diff of | lines: code, prose | the idea |", "|---|---|---|---|"]
    for name, before, after, idea in LESSONS:
        _, code, other = lesson(before, after)
        rows.append(f"| `{name}` | {diffs(before, after)} | {code}, {other} | {idea} |")
    return "\n".join(rows)


def main(argv=None):
    p = argparse.ArgumentParser(description="Write the ladder's lessons, a diff per idea, to course/lessons/.")
    p.add_argument("--out", default=str(ROOT / "course" / "lessons"), help="where the diffs go")
    p.add_argument("--files", default=None, metavar="DIR", help="also write each step's file here")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name, before, after, _ in LESSONS:
        diff, _, _ = lesson(before, after)
        (out / f"{name}.diff").write_text(diff)
        if args.files:
            for s in (before, after):
                target = Path(args.files) / file_name(s)
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_text(step(s))
    if args.files:
        link_helpers(args.files)  # each step runs as written: torchrun --standalone --nproc_per_node 2 DIR/FILE.py
    print(table())


if __name__ == "__main__":
    main()
