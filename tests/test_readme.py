"""README's numbers that come from the files themselves (the table of lessons), and the size of the
ladder's steps: each diff must carry its one idea and little else, each file must fit a reading."""
import ast
import re
import subprocess
import sys

import pytest

from conftest import ROOT

sys.path.insert(0, str(ROOT / "course"))
from make_lessons import table  # noqa: E402

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


def test_lesson_table_matches_the_files():
    """README's table of lessons is what course/make_lessons.py counts in the files as they are, row for row."""
    rows = [ln for ln in (ROOT / "README.md").read_text().splitlines() if ln.startswith("| `") and ".diff`" in ln]
    expected = [ln for ln in table().splitlines() if ln.startswith("| `")]
    assert rows == expected, ("README's table of lessons differs from the files; paste `python course/make_lessons.py`'s "
                              "table:\n" + "\n".join(expected))


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
