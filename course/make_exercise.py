"""
make_exercise.py: turn a reference stage file into an exercise. Each region that a stage file marks as its own idea,

    # [ZeRO-2] what this region must do
    ...the code...
    # [/ZeRO-2]

is replaced by a TODO that says what the region must do, and a `raise NotImplementedError` that says it again when
the code runs. Functions keep their signatures and docstrings (a class, its line and its methods'), so the exercise
still imports; the test suite then grades it. An exercise is one lesson: a region of another lesson nested inside
(stage3.py's [Prefetch] and [Recompute] in [ZeRO-3]) stays as it is, the `raise` at the place before it or after it
that had code, and each misuse the blanked code refuses (its `require` calls, which the grade checks) is written out
in the TODO. By default the exercise blanks the file's newest idea (stage2.py:
ZeRO-2); `--tag` picks others.

    python course/make_exercise.py stage2.py                        # writes exercises/stage2.py
    python course/make_exercise.py stage3.py --tag ZeRO-3 --tag Prefetch -o exercises/stage3_hard.py
    python -m pytest tests --stage exercises/stage2.py              # grade a student's file
"""
import argparse
import os
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LADDER = ["stage0_ddp.py", "stage1.py", "stage2.py", "stage3.py", "offload.py"]

# the ideas, in the order the stages introduce them; the recompute of activation checkpointing (stage 3's) and
# offload.py's later steps are ideas of their own: the copies on a stream of their own, the parameter shard in CPU
# memory (ZeRO-Infinity's ZeRO-3 Offload) and the delayed parameter update (the ZeRO-Offload paper's DPU)
TAGS = ["DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3", "Prefetch", "Recompute", "Offload", "Copy stream", "ZeRO-3 Offload", "DPU", "NVMe"]
OPTIONS = ["Prefetch", "Recompute", "Copy stream", "ZeRO-3 Offload", "DPU", "NVMe"]  # never a file's default: its newest idea is the stage's own
BEGIN = re.compile(r"^(?P<indent>\s*)# \[(?P<tag>[\w-]+(?: [\w-]+)*)\] (?P<todo>.+)$")
END = re.compile(r"^\s*# \[/(?P<tag>[\w-]+(?: [\w-]+)*)\]\s*$")


def tags_in(source):
    found = {m.group("tag") for line in source.splitlines() if (m := BEGIN.match(line))}
    return [t for t in TAGS if t in found]


def newest_idea(source):
    """The idea a file adds to the ladder (its newest tag, options aside): what its exercise blanks by default."""
    return [t for t in tags_in(source) if t not in OPTIONS][-1:]


def signature_and_docstring(body, k):
    """The lines of the `def` starting at body[k]: its signature (which may span lines) and docstring, if any."""
    j = k
    while not re.sub(r"\s+#.*$", "", body[j]).rstrip().endswith(":"):  # (a comment may follow the colon)
        j += 1
    j += 1  # the first line of the function's body
    if j < len(body) and body[j].strip().startswith('"""'):
        one_line = body[j].strip().count('"""') == 2
        j = (j if one_line else next(i for i in range(j + 1, len(body)) if '"""' in body[i])) + 1
    return body[k:j]


def nested_end(lines, i):
    """The index of the line that closes the region opened at lines[i]."""
    tag = BEGIN.match(lines[i]).group("tag")
    return next(j for j in range(i + 1, len(lines)) if (e := END.match(lines[j])) and e.group("tag") == tag)


def keep_nested(indent, lines, message, tag, fill=False):
    """A blanked body: each region of another lesson nested in it kept as it is (that lesson's code, given), and the
    code around them replaced by the TODO's `raise`, at the first place that had code (a later place: a comment).
    fill: the code kept in those places instead (the answer, written where the exercise asks for it)."""
    out, gap, raised = [], [], False

    def close_gap():
        nonlocal raised
        if any(line.strip() and not line.strip().startswith("#") for line in gap):
            if fill:
                out.extend(gap)
            else:
                out.append(f"{indent}# TODO [{tag}] continues here" if raised else f"{indent}raise "
                           f"NotImplementedError({message!r})")
            raised = True
        gap.clear()

    i = 0
    while i < len(lines):
        if BEGIN.match(lines[i]):
            close_gap()
            j = nested_end(lines, i)
            out += lines[i:j + 1]
            i = j + 1
        else:
            gap.append(lines[i])
            i += 1
    close_gap()
    if not raised and not fill:
        out.insert(0, f"{indent}raise NotImplementedError({message!r})")
    return out


def checks(tag, lines):
    """The TODO's lines for the misuses the blanked code refuses (its `require` calls): the grade checks them."""
    out = []
    for line in lines:
        if line.strip().startswith("require("):
            out += [f"# TODO [{tag}]: the grade checks that this refuses a misuse with the project's message, as",
                    f"#     {line.strip()}"]
    return out


def blank_region(indent, tag, todo, body, fill=False):
    todo = todo.rstrip()
    message = f"TODO [{tag}]: {todo}"
    out = [f"{indent}# TODO [{tag}]: {todo}"]
    nested = list(dict.fromkeys(m.group("tag") for line in body if (m := BEGIN.match(line))))
    if nested:
        given = " and ".join(f"[{t}]" for t in nested)
        out.append(f"{indent}# (the {given} code inside is another lesson's: given, keep it as it is)")
    # a region that is a class (offload.py's later ideas): its line and docstring kept, and its methods blanked
    classes = [k for k, line in enumerate(body) if line.startswith(indent + "class ")]
    if classes:
        out += signature_and_docstring(body, classes[0])
        indent += "    "
    defs = [k for k, line in enumerate(body) if line.startswith(indent + "def ")]
    if not defs:
        out += [indent + line for line in checks(tag, body)]
        out += keep_nested(indent, body, message, tag, fill)
    for n, k in enumerate(defs):
        # its decorators (@classmethod) too
        at = k
        while at > 0 and body[at - 1].startswith(indent + "@"):
            at -= 1
        head = signature_and_docstring(body, k)
        # its body: up to the next def, less the comments and decorators that lead into it
        end = defs[n + 1] if n + 1 < len(defs) else len(body)
        while end > k + len(head) and (not body[end - 1].strip() or body[end - 1].startswith(indent + "@")
                                       or body[end - 1].startswith(indent + "#")):
            end -= 1
        inside = body[k + len(head):end]
        out += body[at:k] + head + [indent + "    " + line for line in checks(tag, inside)]
        out += keep_nested(indent + "    ", inside, message, tag, fill)
        out.append("")
    if defs:
        out.pop()
    out.append(f"{indent[:len(indent) - 4 * bool(classes)]}# end of TODO [{tag}]")
    return out


def replace_regions(lines, tags, replace):
    """lines, with each region fenced by `# [TAG] ...` and `# [/TAG]` for a TAG in `tags` (the fences included)
    replaced by replace(match of its opening fence, the lines between the fences)."""
    out, i = [], 0
    while i < len(lines):
        m = BEGIN.match(lines[i].rstrip("\n"))
        if not m or m.group("tag") not in tags:
            out.append(lines[i])
            i += 1
            continue
        j = i + 1
        while j < len(lines) and not ((e := END.match(lines[j])) and e.group("tag") == m.group("tag")):
            j += 1
        if j == len(lines):
            raise SystemExit(f"error: line {i + 1}: `# [{m.group('tag')}]` has no closing `# [/{m.group('tag')}]`")
        out += replace(m, lines[i + 1:j])
        i = j + 1
    return out


def make_exercise(source, tags, fill=False):
    """The exercise: `tags`' regions blanked. fill: the answer instead, each blanked place filled with the reference's
    code (the regions' code less the other lessons' regions nested in them, which the exercise gives)."""
    def blank(m, body):
        return blank_region(m.group("indent"), m.group("tag"), m.group("todo"), body, fill)
    return "\n".join(replace_regions(source.splitlines(), tags, blank)) + "\n"


def link_helpers(folder):
    """Links in `folder` to the files a stage imports (train_gpt.py, comm.py, ..., cpu_adam.cpp), so that a file
    written there runs as the stages do, from the repository root: `torchrun ... exercises/stage2.py` (Python puts the
    script's folder on its path, not the current one). A file already there is left as it is."""
    folder = Path(folder).resolve()
    if folder == ROOT:
        return
    for helper in sorted(ROOT.iterdir()):
        if helper.suffix in (".py", ".cpp") and helper.name not in LADDER and not (folder / helper.name).exists():
            (folder / helper.name).symlink_to(os.path.relpath(helper, folder))


def main(argv=None):
    p = argparse.ArgumentParser(description="Make the exercise version of a stage file.")
    p.add_argument("stage", help="a reference stage file, e.g. stage2.py")
    p.add_argument("--tag", action="append", choices=TAGS, help="the idea(s) to blank (default: the file's newest)")
    p.add_argument("-o", "--output", help="where to write it (default: exercises/<file name>)")
    args = p.parse_args(argv)
    path = Path(args.stage)
    if not path.is_file():
        raise SystemExit(f"error: {path}: no such file; name a stage file such as stage2.py")
    source = path.read_text()
    present = tags_in(source)
    if not present:
        raise SystemExit(f"error: {path} marks no idea with `# [TAG] ...` / `# [/TAG]`; tags are {', '.join(TAGS)}")
    tags = args.tag or newest_idea(source)
    missing = [t for t in tags if t not in present]
    if missing:
        raise SystemExit(f"error: {path} has no region tagged {', '.join(missing)}; it has {', '.join(present)}")
    out = Path(args.output) if args.output else Path("exercises") / path.name
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(make_exercise(source, tags))
    link_helpers(out.parent)
    print(f"wrote {out}: blanked {', '.join(tags)}; run it with: torchrun --standalone --nproc_per_node 2 {out} "
          f"--preset tiny --dtype fp32; grade it with: python -m pytest tests --stage {out}")
    return out


if __name__ == "__main__":
    sys.exit(main() and 0)
