"""
devices.py: the device-specific part, kept thin and in one place, so that train_gpt.py and the stage files read as the
algorithm: which device and dtype a run uses, the process group and the few agreements its ranks make, and, for
ZeRO-Offload's C++ AdamW (built by offload.py), each code path's compiler flags, its build checks and its threads.
Without CUDA each of these degrades to its CPU form (gloo), never to another algorithm.
"""
import datetime, functools, os, shutil, socket, sys

import torch
import torch.distributed as dist
import torch.utils.cpp_extension

from comm import reduce_scatter_tensor  # torch 2.13's name, or an older torch's

# ----------------------------------------------------------------------------------------------------------
# The device, the dtype and the process group.

def pick_device(choice, local_rank):
    if choice == "cuda" and not torch.cuda.is_available():
        raise SystemExit("error: --device cuda, but torch sees no CUDA GPU; use --device cpu (or auto)")
    if choice == "cpu" or not torch.cuda.is_available():
        return torch.device("cpu")
    if local_rank >= torch.cuda.device_count():
        raise SystemExit(f"error: local rank {local_rank} but this node has {torch.cuda.device_count()} GPUs; "
                         f"use --nproc_per_node {torch.cuda.device_count()} or fewer")
    return torch.device("cuda", local_rank)

def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

def init_distributed(args):
    if "RANK" not in os.environ:  # plain `python stageN.py`: a world of one, through the same code path
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    device = pick_device(args.device, int(os.environ["LOCAL_RANK"]))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    seconds = getattr(args, "collective_timeout", 600)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", device_id=device if device.type == "cuda" else None,
                            timeout=datetime.timedelta(seconds=seconds))
    rank = dist.get_rank()
    sys.excepthook = functools.partial(explain_timeout, sys.excepthook, rank, seconds)
    world_size = dist.get_world_size()
    problem = torch_too_old(torch.__version__) or not_averaging(rank, world_size, device)
    if problem:
        stop(problem, rank)
    return rank, world_size, device

TORCH_FLOOR = (2, 11)  # the oldest torch the tests were run on (CPU, gloo); requirements.txt says the same
UPGRADE = f"pip install 'torch>={TORCH_FLOOR[0]}.{TORCH_FLOOR[1]}'"

def torch_too_old(version):
    """One error line for a torch below TORCH_FLOOR, else None; version as in torch.__version__: "2.13.0+cpu"."""
    major, minor = version.split(".")[:2]
    if (int(major), int(minor)) >= TORCH_FLOOR:
        return None
    floor = f"{TORCH_FLOOR[0]}.{TORCH_FLOOR[1]}"
    return f"error: torch {version} is older than this code needs (torch >= {floor}); {UPGRADE}"

def not_averaging(rank, world_size, device):
    """One error line if the process group's AVG does not average, else None. The stages average gradients with
    all_reduce and reduce_scatter (op=AVG): gloo in torch 2.4 to 2.7 refuses all_reduce AVG, and up to 2.8 its
    reduce_scatter AVG sums, so training would take N times the gradients and say nothing. A probe of a few elements,
    on the real process group: each rank gives rank + 1, whose average is (N + 1) / 2 and whose sum is N times that.
    (A world of one cannot tell a sum from an average; there TORCH_FLOOR alone guards.)"""
    average = (world_size + 1) / 2
    backend = f"the {dist.get_backend()} backend of torch {torch.__version__}"
    whole = torch.full((world_size,), rank + 1.0, device=device)
    part = torch.zeros(1, device=device)
    try:
        dist.all_reduce(whole, op=dist.ReduceOp.AVG)
        reduce_scatter_tensor(part, torch.full((world_size,), rank + 1.0, device=device), op=dist.ReduceOp.AVG)
    except Exception as e:  # gloo before torch 2.8: "Cannot use ReduceOp.AVG with Gloo"
        first_line = (str(e).splitlines() or [""])[0]
        return f"error: {backend} cannot average ({type(e).__name__}: {first_line}); {UPGRADE}"
    for name, result in (("all_reduce", whole), ("reduce_scatter", part)):
        # 1e-3: NCCL multiplies each rank's part by 1/N before it sums, which rounds; a sum is off by a factor N >= 2
        wrong = [x for x in result.tolist() if abs(x - average) > 1e-3 * average]
        if wrong:
            return (f"error: {backend} does not average: {name}(op=AVG) of 1..{world_size} over {world_size} ranks "
                    f"gave {wrong[0]:g}, not {average:g}, and training would take wrong gradients; {UPGRADE}")
    return None

WORD = "zero/stopped"  # the process group's store's key for the line of a rank that stopped alone

def leave_word(message):
    """A rank that stops alone mid-run (a disk that failed it, say) leaves its one line in the process group's store,
    where the ranks left waiting for it in a collective read it (explain_timeout): each then names the cause."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        store = dist.distributed_c10d._get_default_store()
        # the first line left stays: a failed write may be followed by others already in flight
        if store.add(WORD + "/count", 1) == 1:
            store.set(WORD, f"rank {dist.get_rank()} stopped: {message}")

def word_left():
    """The line a rank that stopped alone left (leave_word), or None: none was left, or the store went with it (the
    store lives in rank 0's process unless torchrun's agent holds it)."""
    try:
        store = dist.distributed_c10d._get_default_store()
        return store.get(WORD).decode() if store.check([WORD]) else None
    except Exception:
        return None

def explain_timeout(previous, rank, seconds, kind, error, traceback):
    """sys.excepthook once the ranks are up: a collective that timed out ends this rank with one line that names the
    likely cause (a rank that ran out of batches while the others went on), and so does a collective whose peer left
    (the rank that timed out first exits, and gloo tells the others "Connection closed by peer"); where the rank that
    left said why (leave_word), the line is its line; any other error as before."""
    message = str(error).lower()
    lost = issubclass(kind, RuntimeError) and any(s in message for s in ("timed out", "timeout", "by peer"))
    word = word_left() if lost else None
    if word is not None:
        print(f"error: rank {rank}: {word.replace('error: ', '', 1)}", file=sys.stderr, flush=True)
        os._exit(1)
    if issubclass(kind, RuntimeError) and ("timed out" in message or "timeout" in message):
        print(f"error: rank {rank}: a collective waited more than --collective_timeout {seconds:g} s for another rank: "
              f"most likely the ranks had different numbers of batches (uneven data); give every rank the same number "
              f"of micro-steps", file=sys.stderr, flush=True)
        os._exit(1)
    if issubclass(kind, RuntimeError) and ("closed by peer" in message or "reset by peer" in message):
        print(f"error: rank {rank}: another rank left while this one waited for it in a collective (that rank's own "
              f"line says why): most likely the ranks had different numbers of batches (uneven data); give every rank "
              f"the same number of micro-steps", file=sys.stderr, flush=True)
        os._exit(1)
    previous(kind, error, traceback)

def stop(message, rank):
    """End every rank with one error line, printed once: for an error that all ranks meet at the same point."""
    if not dist.is_initialized():
        raise SystemExit(message)
    if rank == 0:
        print(message, file=sys.stderr, flush=True)
    dist.barrier()  # rank 0 has printed before any rank exits (torchrun stops the others once one has exited)
    dist.destroy_process_group()
    sys.stdout.flush(), sys.stderr.flush()
    os._exit(1)

def native_bf16():
    """The CPU's native bf16 matrix instructions, as /proc/cpuinfo's flags name them: amx_bf16 (AMX) and avx512_bf16
    (AVX512-BF16); none where it lists neither, or has no /proc/cpuinfo."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return []
    return [flag for flag in ("amx_bf16", "avx512_bf16") if flag in flags]

def pick_dtype(choice, device):
    """(dtype, why) for --dtype. auto on a GPU: bf16 where it computes bf16 natively, else fp16 with loss scaling (the
    papers' V100s, a T4: fp16 tensor cores, 16 bytes per parameter as in the papers). auto on a CPU: bf16 where it
    has native bf16 matrix instructions (AMX, AVX512-BF16: on the machines measured, bf16 ran 1.6-2.7x as fast as
    fp32), fp32 otherwise, never fp16 (a CPU's fp16 matmul is a fallback, tens of times slower than its fp32 one).
    Elsewhere torch's bf16 matmul runs a fallback too; AVX-512 without BF16, which oneDNN calls bf16-capable, only
    emulates it. What the CPU has decides, not a timing: every run on one machine picks the same dtype, and so
    prints the same table."""
    if choice != "auto":
        return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[choice], f"--dtype {choice}"
    if device.type == "cuda":  # bf16 in hardware from compute capability 8.0 (Ampere) on; torch.cuda.is_bf16_supported()
        # would also say yes where bf16 is only emulated, and slow (a V100 or T4); fp16 they compute natively
        name, (major, minor) = torch.cuda.get_device_name(device), torch.cuda.get_device_capability(device)
        if major >= 8:
            return torch.bfloat16, f"auto: {name} (compute capability {major}.{minor}) computes bf16 natively"
        return torch.float16, (f"auto: {name} (compute capability {major}.{minor}) has no native bf16, only a slow "
                               "emulation: fp16, with dynamic loss scaling")
    isa = torch.backends.cpu.get_cpu_capability()
    found = native_bf16()
    check = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    if found and (check is None or check()):
        return torch.bfloat16, f"auto: this CPU ({isa}) has native bf16 matrix instructions ({', '.join(found)})"
    return torch.float32, (f"auto: this CPU ({isa}) has no native bf16 matrix instructions (amx_bf16, avx512_bf16), "
                           "where bf16 runs a slow fallback")

def everyone(obj):
    """obj from every rank, in rank order (a world of one needs no process group)."""
    if not dist.is_initialized():
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out

def from_rank0(obj):
    """Rank 0's obj, on every rank."""
    if not dist.is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]

def agree(error):
    """Stop every rank with the first rank's error, if any rank has one (a lone exit would hang the others)."""
    errors = [e for e in everyone(error) if e]
    if errors:
        raise SystemExit(errors[0])

# ----------------------------------------------------------------------------------------------------------
# ZeRO-Offload's C++ AdamW: which code path, built with which flags, on how many threads.

CPU_ADAM_BUILDS = {}  # instruction set -> the module load_cpu_adam built for it, once per process
def cpu_adam_source():
    """The text of cpu_adam.cpp, the project's (wherever a stage file is: an exercise's copy builds the same kernel)."""
    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "cpu_adam.cpp")) as f:
        return f.read()

# The compiler flags of each code path of cpu_adam.cpp: the instructions torch's own CPU check promises for its
# capability of that name (ATen reports AVX2 only with FMA, AVX512 only with AVX-512 VL, BW, DQ and FMA), and F16C for
# AVX2, which every AVX2 CPU has (F16C came a generation before AVX2 at Intel and at AMD). Never -march=native: a build
# cached in a shared home or a container image must run on every CPU that reports the path.
ISA_FLAGS = {
    "avx512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma"],
    "avx2": ["-mavx2", "-mfma", "-mf16c"],
    "scalar": [],  # portable C++: the only path on aarch64 and other CPUs (no x86 flags there)
}
OPENMP = () if sys.platform == "darwin" else ("-fopenmp",)  # Apple's compiler has none: the kernel then runs 1 thread

def cpu_adam_isas():
    """The kernel's code paths this CPU can run, best first, from torch.backends.cpu.get_cpu_capability() (which
    ATEN_CPU_CAPABILITY=avx2 or =default lowers, to run another CPU's path here)."""
    cap = torch.backends.cpu.get_cpu_capability()
    return {"AVX512": ["avx512", "avx2"], "AVX2": ["avx2"]}.get(cap, []) + ["scalar"]

def cpu_adam_isa(isa=None):
    """The code path to build: `isa`, else CPU_ADAM_ISA, else the best this CPU runs; one it cannot run is refused."""
    runnable = cpu_adam_isas()
    isa = isa or os.environ.get("CPU_ADAM_ISA") or runnable[0]
    if isa not in runnable:
        raise RuntimeError(f"cpu_adam: no {isa!r} code path for this CPU (torch's CPU capability: "
                           f"{torch.backends.cpu.get_cpu_capability()}); CPU_ADAM_ISA can be {', '.join(runnable)}")
    return isa

def cpu_adam_flags(isa):
    """load_inline's compiler and linker flags for code path `isa`, new lists at each call (load_inline appends torch's
    libraries to the list it is given; a build whose flags changed is compiled again). -ffp-contract=off: the compiler
    adds no FMAs of its own, so every code path rounds alike. -fno-math-errno: sqrt without a branch to set errno, so
    the portable loop can be vectorised."""
    cflags = ["-O3", "-ffp-contract=off", "-fno-math-errno", *OPENMP, *ISA_FLAGS[isa]]
    return {"extra_cflags": cflags, "extra_ldflags": list(OPENMP)}

def build_cpu_adam(isa, build):
    """build() once per code path and process: a missing compiler or ninja is one error that names the fix, and the
    module must run the code path it was built for."""
    if isa not in CPU_ADAM_BUILDS:
        try:
            torch.utils.cpp_extension.verify_ninja_availability()
            if shutil.which(os.environ.get("CXX", "c++")) is None:
                raise RuntimeError(f"C++ compiler {os.environ.get('CXX', 'c++')!r} not found on PATH")
        except Exception as e:
            raise RuntimeError("could not build cpu_adam.cpp: install a C++ compiler (apt-get install g++) and ninja "
                               f"(pip install ninja)\n{type(e).__name__}: {e}") from e
        try:
            mod = build()
        except Exception as e:
            raise RuntimeError(f"could not build cpu_adam.cpp for {isa} with {cpu_adam_flags(isa)}: the compiler's "
                               f"errors are above\n{type(e).__name__}: {str(e)[:2000]}") from e
        if mod.isa() != isa:  # the flags did not give the path asked for (a compiler that ignores them?)
            raise RuntimeError(f"cpu_adam: built for {isa} with {ISA_FLAGS[isa]} but compiled the {mod.isa()} path")
        CPU_ADAM_BUILDS[isa] = mod
    return CPU_ADAM_BUILDS[isa]

def adam_threads(spare=0):
    """(threads per rank, cores, local ranks) for the kernel: this node's cores shared among its local ranks, less
    `spare` cores left to the rank's own threads. Not OMP_NUM_THREADS, which torchrun sets to 1 when nproc_per_node > 1
    (one core for each rank's Adam), while without torchrun every rank would take every core."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    return max(1, cores // local - spare), cores, local

def set_cpu_adam_threads(mod, spare=0, announce=False):
    """The kernel runs on adam_threads(spare)[0] threads; announce: print one line saying what it uses."""
    mod.set_threads(adam_threads(spare)[0])
    if announce:
        threads, (_, cores, local) = mod.threads(), adam_threads()
        print(f"cpu_adam: {mod.isa()} build, {threads} thread{'s' * (threads > 1)} per rank ({cores} core"
              f"{'s' * (cores > 1)} / {local} local rank{'s' * (local > 1)}"
              + f", {spare} left to the rank's own threads" * bool(spare) + ")", flush=True)
    return mod

def load_cpu_adam(isa=None, announce=False, spare=0):
    """cpu_adam.cpp built by load_inline for the best code path this CPU runs, on its cores less spare."""
    isa = cpu_adam_isa(isa)

    # (the module's Python bindings are cpu_adam.cpp's own: its arguments have names)
    def build():
        return torch.utils.cpp_extension.load_inline(f"cpu_adam_{isa}", cpp_sources=[cpu_adam_source()],
                                                     **cpu_adam_flags(isa))
    # once per code path and process; a missing compiler is one clear error
    module = build_cpu_adam(isa, build)
    return set_cpu_adam_threads(module, spare, announce)
