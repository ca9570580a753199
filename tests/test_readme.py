"""README's numbers that come from the files themselves: the diff table of the stage ladder."""
import re
import subprocess

from conftest import ROOT


def test_diff_table_matches_the_files():
    """Each row `| `diff a b` | N (X out, Y in) | ...` counts what `diff a b` prints: X lines out, Y in, N = X + Y."""
    rows = re.findall(r"^\| `diff (\S+) (\S+)` \| (\d+) \((\d+) out, (\d+) in\)", (ROOT / "README.md").read_text(), re.M)
    assert len(rows) == 4, f"README's diff table has {len(rows)} rows, expected the 4 steps of the ladder"
    for a, b, total, out, into in rows:
        text = subprocess.run(["diff", a, b], cwd=ROOT, capture_output=True, text=True).stdout.splitlines()
        got = (sum(ln.startswith("<") for ln in text), sum(ln.startswith(">") for ln in text))
        assert (int(out), int(into), int(total)) == (*got, sum(got)), (
            f"README says diff {a} {b} changes {total} ({out} out, {into} in); it is {sum(got)} ({got[0]} out, {got[1]} in)")
