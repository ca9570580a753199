"""README's numbers that come from the files themselves (the diff table of the stage ladder), and the size of the
ladder's steps: each diff must carry its one idea and little else, each file must fit a reading."""
import ast
import re
import subprocess

import pytest

from conftest import ROOT

# (a, b, most lines `diff a b` may change, most it may change in code: the module docstrings left out)
LADDER = [("stage0_ddp.py", "stage1.py", 100, 120), ("stage1.py", "stage2.py", 70, 120),
          ("stage2.py", "stage3.py", 150, 120), ("stage3.py", "offload.py", 190, 175)]
# Loose on purpose: room for clarity, never a budget to pack lines into (no tuple of unrelated values, no long calls).
MOST_LINES = {"train_gpt.py": 520, "stage0_ddp.py": 300, "stage1.py": 300, "stage2.py": 300, "stage3.py": 300,
              "offload.py": 420}
WIDTH = 120


def changed(a, b):
    """(lines out, lines in) as `diff a b` counts them."""
    text = subprocess.run(["diff", str(a), str(b)], cwd=ROOT, capture_output=True, text=True).stdout.splitlines()
    return sum(ln.startswith("<") for ln in text), sum(ln.startswith(">") for ln in text)


def code(name, tmp_path):
    """A copy of the file without its module docstring."""
    source = (ROOT / name).read_text()
    body = ast.parse(source).body
    first = body[0] if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) else None
    out = tmp_path / f"code_{name}"
    out.write_text("".join(source.splitlines(keepends=True)[first.end_lineno if first else 0:]))
    return out


def test_diff_table_matches_the_files():
    """Each row `| `diff a b` | N (X out, Y in) | ...` counts what `diff a b` prints: X lines out, Y in, N = X + Y."""
    rows = re.findall(r"^\| `diff (\S+) (\S+)` \| (\d+) \((\d+) out, (\d+) in\)", (ROOT / "README.md").read_text(), re.M)
    assert len(rows) == 4, f"README's diff table has {len(rows)} rows, expected the 4 steps of the ladder"
    for a, b, total, out, into in rows:
        got = changed(a, b)
        assert (int(out), int(into), int(total)) == (*got, sum(got)), (
            f"README says diff {a} {b} changes {total} ({out} out, {into} in); it is {sum(got)} ({got[0]} out, {got[1]} in)")


@pytest.mark.parametrize("a, b, most, most_code", LADDER, ids=[b.removesuffix(".py") for _, b, _, _ in LADDER])
def test_each_step_of_the_ladder_is_small(tmp_path, a, b, most, most_code):
    """A step shows its idea and little else: at most `most` lines changed in all, `most_code` outside the docstrings."""
    total, in_code = sum(changed(a, b)), sum(changed(code(a, tmp_path), code(b, tmp_path)))
    assert total <= most and in_code <= most_code, (
        f"diff {a} {b} changes {total} lines (at most {most}), {in_code} of them in code (at most {most_code})")


@pytest.mark.parametrize("name", MOST_LINES)
def test_files_fit_a_reading(name):
    """train_gpt.py, the stage files and offload.py: at most MOST_LINES lines, none wider than WIDTH columns."""
    lines = (ROOT / name).read_text(encoding="utf-8").splitlines()
    wide = [f"{name}:{i}: {len(ln)} columns" for i, ln in enumerate(lines, 1) if len(ln) > WIDTH]
    assert len(lines) <= MOST_LINES[name] and not wide, (
        f"{name}: {len(lines)} lines (at most {MOST_LINES[name]}); wider than {WIDTH}: " + ("; ".join(wide) or "none"))
