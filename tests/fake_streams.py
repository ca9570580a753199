"""
tests/fake_streams.py: the order of CUDA streams on the fake device (tests/fake_cuda.py), by torch's own model of it.

torch's CUDA Sanitizer (torch.cuda._sanitizer) keeps, in its EventHandler, a vector clock per stream (what each stream
has waited for: events, other streams, the host) and, per piece of memory, the last write and the reads since; a
kernel that touches memory another stream wrote, or is still reading, with nothing ordering the two, is a data race.
On a GPU torch feeds it from its CUDA trace; here the fake device feeds it by hand:
  - every op is a kernel on the current stream (torch.cuda.stream), its reads and writes from the op's schema
    (the Sanitizer's ArgumentHandler); an op on pinned host memory alone is work of the host;
  - each host thread is a host stream of its own (the main thread's "the host"), its work spanning from its call to
    its return: a C++ call in another thread counts as done only when a thread that waits for it (Future.result()
    or .exception(), Thread.join(), an event) says so; a thread's task starts after what its submitter did before;
  - host reads below the dispatcher (tolist, numpy, data_ptr, the C++ extension's entry points) are reads (or, for
    the C++ AdamW, writes) of the tensor's memory on the calling thread's host stream;
  - a kernel is launched after what its host thread did before it: its stream first takes that thread's clock;
  - Stream.wait_event/wait_stream, Event.record, Event/Stream/device synchronize() as CUDA orders them (a
    synchronize makes only the calling thread wait); a blocking copy between device and host, or a value read from
    the device (.item()), makes the calling thread wait for that stream;
  - a collective runs on the "nccl" stream, after the stream it was issued on; its work.wait() (or a blocking
    collective's return) makes the current stream wait for it; its tensors' storages are held until then, as c10d
    holds them (a reference: their death cannot come sooner), and no longer (torch >= 2.8 calls no record_stream:
    c10d lets go at the wait, on whichever stream waits);
  - memory freed while a stream other than the one it was made on may still use it (no wait since, on that stream or
    on the freeing thread, no record_stream for that stream) would be handed out again on its own stream under that
    use: refused, naming where it was freed, at the next work on its own stream unless that stream has waited for the
    use by then (before, nothing can run in the memory handed out again). A storage resized to zero
    (untyped_storage().resize_(0), ZeRO-3's free) is a free at once, whatever references it, so c10d's reference does
    not cover it: a collective not yet waited for that may still use it is refused, naming both lines; resized up
    again it is new memory, made on the current stream.
The clock (tests/fake_clock.py says what each piece of work costs): a modelled time per stream, when its queued
work is done, and per host thread, its now. A kernel, copy or collective launched by a thread costs that thread a
launch and runs on its stream once the stream is free and the launch is done; an event records its stream's time
(a host stream's: its now); a wait moves the waiting stream, and a host sync the waiting thread, to the time waited
for; a thread starts at its starter's time. While a profiler records CUDA activity, each piece of device work, each
host sync and each annotation is recorded with its modelled times (`recording`).
Memory is the storage's bytes: each access covers the byte range its tensor spans, so two slices of one buffer used by
two streams are apart; the ranges are the Sanitizer's "data pointers" (a storage's number and a byte offset, pieces
split where an access begins or ends).
"""
import bisect, collections, contextlib, itertools, threading, time, weakref

import torch.cuda._sanitizer as csan
import fake_clock
from torch.utils import _pytree as pytree

HOST = -1  # the main thread's host work on pinned memory, as a stream of the Sanitizer's (other threads: their own)
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
        self.local = threading.local()  # this thread's host stream
        self.hosts = {HOST}  # every thread's host stream
        self.ids = itertools.count(1)
        self.serial = weakref.WeakKeyDictionary()  # storage -> its number
        self.made_on = {}  # storage number -> the stream it was made on (a device storage)
        self.recorded = {}  # storage number -> the streams record_stream named
        self.held = {}  # storage number -> {stream: how many of its collectives c10d holds it for, until waited}
        self.pending = []  # (the stream a freed storage was made on, a use it was not ordered after, number, where)
        self.starts = {}  # storage number -> the sorted byte offsets where its pieces start
        self.freed = []  # (storage number, where) freed since the model last ran: checked at its next call
        self.clock = collections.defaultdict(float)  # stream -> modelled seconds: its work done by then (a host's now)
        self.at = {}  # event -> the modelled time it was recorded at
        self.recording = None  # while a profiler records CUDA activity: (kind, name, thread or stream, times...)

    def new_id(self):
        return next(self.ids)

    def host(self):
        """The calling thread's host stream: the main thread's HOST, another thread's a stream of its own, made at its
        first work and named after the thread."""
        stream = getattr(self.local, "stream", None)
        if stream is None:
            thread = threading.current_thread()
            stream = HOST if thread is threading.main_thread() else self.new_id()
            self.local.stream = stream
            with self.lock:
                if stream not in self.hosts:
                    self.hosts.add(stream)
                    self.handler.syncs.create_stream(stream)
                    names[stream] = f"the host thread {thread.name}"
        return stream

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
        self.freed.append((n, self.where(), self.host()))

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
            if stream not in self.hosts:  # launched by this host thread after everything it did so far
                syncs._state_wait_for_other(syncs.current_sync_states[stream], syncs.current_sync_states[self.host()])
            self._check_pending(stream)
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
            now = self.now()
            if stream not in self.hosts:  # (an idle stream: the event is done when the host records it)
                self.clock[stream] = max(self.clock[stream], now)
            self.at[event] = self.clock[stream] if stream not in self.hosts else now

    def wait(self, stream, event):
        with self.lock:
            self.handler._handle_event_wait(event, stream)
            self.clock[stream] = max(self.clock[stream], self.at.get(event, 0.0))

    def host_waits_for_event(self, event, sync=None):
        """Event.synchronize(), a thread's end waited for: the calling thread alone waits (its later launches too).
        sync: the CUDA call that waits, for a profiler's record."""
        with self.lock:
            self.handler.syncs.stream_wait_for_event(self.host(), event)
            self._host_until(self.at.get(event, 0.0), sync)

    def host_waits_for_stream(self, stream, sync="cudaStreamSynchronize"):
        with self.lock:
            syncs = self.handler.syncs
            syncs._state_wait_for_other(syncs.current_sync_states[self.host()], syncs.current_sync_states[stream])
            self._host_until(self.clock[stream], sync)

    # ---- the modelled clock
    def now(self):
        """The calling thread's modelled time; with the measured host, first moved on by the real time the thread ran
        since it last asked, outside the fake device's own work (faking())."""
        with self.lock:
            h = self.host()
            if not fake_clock.IDEAL and not getattr(self.local, "faking", 0):
                real = time.perf_counter()
                self.clock[h] += real - getattr(self.local, "real", real)
                self.local.real = real
            return self.clock[h]

    def idle(self):
        """The calling thread waited for work until now (a pool's thread between its tasks): none of it its time."""
        self.local.real = time.perf_counter()

    @contextlib.contextmanager
    def faking(self):
        """Around the fake device's own work (an op's math and checks, gloo's collectives, the host's real waits for
        them and for other threads): none of its real time is the host's."""
        self.now()
        self.local.faking = getattr(self.local, "faking", 0) + 1
        try:
            yield
        finally:
            self.local.faking -= 1
            if not self.local.faking:
                self.local.real = time.perf_counter()

    def _host_until(self, t, sync=None):
        """The calling thread waits until modelled time t."""
        start = self.now()
        self.clock[self.host()] = max(start, t)
        if self.recording is not None and sync:
            self.recording.append(("sync", sync, threading.get_ident(), start, max(start, t)))

    def queue(self, stream, seconds, name, kind="kernel"):
        """Device work of `seconds` launched on `stream` by the calling thread now: the thread pays the launch, and
        the work runs once the stream is free and the launch is done."""
        with self.lock:
            h = self.host()
            launch = self.now()
            self.clock[h] = launch + fake_clock.LAUNCH
            start = max(self.clock[stream], self.clock[h])
            self.clock[stream] = start + seconds
            if self.recording is not None:
                self.recording.append((kind, name, threading.get_ident(), launch, stream, start, start + seconds))

    def host_work(self, seconds):
        """The calling thread computes for `seconds` (the C++ AdamW at the GPU machine's host's rate)."""
        with self.lock:
            self.clock[self.host()] = self.now() + seconds

    def annotate(self, name, start, end):
        """A profiler annotation (record_function) of the calling thread, from start to end (modelled)."""
        if self.recording is not None:
            self.recording.append(("annotation", name, threading.get_ident(), start, end))

    def host_after_event(self, event):
        """Event.query(): whether the calling thread is ordered after everything the event was recorded after."""
        with self.lock:
            syncs = self.handler.syncs
            recorded = syncs.recorded_sync_states.get(event, {})
            return all(syncs.is_ordered_after(self.host(), seq, s) for s, seq in recorded.items() if seq > 0)

    def host_after_stream(self, stream):
        """Stream.query(): whether the calling thread is ordered after the work queued on `stream` so far."""
        with self.lock:
            syncs = self.handler.syncs
            syncs._ensure_stream_exists(stream)
            own = syncs.current_sync_states[stream].get(stream, -1)
            return own <= 0 or syncs.is_ordered_after(self.host(), own, stream)

    def device_synchronize(self):
        """torch.cuda.synchronize(): the calling thread waits for every device stream, not for the other threads."""
        with self.lock:
            start = self.now()
            for stream in [s for s in self.handler.syncs.current_sync_states if s not in self.hosts]:
                self.host_waits_for_stream(stream, sync=None)
            if self.recording is not None:
                self.recording.append(("sync", "cudaDeviceSynchronize", threading.get_ident(), start, self.now()))

    def host_event(self):
        """An event recorded on the calling thread's host stream now (a thread's task starts after it; its end)."""
        with self.lock:
            event = self.new_id()
            self.handler._handle_event_record(event, self.host())
            self.at[event] = self.now()
            return event

    def record_stream(self, t, stream):
        with self.lock:
            n = self.serial.get(t.untyped_storage())
            if n is not None:
                self.recorded.setdefault(n, set()).add(stream)

    def hold(self, t, stream):
        """c10d's reference to a collective's tensor until it is waited for: its storage cannot die before, but a
        resize_(0) frees its memory all the same."""
        with self.lock:
            n = self.serial.get(t.untyped_storage())
            if n is not None:
                held = self.held.setdefault(n, {})
                held[stream] = held.get(stream, 0) + 1

    def release(self, t, stream):
        """c10d lets go of a collective's tensor at its wait() (torch >= 2.8 calls no record_stream): from then on
        its storage's death is a free like any other, ordered only by the waits of the stream that made it."""
        with self.lock:
            held = self.held.get(self.serial.get(t.untyped_storage()), {})
            if held.get(stream):
                held[stream] -= 1

    def resized(self, storage, nbytes, stream, at):
        """untyped_storage().resize_(nbytes) of a device storage: to zero, a free checked now (c10d's hold does not
        cover it); from zero, new memory made on `stream`."""
        with self.lock:
            n = self.serial.get(storage)
            if n is None or n not in self.made_on:
                return
            self._check_frees()
            if nbytes == 0:
                self._check_free(n, at, covered=self.recorded.get(n, set()), how="freed by resize_(0)")
                self.recorded.pop(n, None)
                self.held.pop(n, None)
                self.starts[n] = [0]
            else:
                self.made_on[n] = stream

    def check_frees(self):
        """Each storage freed since: its stream must have waited for every other stream's use of it, or
        record_stream named that stream (the caching allocator then holds the memory until that use is done)."""
        with self.lock:
            self._check_frees()

    def _check_frees(self):
        while self.freed:
            n, at, host = self.freed.pop(0)  # (at: where it was freed; host: the thread's host stream that freed it)
            held = {stream for stream, count in self.held.get(n, {}).items() if count}
            self._check_free(n, at, self.recorded.get(n, set()) | held, "freed", host)
            self.made_on.pop(n)
            self.starts.pop(n)
            self.recorded.pop(n, None)
            self.held.pop(n, None)

    def _check_free(self, n, at, covered, how, host=None):
        """Storage n's memory freed at `at`: every other stream's use of it must be ordered before its own stream
        (where the allocator hands it out again) or the freeing thread (which launches what uses it next), unless
        record_stream (or c10d's hold, for a storage's death) named that stream. A use not ordered so yet is checked
        again at the next work on its own stream, the first that could run in its memory handed out again (FSDP2
        frees a gradient its reduce-scatter stream made and the compute stream used, and that stream waits for the
        compute stream before its next work). Its accesses are forgotten."""
        own = self.made_on[n]
        host = self.host() if host is None else host
        syncs = self.handler.syncs
        accesses = self.handler.tensors_accessed.accesses
        for x in self.starts[n]:
            info = accesses.pop(n << 40 | x, None)
            for access in ([info.write] + info.reads) if info else []:
                if access is None or access.stream in (own, *covered):
                    continue
                # record_stream(s) holds the memory until s reaches the free: enough where s waited for this use
                if not any(syncs.is_ordered_after(s, access.seq_num, access.stream) for s in (own, host, *covered)):
                    self.pending.append((own, access, n, at, how))

    def _check_pending(self, stream):
        """Work on `stream`: each use of memory freed from it that it is not ordered after is refused, where freed."""
        syncs = self.handler.syncs
        refused = set()
        for own, access, n, at, how in [p for p in self.pending if p[0] == stream]:
            if (n, at) not in refused and not syncs.is_ordered_after(stream, access.seq_num, access.stream):
                self.refuse(f"stream order: memory {how}", f"{name(access.stream)} may still use it "
                            f"({access.operator} at {line(access.stack_trace, self.where)}): no wait for it "
                            f"on {name(own)}, where it was made, and no record_stream", at)
                refused.add((n, at))
        self.pending = [p for p in self.pending if p[0] != stream]


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
    def __init__(self, work, done, join, stream):
        self.work = work
        self.done = done  # the event recorded after it on the nccl stream
        self.join = join  # join(event): the current stream waits for the event
        self.stream = stream  # torch.cuda.stream, the fake device's

    def wait(self, *args, **kwargs):
        out = self.work.wait(*args, **kwargs)
        self.join(self.done)
        return out

    def get_future(self):
        return Future(self)

    def __getattr__(self, name):
        return getattr(self.work, name)


class Future:
    """An async collective's future: then(callback) runs the callback once gloo's work is done, as NCCL runs it,
    with the collective's own stream current (Done: the modelled time its `done` event recorded)."""
    def __init__(self, work):
        self.work = work

    def then(self, callback):
        def run(_=None):
            with self.work.stream(Done(self.work.done)):
                callback(self)
        try:
            self.work.work.get_future().then(run)
        except RuntimeError:  # (gloo's reduce-scatter has no future: a thread waits for it)
            threading.Thread(target=lambda: (self.work.work.wait(), run()), daemon=True).start()


class Done:
    """The stream a collective's future callback runs on: every event recorded on it is at the collective's end."""
    def __init__(self, event):
        self.event = event
        self.id = NCCL



class Sequence:
    """Every rank issues the same collectives, in the same order: each rank publishes each one (op, ReduceOp, root,
    each tensor's dtype, size and buffer: where its storage was made, and its offset there; the call site) to the
    process group's store before issuing it and compares the other ranks', waiting at most `timeout` seconds for
    theirs. A mismatch would hang NCCL, or mix unrelated buffers (equal-size units gathered in another order on each
    rank): a message instead."""
    def __init__(self, timeout):
        self.timeout = timeout
        self.count = 0  # the collectives issued so far

    def mismatch(self, dist, name, named, options, at):
        """None if every rank's collective number k is this one; else what differs, in one line. named: (argument
        name, tensor, which buffer it is) triples; options: the other arguments compared (op, src, ...)."""
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return None
        import datetime
        store = dist.distributed_c10d._get_default_store()
        rank = dist.get_rank()
        k = self.count
        self.count += 1
        mine = f"{name}(" + ", ".join([f"{n} {str(t.dtype).removeprefix('torch.')}[{t.numel()}] {buffer}"
                                       for n, t, buffer in named] + [f"{k}={v}" for k, v in options.items()]) + ")"
        at = at.replace(" at ", " ")  # (the call site follows the last " at ")
        store.set(f"fake_cuda/collective/{k}/{rank}", f"{mine} at {at}")
        for r in range(dist.get_world_size()):
            key = f"fake_cuda/collective/{k}/{r}"
            try:
                store.wait([key], datetime.timedelta(seconds=self.timeout))
            except RuntimeError:  # (a timeout, or the store gone with a rank that stopped)
                return f"collective #{k} {mine}: rank {r} issued none within {self.timeout} s"
            theirs = store.get(key).decode()
            if theirs.rsplit(" at ", 1)[0] != mine:
                return f"collective #{k} differs across ranks: rank {rank} {mine}, rank {r} {theirs}"
        return None
