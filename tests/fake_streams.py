"""
tests/fake_streams.py: the order of CUDA streams on the fake device (tests/fake_cuda.py), by torch's own model of it.

torch's CUDA Sanitizer (torch.cuda._sanitizer) keeps, in its EventHandler, a vector clock per stream (what each stream
has waited for: events, other streams, the host) and, per piece of memory, the last write and the reads since; a
kernel that touches memory another stream wrote, or is still reading, with nothing ordering the two, is a data race.
On a GPU torch feeds it from its CUDA trace; here the fake device feeds it by hand:
  - every op is a kernel on the current stream (torch.cuda.stream), its reads and writes from the op's schema
    (the Sanitizer's ArgumentHandler); an op on pinned host memory alone is work of the host, a stream of its own;
  - a kernel is launched after what the host did before it: its stream first takes the host's clock;
  - Stream.wait_event/wait_stream, Event.record, Event/Stream/device synchronize() as CUDA orders them; a blocking copy
    between device and host, or a value read from the device (.item()), makes the host wait for that stream;
  - a collective runs on the "nccl" stream, after the stream it was issued on; its work.wait() (or a blocking
    collective's return) makes the current stream wait for it; its tensors' memory is held for that stream, as c10d
    holds it;
  - memory freed while a stream other than the one it was made on may still use it (no wait since, no record_stream
    for that stream) would be handed out again on its own stream under that use: refused where it is freed.
Memory is the storage's bytes: each access covers the byte range its tensor spans, so two slices of one buffer used by
two streams are apart; the ranges are the Sanitizer's "data pointers" (a storage's number and a byte offset, pieces
split where an access begins or ends).
"""
import bisect, itertools, threading, weakref

import torch.cuda._sanitizer as csan
from torch.utils import _pytree as pytree

HOST = -1  # the host's work on pinned memory, as a stream of the Sanitizer's
NCCL = -2  # NCCL's stream
names = {csan.DEFAULT_STREAM_ID: "the compute stream", HOST: "the host", NCCL: "the nccl stream"}


class Model:
    """The Sanitizer's EventHandler, fed by the fake device; refuse(op, detail) reports a race, where(): the line."""
    def __init__(self, refuse, where):
        self.refuse = refuse
        self.where = where
        self.handler = csan.EventHandler()
        self.handler.syncs.create_stream(HOST)
        self.handler.syncs.create_stream(NCCL)
        self.lock = threading.RLock()  # the delayed update's thread launches host work too
        self.ids = itertools.count(1)
        self.serial = weakref.WeakKeyDictionary()  # storage -> its number
        self.made_on = {}  # storage number -> the stream it was made on (a device storage)
        self.recorded = {}  # storage number -> the streams record_stream named
        self.starts = {}  # storage number -> the sorted byte offsets where its pieces start
        self.freed = []  # (storage number, where) freed since the model last ran: checked at its next call

    def new_id(self):
        return next(self.ids)

    # ---- memory: a storage's number and the byte ranges its tensors span
    def allocated(self, storage, stream, device):
        """A new storage made on `stream` (device memory) or pinned host memory (device False)."""
        with self.lock:
            n = self.serial[storage] = self.new_id()
            self.starts[n] = [0]
            if device:
                self.made_on[n] = stream
                weakref.finalize(storage, self._freed, n)

    def _freed(self, n):  # (a finalizer: it may run in the middle of the model's own work, so it only notes the free)
        self.freed.append((n, self.where()))

    def keys(self, t):
        """The Sanitizer's data pointers for the bytes t spans: storage number << 40 | piece start."""
        n = self.serial.get(t.untyped_storage())
        if n is None or t.numel() == 0:
            return []
        a = t.storage_offset() * t.element_size()
        b = a + (1 + sum((s - 1) * st for s, st in zip(t.shape, t.stride()))) * t.element_size()
        starts = self.starts[n]
        accesses = self.handler.tensors_accessed.accesses
        for x in (a, b):
            i = bisect.bisect(starts, x)
            if starts[i - 1] != x:  # a new piece boundary: the piece it splits gives it its history
                before = accesses.get(n << 40 | starts[i - 1])
                if before is not None:
                    accesses[n << 40 | x] = csan.TensorInfo(before.allocation_stack_trace, list(before.reads),
                                                            before.write)
                starts.insert(i, x)
        return [n << 40 | x for x in starts[bisect.bisect_left(starts, a):bisect.bisect_left(starts, b)]]

    # ---- kernels
    def kernel(self, stream, func, args, kwargs, out):
        """An op on `stream`: its reads and writes, from its schema, checked against the other streams'."""
        with self.lock:
            handler = Arguments(self)
            factory = bool(csan.FACTORY_FUNCTION_REGEX.match(func._schema.name))
            handler.parse_inputs(func._schema, args, kwargs, is_factory=factory)
            handler.parse_outputs(func._schema, out, is_factory=factory)
            written = handler.dataptrs_written
            self.launch(stream, str(func).removesuffix(".default"), handler.dataptrs_read - written, written)

    def tensors(self, stream, op, read, written):
        """Work on `stream` (a collective, the C++ AdamW) that reads the tensors `read` and writes `written`."""
        with self.lock:
            written_keys = {k for t in written for k in self.keys(t)}
            read_keys = {k for t in read for k in self.keys(t)} - written_keys
            self.launch(stream, op, read_keys, written_keys)

    def launch(self, stream, op, read, written):
        with self.lock:
            self.check_frees()
            if not read and not written:
                return
            syncs = self.handler.syncs
            syncs._ensure_stream_exists(stream)
            if stream != HOST:  # launched by the host after everything it did so far
                syncs._state_wait_for_other(syncs.current_sync_states[stream], syncs.current_sync_states[HOST])
            aliases = {k: [] for k in read | written}
            for error in self.handler._handle_kernel_launch(stream, read, written, set(), op, aliases):
                previous = error.previous_access
                self.refuse(f"stream order: {op} on {name(stream)}",
                            f"touches memory that {name(previous.stream)} "
                            f"{'wrote' if previous.type is csan.AccessType.WRITE else 'reads'} in "
                            f"{previous.operator} at {line(previous.stack_trace, self.where)}, with no wait in between")

    # ---- streams, events, the host
    def stream_created(self, stream, at):
        with self.lock:
            self.handler._handle_stream_creation(stream)
            names.setdefault(stream, f"the stream made at {at}")

    def record(self, event, stream):
        with self.lock:
            self.handler._handle_event_record(event, stream)

    def wait(self, stream, event):
        with self.lock:
            self.handler._handle_event_wait(event, stream)

    def host_waits_for_event(self, event):
        with self.lock:
            self.handler._handle_event_synchronization(event)

    def host_waits_for_stream(self, stream):
        with self.lock:
            syncs = self.handler.syncs
            syncs._state_wait_for_other(syncs.current_sync_states[HOST], syncs.current_sync_states[stream])

    def device_synchronize(self):
        with self.lock:
            self.handler._handle_device_synchronization()

    def record_stream(self, t, stream):
        with self.lock:
            n = self.serial.get(t.untyped_storage())
            if n is not None:
                self.recorded.setdefault(n, set()).add(stream)

    def check_frees(self):
        """Each storage freed since: its stream must have waited for every other stream's use of it, or
        record_stream named that stream (the caching allocator then holds the memory until that use is done)."""
        with self.lock:
            self._check_frees()

    def _check_frees(self):
        while self.freed:
            n, at = self.freed.pop(0)  # (at: where it was freed)
            own = self.made_on.pop(n)
            syncs = self.handler.syncs
            accesses = self.handler.tensors_accessed.accesses
            for x in self.starts.pop(n):
                info = accesses.pop(n << 40 | x, None)
                for access in ([info.write] + info.reads) if info else []:
                    if access is None or access.stream in (own, *self.recorded.get(n, ())):
                        continue
                    if not syncs.is_ordered_after(own, access.seq_num, access.stream):
                        self.refuse("stream order: memory freed", f"{name(access.stream)} may still use it "
                                    f"({access.operator} at {line(access.stack_trace, self.where)}): no wait for it "
                                    f"on {name(own)}, where it was made, and no record_stream", at)
                        break
            self.recorded.pop(n, None)


class Arguments(csan.ArgumentHandler):
    """The Sanitizer's reading of an op's schema, for the fake device's tensors: device memory and pinned host
    memory (the storages the model follows), each as the pieces of its storage it spans."""
    def __init__(self, model):
        super().__init__()
        self.model = model

    def _handle_argument(self, value, is_write, metadata_only, name=None, is_output=False):
        if not hasattr(value, "untyped_storage"):
            return
        for key in self.model.keys(value):
            if is_write:
                self.dataptrs_written.add(key)
            elif not metadata_only:
                self.dataptrs_read.add(key)


def name(stream):
    return names.get(stream, f"stream {stream}")


def line(stack, where):
    """The project's innermost file:line in a Sanitizer stack (its frames are outermost first)."""
    return where([(f.filename, f.lineno) for f in reversed(stack)]) if stack else "?"


def tensors_in(value):
    return [t for t in pytree.tree_leaves(value) if hasattr(t, "untyped_storage")]


# ---- collectives: NCCL's stream, and the same sequence on every rank
def collective_tensors(name, named):
    """(read, written) of a collective's (argument name, tensor) pairs: its inputs are read, the rest written (an
    all-reduce's or a broadcast's tensor both)."""
    reads_tensor = name in ("all_gather", "gather", "send", "isend", "reduce")
    read = [t for n, t in named if "input" in n or (reads_tensor and n == "tensor")]
    return read, [t for n, t in named if not any(t is r for r in read)]


class Work:
    """An async collective's handle: its wait() makes the current stream wait for the collective (as NCCL's does)."""
    def __init__(self, work, done, join):
        self.work = work
        self.done = done  # the event recorded after it on the nccl stream
        self.join = join  # join(event): the current stream waits for the event

    def wait(self, *args, **kwargs):
        out = self.work.wait(*args, **kwargs)
        self.join(self.done)
        return out

    def __getattr__(self, name):
        return getattr(self.work, name)


class Sequence:
    """Every rank issues the same collectives, in the same order, of the same sizes: each rank publishes each one
    (op, tensors, call site) to the process group's store before issuing it and compares the other ranks', waiting
    at most `timeout` seconds for theirs. A mismatch would hang NCCL, or mix unrelated buffers: a message instead."""
    def __init__(self, timeout):
        self.timeout = timeout
        self.count = 0  # the collectives issued so far

    def mismatch(self, dist, name, named, at):
        """None if every rank's collective number k is this one; else what differs, in one line."""
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return None
        import datetime
        store = dist.distributed_c10d._get_default_store()
        rank = dist.get_rank()
        k = self.count
        self.count += 1
        mine = f"{name}(" + ", ".join(f"{n} {str(t.dtype).removeprefix('torch.')}[{t.numel()}]" for n, t in named) + ")"
        store.set(f"fake_cuda/collective/{k}/{rank}", f"{mine} at {at}")
        for r in range(dist.get_world_size()):
            key = f"fake_cuda/collective/{k}/{r}"
            try:
                store.wait([key], datetime.timedelta(seconds=self.timeout))
            except RuntimeError:  # (a timeout, or the store gone with a rank that stopped)
                return f"collective #{k} {mine}: rank {r} issued none within {self.timeout} s"
            theirs = store.get(key).decode()
            if theirs.split(" at ")[0] != mine:
                return f"collective #{k} differs across ranks: rank {rank} {mine}, rank {r} {theirs}"
        return None
