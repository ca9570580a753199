"""tests/fork_server.py: the suite's runs started without importing torch in each of them.

A run of a stage is mostly its start: `import torch` takes about 3 s of CPU, and a tiny run trains in half a second.
This server imports torch once, then forks a child for each run the suite asks for (conftest.Runner does, through
`Forked`); the child sets up what a fresh `python script.py args` would have (its arguments, environment, working
directory, sys.path, the sitecustomize on its PYTHONPATH, its output files) and runs the script as `__main__`, and
Python's own exit follows (atexit, thread joins, the exit code; an uncaught exception prints its traceback and exits
1). What a fork cannot give: what torch reads from the environment while it is imported. The server starts with the
environment every run has (no GPU visible, OMP_NUM_THREADS=1), and conftest starts a run that changes any variable
torch, its libraries or Python read at import as a fresh process instead. `pytest tests --no_fork` starts every run
fresh.

    python tests/fork_server.py SOCKET     # serves until its standard input closes

A request on the Unix socket SOCKET: a 4-byte length with the run's stdout and stderr file descriptors attached, then
that many bytes of JSON {"argv": [script, *args], "env": {...}, "cwd": dir}. The server answers the child's pid, a
line, and when the child has exited its exit code, a line (negative: the signal that killed it)."""
import gc
import json
import os
import selectors
import socket
import sys
import warnings

# What every run imports; imported here once, and each forked child has it already. torch._dynamo is not imported by
# `import torch`, but the first module built under `with torch.device(...)` imports it, another 3 s.
import numpy  # noqa: F401
import torch  # noqa: F401
import torch._dynamo  # noqa: F401
import torch.distributed  # noqa: F401
import torch.nn.functional  # noqa: F401
import torch.utils._pytree  # noqa: F401
import torch.utils.checkpoint  # noqa: F401
import torch.utils.cpp_extension  # noqa: F401

SERVER_PATH = list(sys.path[1:])  # the interpreter's own path, without this file's folder


def receive(conn):
    """One request: its JSON and the two file descriptors that came with it."""
    head, fds, _, _ = socket.recv_fds(conn, 4, 2)
    size = int.from_bytes(head, "little")
    body = b""
    while len(body) < size:
        body += conn.recv(size - len(body))
    return json.loads(body), fds


def become(request, fds):
    """In the forked child: become `python script.py args` with the request's environment, then run the script."""
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(fds[0], 1)
    os.dup2(fds[1], 2)
    for fd in (devnull, *fds):
        os.close(fd)
    script = os.path.abspath(request["argv"][0])
    extra = [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [os.path.dirname(script), *extra, *SERVER_PATH]
    sys.argv = [script, *request["argv"][1:]]
    # Python imports the first sitecustomize.py on its path at start-up; the server had none
    site = next((os.path.join(p, "sitecustomize.py") for p in extra if os.path.isfile(os.path.join(p, "sitecustomize.py"))), None)
    if site:
        import importlib.util
        spec = importlib.util.spec_from_file_location("sitecustomize", site)
        module = importlib.util.module_from_spec(spec)
        sys.modules["sitecustomize"] = module
        spec.loader.exec_module(module)
    import runpy
    runpy.run_path(script, run_name="__main__")


def serve(path):
    threads = len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else 1
    if threads != 1:
        sys.exit(f"fork_server: {threads} threads after importing torch; a fork would copy them half-alive "
                 "(start it with OMP_NUM_THREADS=1)")
    # What the imports made (about 290,000 objects) goes to the garbage collector's permanent generation: a child's
    # collections and its walks of gc.get_objects() for live tensors (instruments.live_tensor_bytes, about 0.3 s
    # each, at each run's measured step) skip it. So that those walks count what a fresh process's would, none of it
    # may be a tensor.
    with warnings.catch_warnings():  # isinstance() on some deprecated torch objects warns
        warnings.simplefilter("ignore")
        made = [o for o in gc.get_objects() if isinstance(o, torch.Tensor)]
    if made:
        sys.exit(f"fork_server: {len(made)} tensors made while importing; frozen, no child's meter would see them")
    gc.freeze()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    events = selectors.DefaultSelector()
    events.register(listener, selectors.EVENT_READ)
    events.register(sys.stdin, selectors.EVENT_READ)
    children = {}  # pid -> the connection its exit code goes to
    while True:
        for key, _ in events.select(timeout=0.02):
            if key.fileobj is sys.stdin:  # the suite has ended (or died): stop serving
                return
            conn, _ = listener.accept()
            request, fds = receive(conn)
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                events.close()
                listener.close()
                conn.close()
                become(request, fds)
                sys.exit(0)
            for fd in fds:
                os.close(fd)
            conn.sendall(f"{pid}\n".encode())
            children[pid] = conn
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            conn = children.pop(pid)
            try:
                conn.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
            except OSError:  # the suite stopped waiting for it
                pass
            conn.close()


if __name__ == "__main__":
    serve(sys.argv[1])
