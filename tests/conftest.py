"""Shared machinery for the tests: run a stage on N ranks (CPU, gloo), once per configuration, and read what it
wrote. `pytest tests --stage path/to/my_stage2.py` runs the stage checks against any file that implements a stage.
Ranks are started the way torchrun starts them on one node, without torchrun's agent process (which costs a start-up per run),
each forked from tests/fork_server.py, which has imported torch once (a run would spend most of its time importing it);
`pytest tests --torchrun` starts every run under torchrun itself, `--no_fork` each rank as a fresh process. The tests of
killed ranks always use torchrun.
The runs see no GPU (CUDA_VISIBLE_DEVICES=""), so the suite checks the CPU path alike on any machine; tests/test_gpu.py
runs its CUDA runs (gpu_runner) on the fake CUDA device (tests/fake_cuda.py), or with `pytest tests --gpu` on the
machine's GPUs."""
import atexit
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from devices import free_port  # noqa: E402
STAGES = ["stage0_ddp.py", "stage1.py", "stage2.py", "stage3.py", "offload.py"]


def pytest_addoption(parser):
    parser.addoption("--stage", action="append", default=[], metavar="FILE",
                     help="a file implementing a stage, to test instead of the repository's stages (repeatable)")
    parser.addoption("--lesson", default=None, metavar="NAME", help="grade the --stage files as the step after "
                     "lesson NAME (course/make_lessons.py), with every idea up to it (tests/test_ideas.py)")
    parser.addoption("--torchrun", action="store_true", help="start every multi-rank run under torchrun")
    parser.addoption("--no_fork", action="store_true", help="start every run as a fresh Python process, not forked "
                     "from tests/fork_server.py")
    parser.addoption("--gpu", action="store_true", help="also run tests/test_gpu.py on this machine's CUDA GPUs")


# The files whose tests take longest in all (a minute or more each on 2 cores), longest first. `--dist loadfile`
# hands a worker a whole file at a time, in the order collected: these go first, and the files of short tests come
# last, where a long one would keep one worker busy while the other has nothing left to run.
LONGEST_FIRST = ["test_course.py", "test_commands.py", "test_largest.py", "test_bench_fake_cuda.py",
                 "test_end_of_run.py", "test_pairs.py", "test_gpu_check.py", "test_largest_agree.py"]


def pytest_configure(config):
    ForkServer.enabled = not config.getoption("no_fork")
    # pytest-xdist would sort the files by their number of tests, which puts the long files of few tests
    # (test_gpu_check.py has one) last. Without that, it keeps the order pytest_collection_modifyitems makes.
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False
    config.addinivalue_line("markers", "quick: the learner's check (`pytest tests -m quick`): every stage's parity with "
                            "the reference on 2 ranks")
    config.addinivalue_line("markers", "slip: a check whose failure names a slip by its signature; grading (--stage) "
                            "runs these first and says their failures at once, above the other checks'")
    SLIPS.config = config if config.getoption("stage") else None


def stage_files(config):
    return [str(Path(f).resolve()) for f in config.getoption("stage")] or [str(ROOT / f) for f in STAGES]


def pytest_collection_modifyitems(config, items):
    """Grading a student's file (--stage) runs the checks of that file and nothing else. The files run in the order
    LONGEST_FIRST, then the others, those with more tests first; each file's tests in their own order."""
    if config.getoption("stage"):
        keep = [item for item in items if "stage_file" in getattr(item, "fixturenames", ())]
        config.hook.pytest_deselected(items=[item for item in items if item not in keep])
        items[:] = keep
    tests = Counter(item.path.name for item in items)

    def rank(item):
        name = item.path.name
        return (LONGEST_FIRST.index(name), 0) if name in LONGEST_FIRST else (len(LONGEST_FIRST), -tests[name])
    items.sort(key=rank)
    if config.getoption("stage"):  # the checks that name a slip first (a stable sort keeps the order above)
        items.sort(key=lambda item: item.get_closest_marker("slip") is None)


class SLIPS:
    """Grading (--stage): its configuration, whose terminal says at once a failure that names its slip ("the slip:
    ...")."""
    config = None
    said = set()


def pytest_runtest_logreport(report):
    """Grading: a failure whose message names a slip is written out as it happens, one line, above the failures."""
    if SLIPS.config is None or not report.failed or report.longrepr is None:
        return
    crash = getattr(report.longrepr, "reprcrash", None)
    message = crash.message if crash is not None else str(report.longrepr)
    slip = next((line for line in message.splitlines() if "the slip: " in line), None)
    if slip is not None:
        slip = slip[slip.index("the slip: "):]
        said = (report.nodeid.split("[")[-1].split("-")[0], slip.split(" (")[0].split(":")[1])  # (the file, the slip)
        if said not in SLIPS.said:
            SLIPS.said.add(said)
            terminal = SLIPS.config.pluginmanager.get_plugin("terminalreporter")
            terminal.write("\n")
            terminal.write_line(f"{report.nodeid.split('::')[-1]}: {slip}")


def pytest_collection_finish(session):
    """Grading (--stage): first of all, each file's first TODO not done (a `raise NotImplementedError("TODO [...]")`
    of course/make_exercise.py's still in it), where a student sees it before the checks' failures."""
    write = session.config.pluginmanager.get_plugin("terminalreporter").write_line
    for path in session.config.getoption("stage"):
        todos = [(n, line) for n, line in enumerate(Path(path).read_text().splitlines(), 1)
                 if "raise NotImplementedError" in line and "TODO [" in line]
        if todos:
            n, line = todos[0]
            todo = line[line.index("TODO ["):].rstrip("')\"")
            write(f"{path}:{n}: the first TODO not done, of {len(todos)}: {todo}")


def pytest_generate_tests(metafunc):
    if "stage_file" in metafunc.fixturenames:
        files = stage_files(metafunc.config)
        metafunc.parametrize("stage_file", files, ids=[Path(f).stem for f in files])


def last_lines(text, n):
    """The last n lines, with the torchrun boilerplate dropped, and a student's TODO first if there is one."""
    lines = [ln for ln in text.strip().splitlines() if "USDT:" not in ln and "OMP_NUM_THREADS" not in ln and "*****" not in ln]
    todo = [ln for ln in lines if "NotImplementedError: TODO" in ln][:1]
    return todo + lines[-n:]


# Variables read while torch (or Python, or a library torch loads) is imported: a run that sets one starts fresh.
IMPORT_TIME = ("TORCH", "PYTORCH", "OMP_", "MKL_", "OPENBLAS", "GOMP", "KMP_", "CUDA", "NCCL", "GLOO", "LD_", "PYTHON",
               "MALLOC")


class ForkServer:
    """tests/fork_server.py, started on first use and stopped with the suite: one per pytest process, shared with the
    pytest runs a test starts (they find it in ZERO_FORK_SERVER, beside the import-time environment it has)."""
    enabled = True
    proc = None
    path = None

    @classmethod
    def usable(cls, env):
        """Whether a run with this environment can be forked: it differs from the server's in nothing torch reads
        while it is imported."""
        if not cls.enabled:
            return False
        base = cls.environment()
        # (PYTHONPATH is the child's own: fork_server.py sets sys.path and imports its sitecustomize)
        changed = [k for k in set(env) | set(base) if env.get(k) != base.get(k) and k != "PYTHONPATH"]
        return not any(k.startswith(IMPORT_TIME) for k in changed)

    @staticmethod
    def environment():
        return {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}

    @staticmethod
    def import_time(env):
        """The variables of env that torch reads while it is imported, as one string."""
        return json.dumps(sorted((k, v) for k, v in env.items() if k.startswith(IMPORT_TIME) and k != "PYTHONPATH"))

    @classmethod
    def start(cls, argv, env, cwd, stdout, stderr):
        if cls.path is None and os.environ.get("ZERO_FORK_SERVER_ENV") == cls.import_time(cls.environment()):
            # a pytest run inside a test: its parent's server has this environment, and outlives the run
            cls.path = os.environ.get("ZERO_FORK_SERVER")
        if cls.path is None or cls.proc is not None and cls.proc.poll() is not None:
            cls.path = tempfile.mkdtemp(prefix="forks") + "/socket"
            env0 = {k: v for k, v in cls.environment().items() if k != "PYTHONPATH"}
            cls.proc = subprocess.Popen([sys.executable, str(ROOT / "tests" / "fork_server.py"), cls.path],
                                        stdin=subprocess.PIPE, cwd=ROOT, env=env0)
            atexit.register(cls.proc.stdin.close)
            while not os.path.exists(cls.path):
                if cls.proc.poll() is not None:
                    raise RuntimeError(f"tests/fork_server.py exited with code {cls.proc.returncode}")
                time.sleep(0.05)
            os.environ.update(ZERO_FORK_SERVER=cls.path, ZERO_FORK_SERVER_ENV=cls.import_time(env0))
        return Forked(cls.path, argv, env, cwd, stdout, stderr)


class Forked:
    """A run forked by tests/fork_server.py, with what the tests use of subprocess.Popen: args, pid, poll, wait, kill
    and returncode (negative: the signal that killed it)."""

    def __init__(self, path, argv, env, cwd, stdout, stderr):
        self.args = [sys.executable, *argv]
        self.returncode = None
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(path)
        body = json.dumps({"argv": [str(a) for a in argv], "env": env, "cwd": str(cwd)}).encode()
        socket.send_fds(self.sock, [len(body).to_bytes(4, "little")], [stdout.fileno(), stderr.fileno()])
        self.sock.sendall(body)
        self.pid = int(self.line(block=True))

    def line(self, block):
        """The server's next line, or None if it has not come (block=False)."""
        self.sock.setblocking(block)
        data = b""
        while not data.endswith(b"\n"):
            try:
                chunk = self.sock.recv(64)
            except BlockingIOError:
                if not data:
                    return None
                self.sock.setblocking(True)
                continue
            if not chunk:
                raise RuntimeError("tests/fork_server.py stopped while a run was going")
            data += chunk
        return data.decode()

    def poll(self):
        if self.returncode is None:
            line = self.line(block=False)
            if line is not None:
                self.returncode = int(line)
                self.sock.close()
        return self.returncode

    def wait(self, timeout=None):
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.02)
        return self.returncode

    def kill(self):
        if self.returncode is None:
            try:
                os.kill(self.pid, 9)
            except ProcessLookupError:
                pass


class Run:
    def __init__(self, summary, master, stdout, stderr):
        self.summary, self.master, self.stdout, self.stderr = summary, master, stdout, stderr


class Runner:
    """Runs training scripts in subprocesses, each configuration once per test session."""

    def __init__(self, tmp, torchrun=False, gpu=False, fake=False):
        self.tmp, self.cache, self.help, self.torchrun, self.gpu = tmp, {}, {}, torchrun, gpu
        self.fake = fake  # every run through tests/fake_cuda.py: on the fake CUDA device

    def options(self, script):
        """The script's source, to pass stage-specific options (such as --bucket_mb) only where they exist."""
        if script not in self.help:
            self.help[script] = Path(script).read_text()
        return self.help[script]

    def env(self, extra=None):
        """The runs' environment: GPUs hidden unless this runner is the GPU suite's; `extra` on top."""
        hide = {} if self.gpu else {"CUDA_VISIBLE_DEVICES": ""}
        # every collective counted at the process group too (tests/count_collectives), but on the fake device, which
        # has its own
        count = [] if self.fake else [str(ROOT / "tests" / "count_collectives")]
        path = os.pathsep.join([str(ROOT), *count])
        return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", **hide, **(extra or {})}

    def command(self, script, nproc, args):
        if self.fake:
            script, args = str(ROOT / "tests" / "fake_cuda.py"), [script, *args]
        if nproc is None:
            return [sys.executable, script, *args]
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", script, *args]

    def run(self, script, nproc, *args, env=None):
        """Train (with `env` added to the environment); return the JSON summary and the final fp32 parameters rank 0 wrote."""
        key = (script, nproc, args, tuple(sorted((env or {}).items())))
        if key not in self.cache:
            tag = f"{Path(script).stem}_{nproc}_{len(self.cache)}"
            out, master = self.tmp / f"{tag}.json", self.tmp / f"{tag}.pt"
            cmd = self.command(script, nproc, [*args, "--out", str(out), "--save_master", str(master)])
            if nproc is None:
                p = self.finish(cmd[1:], self.env(env))
            elif self.torchrun:
                p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=self.env(env), timeout=900)
            else:
                p = self.spawn(script, nproc, [*args, "--out", str(out), "--save_master", str(master)], env)
            if p.returncode != 0 or not out.exists() or not master.exists():
                # the suite's settings are the reference's, which trains them: a learning rate is no cause here
                said = re.sub(r"; lower --lr \(it is [^)]*\) or --warmup's start, or check --data",
                              ": the reference trains these settings, so the stage file made it, not the learning rate",
                              "\n".join(last_lines(p.stdout + p.stderr, 25)))
                self.cache[key] = (f"this run failed (exit code {p.returncode}):\n  {' '.join(cmd)}\n--- its last output ---\n"
                                   + said)
            else:
                self.cache[key] = Run(json.loads(out.read_text()), torch.load(master), p.stdout, p.stderr)
        if isinstance(self.cache[key], str):  # a failed run fails every test that needs it, without running again
            pytest.fail(self.cache[key], pytrace=False)
        return self.cache[key]

    def spawn(self, script, nproc, args, env=None, timeout=900, grace=0.0, nodes=1):
        """What torchrun does on one node: N ranks with the environment torch.distributed reads (RANK, WORLD_SIZE,
        LOCAL_RANK, MASTER_ADDR, MASTER_PORT), and the whole job stopped as soon as one rank fails (after `grace`
        seconds, for a test of ranks that must all stop by themselves). `nodes`: as torchrun on that many nodes of
        N / nodes ranks each (LOCAL_RANK and GROUP_RANK each rank's on its node), all on this machine."""
        port = free_port()
        procs, outs = [], []
        per_node = nproc // nodes
        for rank in range(nproc):
            rank_env = dict(self.env(env), RANK=str(rank), LOCAL_RANK=str(rank % per_node), WORLD_SIZE=str(nproc),
                            LOCAL_WORLD_SIZE=str(per_node), GROUP_RANK=str(rank // per_node), MASTER_ADDR="127.0.0.1",
                            MASTER_PORT=str(port))
            outs.append((tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")))  # files, not pipes: never full
            fake = [str(ROOT / "tests" / "fake_cuda.py")] if self.fake else []
            procs.append(self.start([*fake, script, *args], rank_env, *outs[-1]))
        deadline = time.monotonic() + timeout
        code = 0  # the exit code of the first rank to fail by itself (those stopped below are not its cause)
        while None in [p.poll() for p in procs]:  # (a list: every rank polled, so a failed one is seen at once)
            if not code and any(p.returncode for p in procs):  # one rank failed: the others get `grace` s to stop
                code = next(p.returncode for p in procs if p.returncode)
                deadline = min(deadline, time.monotonic() + grace)
            if time.monotonic() > deadline:
                for p in procs:  # a failed rank leaves the others waiting in a collective: stop them
                    if p.poll() is None:
                        p.kill()
            time.sleep(0.02)
        text = []
        for out, err in outs:
            out.seek(0), err.seek(0)
            text.append((out.read(), err.read()))
        code = code or next((p.returncode for p in procs if p.returncode), 0)
        return subprocess.CompletedProcess(procs[0].args, code, "".join(o for o, _ in text), "".join(e for _, e in text))

    def start(self, argv, env, stdout, stderr):
        """`python *argv`, forked from the fork server where it can be, else a fresh process."""
        if not self.gpu and ForkServer.usable(env):
            return ForkServer.start(argv, env, ROOT, stdout, stderr)
        return subprocess.Popen([sys.executable, *argv], stdout=stdout, stderr=stderr, text=True, cwd=ROOT, env=env)

    def finish(self, argv, env, timeout=900):
        """`python *argv` to its end, as subprocess.run(..., capture_output=True, text=True) returns it."""
        out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
        p = self.start(argv, env, out, err)
        try:
            p.wait(timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            raise
        out.seek(0), err.seek(0)
        return subprocess.CompletedProcess(p.args, p.returncode, out.read(), err.read())

    def launch(self, script, nproc, *args, env=None):
        """Run once, uncached and unchecked (for runs meant to fail); return the finished process."""
        cmd = self.command(script, nproc, list(args))
        if nproc is None:
            return self.finish(cmd[1:], self.env(env))
        return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=self.env(env), timeout=900)


@pytest.fixture(scope="session")
def runner(tmp_path_factory, request):
    return Runner(tmp_path_factory.mktemp("runs"), request.config.getoption("torchrun"))
