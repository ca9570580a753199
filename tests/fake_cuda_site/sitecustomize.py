"""The fake CUDA device (tests/fake_cuda.py) in every Python process a bench script starts, for
tests/test_bench_fake_cuda.py. Python imports this file at start-up when its directory is on PYTHONPATH; it acts only
when FAKE_CUDA is set, to the number of fake GPUs the machine has ("2"):

    FAKE_CUDA=2 FAKE_CUDA_FINDINGS=DIR PYTHONPATH=tests/fake_cuda_site python bench/largest.py --quick --device cuda

In a process that runs a script (`python file.py`, or `python -c ...` as multiprocessing's spawn starts a worker), it
installs the fake device, enters its mode for the main thread, and at exit reports as fake_cuda.py does: the findings
to DIR/<script>-<pid>/rank<r>.json (each process its own folder: a bench script runs many stages, one after another,
each with its ranks), and exit code 1 on any. `python -m ...` (torchrun's agent, which only starts the ranks) is left
alone. The bench scripts pass --device cuda to what they run themselves."""
import os
import sys

if os.environ.get("FAKE_CUDA") and sys.argv and sys.argv[0] != "-m":
    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    root = os.path.dirname(tests)
    for path in (root, tests):  # train_gpt (fake_cuda.install imports it); fake_cuda and its models
        if path not in sys.path:
            sys.path.append(path)
    name = "c" if sys.argv[0] == "-c" else os.path.splitext(os.path.basename(sys.argv[0]))[0]
    if os.environ.get("FAKE_CUDA_FINDINGS"):  # this process's own folder; what it starts nests theirs inside
        os.environ["FAKE_CUDA_FINDINGS"] = os.path.join(os.environ["FAKE_CUDA_FINDINGS"], f"{name}-{os.getpid()}")
    import atexit
    import torch
    import fake_cuda
    if sys.argv[0] != "-c":  # (a spawned worker is counted in its parent's script folder, which is there already)
        fake_cuda.state.dirs.append(os.path.dirname(os.path.abspath(sys.argv[0])))
    fake_cuda.install()
    torch.cuda.device_count = lambda: int(os.environ["FAKE_CUDA"])  # the machine's GPUs, not this process's ranks
    fake_cuda.FakeCuda().__enter__()  # for the main thread, until the process ends (threads: fake_cuda.run)
    failed = []
    excepthook = sys.excepthook

    def noted(*args):  # an exception that ends the script: its exit code, 1, in the report
        failed.append(1)
        excepthook(*args)
    sys.excepthook = noted

    def report():  # at a normal exit (the stages' own os._exit, from instruments.finish, reports in fake_cuda.install)
        code = fake_cuda.report(1 if failed else 0)
        if code and not failed:
            fake_cuda.real["exit"](code)
    atexit.register(report)
