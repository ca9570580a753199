"""
bench/results.py: where a bench script puts what it measured, so that the page that shows it cannot drift from it.

A script given `--results` writes its Markdown table to bench/results/<name>.md, headed by the machine it ran on, the
torch version, the dtype and the exact command, and puts the same text into bench/README.md between the two lines

    <!-- bench/results/<name>.md -->
    <!-- end bench/results/<name>.md -->

(tests/test_docs.py fails if the page and the files differ). `--results DIR` writes to DIR instead and leaves
bench/README.md alone (the smoke tests do this).
"""
import os
import platform
import re
import shlex
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
PAGE = ROOT / "bench" / "README.md"


def cpu_model():
    """The CPU's name, with its family and model numbers (a virtual machine may say no more than "AMD EPYC")."""
    try:
        with open("/proc/cpuinfo") as f:
            info = dict(line.split(":", 1) for line in f.read().split("\n\n")[0].splitlines() if ":" in line)
        info = {k.strip(): v.strip() for k, v in info.items()}
        return f"{info['model name']}, family {info.get('cpu family', '?')} model {info.get('model', '?')}"
    except (OSError, KeyError):
        return platform.processor() or platform.machine()


def machine():
    """The GPU's name where the run used CUDA, else the CPU's, with the number of cores this process may use."""
    import torch
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    cpu = f"{cpu_model()} ({platform.machine()}, {cores} cores, torch CPU capability {torch.backends.cpu.get_cpu_capability()})"
    if torch.cuda.is_available() and os.environ.get("CUDA_VISIBLE_DEVICES", None) != "":
        return f"{torch.cuda.get_device_name()} ({torch.cuda.device_count()} GPU(s)); host {cpu}"
    return cpu


def command(argv=None):
    """The command line that ran this script, as one would type it from the repository's root."""
    argv = sys.argv if argv is None else argv
    script = Path(argv[0]).resolve()
    shown = script.relative_to(ROOT) if script.is_relative_to(ROOT) else script
    return shlex.join(["python", str(shown), *argv[1:]])


def header(dtype, argv=None):
    import torch
    return (f"Machine: {machine()}; torch {torch.__version__}; {dtype}.  \n"
            f"Command: `{command(argv)}`")


def add_flag(parser):
    parser.add_argument("--results", nargs="?", const=str(RESULTS), default=None, metavar="DIR",
                        help="write the table to bench/results/ (and into bench/README.md), or to DIR")


def publish(name, body, dtype, directory, argv=None):
    """Write header + body to DIRECTORY/<name>.md; when DIRECTORY is bench/results, also into bench/README.md.
    Returns the path written."""
    directory = Path(directory)
    path = directory / f"{name}.md"
    path.parent.mkdir(parents=True, exist_ok=True)
    text = header(dtype, argv) + "\n\n" + body.strip() + "\n"
    path.write_text(text)
    where = f"wrote {path}"
    if directory.resolve() == RESULTS.resolve():
        where += splice(name, text)
    print(where, flush=True)
    return path


def block(name):
    """The pattern of name's block in bench/README.md: (opening line, text, closing line)."""
    key = re.escape(f"bench/results/{name}.md")
    return re.compile(rf"(^<!-- {key} -->\n)(.*?)(^<!-- end {key} -->$)", re.S | re.M)


def splice(name, text):
    page = PAGE.read_text() if PAGE.exists() else ""
    pattern = block(name)
    if not pattern.search(page):
        return f"; bench/README.md has no block for it (add the lines <!-- bench/results/{name}.md --> and <!-- end ... -->)"
    PAGE.write_text(pattern.sub(lambda m: m.group(1) + text + m.group(3), page, count=1))
    return " and its block in bench/README.md"


def blocks(page=None):
    """{name: text} of every results block in bench/README.md."""
    page = PAGE.read_text() if page is None else page
    found = re.findall(r"^<!-- bench/results/(\S+)\.md -->\n(.*?)^<!-- end bench/results/\1\.md -->$", page, re.S | re.M)
    return dict(found)


def main():
    """Copy every file in bench/results/ into its block in bench/README.md (after a script wrote it without --results,
    such as compare.py's and largest.py's --out_dir); say which blocks have no file and which files no block."""
    found = {p.relative_to(RESULTS).with_suffix("").as_posix() for p in RESULTS.rglob("*.md")}
    page = blocks()
    for name in sorted(found & set(page)):
        print(f"bench/results/{name}.md{splice(name, (RESULTS / f'{name}.md').read_text())}")
    for name in sorted(set(page) - found):
        print(f"bench/README.md shows bench/results/{name}.md, which does not exist")
    for name in sorted(found - set(page)):
        print(f"bench/results/{name}.md has no block in bench/README.md")
    return 0 if found == set(page) else 1


if __name__ == "__main__":
    sys.exit(main())
