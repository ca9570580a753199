"""
outside.py: ZeRO-3's parameters outside their unit (stage3.py, offload.py). A unit's parameters are gathered for its
forward and freed right after; but a parameter can leave its unit in the forward: returned in the unit's output
(DeepSpeed's test_ext_param_return: a linear that returns its bias for the caller to add), or read by a module outside
the unit (test_ext_param_getattr: the root's F.linear(h, self.l1.weight) after l1 ran). As DeepSpeed does with such
"external" parameters, the read gathers the unit (a read is `module.weight`: torch's Module.__getattr__ takes it from
module._parameters, which Reads replaces, as DeepSpeed's ZeROOrderedDict), and either way the unit stays gathered
until its backward is done, instead of being freed after its forward: the reader's backward needs the parameter too.
Outside engine.forward a read gathers nothing (a gather is a collective: one rank's read would hang the others), and
a freed parameter used there, or held from before a step, raises a line that names it, its unit and the fix
(Sharded), where torch would read freed memory or fail naming nothing. A view made of a parameter (a module that keeps
`self.weight.t()` from its forward) shares the bucket's storage, and so its freeing: torch makes it a ParamView, which
is read as its parameter is (in engine.forward, outside its unit, it gathers the unit; elsewhere, freed, it raises).
A unit's all-gather pairs with whatever the other ranks gather at that moment: if ranks run units in different orders (a
mixture of experts whose experts run in a data-dependent order), their collectives pair different units. Each rank
hashes the units of its collectives in the order issued, and the ranks compare the hashes at each step, before the
update (Order): a difference stops the run in one line naming each rank's unit.
"""
import dataclasses

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.utils._pytree

from comm import comm

FREED = ("{} is freed: ZeRO-3 keeps only this rank's shard of it outside its unit's forward and backward; read it "
         "through its module (module.weight) inside engine.forward, which gathers it, or its trained values with "
         "checkpoint.gather_master(engine)")
# what a freed parameter still answers (its shape, its dtype, where it lives, its hooks), never its values
METADATA = {"__get__", "__set__", "__hash__", "numel", "size", "dim", "stride", "storage_offset", "untyped_storage",
            "element_size", "is_contiguous", "is_pinned", "data_ptr", "requires_grad_", "register_hook",
            "register_post_accumulate_grad_hook"}

ORDER = ("the ranks' collectives paired different units ({}): ZeRO-3 gathers a unit when a rank reaches it, so every "
         "rank must run its units in one order; make the module that calls them in a data-dependent order one unit "
         "(units=[{}]), gathered whole")

def guarded(func, args, kwargs):
    """func on ZeRO-3 parameters and their views: a freed one is read first (Outside._read: in engine.forward and
    outside its unit, the unit is gathered), and raises FREED if it stays freed; a tensor out that shares a parameter's
    storage (a view: p.t(), p[0], p.detach()) becomes a ParamView of that parameter."""
    kwargs = kwargs or {}
    with torch._C.DisableTorchFunctionSubclass():  # as nn.Parameter: plain tensors out, and no recursion here
        if getattr(func, "__name__", None) in METADATA:
            return func(*args, **kwargs)
        ins = [x for a in (*args, *kwargs.values()) for x in (a if isinstance(a, (list, tuple)) else [a])]
        # each guarded tensor in, and the parameter it is or views
        params = [(t, t if type(t) is Sharded else t.param) for t in ins if isinstance(t, (Sharded, ParamView))]
        for t, p in params:
            if t.numel() and not t.untyped_storage().nbytes():
                p.outside._read(p)
            if t.numel() and not t.untyped_storage().nbytes():
                raise RuntimeError(FREED.format(p.where))
        out = func(*args, **kwargs)
        for o in out if isinstance(out, (list, tuple)) else [out]:
            # a view (p.t(), p[0], p.detach()) shares its parameter's storage: the same storage object (_cdata)
            if type(o) is torch.Tensor:
                storage = o.untyped_storage()._cdata
                for t, p in params:
                    if storage == t.untyped_storage()._cdata:
                        o.__class__ = ParamView
                        o.param = p
        return out

class Sharded(nn.Parameter):
    """A ZeRO-3 engine's trained parameter: an nn.Parameter that, used while freed (its bucket's storage resized to
    zero bytes, its sizes kept), raises FREED naming itself (its `where`), unless engine.forward reads it outside its
    unit, which gathers it (`outside`: the engine's Outside)."""
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return guarded(func, args, kwargs)

class ParamView(torch.Tensor):
    """A view of a Sharded parameter (`param`), made by torch on its bucket's storage: used, it is guarded as its
    parameter is."""
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return guarded(func, args, kwargs)

class Reads(dict):
    """A module's _parameters that tells on_read(p) of each read of a parameter by attribute (module.weight)."""
    def __init__(self, params, on_read):
        super().__init__(params)
        self.on_read = on_read

    def __getitem__(self, name):
        p = super().__getitem__(name)
        self.on_read(p)
        return p

def leaves(out):
    """The tensors of a forward's output of any structure: torch's pytree walk (dicts, lists, tuples, namedtuples, as
    FSDP2 walks them), and into dataclasses, which pytree keeps whole unless registered with it."""
    found = torch.utils._pytree.tree_leaves(out)
    fields = [[getattr(t, f.name) for f in dataclasses.fields(t)] for t in found
              if dataclasses.is_dataclass(t) and not isinstance(t, type)]
    return [t for t in found + torch.utils._pytree.tree_leaves(fields) if isinstance(t, torch.Tensor)]

class Outside:
    """One ZeRO-3 engine's watch on its parameters leaving their units (the engine's buckets, bucket_of, _gather,
    _wait). A bucket a parameter left in this forward is `kept`: gathered until its backward frees it (_grad_ready)."""
    def __init__(self, engine, model):
        self.engine = engine
        self.model = model
        self.bucket = {id(p): b for p, b in engine.bucket_of.items()}  # id(parameter) -> its bucket
        self.running = {}  # module -> how many of its forwards are running now (the root's: engine.forward)
        self.kept = set()
        names = {m: name or "the root" for name, m in model.named_modules()}
        for name, p in model.named_parameters():
            if id(p) in self.bucket:
                p.__class__ = Sharded
                p.where = f"{name} of unit {names[self.bucket[id(p)].module]}"
                p.outside = self
        for m in model.modules():
            m._parameters = Reads(m._parameters, self._read)
        for m in dict.fromkeys([*(b.module for b in engine.buckets), model]):
            m.register_forward_pre_hook(lambda m, inputs: self._count(m, 1))
            m.register_forward_hook(lambda m, inputs, out: self._count(m, -1), always_call=True)
        # each forward starts with no bucket kept (the last one's kept buckets were freed by their backward)
        model.register_forward_pre_hook(lambda m, inputs: self.kept.clear())
        self.order = Order(engine, model, names)

    def _count(self, m, n):
        self.running[m] = self.running.get(m, 0) + n

    def _read(self, p):
        """p is read: in engine.forward and outside p's unit, gather the unit now and keep it."""
        b = self.bucket.get(id(p))
        if b is not None and self.running.get(self.model) and not self.running.get(b.module):
            self.engine._gather(b)
            self.engine._wait(b)
            self.kept.add(b)

    def free_unless_kept(self, b, out):
        """After b's forward: free b (engine._free), unless one of its parameters (or a view of one) is in the
        forward's output `out` or was read outside b in this forward: then b stays gathered until its backward."""
        if any(t is p or t._base is p for t in leaves(out) for p in b.params):
            self.kept.add(b)
        if b not in self.kept:
            self.engine._free(b)

class Order:
    """The units of one rank's collectives (all-gathers, reduce-scatters) since the last step, in the order it issued
    them (issued(b)); agree(), at step() before the norm, compares them across the ranks: one all-reduce (MAX) of a
    hash and its negative, two float64 scalars, copied to the host behind it (pinned with CUDA: no host sync). check(),
    once the host has waited for the norm (clip_coef), reads them: a difference stops every rank with ORDER before the
    update, naming each rank's unit at the first collective where they differ."""
    def __init__(self, engine, model, names):
        self.model = model
        self.index = {b: k for k, b in enumerate(engine.buckets)}
        self.names = [names[b.module] for b in engine.buckets]
        self.device = engine.buckets[0].param.device
        self.units = []
        self.checked = []
        # the result on the host: with CUDA a pinned buffer the copy fills without a host sync; on a CPU a list
        # (a world of one has nothing to compare)
        self.seen = None
        if dist.get_world_size() > 1 and self.device.type == "cuda":
            self.seen = torch.zeros(2, dtype=torch.float64, pin_memory=True)

    def issued(self, b):
        self.units.append(self.index[b])

    def agree(self):
        self.checked = self.units
        self.units = []
        if dist.get_world_size() == 1:
            return
        h = float(hash(tuple(self.checked)) % 2**52)
        extremes = torch.full((2,), h, dtype=torch.float64, device=self.device)
        extremes[1:].neg_()
        comm.all_reduce(extremes, op=dist.ReduceOp.MAX)
        if self.device.type == "cuda":
            self.seen.copy_(extremes, non_blocking=True)
        else:
            self.seen = extremes.tolist()

    def check(self, explain=True):
        """ORDER if the ranks' collectives differed; explain: each rank's unit named (a collective, so the training
        thread's only), else this rank's own order (--delayed_update's thread)."""
        if dist.get_world_size() == 1:
            return
        high, low = self.seen.tolist() if self.device.type == "cuda" else self.seen
        if high == -low:
            return
        units = self.checked
        if not explain:
            own = ", ".join(self.names[u] for u in units[:8])
            raise RuntimeError(ORDER.format(f"this rank's first: {own}", self.caller([self.names[u] for u in units])))
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, units)
        k = next(k for k in range(max(map(len, every)) + 1) if len({tuple(u[k:k + 1]) for u in every}) > 1)
        seen = [self.names[u[k]] if k < len(u) else "none" for u in every]
        pairs = ", ".join(f"rank {r}: {name}" for r, name in enumerate(seen))
        raise RuntimeError(ORDER.format(f"collective {k} of the step, {pairs}", self.caller(seen)))

    def caller(self, names):
        """The name of the module that holds the units named: their longest common prefix, above a ModuleList."""
        parts = [name.split(".") for name in names if name not in ("none", "the root")]
        common = []
        for level in zip(*parts):
            if len(set(level)) > 1:
                break
            common.append(level[0])
        while common and isinstance(self.model.get_submodule(".".join(common)), nn.ModuleList):
            common.pop()
        return "model." + ".".join(common) if common else "model"
