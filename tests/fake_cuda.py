"""
tests/fake_cuda.py: a stage on a fake CUDA device, on a machine without one, refused what CUDA would refuse.

    python tests/fake_cuda.py offload.py --preset tiny --steps 2         # one rank; or under torchrun, N ranks:
    FAKE_CUDA_FINDINGS=DIR torchrun --nproc_per_node 2 tests/fake_cuda.py stage3.py ...  # (findings: DIR/rank<r>.json)

The stage runs with --device cuda through its own CUDA code paths (nccl's calls, pinned host buffers, Copies' streams
and events) on CPU storage: a TorchDispatchMode tags each storage with the device it was asked for (cuda:r, cpu or
pinned cpu), the CUDA runtime is stubbed, the process group is gloo, real numbers flow. Refused, naming the project's
file:line, the op, and the tensors' devices (a host tensor's with the line that made it):
  - an op whose non-scalar tensors are not all on one device: a kernel reads one device's memory (a 0-dim host
    tensor is passed as a scalar; copy_ and .to() cross devices);
  - a collective with a tensor not on the GPU its process group is bound to (init_process_group's device_id, else
    the current device at its first collective): NCCL reads and writes that GPU's memory only. A rank's current
    device is CUDA's first until it calls torch.cuda.set_device, and torch's object collectives (all_gather_object,
    broadcast_object_list, ...) go through it as under NCCL: pickled into a tensor copied up, gathered, copied down
    (their host syncs counted);
  - the C++ AdamW (an engine's `adam`) given a GPU tensor: it reads host pointers; record_stream on a host tensor;
  - inside forward or backward, or while a batch comes up, a host synchronisation, which stops the host from queueing work ahead of the GPU:
    .item()/float() of a GPU tensor, nonzero(), synchronize(), a copy between device and host unless non_blocking with
    its host end pinned (torch waits for a blocking one; to pageable memory it returns only when done).
  - stream order (tests/fake_streams.py: torch's CUDA Sanitizer, fed by the stubs below): a kernel, copy or
    collective touching memory another stream (or a host thread, for pinned memory) wrote or reads with no wait in
    between; device memory freed (a storage's death, or its resize_(0)) while another stream may still use it;
    host reads below the dispatcher (tolist, numpy, data_ptr, the C++ extension's entry points) under a copy;
  - collectives that differ across ranks (op, ReduceOp, root, sizes, dtypes, buffers: each rank checks the others'
    through the store, waiting FAKE_CUDA_COLLECTIVE_TIMEOUT seconds at most): the rank stops at once, naming both
    call stacks.
A rank reports every finding at exit, and exits 1. Recorded, for the tests: the compute stream waiting for another
stream in forward; collectives issued on another stream. Time (tests/fake_clock.py, fake_streams.py): each stream's
and each host thread's on a modelled clock, at a GPU's measured rates (FAKE_CUDA_HOST=ideal: the host's own time
none); CUDA events record it (elapsed_time refuses events made without enable_timing=True, as CUDA does), a profiler
asked for CUDA activity writes it as a GPU's trace, and instruments.Timeline reads it as its host clock, so
--timeline draws the modelled step; each step's end goes to the findings file ("clock"). Memory
(tests/fake_memory.py): device memory allocated, reserved and peak (cuBLAS's workspaces in it, one per thread's
handle and stream), pinned host memory, a budget per rank (FAKE_CUDA_FREE_BYTES) past which an allocation raises
OutOfMemoryError, and a leak (device memory that grows from step to step) refused, naming the line that made what is
held. A device the project names (device="cpu", .cpu(), .to("cpu")) is where its tensor lives, whatever its inputs'
device.
"""
import collections, concurrent.futures, contextlib, gc, inspect, json, os, runpy, sys, threading, time, traceback
import importlib, itertools, types, warnings, weakref

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

import fake_clock  # what each piece of work costs on a GPU: the modelled clock's rates
import fake_memory  # device memory and pinned host memory, counted from the storages tagged here
import fake_streams  # stream order: torch's CUDA Sanitizer, fed from the dispatch and the stream stubs here

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
aten = torch.ops.aten
INDEXING = (aten.index.Tensor, aten.index_put_.default, aten.index_put.default)  # (host indices are moved over)
MATMULS = (aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default, aten._addmm_activation.default,
           aten.mv.default, aten.addmv.default)  # cuBLAS's: each (handle, stream) pair keeps a workspace
tags = weakref.WeakKeyDictionary()  # storage -> (device: "cuda:i", "cpu" or "pinned" (a pinned host buffer), made at)
origins = weakref.WeakKeyDictionary()  # storage -> (its allocation site, its number: None if made outside an engine's
made_at = collections.defaultdict(list)  # __init__); allocation site -> [(number, weakref)] of the engines' storages
storages_made = itertools.count()  # each storage's number, in the order they are made
blocks = weakref.WeakKeyDictionary()  # storage -> its fake_memory.Block (device and pinned storages)
findings, seen = collections.Counter(), collections.Counter()  # refusals; what was checked (the tests: not nothing)
# device: the current device, CUDA's first until torch.cuda.set_device; bound: the device the nccl process group is
# bound to (its device_id, or the current device at its first collective); host_groups: the gloo groups made beside it
state = types.SimpleNamespace(device=0, bound=None, nccl=False, dirs=[ROOT], compute=None, host_groups=set(),
                              sync_debug=0, step_ends=[])  # step_ends: the modelled clock at each step's end

class Flags(threading.local):  # per thread: in "forward", "backward" or "batch"; in a collective; in Tensor.to; the
    phase, collective, move, streams = None, False, False, ()  # streams made current (torch.cuda.stream), innermost last
    building = False  # in an engine's __init__
    cxx_device = None  # in DDP's C++ Reducer: its parameters' device ("cuda:i"), where it makes its buckets
    objects = False  # in one of torch's object collectives (all_gather_object, ...)
flags = Flags()
def real_device(t):
    """t's real device; a tensor subclass's too (outside.Sharded: torch asks its __torch_function__, which would
    call the fake Tensor.device)."""
    with torch._C.DisableTorchFunctionSubclass():
        return torch._C.TensorBase.device.__get__(t)

real = dict(device=real_device, to=torch.Tensor.to, init=dist.init_process_group,
            exit=os._exit, run=threading.Thread.run, resize=torch.UntypedStorage.resize_, generator=torch.Generator,
            tensor=torch.tensor, start=threading.Thread.start, join=threading.Thread.join,
            submit=concurrent.futures.ThreadPoolExecutor.submit, new_group=dist.new_group,
            object_device=dist.distributed_c10d._get_object_coll_device)


def tag(t):
    """Where t lives on the fake machine; a tensor made outside the mode (or on meta) is on its real device."""
    entry = tags.get(t.untyped_storage()) if real["device"](t).type == "cpu" else None
    return entry[0] if entry else real["device"](t).type

def host(t):
    return not tag(t).startswith("cuda")

def shown(name, t):
    """'name cuda[numel]', 'name cpu(pinned)[numel] (made at file:line)'."""
    made = f" (made at {tags.get(t.untyped_storage(), ('', '?'))[1]})" if host(t) else ""
    own = state.device if state.bound is None else state.bound  # (another GPU's tensor: named by its index)
    device = {"pinned": "cpu(pinned)", f"cuda:{own}": "cuda"}.get(tag(t), tag(t))
    return f"{name} {device}[{t.numel()}]{made}"

def tensors(arguments):
    """(name, tensor) for each tensor among (name, value) pairs, a list's as name[i]."""
    return [(f"{n}[{i}]" if isinstance(v, (list, tuple)) else n, t) for n, v in arguments
            for i, t in enumerate(v if isinstance(v, (list, tuple)) else [v]) if isinstance(t, torch.Tensor)]

# the files every stage calls through, never the culprit (outside.py: every op on a ZeRO-3 parameter)
PLUMBING = ("comm.py", "instruments.py", "devices.py", "outside.py")

def where(stack=None):
    """file:line of the innermost frame in the project (the repository or the stage's folder, not tests/); if that is
    in the plumbing every stage shares (comm.py, instruments.py, devices.py, outside.py), its caller's, "via" the
    plumbing's. Of this thread's stack, or of `stack`: (file, line) pairs, innermost first."""
    frames = ["?"]
    for file, lineno in stack if stack is not None else this_stack(sys._getframe(1)):
        path = os.path.abspath(file)
        d = next((d for d in state.dirs if path.startswith(d + os.sep)), None)
        if d and not path.startswith(os.path.join(ROOT, "tests", "")) and "site-packages" not in path:
            frames.insert(-1, f"{os.path.relpath(path, d)}:{lineno}")
    caller = next((fr for fr in frames if fr.split(":")[0] not in PLUMBING), frames[0])
    return caller + f" (via {frames[0]})" * (caller != frames[0])

def call_stack(depth=3):
    """The project's innermost `depth` frames of this thread but the shared plumbing's (comm.py, instruments.py,
    devices.py), 'file:line < its caller's file:line < ...'."""
    frames = []
    for file, lineno in this_stack(sys._getframe(1)):
        path = os.path.abspath(file)
        d = next((d for d in state.dirs if path.startswith(d + os.sep)), None)
        if d and not path.startswith(os.path.join(ROOT, "tests", "")) and "site-packages" not in path:
            name = os.path.relpath(path, d)
            if name not in PLUMBING:
                frames.append(f"{name}:{lineno}")
    return " < ".join(frames[:depth]) or "?"

def identity(t):
    """Which buffer t is, alike on every rank that holds the same buffers: the site that made its storage, the byte
    offset of t in it, and for the buffers an engine makes in its __init__ (its units' buckets: made in one loop, at
    one line), the how-manieth of that site's live ones it is. (Not for a step's temporaries: when one dies depends
    on when a collective's work lets it go, which differs by rank; not counted among dead ones either: a probe that
    ran out of memory on one rank made more there.)"""
    site, number = origins.get(t.untyped_storage(), ("?", None))
    if number is None:
        return f"made at {site} +{t.storage_offset() * t.element_size()}"
    live = [(n, ref) for n, ref in made_at[site] if ref() is not None]
    made_at[site] = live
    k = 1 + sum(n < number for n, _ in live)
    return f"made at {site} #{k} +{t.storage_offset() * t.element_size()}"

# collective: (the whole buffer, the rank's slice of it) when it runs in place
IN_PLACE = {"all_gather_into_tensor": ("output_tensor", "input_tensor"),
            "all_gather_single": ("output_tensor", "input_tensor"),
            "reduce_scatter_tensor": ("input", "output"), "reduce_scatter_single": ("input", "output")}

def identities(name, bound, named):
    """(name, tensor, which buffer it is) of a collective's tensors, each by identity(), but the rank's slice of an
    in-place one (NCCL's rule: an all-gather's input at output + rank * its size, a reduce-scatter's output at input +
    rank * its size; FSDP2 gathers so), which is named as that slice: its offset differs by rank by design. A slice
    anywhere else keeps its offset, which the other ranks' then show differs. A gather's list of outputs (a
    scatter's of inputs) is the root's alone: left out."""
    whole_name, part_name = IN_PLACE.get(name, (None, None))
    whole, part = bound.get(whole_name), bound.get(part_name)
    slice_of = None
    if isinstance(whole, torch.Tensor) and isinstance(part, torch.Tensor):
        size = part.numel() * part.element_size()
        start = whole.storage_offset() * whole.element_size() + dist.get_rank(bound.get("group")) * size
        if (part.untyped_storage().data_ptr() == whole.untyped_storage().data_ptr() and whole.is_contiguous()
                and part.storage_offset() * part.element_size() == start
                and whole.numel() == part.numel() * dist.get_world_size(bound.get("group"))):
            slice_of = f"in place: the rank's slice of {whole_name}"
    rooted = [n for n, _ in named if n.startswith(("gather_list", "scatter_list"))]
    return [(n, t, slice_of if slice_of and n == part_name else identity(t)) for n, t in named if n not in rooted]

def this_stack(f):
    while f is not None:
        yield f.f_code.co_filename, f.f_lineno
        f = f.f_back

def refuse(op, detail, at=None):
    findings[f"{at or where()} {op}: {detail}"] += 1

def from_project():
    """Whether the op being dispatched was called by the project's own code (a frame in the project, not tests/),
    rather than by torch's C++ (autograd's saved options) or torch's Python."""
    f = sys._getframe(1)
    while f.f_code in (FakeCuda.__torch_dispatch__.__code__, FakeCuda.dispatch.__code__):  # (the mode's frames)
        f = f.f_back
    path = os.path.abspath(f.f_code.co_filename)
    ours = any(path.startswith(d + os.sep) for d in state.dirs)
    return ours and not path.startswith(os.path.join(ROOT, "tests", "")) and "site-packages" not in path

def host_sync(what):
    # another thread's wait (offload's delayed update: its thread waits for the gradient) stops only that thread
    if threading.current_thread() is not threading.main_thread():
        seen["host syncs in other threads"] += 1
        return
    seen[f"host syncs in {flags.phase or 'the rest'}"] += 1  # the tests count them outside the phases too
    seen["host syncs in object collectives"] += flags.objects  # (of those: under NCCL, 3 + N in an all-gather)
    if state.sync_debug == 1:  # torch.cuda.set_sync_debug_mode("warn"), as torch warns
        warnings.warn(f"called a synchronizing CUDA operation: {what}")
    if flags.phase:
        refuse(f"host sync in {flags.phase}", what)

streams = fake_streams.Model(refuse, where)  # the order of streams: torch's CUDA Sanitizer, fed by the stubs below
collectives = fake_streams.Sequence(float(os.environ.get("FAKE_CUDA_COLLECTIVE_TIMEOUT", 60)))


class FakeCuda(TorchDispatchMode):
    """device="cuda" served on the CPU; every op checked; new outputs tagged (views share their storage's tag)."""
    @classmethod
    def _should_skip_dynamo(cls):  # nothing is compiled here: torch need not import its compiler
        return False

    def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func.namespace == "c10d":  # collectives: checked by NCCL's rule where torch.distributed is called
            return func(*args, **kwargs)
        named = tensors([(a.name, v) for a, v in zip(func._schema.arguments, args)] + list(kwargs.items()))
        want = kwargs.get("device")
        if not (any(not host(t) for _, t in named) or isinstance(want, torch.device) and want.type == "cuda"):
            return self.dispatch(func, args, kwargs, named)  # the host's own work: its time is the host's
        with streams.faking():  # a GPU's kernel: modelled, the host's math here is the fake device's
            return self.dispatch(func, args, kwargs, named)

    def dispatch(self, func, args, kwargs, named):
        want, pin = kwargs.get("device"), kwargs.pop("pin_memory", None)  # pinning needs CUDA: a tag instead
        if want == torch.device("cpu") and flags.cxx_device and not from_project():  # (DDP's buckets)
            want = torch.device(flags.cxx_device)
        if isinstance(want, torch.device) and want.type == "cuda":
            want = torch.device("cuda", state.device if want.index is None else want.index)
            kwargs["device"] = torch.device("cpu")
        elif want == torch.device("cpu") and not flags.move and any(not host(t) for _, t in named) \
                and not from_project():
            want = None  # C++ (autograd's saved options, say) names the real device: its inputs' is meant
        non_blocking = kwargs.get("non_blocking", len(args) > 2 and args[2] if func is aten.copy_.default else False)
        if func is aten._to_copy.default and non_blocking and want == torch.device("cpu") and not host(args[0]):
            pin = True  # torch pins the host end of a non_blocking copy down itself
        seen[f"{flags.phase} ops"] += bool(flags.phase)
        if func is aten.is_pinned.default:
            return tag(args[0]) == "pinned"
        waits = False if flags.collective else self.check(func, named, want, pin, non_blocking)
        if func in MATMULS and any(not host(t) for _, t in named):
            # cuBLAS's handles are per thread; autograd runs a backward's GPU work in a thread of its own per device
            handle = "backward" if torch._C._current_graph_task_id() != -1 else threading.get_ident()
            device = int(next(tag(t) for _, t in named if not host(t)).split(":")[1])
            fake_memory.workspace(device, handle, current_stream().id, where())
        out = args[0].clone() if func is aten._pin_memory.default else func(*args, **kwargs)
        pin = pin or func is aten._pin_memory.default
        new = next((tag(t) for _, t in named if not host(t)), "pinned" if pin else "cpu") if want is None else \
            str(want) if want.type == "cuda" else "pinned" if pin else "cpu"  # (a buffer like a pinned one: pageable)
        for t in out if isinstance(out, (list, tuple)) else [out]:
            if isinstance(t, torch.Tensor) and real["device"](t).type == "cpu" and t.untyped_storage() not in tags:
                site = where()
                tags[t.untyped_storage()] = (new, site)
                number = next(storages_made) if flags.building else None
                if number is not None:
                    made_at[site].append((number, weakref.ref(t.untyped_storage())))
                origins[t.untyped_storage()] = (site, number)
                if new != "cpu":  # device or pinned memory, counted while the storage lives (OutOfMemoryError)
                    blocks[t.untyped_storage()] = fake_memory.allocated(t.untyped_storage(), new, site)
                if new != "cpu":  # device memory, or pinned host memory: the stream model follows it
                    streams.allocated(t.untyped_storage(), current_stream().id, device=new.startswith("cuda"))
        if not flags.collective:  # a kernel on the current stream; on pinned host memory alone, the host's work
            on = [t for t in fake_streams.tensors_in([args, kwargs, out]) if tag(t) != "cpu"]
            if on:
                stream_id = current_stream().id if any(not host(t) for t in on) else streams.host()
                streams.kernel(stream_id, func, args, kwargs, out)
                if stream_id not in streams.hosts:
                    self.timed(stream_id, func, args, kwargs, out, on)
                if waits:  # a blocking copy between device and host, a value read: the host waits for the stream
                    streams.host_waits_for_stream(stream_id)
        return out

    def timed(self, stream_id, func, args, kwargs, out, on):
        """The op's kernel (or copy) on the modelled clock: its cost (tests/fake_clock.py) queued on its stream."""
        device = [t for t in on if not host(t)]
        ends = None
        if func in (aten.copy_.default, aten._to_copy.default):
            src, dst = (args[1], args[0]) if func is aten.copy_.default else (args[0], out)
            ends = (tag(src), tag(dst)) if host(src) != host(dst) else None
        cost = fake_clock.work(func, args, kwargs, out, device, ends=ends)
        if cost is not None:
            streams.queue(stream_id, *cost)

    def check(self, func, named, want, pin, non_blocking):
        """Refuses what CUDA would; True where the host waits for the stream (a blocking copy, a value read)."""
        op, (_, first) = str(func).removesuffix(".default"), named[0] if named else (None, None)
        if func in (aten.copy_.default, aten._to_copy.default):  # across: async only non_blocking, host end pinned
            src = tag(named[1][1] if func is aten.copy_.default else first)
            dst = tag(first) if func is aten.copy_.default else src if want is None else \
                str(want) if want.type == "cuda" else "pinned" if pin else "cpu"
            if src.startswith("cuda") != dst.startswith("cuda"):
                seen[f"device-host copies in {flags.phase}"] += bool(flags.phase)
                seen["device-host copies on another stream"] += current_stream() is not state.compute
                down, host_end = src.startswith("cuda"), dst if src.startswith("cuda") else src
                if not (non_blocking and host_end == "pinned"):
                    host_sync(f"{op} {'non_blocking' if non_blocking else 'blocking'} to the "
                              f"{'host' if down else 'device'}, {'pinned' if host_end == 'pinned' else 'pageable'} "
                              f"memory: " + ", ".join(shown(n, t) for n, t in named[:2]))
                    return True
        elif func in (aten._local_scalar_dense.default, aten.nonzero.default):
            if not host(first):
                host_sync(f"{op} (.item(), float(), a shape from data) of {shown('self', first)}")
                return True
        elif len({"cpu" if host(t) else tag(t) for n, t in named if (t.dim() or not host(t)) and not (
                func in INDEXING and n.startswith("indices") and host(t))}) > 1:  # one kernel, one device
            refuse(op, ", ".join(shown(n, t) for n, t in named))


class Reducer(dist.Reducer):
    """DDP's C++ Reducer, which makes its buckets (at construction, and again in its first forwards' rebuild) with
    its parameters' options: on a GPU their device; here the host, which holds the fake device's memory. Its factory
    calls naming the host are placed on its parameters' device. Its rebuild, once in a run, broadcasts the new
    buckets' indices through a blocking copy down and back (as on a GPU): a host sync outside forward's count (torch's
    own, once, not the project's queueing)."""
    def __init__(self, params, *args, **kwargs):
        self.fake_cuda_device = tag(params[0]) if tag(params[0]).startswith("cuda") else None
        during("cxx_device", self.fake_cuda_device, super().__init__)(params, *args, **kwargs)

    def _rebuild_buckets(self):
        return during("phase", None, during("cxx_device", self.fake_cuda_device, super()._rebuild_buckets))()


# ---- the CUDA runtime, stubbed: a fake GPU per local rank -----------------------------------------------------
class Stream:
    """Ordered by the stream model (tests/fake_streams.py); also recorded: the compute stream (the default one)
    waiting for another stream's events in forward, where it should compute while copies and collectives run."""
    def __init__(self, *args, stream_id=None, **kwargs):
        self.id = streams.new_id() if stream_id is None else stream_id
        with streams.faking():
            streams.stream_created(self.id, where())
    stream_id = property(lambda self: self.id)
    def wait_event(self, event):
        if self is state.compute and event.stream is not self:
            seen[f"compute waits for another stream in {flags.phase}"] += 1
        streams.wait(self.id, event.id)
    def wait_stream(self, other):
        self.wait_event(Event().record(other))
    def record_event(self, event=None):
        return (event or Event()).record(self)
    def synchronize(self):
        host_sync("synchronize()")
        streams.host_waits_for_stream(self.id, "cudaStreamSynchronize")
    def query(self):  # done only once the host is ordered after its work (a copy down returns early)
        return streams.host_after_stream(self.id)

class Event:
    """A CUDA event: recorded at its stream's modelled time; elapsed_time as CUDA refuses it (events made without
    enable_timing=True, not recorded, or not yet done)."""
    def __init__(self, enable_timing=False, blocking=False, interprocess=False):
        self.stream = None  # where it was last recorded
        self.id = streams.new_id()
        self.timing = enable_timing
    def record(self, stream=None):
        self.stream = stream or current_stream()
        if isinstance(self.stream, fake_streams.Done):  # in a collective's future callback: at the collective's end
            streams.at[self.id] = streams.at[self.stream.event.id]
        else:
            streams.record(self.id, self.stream.id)
        return self
    def wait(self, stream=None):
        (stream or current_stream()).wait_event(self)
    def synchronize(self):
        host_sync("synchronize()")
        streams.host_waits_for_event(self.id, "cudaEventSynchronize")
    def query(self):
        return streams.host_after_event(self.id)
    def elapsed_time(self, other):
        if not (self.timing and other.timing):
            raise RuntimeError("Both events must be created with argument 'enable_timing=True'.")
        if self.id not in streams.at or other.id not in streams.at:
            raise RuntimeError("Both events must be recorded before calculating elapsed time.")
        if not (self.query() and other.query()):
            raise RuntimeError("CUDA error: device not ready (cudaEventElapsedTime before both events are done)")
        return (streams.at[other.id] - streams.at[self.id]) * 1e3

def synchronize(device=None):
    host_sync("synchronize()")
    streams.device_synchronize()

def record_stream(t, stream):
    if host(t):
        refuse("record_stream", shown("self", t))
    streams.record_stream(t, stream.id)

def current_stream(device=None):
    return flags.streams[-1] if flags.streams else state.compute

@contextlib.contextmanager
def stream(s):  # torch.cuda.stream: None changes nothing
    outer = flags.streams
    flags.streams = outer + (s,) * (s is not None)
    try:
        yield
    finally:
        flags.streams = outer

def to(self, *args, **kwargs):
    """Tensor.to by the fake devices: a move copies (the real devices are the same), no move returns self."""
    if args and isinstance(args[0], torch.Tensor):
        args = (args[0].device, args[0].dtype, *args[1:])
    copy = kwargs.pop("copy", False)
    device, dtype, non_blocking, fmt = torch._C._nn._parse_to(*args, **kwargs)
    if device is not None and device.type == "cuda" and device.index is None:
        device = torch.device("cuda", state.device)
    device = None if device == self.device else device
    return during("move", True, real["to"])(self, device=device, dtype=dtype, non_blocking=non_blocking,
                                            copy=copy or device is not None, memory_format=fmt or torch.preserve_format)

def tensor(data, *args, device=None, **kwargs):
    """torch.tensor from Python data: on a GPU, made on the host and copied up (as torch does, blocking), since its
    C++ builds a GPU tensor below the dispatcher, where the mode cannot serve it."""
    if device is not None and torch.device(device).type == "cuda":
        return real["tensor"](data, *args, **kwargs).to(device)
    return real["tensor"](data, *args, device=device, **kwargs)

def read_below(name, real_read):
    """Tensor.<name> (tolist, numpy, data_ptr) reads the values where they are, below the dispatcher: of a GPU tensor
    a host sync; of pinned host memory, a read of it by this thread's host (a copy may still be filling it)."""
    def read(t, *args, **kwargs):
        if not host(t):
            host_sync(f"{name}() of {shown('self', t)}")
        elif tag(t) == "pinned":
            streams.tensors(streams.host(), f"Tensor.{name}", [t], [])
        return real_read(t, *args, **kwargs)
    return read

def init_process_group(backend=None, *args, **kwargs):
    """nccl -> gloo, without device_id; the calls keep NCCL's rules."""
    state.nccl = backend == "nccl"
    device_id = kwargs.pop("device_id", None)
    if state.nccl and device_id is not None:
        state.bound = device_id.index if isinstance(device_id, torch.device) else int(device_id)
    return real["init"]("gloo" if state.nccl else backend, *args, **kwargs)

def new_group(*args, **kwargs):
    """dist.new_group: a group made with backend="gloo" beside nccl is the host's (its tensors live there)."""
    group = real["new_group"](*args, **kwargs)
    backend = kwargs.get("backend", args[2] if len(args) > 2 else None)
    if backend is not None and str(backend).lower() == "gloo":
        state.host_groups.add(group)
    return group

def object_device(group=None):
    """The device torch's object collectives (all_gather_object, broadcast_object_list, ...) pickle through: under
    nccl, the current device (torch.cuda.current_device(), as torch's own _get_object_coll_device picks for nccl),
    each object a byte tensor copied up and the result copied down; on a gloo group, the host."""
    if state.nccl and group not in state.host_groups:
        return "cuda"
    return real["object_device"](group)

def bound_device():
    """The device the nccl process group is bound to: its device_id, or (NCCL's lazy binding) the current device at
    its first collective."""
    if state.bound is None:
        state.bound = state.device
    return state.bound

def during(flag, value, fn):
    """fn, with this thread's flags.<flag> set to value while it runs."""
    def call(*args, **kwargs):
        outer = getattr(flags, flag)
        setattr(flags, flag, value)
        try:
            return fn(*args, **kwargs)
        finally:
            setattr(flags, flag, outer)
    return call

def nccl_checked(name, fn):
    """torch.distributed.<name> refusing, under nccl, a tensor not on the GPU the process group is bound to (the
    *_object collectives call these too, through the current device: object_device). On a gloo group, and inside
    another collective (one that calls another), the call as it is."""
    signature = inspect.signature(fn)
    def checked(*args, **kwargs):
        with streams.faking():  # gloo's work here is the GPU's, modelled
            return check_collective(*args, **kwargs)
    def check_collective(*args, **kwargs):
        bound = signature.bind_partial(*args, **kwargs).arguments
        if not state.nccl or flags.collective or bound.get("group") in state.host_groups:
            return during("collective", True, fn)(*args, **kwargs)
        seen["collectives"] += 1
        issued_on = current_stream()
        seen["collectives issued on another stream"] += issued_on is not state.compute
        named = tensors(bound.items())
        device = f"cuda:{bound_device()}"
        if any(tag(t) != device for _, t in named):
            on = f" (the process group is bound to {device}, the current device is cuda:{state.device})"
            refuse(f"c10d {name}", ", ".join(shown(n, t) for n, t in named) + on * (device != f"cuda:{state.device}"))
        options = {k: v for k, v in bound.items() if k in ("op", "src", "dst", "group_src", "group_dst")}
        mismatch = collectives.mismatch(dist, name, identities(name, bound, named), options, call_stack())
        if mismatch:  # issued, it would hang or mix unrelated buffers: stop here, with every finding
            refuse(f"c10d {name}", mismatch)
            sys.stdout.flush()
            real["exit"](report(1))
        state.nccl_stream.wait_stream(issued_on)  # NCCL's stream runs it after the work queued where it was issued
        streams.tensors(fake_streams.NCCL, f"c10d {name}", *fake_streams.collective_tensors(name, named))
        world = dist.get_world_size(bound.get("group"))
        streams.queue(fake_streams.NCCL, fake_clock.collective(name, [t for _, t in named], world), f"c10d::{name}")
        done = state.nccl_stream.record_event()
        held = [t for _, t in named]
        for t in held:  # c10d holds its tensors (a reference) until the collective is waited for
            streams.hold(t, fake_streams.NCCL)
        work = during("collective", True, fn)(*args, **kwargs)

        def join(event):  # (no count: not forward's wait)
            """The wait: the current stream waits for the collective, and c10d lets go of its tensors (torch >= 2.8),
            whatever stream waited: their deaths are then ordered by the waits of the streams that made them alone."""
            streams.wait(current_stream().id, event.id)
            while held:
                streams.release(held.pop(), fake_streams.NCCL)
        if bound.get("async_op"):
            return fake_streams.Work(work, done, join, stream)
        join(done)  # a blocking collective: the current stream waits for it
        return work
    return checked

def entry_point(name, fn):
    """One of the C++ extension's entry points (cpu_adam.cpp): it reads (and adam_step writes) its tensors' memory
    through host pointers, below the dispatcher, as work of the calling thread's host; a GPU tensor is refused."""
    def call(*args, **kwargs):
        seen[f"cpu_adam {name} calls"] += 1
        seen["cpu_adam steps"] += name == "adam_step"
        named = tensors((f"arg{i}", t) for i, t in enumerate(args))
        if any(not host(t) for _, t in named):
            refuse(f"cpu_adam.{name}", ", ".join(shown(n, t) for n, t in named))
        # (param, grad, m, v, out, ...): adam_step reads the gradient only and writes the rest
        read = [named[1][1]] if name == "adam_step" else [t for _, t in named]
        written = [t for n, t in named if n != "arg1"] if name == "adam_step" else []
        streams.tensors(streams.host(), f"cpu_adam.{name}", read, written)
        # its time: the GPU machine's host's (the C++ AdamW's rate, or a read of the gradient), not this one's
        with streams.faking():
            out = fn(*args, **kwargs)
        if name == "adam_step":
            streams.host_work(fake_clock.adam(args[0].numel()))
        else:
            streams.host_work(fake_clock.host_read(sum(t.numel() * t.element_size() for _, t in named)))
        return out
    return call

def checked_engine(Engine):
    """The engine class, its forward and backward marked as the phases, its C++ AdamW's entry points (`adam`, where
    instruments.Timeline finds it) refusing GPU tensors and reading their memory as the host; the host syncs of each
    step counted (seen["most host syncs in one step"])."""
    init = during("building", True, Engine.__init__)
    def __init__(engine, *args, **kwargs):
        init(engine, *args, **kwargs)
        adam = getattr(engine, "adam", None)
        if hasattr(adam, "adam_step"):
            engine.adam = types.SimpleNamespace(**{k: getattr(adam, k) for k in dir(adam) if not k.startswith("__")})
            for k in ("adam_step", "sum_of_squares"):
                setattr(engine.adam, k, entry_point(k, getattr(adam, k)))
    Engine.__init__ = __init__
    Engine.forward = during("phase", "forward", Engine.forward)
    Engine.backward = during("phase", "backward", Engine.backward)
    step = Engine.step
    def leak_checked(engine, *args, **kwargs):  # device memory allocated after each step, against the step before
        before = seen["host syncs in the rest"]
        out = step(engine, *args, **kwargs)
        with streams.faking():
            check_leak(before)
        state.step_ends.append(max(streams.clock.values()))  # the modelled time every stream and thread is done by
        return out
    def check_leak(before):
        seen["most host syncs in one step"] = max(seen["most host syncs in one step"],
                                                  seen["host syncs in the rest"] - before)
        gc.collect()  # what only the cycle collector frees (a step's temporaries in a cycle) is garbage, not a leak
        # gloo's worker thread lets go of a collective's tensors a moment after the call has returned: on a busy
        # machine that moment can come after this check, so growth must last a while to be a leak
        settle = time.monotonic() + 2
        while fake_memory.grew(state.device) and time.monotonic() < settle:
            time.sleep(0.05)
            gc.collect()
        leak = fake_memory.after_step(state.device)
        if leak:
            findings[f"{leak[0]} {leak[1]}"] += 1
    Engine.step = leak_checked
    return Engine

def start(thread):
    """Thread.start: the thread's host stream starts after what the starting thread did so far."""
    thread.fake_cuda_start = streams.host_event()
    real["start"](thread)

def run(thread):
    """Thread.run under the mode, which is per thread (offload's delayed update runs in a thread of its own); its
    work spans from its start to its return, which the event thread.fake_cuda_end marks for join()."""
    with FakeCuda():
        streams.idle()
        if hasattr(thread, "fake_cuda_start"):
            streams.host_waits_for_event(thread.fake_cuda_start)
        try:
            real["run"](thread)
        finally:
            thread.fake_cuda_end = streams.host_event()

def join(thread, timeout=None):
    """Thread.join: once the thread has ended, the joining thread is ordered after all of its work."""
    with streams.faking():  # (the other thread's time is its own)
        real["join"](thread, timeout)
    if not thread.is_alive() and hasattr(thread, "fake_cuda_end"):
        streams.host_waits_for_event(thread.fake_cuda_end)

def submit(executor, fn, /, *args, **kwargs):
    """ThreadPoolExecutor.submit: the task starts after what the submitting thread did so far, and its work spans to
    its return; the future's result() and exception(), once it is done, order the waiting thread after that."""
    begun, end = streams.host_event(), {}
    def task():
        streams.idle()
        streams.host_waits_for_event(begun)
        try:
            return fn(*args, **kwargs)
        finally:
            end["event"] = streams.host_event()
    future = real["submit"](executor, task)
    for name in ("result", "exception"):
        setattr(future, name, joined(getattr(future, name), future, end))
    return future

def joined(wait, future, end):
    def call(*args, **kwargs):
        try:
            with streams.faking():
                return wait(*args, **kwargs)
        finally:
            if future.done() and "event" in end:
                streams.host_waits_for_event(end["event"])
    return call

def index(d=None):
    """The fake GPU a torch.cuda memory call asks about: a device, an index, or None (the current one)."""
    d = torch.device(d) if isinstance(d, str) else d
    if d is None or getattr(d, "index", 0) is None:
        return state.device
    return d.index if isinstance(d, torch.device) else int(d)

def resize_(storage, nbytes):
    """UntypedStorage.resize_ (no op the mode sees): a device or pinned block resized is counted anew; to zero, a
    device storage's memory is freed at once (the stream model checks who may still use it), and from zero made anew
    on the current stream."""
    streams.resized(storage, nbytes, current_stream().id, where())
    out = real["resize"](storage, nbytes)
    if storage in blocks:
        fake_memory.resized(blocks[storage], nbytes, where())
    return out

def host_generator(sample_text):
    """train_gpt.sample_text (the end of a run's sample) with torch.Generator(device="cuda") made on the host: a CPU
    build of torch has no CUDA generator, and the fake device's numbers are the host's."""
    def sample(*args, **kwargs):
        torch.Generator = lambda device=None: real["generator"]()
        try:
            return sample_text(*args, **kwargs)
        finally:
            torch.Generator = real["generator"]
    return sample

def host_profile(profile):
    """torch.profiler.profile without ProfilerActivity.CUDA (--profile on the device): a CPU build of torch records
    no CUDA activity, and asked to, warns with a stack trace at every op; the fake device's ops are the host's. Asked
    for CUDA activity, its Chrome trace is the modelled clock's instead (modelled_trace), as a GPU's would be."""
    class Profile(profile):
        def __init__(self, activities=None, **kwargs):
            self.fake_cuda = torch.profiler.ProfilerActivity.CUDA in (activities or [])
            self.recorded = []
            cpu = [a for a in activities or [] if a != torch.profiler.ProfilerActivity.CUDA]
            super().__init__(activities=cpu or None, **kwargs)
        def start(self):
            if self.fake_cuda:
                streams.recording = self.recorded
            super().start()
        def stop(self):
            super().stop()
            if self.fake_cuda:
                streams.recording = None
        def export_chrome_trace(self, path):
            super().export_chrome_trace(path)
            if self.fake_cuda:
                modelled_trace(path, self.recorded)
    return Profile

class RecordFunction(torch.autograd.profiler.record_function):
    """torch.profiler.record_function, its annotation also recorded on the modelled clock."""
    def __enter__(self):
        self.fake_cuda_start = streams.now()
        return super().__enter__()
    def __exit__(self, *exc):
        streams.annotate(self.name, self.fake_cuda_start, streams.now())
        return super().__exit__(*exc)

def modelled_trace(path, recorded):
    """The Chrome trace at `path` as a GPU's profiler writes it, in modelled microseconds: the annotations (forward,
    backward, step, ...), each launch (cudaLaunchKernel, cudaMemcpyAsync) and its kernel or copy on its stream (tied
    by a correlation id), the host's synchronize calls. The host's CPU ops, on the real clock, are left out."""
    with open(path) as f:
        trace = json.load(f)
    pid, us = os.getpid(), lambda t: round(t * 1e6, 3)
    events = [e for e in trace["traceEvents"] if e.get("ph") == "M"]
    for k, (kind, name, thread, *times) in enumerate(recorded, 1):
        if kind == "annotation":
            events.append(dict(ph="X", cat="user_annotation", name=name, pid=pid, tid=thread, ts=us(times[0]),
                               dur=us(times[1]) - us(times[0])))
        elif kind == "sync":
            events.append(dict(ph="X", cat="cuda_runtime", name=name, pid=pid, tid=thread, ts=us(times[0]),
                               dur=us(times[1]) - us(times[0])))
        else:
            launch, stream, start, end = times
            args = {"correlation": k, "stream": stream}
            call = "cudaMemcpyAsync" if kind == "gpu_memcpy" else "cudaLaunchKernel"
            events.append(dict(ph="X", cat="cuda_runtime", name=call, pid=pid, tid=thread, ts=us(launch),
                               dur=us(fake_clock.LAUNCH), args=args))
            events.append(dict(ph="X", cat=kind, name=name, pid=pid, tid=f"stream {stream}", ts=us(start),
                               dur=us(end) - us(start), args=args))
    trace["traceEvents"] = events
    with open(path, "w") as f:
        json.dump(trace, f)

class ModelledTime(types.ModuleType):
    """The time module, its perf_counter the calling thread's modelled time (the clock instruments.Timeline reads)."""
    def __init__(self):
        super().__init__("time")
    perf_counter = staticmethod(lambda: streams.now())
    def __getattr__(self, name):
        return getattr(time, name)

def install():
    # TorchScript compiles torch.distributed.optim's optimizers at import: before torch.tensor is ours
    importlib.import_module("torch.distributed.optim")
    none = lambda: lambda *args, **kwargs: None  # noqa: E731  (one each: torch._dynamo refuses a function twice)
    for name, value in dict(
            is_available=lambda: True, device_count=lambda: int(os.environ.get("LOCAL_WORLD_SIZE", 1)),
            set_device=lambda d: setattr(state, "device", d.index if isinstance(d, torch.device) else int(d)),
            current_device=lambda: state.device, get_device_name=lambda d=None: "fake CUDA",
            get_device_capability=lambda d=None: (9, 0), is_bf16_supported=lambda *a, **k: True, Stream=Stream,
            Event=Event, stream=stream, current_stream=current_stream,
            synchronize=synchronize,
            max_memory_allocated=lambda d=None: fake_memory.memory(index(d)).peak,
            memory_allocated=lambda d=None: fake_memory.memory(index(d)).allocated,
            memory_reserved=lambda d=None: fake_memory.memory(index(d)).reserved,
            max_memory_reserved=lambda d=None: fake_memory.memory(index(d)).peak_reserved,
            reset_peak_memory_stats=lambda d=None: fake_memory.reset_peak(index(d)),
            mem_get_info=lambda d=None: fake_memory.mem_get_info(index(d)),
            host_memory_stats=fake_memory.host_memory_stats, empty_cache=fake_memory.empty_cache,
            get_rng_state=lambda d=None: torch.get_rng_state(), _lazy_init=none(),
            set_per_process_memory_fraction=none(), set_rng_state=none()).items():
        setattr(torch.cuda, name, value)
    torch._C._cuda_clearCublasWorkspaces = fake_memory.clear_workspaces
    sync_debug = {"default": 0, "warn": 1}
    torch.cuda.set_sync_debug_mode = lambda mode: setattr(state, "sync_debug", sync_debug.get(mode, mode))
    torch.cuda.get_sync_debug_mode = lambda: state.sync_debug
    torch.UntypedStorage.resize_ = resize_
    torch.Tensor.device = property(lambda t: torch.device(tag(t)) if not host(t) else real["device"](t))
    torch.Tensor.is_cuda = property(lambda t: not host(t))
    torch.Tensor.to = to
    for name in ("tolist", "numpy", "data_ptr"):
        setattr(torch.Tensor, name, read_below(name, getattr(torch.Tensor, name)))
    torch.tensor = tensor
    torch.Tensor.record_stream = record_stream
    torch.Tensor.cpu = lambda t, memory_format=torch.preserve_format: t.to("cpu", memory_format=memory_format)
    torch.Tensor.cuda = lambda t, device=None, non_blocking=False, **kwargs: t.to(
        "cuda" if device is None else device, non_blocking=non_blocking)
    dist.Reducer = Reducer
    dist.init_process_group, threading.Thread.run = init_process_group, run
    threading.Thread.start, threading.Thread.join = start, join
    concurrent.futures.ThreadPoolExecutor.submit = submit
    wait = during("collective", True, dist.Work.wait)  # gloo's own copies in it (NCCL makes none)
    def work_wait(*args, **kwargs):
        with streams.faking():  # the host's real wait for gloo: the modelled wait is Work's join
            return wait(*args, **kwargs)
    dist.Work.wait = work_wait
    for name in ("all_reduce", "reduce_scatter_tensor", "reduce_scatter_single", "all_gather_into_tensor",
                 "all_gather_single", "broadcast", "all_gather", "reduce_scatter", "reduce", "gather", "scatter",
                 "all_to_all_single", "send", "recv", "isend", "irecv"):
        if hasattr(dist, name):  # (torch's object collectives call the module's own: checked there too)
            checked = nccl_checked(name, getattr(dist, name))
            setattr(dist, name, checked)
            setattr(dist.distributed_c10d, name, checked)
    dist.new_group = dist.distributed_c10d.new_group = new_group
    for name in ("all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list"):
        setattr(dist, name, during("objects", True, getattr(dist, name)))
    dist.distributed_c10d._get_object_coll_device = object_device
    state.compute = Stream(stream_id=fake_streams.csan.DEFAULT_STREAM_ID)
    state.nccl_stream = Stream(stream_id=fake_streams.NCCL)
    import train_gpt
    train_gpt.CharData.batch = during("phase", "batch", train_gpt.CharData.batch)  # its copies up: never blocking
    train_gpt.sample_text = host_generator(train_gpt.sample_text)
    torch.profiler.profile = host_profile(torch.profiler.profile)
    torch.profiler.record_function = RecordFunction
    import instruments
    instruments.time = ModelledTime()  # the Timeline's host clock: the modelled one
    main = train_gpt.main
    train_gpt.main = lambda Engine, *args, **kwargs: main(checked_engine(Engine), *args, **kwargs)
    os._exit = lambda code: sys.stdout.flush() or real["exit"](report(code))  # instruments.finish's exit: os._exit(0)

def report(code):
    """Write this rank's findings (to FAKE_CUDA_FINDINGS/rank<r>.json), print them; the exit code: 1 on a finding."""
    streams.check_frees()  # the storages freed since the last kernel
    rank, out = int(os.environ.get("RANK", 0)), os.environ.get("FAKE_CUDA_FINDINGS")
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, f"rank{rank}.json.part"), "w") as f:  # whole or absent: a rank may be stopped
            memory = {k: vars(m) for k, m in fake_memory.devices.items()}
            clock = {"host": fake_clock.HOST, "facts": fake_clock.FACTS, "step_ends_s": state.step_ends}
            json.dump({"rank": rank, "exit_code": code, "findings": findings, "seen": +seen, "memory": memory,
                       "host_memory": fake_memory.host_memory_stats(), "clock": clock}, f, indent=1)
        os.replace(os.path.join(out, f"rank{rank}.json.part"), os.path.join(out, f"rank{rank}.json"))
    for message, count in findings.items():
        print(f"fake_cuda: rank {rank}: {message}" + f" ({count} times)" * (count > 1), file=sys.stderr, flush=True)
    return code or int(bool(findings))


if __name__ == "__main__":
    script = os.path.abspath(sys.argv[1]) if len(sys.argv) > 1 else sys.exit(__doc__)
    state.dirs.append(os.path.dirname(script))
    sys.argv, sys.path[0] = [script, *sys.argv[2:], "--device", "cuda"], os.path.dirname(script)  # as python stage.py
    sys.path.insert(1, ROOT)
    install()
    code = 1
    try:
        with FakeCuda():
            runpy.run_path(script, run_name="__main__")
        code = 0
    except SystemExit as e:  # its code, or its message printed and 1, as Python does
        code = e.code if isinstance(e.code, int) else 0 if e.code is None else print(e.code, file=sys.stderr) or 1
    except BaseException:
        traceback.print_exc()
    os._exit(code)
