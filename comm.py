"""
comm.py: the collectives every stage calls, in one place. Each is torch.distributed's own call on the process group,
with two things added: the bytes this rank sends are counted (ring algorithms: an all-reduce sends 2(N-1)/N of its
tensor, a reduce-scatter (N-1)/N of its input, an all-gather (N-1)/N of its output), so that a run can print them
beside the paper's formula; and, with --timeline, each collective is timed from its call to its completion
(instruments.Timeline attaches itself as `comm.timeline`). In a world of one nothing is called: a result is a copy.

A stage writes `comm.all_reduce(t, op=dist.ReduceOp.AVG)` where it would write `dist.all_reduce(t, op=...)`.
"""
from collections import defaultdict

import torch
import torch.distributed as dist

# torch 2.13 renamed the collectives on flat tensors; an older torch has only the old names
reduce_scatter_tensor = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
all_gather_into_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def nbytes(t):
    return t.numel() * t.element_size()


class Done:
    """A world of one's collective: done when issued (its result a local copy, or nothing). Its wait() orders what
    the waiter's stream runs next after that copy, as a real collective's wait() does (with CUDA: an event)."""
    def __init__(self, t):
        self.event = None
        if t.is_cuda:
            self.event = torch.cuda.Event()
            self.event.record()

    def wait(self, timeout=None):
        if self.event is not None:
            torch.cuda.current_stream().wait_event(self.event)
        return True

    def is_completed(self):
        return True

    def get_future(self):
        future = torch.futures.Future()
        future.set_result(None)
        return future


class CommLedger:
    """The collectives the stages call, each counting the bytes this rank sends in `sent` and its calls in `calls`,
    by collective; a step's counts start from zero at begin_step and are read by take()."""
    def __init__(self):
        self.sent = defaultdict(float)
        self.calls = defaultdict(int)
        self.timeline = None  # instruments.Timeline, with --timeline
        # the counts at the last take(): the ledger's calls, and the process group's own beside its bytes
        self.taken = {}

    def begin_step(self):
        """A step begins: every count starts from zero, the ledger's and, where it is counted, the process group's."""
        self.sent.clear()
        self.calls.clear()
        for counts in self._process_group():
            counts.clear()

    def _process_group(self):
        """The process group's own counts (bytes, calls) by collective, where the runs keep them (the tests'
        tests/count_collectives wraps torch.distributed's collectives: every call, whoever makes it); else none."""
        seen = getattr(dist, "sent_at_process_group", None)
        return [seen, dist.calls_at_process_group] if seen is not None else []

    def take(self):
        """What the step has sent so far, the ledger's bytes by collective (train_step returns them); self.taken keeps
        the ledger's calls, and the process group's bytes and calls where they are counted, taken at the same moment."""
        counts = [dict(c) for c in self._process_group()]
        seen = dict(sent=counts[0], calls=counts[1]) if counts else None
        self.taken = dict(calls=dict(self.calls), process_group=seen)
        return dict(self.sent)

    def _count(self, name, sends):
        """One call of collective `name`, which sends `sends` bytes over a ring of N ranks: (N-1)/N of them go out."""
        n = dist.get_world_size()
        self.calls[name] += 1
        self.sent[name] += sends * (n - 1) / n
        return sends * (n - 1) / n

    def _average_first(self, t, op):
        """gloo's AVG sums, then divides: in fp16, the sum of N ranks' loss-scaled gradients can overflow where their
        average would not. NCCL's AVG multiplies each rank's part by 1/N before the sum (ncclAvg is its PreMulSum for
        floating-point types), and so does this, for fp16 on gloo: t, the engine's buffer that the collective spends,
        is divided in place, then summed. (Elsewhere, and in bf16 and fp32, `op` stays as it is.)"""
        if op == dist.ReduceOp.AVG and t.dtype == torch.float16 and dist.get_backend() == "gloo":
            t.div_(dist.get_world_size())
            return dist.ReduceOp.SUM
        return op

    def _issue(self, name, tensors, sent):
        """The timeline's record of a collective about to be issued, with the bytes counted; None without --timeline."""
        return self.timeline.issue(name, tensors, sent) if self.timeline is not None else None

    def _issued(self, record, work, async_op):
        """The collective's handle (timed with --timeline: its wait() is the timeline's)."""
        return self.timeline.issued(record, work, async_op) if record is not None else work

    def _alone(self, out=None, inp=None):
        """A world of one: a collective's result is its own input, so none is called or counted (on a GPU each call
        costs the host tens of microseconds, and a step calls one or more per unit). Its output, if any, is a copy."""
        if dist.get_world_size() > 1:
            return False
        if out is not None and out is not inp:
            out.copy_(inp)
        return True

    def all_reduce(self, t, op, async_op=False):
        if self._alone():
            return Done(t) if async_op else None
        sent = self._count("all_reduce", 2 * nbytes(t))
        op = self._average_first(t, op)
        record = self._issue("all_reduce", [t], sent)
        work = dist.all_reduce(t, op=op, async_op=async_op)
        return self._issued(record, work, async_op)

    def reduce_scatter(self, out, inp, op, async_op=False):
        if self._alone(out, inp):
            return Done(out) if async_op else None
        sent = self._count("reduce_scatter", nbytes(inp))
        op = self._average_first(inp, op)
        record = self._issue("reduce_scatter", [out, inp], sent)
        work = reduce_scatter_tensor(out, inp, op=op, async_op=async_op)
        return self._issued(record, work, async_op)

    def all_gather(self, out, inp, async_op=False):
        if self._alone(out, inp):
            return Done(out) if async_op else None
        sent = self._count("all_gather", nbytes(out))
        record = self._issue("all_gather", [out, inp], sent)
        work = all_gather_into_tensor(out, inp, async_op=async_op)
        return self._issued(record, work, async_op)

    def broadcast(self, t, src):
        """A model's buffers, before each forward (the GPT has none)."""
        if self._alone():
            return None
        sent = self._count("broadcast", nbytes(t))
        record = self._issue("broadcast", [t], sent)
        work = dist.broadcast(t, src=src)
        return self._issued(record, work, async_op=False)


comm = CommLedger()
