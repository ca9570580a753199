"""The pages: README.md is a first page a learner can read (its size, its first screen, a README in every folder);
bench/README.md's tables are exactly what the bench scripts wrote in bench/results/; no page or comment tells history.
(test_readme.py checks README's table of lessons; test_commands.py runs every command the pages show.)"""
import re
import sys
from pathlib import Path

from conftest import ROOT

sys.path.insert(0, str(ROOT / "bench"))
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
