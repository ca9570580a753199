"""A simulated asynchronous device, for offload.py's copies on a CPU. Python imports this file at start-up when its
directory is on PYTHONPATH (tests/test_offload.py's SIMULATED). On a CPU, offload's copies are plain and synchronous,
so a missing wait cannot show; here a copy lands only when a wait on an event that covers it comes, and reads its
source then, as a copy on a CUDA copy stream may: a missing wait, or a buffer reused before its copy has landed,
changes the numbers. Work queued on the copy stream (`with torch.cuda.stream(copies.stream)`) comes after its copies.

Every class named Copies that a stage file defines (offload.py, or a copy of it) is replaced, as it is defined, by a
subclass with the simulated stream: the stage file itself holds no test branch."""
import builtins
import contextlib

import torch

_build_class, _stream = builtins.__build_class__, torch.cuda.stream


class SimulatedStream:
    """Stands for the copy stream: entering it lands every copy queued so far."""
    def __init__(self, copies):
        self.copies = copies


def simulated(Copies):
    class SimulatedCopies(Copies):
        def __init__(self, device):
            super().__init__(device)
            assert not self.cuda, "the simulated stream stands in for CUDA on a CPU"
            self.stream = SimulatedStream(self)
            self.queued, self.landed = [], 0  # the copies not yet landed, in order; how many have landed

        def copy(self, dst, src):
            self.queued.append((dst, src))
            return dst

        def event(self):
            return self.landed + len(self.queued)

        def host_waits(self, event):
            self._land(event)

        def compute_waits(self, event):  # the copies land at once: the host itself runs the "device" work after them
            self._land(event)

        def _land(self, event):
            """The copies the event covers land now, in order, reading their sources now."""
            while event is not None and self.landed < event:
                dst, src = self.queued.pop(0)
                dst.copy_(src)
                self.landed += 1
    return SimulatedCopies


def stream(s):
    if isinstance(s, SimulatedStream):
        s.copies._land(s.copies.event())
        return contextlib.nullcontext()
    return _stream(s)


def build_class(body, name, *bases, **kwargs):
    cls = _build_class(body, name, *bases, **kwargs)
    return simulated(cls) if name == "Copies" and hasattr(cls, "copy") and hasattr(cls, "event") else cls


builtins.__build_class__ = build_class
torch.cuda.stream = stream
