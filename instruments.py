"""
instruments.py: the ledgers and meters every stage is measured with, shared so that the stage files read as the
algorithm: the bytes of the tensors an engine holds and of every live tensor (comm.py counts the bytes each
collective sends), the peak of live tensor bytes during a step, pinned host memory as PyTorch allocates it, the per-rank memory table a run ends with,
a timeline of one step (--timeline DIR, for bench/timeline.py), a torch.profiler trace of one (--profile DIR), the
validation loss, the model FLOPs a run reports (TFLOP/s per rank, and MFU where the GPU's peak is known), the progress
shown, and the end of a run (finish: the report, the files asked for, the exit).
A Run (train_gpt.main's `run`) is a training run's bookkeeping: it applies these to the steps main's loop takes, and
holds what summarize and finish report.
"""
import contextlib, gc, json, math, os, sys, tempfile, textwrap, time, warnings
from collections import defaultdict

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from checkpoint import checkpoint_due, gather_master, tied_names
from comm import comm
from devices import everyone, stop

def pinned_bytes(nbytes):
    """What PyTorch's pinned-memory cache (CachingHostAllocator) takes for a pinned allocation of nbytes: rounded up to
    the next power of two (and kept for reuse once freed). Pageable memory is not rounded."""
    return 1 << (nbytes - 1).bit_length() if nbytes > 0 else 0

def pinned_theory(stage, n_params, world_size, param_bytes=2, offload_params=False, delayed_update=False):
    """Pinned host memory per rank with CUDA, as allocated: ZeRO-Offload pins each buffer a device-host copy touches,
    one allocation of param_bytes·Ψ/N each: the gradient shard (two with --delayed_update), the staging buffer of
    updated parameters, and with --offload_params the parameter shard; with --delayed_update also the global norm's
    float64, which the update's thread reads. ZeRO-3's unit-order check (outside.Order), in stage 3 and offload at
    N > 1, reads its two float64 on the host. (fp32 master and moments stay pageable.)"""
    order = pinned_bytes(16) if stage in ("stage3", "offload") and world_size > 1 else 0
    if stage != "offload":
        return order
    shards = (2 + delayed_update + offload_params) * pinned_bytes(param_bytes * n_params // world_size)
    return shards + delayed_update * pinned_bytes(8) + order

def without(label, a, b, holes):
    """What is left of [a, b) outside `holes` (sorted (start, end) pairs), as (label, start, end) pieces."""
    pieces = []
    for h0, h1 in holes:
        if h0 < b and h1 > a:
            pieces.append((label, a, min(h0, b)))
            a = max(a, h1)
    pieces.append((label, a, b))
    return [p for p in pieces if p[1] < p[2]]

def host_compute(segments, holes):
    """The compute row on a CPU: each marker segment (label, start, end) of the computing thread, less the holes where
    that thread did something else (inside a collective's call, a host wait, a copy or a C++ AdamW call)."""
    holes = sorted(holes)
    return [piece for label, a, b in segments for piece in without(label, a, b, holes)]

def kernel_compute(segments, kernels):
    """The compute row on a GPU: the compute stream's kernels (launch, start, end), each labelled by the marker segment
    (label, start, end) in which it was launched, "other" where none (the engine's hooks, the loss). Kernels of one
    label that touch are joined; an idle stream between two kernels stays a gap."""
    rows = []
    for launch, a, b in sorted(kernels, key=lambda k: k[1]):
        label = next((name for name, s0, s1 in segments if s0 <= launch < s1), "other")
        if rows and rows[-1][0] == label and a <= rows[-1][2]:
            rows[-1] = (label, rows[-1][1], max(b, rows[-1][2]))
        else:
            rows.append((label, a, b))
    return rows

HOST_WAITS = ("cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize")  # the host stops for the GPU

def read_profile(events, anchor, host):
    """From a torch.profiler Chrome trace's events (CPU and CUDA activities) of the traced step: the compute stream's
    kernels (launch, start, end) and the host's waits for the GPU (name, start, end), in seconds on the host clock.
    anchor: the name of a user annotation recorded around the host moment `host` (perf_counter), which ties the
    profiler's clock to the host's. A kernel's launch (its runtime call, by correlation id) says when the host asked
    for it; the compute stream is the one that ran most non-NCCL kernels; NCCL kernels are communication, drawn from
    the collectives. Waits: the synchronize calls of the threads that launched compute (a blocking .item() is one)."""
    mark = next(e for e in events if e.get("cat") == "user_annotation" and e["name"] == anchor)
    sec = lambda us: host + (us - mark["ts"] - mark["dur"] / 2) / 1e6
    runtime = [e for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver")]
    launched = {e["args"]["correlation"]: e for e in runtime if "correlation" in e.get("args", {})}
    kernels = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")
               and "nccl" not in e["name"].lower() and e.get("args", {}).get("correlation") in launched]
    streams = [e["args"].get("stream") for e in kernels if e["cat"] == "kernel"]
    stream = max(set(streams), key=streams.count) if streams else None
    kernels = [e for e in kernels if e["args"].get("stream") == stream]
    threads = {launched[e["args"]["correlation"]]["tid"] for e in kernels} | {mark["tid"]}
    waits = [(f"wait {e['name']}", sec(e["ts"]), sec(e["ts"] + e["dur"])) for e in runtime
             if e["name"] in HOST_WAITS and e["tid"] in threads]
    return ([(sec(launched[e["args"]["correlation"]]["ts"]), sec(e["ts"]), sec(e["ts"] + e["dur"])) for e in kernels],
            waits)

class Timeline:
    """One training step of this rank as a timeline, for bench/timeline.py. Off unless --timeline DIR is given (without
    it nothing is hooked or wrapped); with it, main() traces the run's last step and each rank writes
    DIR/trace_rank<r>.json, Chrome trace events in microseconds. Everything is attached from outside the engine, so
    the stage files stay as they are:
    - units: the engine's own where it has them (ZeRO-3's buckets, a module each: those it was given, or its default),
      else each block of an nn.ModuleList, then the root with the parameters no block owns; units train something.
      A unit's forward runs from its forward pre-hooks to its forward hooks; its backward from the gradient reaching
      its output to the gradient of the last of its own parameters. These hooks sit on both sides of the engine's own
      (prepend=True: before them), so what the engine does in its hooks (stage 3 gathering and freeing parameters) is
      not the unit's compute. A block pauses the root it runs in. With --checkpoint_activations a block's forward runs
      again inside its backward (the recompute): drawn as part of that backward, its forward hooks ignored there.
    - each collective through `comm`, from the call to its completion: the earlier of the moment its future completes
      (a callback, which may wait for the GIL; gloo's reduce-scatter has no future, so a thread of ours waits for it)
      and the moment the engine's wait() returns. Both come after the true completion, and a collective that finished
      long before wait() was called does not look longer.
    - the optimizer step (engine.step), and offload's device-host copies (the copy methods of engine.copies) and C++
      AdamW calls (engine.adam.adam_step), wrapped on the instance; with --delayed_update, the host's wait for the
      update in flight (the futures of engine.updater), a host wait.
    - offload's NVMe tier (engine.disk, an nvme.DiskStates): each read and write of its state file, from its submission
      to its Future's completion (a callback on the pool thread that ran it, host clock), with its bytes, in rows of
      their own; the host's wait for a transfer (the Future's result()) is a host wait.
    A moment of the computing thread is drawn once: inside a collective's call ("issue <op>", "wait <op>": a blocking
    collective is all wait), in the copies, C++ AdamW or host waits row when that thread runs them, or else as compute.
    On a GPU the compute row is the compute stream's kernels, not the time between the marks: the traced step runs
    under torch.profiler (CPU and CUDA activities), and each kernel is labelled by the marked segment in which it was
    launched (read_profile, kernel_compute), so a stream idle while the host waits or runs the C++ AdamW is a gap. The
    host's synchronize calls (an event's or a stream's, a blocking .item()) are the host waits row, and the computing
    thread's time inside collective calls is drawn there too. Copies and collectives are timed by CUDA events on the
    stream doing the work (copy, or for a collective's end the stream its future's callback runs on), read after the
    step; marks, calls and the C++ AdamW on the host clock."""
    ROWS = {"compute": 0, "communication": 100, "copies": 200, "cpu adam": 300, "host waits": 400, "nvme reads": 500,
            "nvme writes": 600}
    # the rows' trace tids; communication + k: the collectives' lane k
    ANCHOR = "timeline: host clock"  # a profiler annotation recorded at a known host moment (on a GPU)

    @classmethod
    def start(cls, out_dir, engine, model, device, rank, stage, step, *, holdings=False):
        """A Timeline of training step `step` if --timeline named a directory, else None."""
        return cls(out_dir, engine, model, device, rank, stage, step, holdings=holdings) if out_dir else None

    def __init__(self, out_dir, engine, model, device, rank, stage, step, *, holdings=False):
        import threading, types
        self.out_dir, self.rank, self.stage, self.step = out_dir, rank, stage, step
        # holdings: the traced step is also the memory meter's (a 2-step run, bench/animate.py), and at each moment of
        # the computing thread the engine's holdings are read (hold): DIR/holdings_rank<r>.json
        self.engine = engine
        self.device = device
        self.holdings = holdings
        self.held = []  # the holdings read, moment by moment
        self.tracing = False  # inside the traced step's window
        self.cuda, self.on = device.type == "cuda", True
        self.thread, self.here = threading.get_ident(), lambda: threading.get_ident() == self.thread
        self.stack, self.since = [], None  # the compute row now: the top's label (None: not compute), since when
        self.segments, self.calls, self.collectives, self.spans = [], [], [], {"copies": [], "cpu adam": [],
                                                                       "nvme reads": [], "nvme writes": []}
        self.waits = []  # the host's waits: (name, start, end) on the host clock
        buckets = getattr(engine, "buckets", None)
        if buckets and all(hasattr(b, "module") for b in buckets):  # the engine's units: each trained parameter's
            owner = {p: b.module for b in buckets for p in b.params}
        else:  # each block of a ModuleList, then the root; a parameter belongs to the first unit holding it
            owner = {}
            for u in [m for lst in model.modules() if isinstance(lst, nn.ModuleList) for m in lst] + [model]:
                for p in u.parameters():
                    if p.requires_grad:
                        owner.setdefault(p, u)
        units = list(dict.fromkeys(owner.values()))
        self.names = {m: name or "root" for name, m in model.named_modules()}
        self.n_params, self.left = {u: list(owner.values()).count(u) for u in units}, {}
        for u in units:
            u.register_forward_pre_hook(lambda m, a: self._mark("push", forward=True), prepend=True)
            u.register_forward_pre_hook(lambda m, a: self._mark("top", f"forward {self.names[m]}", forward=True))
            u.register_forward_hook(lambda m, a, out: self._after_forward(m, out, before_engine=True), prepend=True)
            u.register_forward_hook(lambda m, a, out: self._after_forward(m, out, before_engine=False))
        for p, u in owner.items():
            p.register_post_accumulate_grad_hook(lambda p, u=u: self._grad_done(u))
        engine.step = self._wrap(engine.step, lambda: self._mark("push", "optimizer step"), lambda _: self._mark("pop"))
        self.in_backward = False  # in engine.backward a unit's forward is a recompute (--checkpoint_activations)
        engine.backward = self._wrap(engine.backward, lambda: setattr(self, "in_backward", True),
                                     lambda _: setattr(self, "in_backward", False))
        copies = getattr(engine, "copies", None)
        stream = getattr(copies, "stream", None) if self.cuda else None
        if hasattr(copies, "copy"):  # offload's copies between device and host, named by where they go
            down = self._span("copies", "copy to host", stream)
            up = self._span("copies", "copy to device", stream)
            copies.copy = self._wrap_copy(copies.copy, down, up)
        if hasattr(copies, "landed") and not self.cuda:  # the host waiting for copies: a wait, not compute (on a GPU
            # the wait shows as the gap between the kernels on either side of it)
            copies.landed = self._wrap(copies.landed, time.perf_counter,
                                       lambda t0: self.calls.append(("wait copies", t0, time.perf_counter())))
        updater = getattr(engine, "updater", None)
        if hasattr(updater, "submit"):  # --delayed_update's thread: the host waiting for its update is a host wait
            engine.updater = types.SimpleNamespace(**{k: getattr(updater, k) for k in dir(updater)
                                                     if not k.startswith("_")})
            engine.updater.submit = lambda *a, **kw: TimedFuture(updater.submit(*a, **kw), self)
        adam = getattr(engine, "adam", None)
        if hasattr(adam, "adam_step"):  # offload's C++ module: wrapped in a copy of its namespace, not in the module
            engine.adam = types.SimpleNamespace(**{k: getattr(adam, k) for k in dir(adam) if not k.startswith("__")})
            engine.adam.adam_step = self._wrap(adam.adam_step, *self._span("cpu adam", "adam_step", "host"))
        disk = getattr(engine, "disk", None)
        if disk is not None:  # offload's NVMe tier: its state file's transfers, wrapped on the instance
            disk.file.read = self._transfer("nvme reads", "read", disk.file.read)
            disk.file.write = self._transfer("nvme writes", "write", disk.file.write)
        comm.timeline = self

    def _transfer(self, row, name, submit):
        """submit (a StateFile's read or write), each transfer a span of `row` from its submission to its Future's
        completion, with its bytes; its Future's result() timed as a host wait."""
        def wrapped(offset, buffer):
            if not self.on:
                return submit(offset, buffer)
            span = [name, time.perf_counter(), None, False, dict(MiB=round(buffer.numel() / 2**20, 3))]
            self.spans[row].append(span)
            future = submit(offset, buffer)
            # the callback runs on the pool thread as the transfer ends (or here, if it has ended already)
            future.add_done_callback(lambda _: span.__setitem__(2, time.perf_counter()))
            return TimedFuture(future, self, f"wait nvme {name}")
        return wrapped

    def now(self, stream=None):
        """This moment: the host clock (CLOCK_MONOTONIC, shared by the ranks of one machine); with CUDA, an event on
        `stream` (default: the current one)."""
        if not self.cuda or stream == "host":
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record(stream)
        return event

    def _mark(self, op, label=None, forward=False):
        """The compute row changes now (host clock): `push` label (None: the engine's hook runs), `top`: the top
        becomes label, `pop` the top, `end` unit label's backward (its entry may be below the top: a paused unit). A
        forward hook's mark (forward=True) in backward is a recompute's: no change."""
        if not self.on or (forward and self.in_backward):
            return
        if op == "end" and self.stack[-1:] != [label]:
            if label in self.stack:
                self.stack.remove(label)
            return
        t = time.perf_counter()
        if self.stack and self.stack[-1] is not None:
            self.segments.append((self.stack[-1], self.since, t))
        self.since = t
        if op == "push":
            self.stack.append(label)
        elif op == "top":
            self.stack[-1] = label
        else:
            self.stack.pop()
        self.hold(f"{op} {label}" if label else op)

    def hold(self, moment):
        """The engine's holdings now (with `holdings`, in the traced step, on the computing thread): its model states
        by category (model_states(), as the ledger reads them) and the tensors its attributes hold beyond them
        (unlisted: units gathered, gradients in flight, buffers), in bytes, with the host-clock time and the moment."""
        if not (self.holdings and self.tracing and self.on and self.here()):
            return
        states = self.engine.model_states()
        listed = sum(states.values(), [])
        self.held.append(dict(t=time.perf_counter(), moment=moment, states={k: storage_bytes(v) for k, v in
                                                                            states.items()},
                              beyond=unlisted(self.engine, listed, self.device)))

    def _after_forward(self, unit, out, before_engine):
        """Before the engine's forward hooks: the unit's forward is over; after them, back to its caller. On its
        output, hooks on both sides of the engine's (registered in its forward hook) bracket its work before backward."""
        if self.in_backward:  # a recompute: no output of it is backpropagated
            return
        self._mark("top" if before_engine else "pop")
        outs = out if isinstance(out, tuple) else (out,)
        t = next((t for t in outs if isinstance(t, torch.Tensor) and t.requires_grad), None)
        if t is not None:
            t.register_hook(lambda g: self._mark("push") if before_engine else self._backward_begins(unit))

    def _backward_begins(self, unit):
        self.left[unit] = self.n_params[unit]
        self._mark("top", f"backward {self.names[unit]}")

    def _grad_done(self, unit):
        if unit in self.left:
            self.left[unit] -= 1
            if self.left[unit] == 0:
                del self.left[unit]
                self._mark("end", f"backward {self.names[unit]}")

    def _wrap(self, fn, enter, leave):
        """fn, calling enter() before and leave(enter's result) after, while tracing."""
        def wrapped(*args, **kwargs):
            if not self.on:
                return fn(*args, **kwargs)
            token = enter()
            try:
                return fn(*args, **kwargs)
            finally:
                leave(token)
        return wrapped

    def _wrap_copy(self, copy, down, up):
        """copies.copy(dst, src), each call a span of the copies row (down: to the host, else up) with its bytes."""
        def wrapped(dst, src):
            if not self.on:
                return copy(dst, src)
            enter, leave = down if dst.device.type == "cpu" else up
            span = enter(dict(bytes=src.numel() * src.element_size()))
            try:
                return copy(dst, src)
            finally:
                leave(span)
        return wrapped

    def _span(self, row, name, stream):
        """enter and leave functions that record each call as a span of `row`, timed on `stream` ("host": the host
        clock), and whether the computing thread ran it; enter(args): the span's args in the trace."""
        def enter(args=None):
            if stream not in (None, "host"):  # what the copy itself does first: the copy stream waits for compute
                stream.wait_stream(torch.cuda.current_stream())
            span = [name, self.now(stream), None, self.here(), *([args] if args else [])]
            self.spans[row].append(span)
            return span
        def leave(span):
            span[2] = self.now(stream)
            self.hold(f"{name} done")
        return enter, leave

    def issue(self, name, tensors, sent=0.0):
        """A collective (comm's) is about to be issued: its record, None when the timeline is off. sent: the bytes the
        ledger counted for it."""
        if not self.on:
            return None
        mib = max(t.numel() * t.element_size() for t in tensors) / 2**20
        c = {"name": name, "issued": self.now(), "ends": [], "MiB": mib, "called": time.perf_counter(), "sent": sent}
        self.collectives.append(c)
        self.hold(f"issue {name}")
        return c

    def issued(self, c, work, async_op):
        """The collective of record c has been issued: its handle, whose wait() is timed."""
        if c is None:
            return work
        name = c["name"]
        if not async_op:  # the caller waited all along
            c["ends"].append(self.now())
        self.calls.append((f"{'issue' if async_op else 'wait'} {name}", c["called"], time.perf_counter()))
        if not async_op:
            self.hold(f"{name} done")
            return work
        try:
            work.get_future().then(lambda fut: c["ends"].append(self.now()))
        except RuntimeError:  # gloo's reduce-scatter has no future: a thread waits for it instead
            import threading
            threading.Thread(target=lambda: (work.wait(), c["ends"].append(self.now())), daemon=True).start()
        return TimedWork(work, c, self)

    @contextlib.contextmanager
    def window(self, step):
        """Around every training step: what ended before it is dropped; the traced step is written when it ends."""
        self.segments, self.calls, self.stack, self.waits = [], [], [], []
        self.collectives = [c for c in self.collectives if not c["ends"]]
        # still running now: not ended yet, or (another thread's span on the host clock) ending later than this
        # thread's now, as on the fake device's modelled clock, where each thread keeps its own time
        now = time.perf_counter()
        self.spans = {row: [s for s in spans if s[2] is None or isinstance(s[2], float) and s[2] > now]
                      for row, spans in self.spans.items()}
        if step != self.step or not self.on:
            yield
            return
        profiler = None
        if self.cuda:  # the compute stream's kernels, and the host's synchronize calls
            if torch.autograd._profiler_enabled():
                raise SystemExit("error: --timeline on a GPU profiles the step it traces (the last), and --profile "
                                 "profiles that one too: run more steps, or drop --profile or --timeline")
            profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                          torch.profiler.ProfilerActivity.CUDA])
            profiler.__enter__()
            # the compute stream's work so far, not the device's: the delayed update's thread may have queued its
            # copies up on the copy stream, and the traced step is the one beside them
            torch.cuda.current_stream().synchronize()
        start = self.now()
        self.anchor = (start, time.perf_counter())  # with CUDA: an event that ran at this host time
        if profiler is not None:  # the host moment of the annotation's middle: the profiler's clock on the host's
            t = time.perf_counter()
            with torch.profiler.record_function(self.ANCHOR):
                pass
            self.profile_anchor = (t + time.perf_counter()) / 2
        self.tracing = True
        self.hold("step begins")
        yield
        self.hold("step ends")
        self.tracing = False
        end = self.now()
        kernels = None
        if self.cuda:
            torch.cuda.synchronize()
            profiler.__exit__(None, None, None)
            with tempfile.TemporaryDirectory() as tmp:
                profiler.export_chrome_trace(os.path.join(tmp, "trace.json"))
                with open(os.path.join(tmp, "trace.json")) as f:
                    events = json.load(f)["traceEvents"]
            kernels, waits = read_profile(events, self.ANCHOR, self.profile_anchor)
            self.waits += waits
        self.on, comm.timeline = False, None
        self._write(self._seconds(start), self._seconds(end), kernels)
        if self.holdings:
            with open(os.path.join(self.out_dir, f"holdings_rank{self.rank}.json"), "w") as f:
                json.dump([dict(h, t=round(h["t"] * 1e6, 3)) for h in self.held], f)

    def write_memory(self, meter):
        """DIR/memory_rank<r>.json: the memory meter's account of the traced step (on a CPU its allocations and frees,
        host-clock microseconds, from the live bytes at its start), and its peak."""
        events = [[round(t * 1e6, 3), nbytes] for t, nbytes in getattr(meter, "events", [])]
        with open(os.path.join(self.out_dir, f"memory_rank{self.rank}.json"), "w") as f:
            json.dump(dict(base=getattr(meter, "base", 0), peak=meter.peak, events=events), f)

    def _seconds(self, t):
        return t if isinstance(t, float) else self.anchor[1] + self.anchor[0].elapsed_time(t) / 1e3

    @staticmethod
    def _done(t):
        """A time read: a host clock's, or a CUDA event's that has completed (elapsed_time raises before)."""
        return t is not None and (isinstance(t, float) or t.query())

    def _write(self, t0, t1, kernels=None):
        """DIR/trace_rank<r>.json: the step's events, each clipped to the step. Compute: on a GPU the compute stream's
        kernels (kernels: (launch, start, end) from read_profile), else the marked segments without the holes."""
        events, us = [], lambda t: round(t * 1e6, 3)
        def add(name, row, a, b, tid=None, cat=None, **args):
            a, b = max(a, t0), min(t1 if b is None else b, t1)  # still running at the end: drawn until then
            if a < b:
                tid = self.ROWS[row] if tid is None else tid
                events.append(dict(name=name, cat=cat or row, ph="X", pid=self.rank, tid=tid, ts=us(a), dur=us(b) - us(a),
                                   args=args))
        # a span another thread (the delayed update's) is still in: its end's event not yet done, drawn until t1
        def sec(span):
            end = self._seconds(span[2]) if self._done(span[2]) else None
            return span[0], self._seconds(span[1]), end
        holes = [(a, t1 if b is None else b) for _, a, b in self.calls + self.waits]
        holes += [(a, t1 if b is None else b) for row in self.spans.values() for _, a, b, here, *_ in row if here]
        if kernels is None:
            compute = host_compute(self.segments, holes)
        else:
            compute = kernel_compute(self.segments, kernels)
        for label, a, b in compute:
            add(label, "compute", a, b)
        for name, a, b in self.calls:  # on a GPU the host's time, beside the kernels
            add(name, "compute" if kernels is None else "host waits", a, b, cat="comm call")
        for name, a, b in self.waits:
            add(name, "host waits", a, b)
        lanes = []  # collectives in flight together go to separate lanes (Chrome traces nest the events of one row)
        for c in sorted(self.collectives, key=lambda c: self._seconds(c["issued"])):
            a, b = self._seconds(c["issued"]), min((self._seconds(e) for e in c["ends"]), default=None)
            lane = next((k for k, free in enumerate(lanes) if free <= a), len(lanes))
            if lane == len(lanes):
                lanes.append(None)
            lanes[lane] = t1 if b is None else b  # busy until then
            add(c["name"], "communication", a, b, self.ROWS["communication"] + lane, MiB=round(c["MiB"], 3),
                sent=c["sent"])
        for row, spans in self.spans.items():
            for span in list(spans):  # (an NVMe transfer's span carries its MiB)
                if not self._done(span[1]):  # begun by another thread after the step's end
                    continue
                name, a, b = sec(span)
                args = span[4] if len(span) > 4 else {}
                # a transfer the step before left in flight is drawn from this step's start, and says so
                add(name, row, a, b, **args, **({"submitted_before_the_step": True} if a < t0 else {}))
        def row_name(tid):  # "communication 2": its second lane
            base, row = max((base, row) for row, base in self.ROWS.items() if base <= tid)
            return row + (f" {tid - base + 1}" if tid > base else "")
        meta = [dict(ph="M", pid=self.rank, name="process_name", args=dict(name=f"rank {self.rank}")),
                dict(ph="M", pid=self.rank, name="process_sort_index", args=dict(sort_index=self.rank))]
        for tid in sorted({e["tid"] for e in events}):
            meta += [dict(ph="M", pid=self.rank, tid=tid, name="thread_name", args=dict(name=row_name(tid))),
                     dict(ph="M", pid=self.rank, tid=tid, name="thread_sort_index", args=dict(sort_index=tid))]
        os.makedirs(self.out_dir, exist_ok=True)
        with open(os.path.join(self.out_dir, f"trace_rank{self.rank}.json"), "w") as f:
            json.dump(dict(traceEvents=meta + events, displayTimeUnit="ms", otherData=dict(
                rank=self.rank, stage=self.stage, step=self.step, window_us=[us(t0), us(t1)],
                device="cuda" if self.cuda else "cpu")), f)

class TimedWork:
    """A collective's handle whose wait() is timed: its return bounds the completion; the caller waited meanwhile."""
    def __init__(self, work, record, timeline):
        self.work, self.record, self.timeline = work, record, timeline

    def wait(self, *args, **kwargs):
        t = time.perf_counter()
        out = self.work.wait(*args, **kwargs)
        self.record["ends"].append(self.timeline.now())
        self.timeline.calls.append((f"wait {self.record['name']}", t, time.perf_counter()))
        self.timeline.hold(f"{self.record['name']} waited")
        return out

    def __getattr__(self, name):
        return getattr(self.work, name)

class TimedFuture:
    """A future whose result() and exception() are timed, a host wait named `name`: --delayed_update's thread (the host
    waits for the update), or an NVMe transfer (the host waits for the disk)."""
    def __init__(self, future, timeline, name="wait cpu adam"):
        self.future, self.timeline, self.name = future, timeline, name

    def _timed(self, method, *args, **kwargs):
        t = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            if self.timeline.on:
                self.timeline.waits.append((self.name, t, time.perf_counter()))

    def result(self, *args, **kwargs):
        return self._timed(self.future.result, *args, **kwargs)

    def exception(self, *args, **kwargs):
        return self._timed(self.future.exception, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.future, name)

def readable_storages(t):
    """The storages that hold tensor t's memory, each one whose data_ptr() can be read. A wrapper subclass (DTensor:
    FSDP2's parameters, gradients and Adam moments) has a storage of its own with no memory behind it, whose
    data_ptr() raises ("an invalid python storage"): its memory is its inner tensors' (a DTensor's local shard),
    found through __tensor_flatten__. Any other tensor whose storage cannot be read holds no memory the meter can
    see."""
    if is_traceable_wrapper_subclass(t):
        inner, _ = t.__tensor_flatten__()
        parts = [getattr(t, name) for name in inner]
        return [s for part in parts if isinstance(part, torch.Tensor) for s in readable_storages(part)]
    try:
        storage = t.untyped_storage()
        storage.data_ptr()
    except (RuntimeError, NotImplementedError):
        return []
    return [storage]

def storage_bytes(tensors):
    """Bytes of the distinct storages behind `tensors`: views of one buffer count once."""
    seen = {}
    for t in tensors:
        for s in readable_storages(t):
            seen[s.data_ptr(), s.device] = s.nbytes()
    return sum(seen.values())

def on_device(t, device):
    """Whether tensor t lives on device's type. False for a tensor that cannot say: the gc walk meets tensors that
    torch itself holds, and some raise on .device (torch 2.8 and 2.9: "tensor does not have a device")."""
    try:
        return t.device.type == device.type
    except Exception:  # any error: the scan counts what it can, it must never kill a rank
        return False

def live_tensor_bytes(device):
    """Every tensor storage Python can reach on `device`, each counted once."""
    with warnings.catch_warnings():  # isinstance() on some deprecated torch objects warns
        warnings.simplefilter("ignore")
        tensors = [o for o in gc.get_objects() if isinstance(o, torch.Tensor)]
    return storage_bytes(t for t in tensors if on_device(t, device))

@contextlib.contextmanager
def native_stderr_without(patterns):
    """Around a block, stderr lines (written by C++ too: it is done at the file-descriptor level) that contain one of
    `patterns` are dropped and the others passed on, after the block. The profiler behind PeakMemory prints `USDT:`
    lines and, with several ranks, an allocator warning; both are harmless."""
    sys.stderr.flush()
    saved, captured = os.dup(2), tempfile.TemporaryFile()
    os.dup2(captured.fileno(), 2)
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)
        captured.seek(0)
        lines = captured.read().decode(errors="replace").splitlines(keepends=True)
        sys.stderr.write("".join(ln for ln in lines if not any(p in ln for p in patterns)))
        sys.stderr.flush()

def holdings(engine, data, batch, device):
    """What this rank holds, in bytes, found two ways. From the engine's own list (model_states()): its model states by
    category, and, on a GPU, where each category's tensors are ("device", "host", or "device and host"; on a CPU
    device and host are one memory: no word). Independently of that list: `live`, every tensor on the device that
    Python can reach (a walk of the garbage collector's objects), less the data set (`data`, its own figure); and
    `other` = live - the states on the device, named where it can be (`named`): the micro-batch (`batch`, train_step's
    x and y), the tensors the engine's attributes hold beyond its list (unlisted), and the rest (scalars, buffers in
    flight, leaks). Pinned host memory (with CUDA): the live pinned storages, each rounded up to a power of two as
    PyTorch's pinned-memory cache takes it. (The cache's own counter, torch.cuda.host_memory_stats, also holds the
    blocks each batch was pinned in, freed or still in flight, and cached blocks.)"""
    model_states = engine.model_states()
    listed = sum(model_states.values(), [])
    on_device = [t for t in listed if t.device.type == device.type]
    places = {k: {"device" if t.device.type == device.type else "host" for t in v} for k, v in model_states.items()}
    where = {k: " and ".join(sorted(p)) or None for k, p in places.items()}
    data_bytes = storage_bytes(t for t in data if t.device.type == device.type)
    live = live_tensor_bytes(device) - data_bytes
    other = live - storage_bytes(on_device)
    named = {"the micro-batch": storage_bytes(t for t in batch if t.device.type == device.type)}
    named.update(unlisted(engine, listed + data + batch, device))
    named["the rest"] = other - sum(named.values())
    return dict(states={k: storage_bytes(v) for k, v in model_states.items()},
                where=where if device.type != "cpu" else {},
                live=live, data=data_bytes, other=other, named=named,
                pinned=pinned_tensor_bytes() if device.type == "cuda" else 0,
                disk=disk_bytes(engine))

def disk_bytes(engine):
    """The bytes of this rank's files on disk, as the filesystem gives their sizes (offload's NVMe tier: its state
    file; none without)."""
    disk = getattr(engine, "disk", None)
    return os.path.getsize(disk.file.path) if disk is not None else 0

def own_class(obj):
    """Whether obj is an instance of a class defined in this project's files (or in the script run as __main__)."""
    module = sys.modules.get(type(obj).__module__)
    path = getattr(module, "__file__", None) or ""
    return type(obj).__module__ == "__main__" or os.path.dirname(os.path.abspath(path)) == os.path.dirname(__file__)

def unlisted(engine, listed, device, depth=4):
    """The device tensors the engine's attributes hold beyond `listed`, in bytes by attribute path (`buckets[*].reduced`:
    that attribute of the buckets): a walk from the engine through lists, tuples, dicts and the objects of this
    project's classes (own_class: buckets, optimizers, copies), not into modules (the model's parameters are in the
    engine's list, or views of it). Each storage counts once, under the first path that reaches it."""
    seen = {(s.data_ptr(), s.device) for t in listed if on_device(t, device) for s in readable_storages(t)}
    found = defaultdict(int)

    def visit(obj, path, depth):
        if isinstance(obj, torch.Tensor):
            if not on_device(obj, device):
                return
            for storage in readable_storages(obj):
                if (storage.data_ptr(), storage.device) not in seen:
                    seen.add((storage.data_ptr(), storage.device))
                    found[path] += storage.nbytes()
            return
        if depth == 0 or isinstance(obj, nn.Module):
            return
        if isinstance(obj, (list, tuple)):
            children = [(f"{path}[*]", x) for x in obj]
        elif isinstance(obj, dict):
            children = [(f"{path}[*]", x) for x in obj.values()]
        elif hasattr(obj, "__dict__") and own_class(obj):
            children = [(f"{path}.{name}", x) for name, x in vars(obj).items()]
        else:
            return
        for child_path, child in children:
            visit(child, child_path, depth - 1)

    for name, value in vars(engine).items():
        visit(value, name, depth)
    return {path: n for path, n in found.items() if n}

def pinned_tensor_bytes():
    """Pinned host memory that live tensors hold: each distinct pinned storage, rounded up to a power of two."""
    with warnings.catch_warnings():  # isinstance() on some deprecated torch objects warns
        warnings.simplefilter("ignore")
        tensors = [o for o in gc.get_objects() if isinstance(o, torch.Tensor)]
    seen = {}
    for t in tensors:
        if t.device.type == "cpu" and t.is_pinned():
            s = t.untyped_storage()
            seen[s.data_ptr()] = pinned_bytes(s.nbytes())
    return sum(seen.values())

class PeakMemory:
    """Peak bytes of live tensors during a `with` block: the CUDA allocator's counter on GPU, less cuBLAS's
    workspaces (named apart: `workspace`); on CPU, the live bytes at entry plus the highest running sum of the
    allocations and frees the profiler records (RSS would mislead: glibc keeps freed buffers)."""
    def __init__(self, device):
        self.device, self.peak, self.largest = device, 0, 0  # largest: the largest single allocation (CPU only)
        self.workspace = 0  # cuBLAS's workspaces in the peak (CUDA only)

    def __enter__(self):
        # On CUDA the allocator's counters are the host's: a block counts from the call that asks for it, whether or
        # not the GPU has run the kernels queued before. So no synchronize, which would also order every stream
        # around the measured step and hide a missing wait there.
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base = torch.cuda.memory_allocated(self.device)
        else:
            self.base = live_tensor_bytes(self.device)
            self.quiet = native_stderr_without(("USDT:", "allocated before the profiling started"))
            self.quiet.__enter__()
            # the autograd profiler itself: torch.profiler.profile would first import torch._inductor
            self.prof = torch.autograd.profiler.profile(use_cpu=True, profile_memory=True, use_kineto=True)
            self.prof.__enter__()
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            self.peak = torch.cuda.max_memory_allocated(self.device)
            # cuBLAS keeps a workspace per handle and stream (32 MiB each on Hopper), made at its first matmul there
            # (in the warm-up step) and kept: in the peak, but neither states nor activations. Freed here, its bytes
            # are what memory_allocated loses; the next step makes it again.
            held = torch.cuda.memory_allocated(self.device)
            torch._C._cuda_clearCublasWorkspaces()
            self.workspace = held - torch.cuda.memory_allocated(self.device)
            self.peak -= self.workspace
            return
        self.prof.__exit__(*exc)
        self.quiet.__exit__(*exc)
        events = sorted((e.start_ns(), e.nbytes()) for e in self.prof.kineto_results.events()
                        if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU)
        running = highest = 0
        for _, nbytes in events:
            running += nbytes
            highest = max(highest, running)
            self.largest = max(self.largest, nbytes)
        self.peak = self.base + highest
        # the events on the host clock (perf_counter seconds; the profiler's are the epoch's nanoseconds)
        shift = time.time_ns() - time.perf_counter_ns()
        self.events = [((ns - shift) / 1e9, nbytes) for ns, nbytes in events]

@contextlib.contextmanager
def timeline(trace_dir, rank, device):
    """--profile DIR: a torch.profiler timeline of one step (CPU ops; on a GPU also its kernels and copies, each on its
    stream), forward, backward and step marked, as a Chrome trace per rank: DIR/rank{r}.json (ui.perfetto.dev shows it)."""
    cuda = device.type == "cuda"
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU] + [torch.profiler.ProfilerActivity.CUDA] * cuda) as prof:
        yield
        if cuda:
            torch.cuda.synchronize(device)  # the step's kernels have all run: the timeline holds them
    os.makedirs(trace_dir, exist_ok=True)
    prof.export_chrome_trace(os.path.join(trace_dir, f"rank{rank}.json"))

def mib(nbytes):
    """Bytes as MiB in a table's cell."""
    return f"{nbytes / 2**20:9.2f}"

def amount(nbytes):
    """Bytes as MiB in a sentence; below 0.01 MiB (the norm's scalar), as bytes."""
    return f"{nbytes / 2**20:.2f} MiB" if nbytes >= 0.005 * 2**20 or nbytes == 0 else f"{nbytes:,.0f} bytes"

def comm_moves(stage):
    """What each collective of a stage moves, as the bytes line of a run's table says it."""
    gathered = "the updated parameters" if stage in ("stage1", "stage2") else "the parameters, in forward and backward"
    scalars = "the gradient norm: one float64 scalar" if stage in ("stage1", "stage2") else (
        "the gradient norm and the units' order: three float64 scalars")
    return {"all_reduce": "the gradients" if stage == "stage0" else scalars,
            "reduce_scatter": "the gradients", "all_gather": gathered, "broadcast": "the model's buffers"}

def memory_table(s, th):
    """What a run ends with: each rank's model states by category beside the formula (the engine's list), then found
    without that list, every live tensor on the device and the part of it that is not model states (`other`, named
    below the table), its peak; and the bytes it sent per step beside the formula, each collective with what it moves.
    Ranks that hold the same states share a row (the highest live, other and peak of them)."""
    theory = th["states"]
    cats = list(theory)
    per_rank = s["model_state_bytes_per_rank"]
    columns = list(zip(per_rank, s["live_tensor_bytes_per_rank"], s["other_tensor_bytes_per_rank"],
                       s["peak_memory_bytes_per_rank"]))
    rows = [(str(r), *column) for r, column in enumerate(columns)]
    if len(rows) > 1 and all(states == per_rank[0] for states in per_rank):
        rows = [(f"0-{len(rows) - 1}", per_rank[0], *[max(values) for values in list(zip(*columns))[1:]])]
    where = f"host: {', '.join(th['host'])}" if th["host"] else "all on the device"
    # each column as wide as its header (nvme_buffers), at least 9; the step the meter measured, counted from 1 as the
    # log's lines count them
    width = {c: max(9, len(c) + 1) for c in cats}
    lines = [f"memory per rank, MiB ({s['stage']}, {s['dtype']}, {th['formula']}; "
             f"measured on step {s['measured_step']}; {where})",
             f"{'rank':>8} |" + "".join(f"{c:>{width[c]}} |" for c in cats)
             + "".join(f"{c:>9} |" for c in ("states", "live", "other")) + f"{'peak':>9}"]
    for name, states, live, other, peak in rows:
        lines.append(f"{name:>8} |" + "".join(f"{mib(states.get(c, 0)):>{width[c]}} |" for c in cats)
                     + f"{mib(sum(states.values()))} |{mib(live)} |{mib(other)} |{mib(peak)}")
    lines.append(f"{'formula':>8} |" + "".join(f"{mib(theory[c]):>{width[c]}} |" for c in cats)
                 + f"{mib(sum(theory.values()))} |")
    sent = {k: v["measured"] for k, v in s["comm_bytes_per_step"]["by_collective"].items() if v["measured"]}
    moves = comm_moves(s["stage"])
    each = ", ".join(f"{k} {amount(v)} ({moves.get(k, 'not in the formula')})"
                     for k, v in sorted(sent.items(), key=lambda kv: -kv[1]))
    total = f"sent per step {sum(sent.values()) / 2**20:.2f} MiB (formula {sum(th['comm'].values()) / 2**20:.2f})"
    lines += textwrap.wrap(f"{total}: {each or 'nothing'}", 120)
    # the rest: what no attribute of the engine holds (scalars, buffers in flight, leaks)
    named = ", ".join(f"{'engine.' * (k not in ('the micro-batch', 'the rest'))}{k} {amount(v)}"
                      + " (scalars no attribute of the engine holds: losses, a gradient norm)" * (k == "the rest")
                      for k, v in s["other_named"].items() if v or k == "the micro-batch")
    note = (f"other = live - states, on rank 0: {named}. "
            f"live: every tensor on the device that the garbage collector finds (not the engine's list) after step "
            f"{s['measured_step']}'s backward (not the first step's: it makes Adam's moments), less the data set "
            f"({amount(s['data_bytes'])}); the peak counts it too, and adds the step's activations and working set")
    lines += textwrap.wrap(note, 120)
    if th["disk"]:
        lines.append(f"on disk: the state file {s['disk_bytes']['measured'] / 2**20:.2f} MiB (formula 12Ψ/N = "
                     f"{th['disk'] / 2**20:.2f}: the fp32 master, Adam m and v; each bucket's from an offset aligned "
                     f"to 4 KiB)")
        # one bucket's states a buffer, whatever the depth: from some Ψ on they weigh less than the states they replace
        buffers = theory["nvme_buffers"]
        if buffers > th["disk"]:
            lines += textwrap.wrap(f"the tier's buffers ({buffers / 2**20:.2f} MiB) outweigh the states they keep off "
                                   f"the host (12Ψ/N = {th['disk'] / 2**20:.2f} MiB): it pays from {buffers / th['disk']:.1f}x "
                                   f"this Ψ, in more blocks of this width", 120)
    return "\n".join(lines)

# ----------------------------------------------------------------------------------------------------------
# Model FLOPs: the TFLOP/s and MFU a run reports.

# Dense peaks in TFLOP/s from NVIDIA's datasheets (H100, H200, A100, V100): the tensor-core figures without sparsity,
# half the sheets' headline "with sparsity" ones. fp32 is the plain FP32 figure, not TF32's: TF32 stays off here
# (torch's default, and tests/gpu_check.sh sets NVIDIA_TF32_OVERRIDE=0). The first name contained in the device's
# name (torch.cuda.get_device_name) is its row: "NVIDIA H100 80GB HBM3" is the SXM card, "NVIDIA H200" the SXM one.
PEAK_TFLOPS = [
    ("H200 NVL", dict(bf16=835, fp16=835, fp32=60)),
    ("H200", dict(bf16=989, fp16=989, fp32=67)),
    ("H100 NVL", dict(bf16=835, fp16=835, fp32=60)),
    ("H100 PCIe", dict(bf16=756, fp16=756, fp32=51)),
    ("H100", dict(bf16=989, fp16=989, fp32=67)),
    ("A100", dict(bf16=312, fp16=312, fp32=19.5)),
    ("V100-PCIE", dict(fp16=112, fp32=14)),
    ("V100", dict(fp16=125, fp32=15.7)),
]

def flops_per_token(model, cfg):
    """Model FLOPs of one training step per token, as nanoGPT's estimate_mfu counts them (PaLM, arXiv 2204.02311,
    appendix B):  6Ψ' + 12·L·H·Q·T.  Ψ' is every parameter but the position embedding (nanoGPT's non-embedding
    count): each weight matrix costs 2 FLOPs per token in forward and 4 in backward, and the token embedding is the
    LM head's matrix (tied), while the position embedding is a lookup. 12·L·H·Q·T is attention's QKᵀ and its product
    with V (L layers, H heads of width Q, T = block_size), forward and backward, over the whole T x T square, as
    nanoGPT counts it. Left out: LayerNorm, GELU, softmax and the loss (elementwise), the optimizer step, and what
    --checkpoint_activations runs again (model FLOPs, not the hardware's)."""
    psi = sum(p.numel() for p in model.parameters()) - model.wpe.weight.numel()
    attention = 12 * cfg.n_layer * cfg.n_head * (cfg.n_embd // cfg.n_head) * cfg.block_size
    return 6 * psi + attention

def peak_tflops(device, dtype):
    """The device's dense peak for dtype in TFLOP/s (PEAK_TFLOPS), and its name; None where it is not known (a CPU,
    a GPU not in the table, or fp32 on a card whose table row has no such figure)."""
    if device.type != "cuda":
        return None, None
    name = torch.cuda.get_device_name(device)
    peaks = next((row for key, row in PEAK_TFLOPS if key in name), {})
    return peaks.get(dtype), name

def speed(flops, tokens_per_s, world_size, device, dtype):
    """What a run reports beside tokens/s: model TFLOP/s per rank (the global tokens per second over the ranks) and
    its MFU, the share of the device's dense peak (None where the peak is not known)."""
    tflops = flops * tokens_per_s / world_size / 1e12
    peak, name = peak_tflops(device, dtype)
    return dict(flops_per_token=flops, tflops_per_rank=tflops, peak_tflops=peak, device_name=name,
                mfu=tflops / peak if peak else None)

def speed_text(s):
    """'1.23 TFLOP/s per rank' and, where the peak is known, its MFU against that peak."""
    text = f"{s['tflops_per_rank']:.3g} TFLOP/s per rank"
    if s["mfu"] is None:
        return text
    return text + f" (MFU {s['mfu']:.1%} of the {s['device_name']}'s dense {s['peak_tflops']:g})"

# ----------------------------------------------------------------------------------------------------------
# What a run shows: progress, then its summary and the per-rank memory table.

def evaluate(engine, data, args, device):
    """The validation loss, averaged over --eval_batches batches and over the ranks (outside the comm ledger)."""
    rank, world_size = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    total = torch.zeros((), device=device)
    with torch.no_grad():
        for k in range(args.eval_batches):
            x, y = data.batch("val", 10**9 + k, args.batch_size // args.grad_accum, rank, world_size, device)
            total += engine.forward(x, y).float()
    if dist.is_initialized():
        dist.all_reduce(total, op=dist.ReduceOp.AVG)
    return total.item() / args.eval_batches

def progress(steps, start, args, rank):
    """A progress bar on a terminal (rank 0); otherwise the steps themselves, and Run.log prints a line now and then."""
    if rank == 0 and not args.no_progress and sys.stderr.isatty():
        from tqdm import tqdm
        return tqdm(steps, initial=start, total=args.steps, dynamic_ncols=True)
    return steps

def log_due(step, end, args):
    """Does Run.log show this step's loss? Every max(1, steps // 10)th step and the last: Run.record reads them then."""
    return step + 1 == end or (step + 1) % max(1, args.steps // 10) == 0

def check_profile(args, plan, rank):
    """--profile needs a step no other profiler watches: on a one-step run, that step is the memory meter's."""
    if args.profile and plan.end - plan.start < 2:  # (the memory meter's profiler cannot run inside another)
        stop(f"error: --profile {args.profile}: this run trains one step (from step {plan.start} to {plan.end}), which "
             f"the memory meter measures; train 2 steps or more to profile one", rank)

class Run:
    """A training run's bookkeeping, kept out of train_gpt.main's loop, and what its report reads. A step is watched
    (watch: the memory meter on one step, --profile's and --timeline's on theirs, the time of every other) and its
    outcome recorded (record: the losses and gradient norms, read from the device only at the steps that log or save);
    then rank 0 logs it (log), and a checkpoint is saved when due (saves, checkpoint_meta). At the end summarize and
    finish read it: the history, what was measured on the measured step, the step times, the paper's model (th) and
    the steps [start, end) this run took."""
    def __init__(self, stage, args, cfg, plan, *, engine, data, th, scaler, device, rank, world_size, distributed):
        self.stage = stage
        self.args = args
        self.cfg = cfg
        self.engine = engine
        self.data = data
        self.th = th  # what the paper's model says this run holds and sends (train_gpt.theory)
        self.scaler = scaler  # fp16's loss scaler (main's, a train_gpt.LossScaler): the log shows its scale and skipped steps
        self.device = device
        self.rank = rank
        self.world_size = world_size
        self.distributed = distributed
        self.start = plan.start
        self.end = plan.end
        self.ckpt_dir = plan.ckpt_dir
        # the history: a resumed run's own, from its checkpoint
        self.history = {k: plan.manifest[k] if plan.manifest else [] for k in ("losses", "grad_norms", "val_losses")}
        self.measured = dict(peak=0)  # the measured step's: this rank's holdings, its peak, the bytes it sent
        self.step_times = []  # seconds, of every step neither measured nor profiled
        self.unread = []  # (loss, grad norm) tensors of the steps since the history was last read
        # the memory meter's step: step 0 creates Adam's moments, step 1 is the steady state (or a resumed run's first)
        self.measure_step = self.start if self.start else min(1, self.end - 1)
        self.trace = Timeline.start(args.timeline, engine, engine.model, device, rank, stage, step=self.end - 1,
                                    holdings=self.measure_step == self.end - 1)
        self.flops = flops_per_token(engine.model, cfg)  # model FLOPs per token: the TFLOP/s the log and report show
        self.bar = None  # the steps, as steps() shows them
        self.skipped_before = 0  # the steps fp16's scaler had skipped before this one
        # --profile's step: one no other profiler watches (on a CPU the memory meter's, on a GPU --timeline's, the last)
        if device.type == "cpu":
            watched = {self.measure_step}
        else:
            watched = {self.end - 1} if args.timeline else set()
        near = (self.measure_step + 1, self.measure_step - 1, self.measure_step)
        unwatched = [s for s in near if self.start <= s < self.end and s not in watched]
        self.profile_step = unwatched[0] if args.profile else None  # (check_profile: 2 steps or more, one unwatched)

    def announce(self):
        """Rank 0's word before the first step: Ψ, the padded count, the ranks, the model states per rank in theory
        (the paper's formula for this stage), and the unigram loss (the loss of knowing character frequencies)."""
        if self.rank != 0:
            return
        th = self.th
        print(f"{self.stage}: {sum(p.numel() for p in self.engine.model.parameters()):,} parameters (Ψ), "
              f"padded to {self.engine.padded_numel:,}; {self.world_size} rank(s) on {self.device.type}; model states "
              f"per rank {th['formula']} = {sum(th['states'].values()) / 2**20:.2f} MiB in theory; unigram loss "
              f"{self.data.unigram_loss:.3f}", flush=True)

    def steps(self):
        """The steps [start, end): a progress bar on a terminal (rank 0), else the range itself."""
        self.bar = progress(range(self.start, self.end), self.start, self.args, self.rank)
        return self.bar

    @contextlib.contextmanager
    def watch(self, step):
        """Around train_step: yields the dict in which train_step records this rank's holdings at the measured step
        (None at the others); the memory meter measures that step, --profile and --timeline their own, and every
        other step is timed (a profiled step runs slower: not timed)."""
        t0 = time.perf_counter()
        measuring = step == self.measure_step
        profiled = self.args.profile and step == self.profile_step
        comm.begin_step()
        self.skipped_before = self.scaler.skipped  # if this step adds one, it was skipped
        with contextlib.ExitStack() as windows:
            meter = windows.enter_context(PeakMemory(self.device)) if measuring else None
            if profiled:
                windows.enter_context(timeline(self.args.profile, self.rank, self.device))
            if self.trace:
                windows.enter_context(self.trace.window(step))
            yield self.measured if measuring else None
        if meter:
            self.measured.update(peak=meter.peak, workspace=meter.workspace)
        if meter and self.trace and self.trace.holdings:  # the memory line of the step the timeline traced too
            self.trace.write_memory(meter)
        elif not profiled:
            self.step_times.append(time.perf_counter() - t0)

    def record(self, step, loss, grad_norm, sent):
        """What train_step returned: the loss and the gradient norm (tensors on the device), the bytes sent. Read at
        once at the steps that log or save: the host waits for the device there, not twice every step."""
        if step == self.measure_step:
            self.measured.update(sent=sent, counted=comm.taken)
        self.unread.append((loss, grad_norm))
        if log_due(step, self.end, self.args) or self.saves(step):
            self.history["losses"] += torch.stack([loss for loss, _ in self.unread]).tolist()
            self.history["grad_norms"] += torch.stack([norm for _, norm in self.unread]).tolist()
            self.unread.clear()

    def saves(self, step):
        """Does this run save a checkpoint after this step? (Only with a checkpoint directory.)"""
        return bool(self.ckpt_dir) and checkpoint_due(step, self.end, self.args)

    def checkpoint_meta(self):
        """What a checkpoint's manifest keeps beside the state: the model, its vocabulary, the history, the scaler."""
        params = {n: list(p.shape) for n, p in self.engine.model.named_parameters() if p.requires_grad}
        return dict(stage=self.stage, config=vars(self.cfg), chars="".join(self.data.chars), **self.history,
                    params=params, tied=tied_names(self.engine.model), loss_scaler=vars(self.scaler))

    def log(self, step):
        """Rank 0's word on a step: at the steps log_due names, its loss and speed (a bar's figures, closed after the
        last step, or a line); a step fp16's scaler skipped gets a line. The speed: a step's tokens over the last of
        step_times (a step measured or profiled is not timed)."""
        args = self.args
        scaler = vars(self.scaler)
        tokens = args.batch_size * self.cfg.block_size
        tok_s = tokens / (self.step_times or [math.inf])[-1]
        rate = speed(self.flops, tok_s, self.world_size, self.device, args.dtype)
        fp16 = scaler["enabled"]
        if self.rank == 0 and fp16 and scaler["skipped"] > self.skipped_before and not args.no_progress:
            line = (f"{self.stage}: step {step + 1}: the fp16 gradient overflowed (on some rank), so every rank "
                    f"skipped the step; loss scale now {scaler['scale']:g}")
            self.bar.write(line) if hasattr(self.bar, "write") else print(line, flush=True)
        if not log_due(step, self.end, args):
            return
        loss = self.history["losses"][-1]
        if self.rank == 0 and hasattr(self.bar, "set_postfix"):
            scaling = dict(scale=f"{scaler['scale']:g}", skipped=scaler["skipped"]) if fp16 else {}
            mem = f"{self.measured['peak'] / 2**20:.1f}MiB"
            tflops = f"{rate['tflops_per_rank']:.3g}"
            self.bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tok_s:,.0f}", tflops=tflops, mem=mem, **scaling)
            if step + 1 == self.end:
                self.bar.close()
        elif self.rank == 0 and not args.no_progress:
            k = scaler["skipped"] if fp16 else 0
            scaling = f", loss scale {scaler['scale']:g}, {k} step{'s' * (k != 1)} skipped" if fp16 else ""
            print(f"{self.stage}: step {step + 1}/{args.steps}, loss {loss:.3f}, {tok_s:,.0f} tokens/s, "
                  f"{speed_text(rate)}{scaling}", flush=True)

def summarize(run):
    """The run's JSON summary (--out): losses, speed, and every ledger beside its formula; rank 0's, and every rank's
    model states and peak."""
    args = run.args
    cfg = run.cfg
    th = run.th
    measured = run.measured
    history = run.history
    timed = sorted(run.step_times[1:] or run.step_times)  # the first step warms up
    states = measured["states"]
    sent = measured["sent"]
    ranks = everyone((measured["states"], measured["peak"], measured["live"], measured["other"]))
    where = measured.get("where")  # measured on a GPU; on a CPU, the plan's (th["host"])
    tokens_per_s = args.batch_size * cfg.block_size / timed[len(timed) // 2] if timed else 0.0
    return dict(stage=run.stage, world_size=run.world_size,
                n_params=sum(p.numel() for p in run.engine.model.parameters()),
                padded_numel=run.engine.padded_numel, dtype=args.dtype, device=run.device.type, config=vars(cfg),
                args=vars(args), **history, val_loss=history["val_losses"][-1][1] if history["val_losses"] else None,
                steps_done=run.end, resumed_from=run.start, measured_step=run.measure_step + 1,
                unigram_loss=run.data.unigram_loss,
                tokens_per_s=tokens_per_s, **speed(run.flops, tokens_per_s, run.world_size, run.device, args.dtype),
                peak_memory_bytes=measured["peak"], live_tensor_bytes=measured["live"], data_bytes=measured["data"],
                other_tensor_bytes=measured["other"], other_named=measured["named"],
                workspace_bytes=measured.get("workspace", 0),
                pinned_host_bytes={"measured": measured["pinned"], "theory": th["pinned"]},
                disk_bytes={"measured": measured["disk"], "theory": th["disk"]},
                model_state_bytes={k: {"measured": states.get(k, 0), "theory": v,  # where: its tensors' device (GPU)
                                       "where": where.get(k) if where else "host" if k in th["host"] else "device"}
                                   for k, v in th["states"].items()},
                model_state_bytes_per_rank=[r[0] for r in ranks], peak_memory_bytes_per_rank=[r[1] for r in ranks],
                live_tensor_bytes_per_rank=[r[2] for r in ranks], other_tensor_bytes_per_rank=[r[3] for r in ranks],
                activation_checkpoints=activation_checkpoints(args, cfg, run.world_size),
                comm_bytes_per_step={"measured": sum(sent.values()), "theory": sum(th["comm"].values()),
                                     "by_collective": {k: {"measured": sent.get(k, 0.0),
                                                           "theory": th["comm"].get(k, 0.0)}
                                                       for k in sorted(set(sent) | set(th["comm"]))},
                                     # the ledger's calls, and what the process group itself saw, where it is counted
                                     **measured["counted"]},
                loss_scaler=vars(run.scaler))

def activation_checkpoints(args, cfg, world_size):
    """With --checkpoint_activations, what backward keeps of each block: its input alone, one micro-batch of this rank
    (batch_size / (N x grad_accum) sequences) x block_size x n_embd in the run's dtype; the block's own activations
    exist only while its backward runs (it runs the block's forward again first), one block at a time. None without."""
    if not getattr(args, "checkpoint_activations", False):
        return None
    micro_batch = args.batch_size // (world_size * args.grad_accum)
    return dict(blocks=cfg.n_layer, kept_per_block="the block's input: micro_batch x block_size x n_embd",
                micro_batch=micro_batch, bytes_per_block=micro_batch * cfg.block_size * cfg.n_embd
                * {"bf16": 2, "fp16": 2, "fp32": 4}[args.dtype])

def report(summary, th):
    """What a run ends with: its loss and speed, then the memory table the project is about."""
    s, val = summary, f"{summary['val_loss']:.4f}" if summary["val_loss"] is not None else "-"
    scaler = s.get("loss_scaler") or {}  # fp16's loss scaler: its scale at the end, and the steps it skipped
    k = scaler.get("skipped", 0)
    print(f"{s['stage']}: val loss {val} (unigram {s['unigram_loss']:.3f}), {s['tokens_per_s']:,.0f} tokens/s, "
          f"{speed_text(s)}"
          + (f"; fp16 loss scale {scaler['scale']:g}, {k} step{'s' * (k != 1)} skipped" if scaler.get("enabled") else ""))
    print(memory_table(s, th))
    if s.get("activation_checkpoints"):
        a = s["activation_checkpoints"]
        print(f"activations checkpointed: each of the {a['blocks']} blocks keeps only its input for backward "
              f"({a['micro_batch']} x {s['config']['block_size']} x {s['config']['n_embd']}, {a['bytes_per_block'] / 2**10:.1f} "
              f"KiB); one block's activations at a time are recomputed in backward")
    if s.get("workspace_bytes"):
        print(f"peak without cuBLAS's workspaces ({s['workspace_bytes'] / 2**20:.2f} MiB on rank 0, one per handle and "
              f"stream, kept from the first matmul): states + activations")
    if th["pinned"]:
        print(f"pinned host memory {s['pinned_host_bytes']['measured'] / 2**20:.2f} MiB (theory {th['pinned'] / 2**20:.2f}: "
              f"PyTorch rounds each pinned allocation up to a power of two)")

def finish(run, summary, sample):
    """The end of a run: the report and the files asked for (rank 0), and every rank's orderly exit. sample(master):
    the text the GPT writes with the final fp32 weights."""
    args = run.args
    stage = run.stage
    stopped = run.end < args.steps
    run.engine.state_pieces()  # the state is final: with --delayed_update the update in flight lands, or raises
    sampled = args.sample_chars and not stopped
    master = gather_master(run.engine) if args.save_master or sampled else None  # (a collective)
    if run.rank == 0:
        report(summary, run.th)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(summary, f, indent=1)
        if args.save_master:
            torch.save(master, args.save_master)
        if stopped:
            print(f"{stage}: stopped after step {run.end} of {args.steps} (--stop_after)"
                  + (f"; continue with --resume {run.ckpt_dir}" if run.ckpt_dir else ""))
        elif args.sample_chars:
            whole = 4 * summary["n_params"]  # sampling builds the whole model in fp32 on one device
            if run.device.type == "cuda" and whole > torch.cuda.mem_get_info(run.device)[0] // 2:
                print(f"{stage}: no sample: the whole fp32 model ({whole / 2**30:.1f} GiB) would not fit beside the "
                      f"run on {run.device}; consolidate a checkpoint and sample it with --sample")
            else:
                print(sample(master))
    # an engine's files (offload's state files on NVMe) go once the run is done with them
    if hasattr(run.engine, "close"):
        run.engine.close()
    if run.distributed:
        dist.barrier()
        dist.destroy_process_group()
        sys.stdout.flush(), sys.stderr.flush()
        os._exit(0)  # gloo ranks of torch 2.13 sometimes abort (SIGABRT) in their exit-time destructors
