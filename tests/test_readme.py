"""README's numbers that come from the files themselves (the table of lessons), and the size of the
ladder's steps: each diff must carry its one idea and little else, each file must fit a reading."""
import sys

import pytest

from conftest import ROOT

sys.path.insert(0, str(ROOT / "course"))
from make_lessons import LESSONS, lesson, table  # noqa: E402

# each lesson (course/make_lessons.py): the most code lines, and the most other lines, it may change
LESSON_LIMITS = {"1_zero1": (55, 60), "2_zero2": (45, 40), "3_zero3": (80, 60), "4_recompute": (10, 10),
                 "5_offload": (60, 70), "6_grad_acc": (10, 10), "7_copy_stream": (30, 25), "8_offload_params": (25, 20),
                 "9_delayed_update": (30, 25)}  # offload's ideas: at most 60 code lines each
# Loose on purpose: room for clarity, never a budget to pack lines into (no tuple of unrelated values, no long calls).
MOST_LINES = {"train_gpt.py": 520, "stage0_ddp.py": 300, "stage1.py": 300, "stage2.py": 300, "stage3.py": 300,
              "offload.py": 420}
WIDTH = 120


def test_lesson_table_matches_the_files():
    """README's table of lessons is what course/make_lessons.py counts in the files as they are, row for row."""
    rows = [ln for ln in (ROOT / "README.md").read_text().splitlines() if ln.startswith("| `") and ".diff`" in ln]
    expected = [ln for ln in table().splitlines() if ln.startswith("| `")]
    assert rows == expected, ("README's table of lessons differs from the files; paste `python course/make_lessons.py`'s "
                              "table:\n" + "\n".join(expected))


@pytest.mark.parametrize("name, before, after", [lesson[:3] for lesson in LESSONS], ids=[n for n, *_ in LESSONS])
def test_each_lesson_is_small(name, before, after):
    """A lesson shows its idea and little else: at most LESSON_LIMITS' code lines and other lines changed."""
    _, code, prose = lesson(before, after)
    most_code, most_prose = LESSON_LIMITS[name]
    assert code <= most_code and prose <= most_prose, (
        f"{name}: {before} -> {after} changes {code} code lines (at most {most_code}) and {prose} others (at most "
        f"{most_prose})")


@pytest.mark.parametrize("name", MOST_LINES)
def test_files_fit_a_reading(name):
    """train_gpt.py, the stage files and offload.py: at most MOST_LINES lines, none wider than WIDTH columns."""
    lines = (ROOT / name).read_text(encoding="utf-8").splitlines()
    wide = [f"{name}:{i}: {len(ln)} columns" for i, ln in enumerate(lines, 1) if len(ln) > WIDTH]
    assert len(lines) <= MOST_LINES[name] and not wide, (
        f"{name}: {len(lines)} lines (at most {MOST_LINES[name]}); wider than {WIDTH}: " + ("; ".join(wide) or "none"))
