"""bench/bench_nvme.py: the disk's own sequential write and read bandwidth, as the NVMe tier sees it
(nvme.StateFile: O_DIRECT where the filesystem allows it, aligned blocks of --block_mb), with one I/O thread and with
StateFile's default.

This is the ceiling the tier's bandwidth during training is measured against: a step cannot stream its optimizer
states faster than the disk moves them. Each pass writes (or reads) the whole file in order, with as many blocks in
flight as threads; each file is written once before any timed pass, so that every pass meets written blocks. The
passes of the thread counts take turns, and the best of --repeats passes of each is reported, as MB/s (10^6 bytes per
second), beside the CPU and the filesystem.

    python bench/bench_nvme.py [--nvme_path DIR] [--file_mb 512] [--block_mb 4] [--repeats 2] [--quick] [--results]

--nvme_path defaults to a temporary directory under the current directory (not /tmp, which may be tmpfs: memory).
"""
import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))  # before bench/: nvme is the repository's nvme.py
from nvme import StateFile, aligned  # noqa: E402
from results import add_flag, header, publish  # noqa: E402

DEFAULT_THREADS = StateFile.__init__.__defaults__[0]


def filesystem(path):
    """(type, source) of the filesystem that holds path, from the longest mount point above it in /proc/self/mounts."""
    path = os.path.realpath(path)
    best = ("", "?", "?")
    with open("/proc/self/mounts") as f:
        for line in f:
            source, point, kind = line.split()[:3]
            point = point.replace("\\040", " ")
            if (path == point or path.startswith(point.rstrip("/") + "/")) and len(point) > len(best[0]):
                best = (point, kind, source)
    return best[1], best[2]


def one_pass(f, op, buffers, block):
    """Read or write the whole file in order, len(buffers) blocks in flight; returns the seconds it took."""
    pending = [None] * len(buffers)
    start = time.perf_counter()
    for k, offset in enumerate(range(0, f.nbytes, block)):
        slot = k % len(buffers)
        # a buffer is reused only once its last transfer is done
        if pending[slot] is not None:
            f.wait(pending[slot])
        pending[slot] = f.read(offset, buffers[slot]) if op == "read" else f.write(offset, buffers[slot])
    for future in pending:
        if future is not None:
            f.wait(future)
    return time.perf_counter() - start


def measure(directory, file_bytes, block, thread_counts, repeats):
    """{threads: (write MB/s, read MB/s, StateFile's mode)}: a file per thread count, each written once, then timed
    round-robin (a pass of each in turn, --repeats times): a slow spell of a shared disk falls on every count."""
    files = [StateFile(directory, f"bench{t}", file_bytes, threads=t) for t in thread_counts]
    try:
        buffers = {t: [aligned(block) for _ in range(t)] for t in thread_counts}
        for b in [b for bs in buffers.values() for b in bs]:
            b.random_(0, 256)  # not zeros: a disk or filesystem may store zeros for less
        for f, t in zip(files, thread_counts):
            one_pass(f, "write", buffers[t], block)
        best = {(t, op): float("inf") for t in thread_counts for op in ("write", "read")}
        for op in ("write", "read"):
            for _ in range(repeats):
                for f, t in zip(files, thread_counts):
                    best[t, op] = min(best[t, op], one_pass(f, op, buffers[t], block))
        return {t: (f.nbytes / best[t, "write"] / 1e6, f.nbytes / best[t, "read"] / 1e6, f.mode)
                for f, t in zip(files, thread_counts)}
    finally:
        for f in files:
            f.close()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nvme_path", default=None, help="the directory to measure (default: a temporary directory under "
                    "the current directory, removed at the end)")
    ap.add_argument("--file_mb", type=int, default=512, help="the file's size, MiB")
    ap.add_argument("--block_mb", type=int, default=4, help="the size of one read or write, MiB")
    ap.add_argument("--threads", type=int, default=DEFAULT_THREADS, help="StateFile's threads, besides one")
    ap.add_argument("--repeats", type=int, default=2, help="timed passes of each direction (the best is reported)")
    ap.add_argument("--quick", action="store_true", help="a file of 8 MiB in 1 MiB blocks, one pass: a smoke test")
    add_flag(ap)
    a = ap.parse_args(argv)
    if a.quick:
        a.file_mb, a.block_mb, a.repeats = 8, 1, 1
    block = a.block_mb << 20
    file_bytes = -(-(a.file_mb << 20) // block) * block
    directory = a.nvme_path or tempfile.mkdtemp(prefix=".nvme-bench-", dir=os.getcwd())
    kind, source = filesystem(directory)
    try:
        rows = measure(directory, file_bytes, block, sorted({1, a.threads}), a.repeats)
    finally:
        if a.nvme_path is None:
            shutil.rmtree(directory, ignore_errors=True)
    modes = {mode for _, _, mode in rows.values()}
    out = [f"Sequential write and read through nvme.StateFile: a {file_bytes >> 20} MiB file in {a.block_mb} MiB "
           f"blocks, as many in flight as threads; {kind} on {source}, {' / '.join(sorted(modes))}; MB/s = 10^6 bytes "
           f"per second, best of {a.repeats} pass{'es' * (a.repeats > 1)}, taking turns.", ""]
    if kind == "tmpfs":
        out += ["(tmpfs holds its files in memory: these are memory's numbers, not a disk's.)", ""]
    out += ["| threads | write MB/s | read MB/s |", "|---:|---:|---:|"]
    out += [f"| {threads} | {write:,.0f} | {read:,.0f} |" for threads, (write, read, _) in rows.items()]
    print(header("raw bytes", argv and [sys.argv[0], *argv]) + "\n")
    print("\n".join(out), flush=True)
    if a.results:
        publish("nvme_disk", "\n".join(out), "raw bytes", a.results, argv and [sys.argv[0], *argv])
    return 0


if __name__ == "__main__":
    sys.exit(main())
