"""Every collective a rank issues, counted where it reaches torch.distributed, whoever calls it: the ledger `comm`,
a stage that calls torch.distributed directly, a library. Python imports this file at start-up when its directory is
on PYTHONPATH (conftest.Runner puts it there for the runs of the CPU suite). torch.distributed's collective functions
are wrapped, in both namespaces a caller can import them from (torch.distributed and its distributed_c10d); each call
adds, under the ledger's name for it, one call and the bytes this rank sends with ring algorithms, as
comm.CommLedger counts its own: an all-reduce 2(N-1)/N of its tensor, a reduce-scatter (N-1)/N of its input, an
all-gather (N-1)/N of its output, anything else (N-1)/N of the tensors it is given. The counts live in
torch.distributed.sent_at_process_group (bytes) and calls_at_process_group; instruments.Run reads them on the step
it measures, beside the ledger's. A collective called inside another (all_gather_object's all_gather) is the outer
one's and is not counted again."""
import functools
import threading
from collections import defaultdict

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

# the ledger's name for each function, and which tensors it sends
LEDGER_NAMES = {"all_reduce": "all_reduce", "reduce_scatter_tensor": "reduce_scatter",
                "reduce_scatter_single": "reduce_scatter", "all_gather_into_tensor": "all_gather",
                "all_gather_single": "all_gather", "reduce_scatter": "reduce_scatter", "all_gather": "all_gather"}
OTHERS = ("broadcast", "reduce", "all_to_all_single", "all_to_all", "gather", "scatter", "send", "recv", "isend",
          "irecv", "barrier", "all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list")
dist.sent_at_process_group = defaultdict(float)
dist.calls_at_process_group = defaultdict(int)
inside = threading.local()


def tensor_bytes(x):
    """Bytes of the tensors in x: a tensor, or a list of them (anything else counts 0)."""
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(tensor_bytes(t) for t in x)
    return 0


def sent(name, args, kwargs):
    """The bytes this rank sends in collective `name` with ring algorithms, from its arguments."""
    group = kwargs.get("group")
    n = dist.get_world_size(group)
    ring = (n - 1) / n
    first = args[0] if args else next(iter(kwargs.values()), None)
    second = args[1] if len(args) > 1 else kwargs.get("input", kwargs.get("input_tensor", kwargs.get("tensor")))
    if name == "all_reduce":
        return 2 * tensor_bytes(first) * ring
    if name in ("reduce_scatter_tensor", "reduce_scatter_single", "reduce_scatter"):
        return tensor_bytes(second) * ring
    if name in ("all_gather_into_tensor", "all_gather_single", "all_gather"):
        return tensor_bytes(first) * ring
    return sum(tensor_bytes(a) for a in list(args) + list(kwargs.values())) * ring


def counted(name, real):
    @functools.wraps(real)
    def collective(*args, **kwargs):
        if getattr(inside, "depth", 0):
            return real(*args, **kwargs)
        key = LEDGER_NAMES.get(name, name)
        dist.calls_at_process_group[key] += 1
        dist.sent_at_process_group[key] += sent(name, args, kwargs)
        inside.depth = 1
        try:
            return real(*args, **kwargs)
        finally:
            inside.depth = 0
    return collective


for fname in list(LEDGER_NAMES) + list(OTHERS):
    real = getattr(c10d, fname, None) or getattr(dist, fname, None)
    if real is None:
        continue
    wrapped = counted(fname, real)
    for namespace in (dist, c10d):
        if hasattr(namespace, fname):
            setattr(namespace, fname, wrapped)
