"""
offload.py: ZeRO-Offload, stage 3 plus one idea: the optimizer and its states live in CPU memory.

Per rank, for Ψ parameters on N ranks (ZeRO paper; fp16 as bf16): model states in bytes, and elements sent per step
    device    bf16 parameters 2Ψ/N (0 with --offload_params) + stage 3's working set (ZeRO-Offload paper)
              + 2Ψ/N with --grad_accum > 1: the gradient shard summed over the micro-steps
              + 2Ψ/N with --delayed_update (not with --offload_params): the parameters its update writes
    host      bf16 gradients 2Ψ/N + (fp32 master, Adam m, Adam v) 12Ψ/N (+ 2Ψ/N with --offload_params: the parameters)
              + 2Ψ/N with --delayed_update: the gradient shard its update reads
    sent      what stage 3 sends; and over each rank's device-host link, 2Ψ/N down and 2Ψ/N up

The idea: each bucket's reduced gradient shard goes down to host memory (Copies) as soon as its reduce-scatter is
done, its squares summed on the device first (the global norm, without a pass over the host's copy); the step's C++
AdamW (cpu_adam.cpp, built by load_inline) updates this rank's shard there, and the new parameters go up bucket by
bucket. With CUDA the host buffers are pinned, so a copy does not block the host: it waits only where it reads what
came down. With --grad_accum > 1 the micro-steps' reduced shards are summed on the device, in grad_acc, and only the
sum goes down.

Run (gloo on CPU, NCCL with one rank per GPU; plain `python` runs a world of one, through the same code):
    torchrun --standalone --nproc_per_node 2 offload.py --preset tiny --steps 100
"""
import torch
import torch.distributed as dist
import torch.nn as nn

from comm import comm
from devices import load_cpu_adam
from options import Misuse, require
from train_gpt import AdamW, clip_coef, main, pieces_of, share_rank0s, sum_of_squares, trained
from train_gpt import Outside, before_backward, units_of

class Copies:
    """Copies between device and host memory. With CUDA the host buffers are pinned (page-locked), so a copy is queued
    on the compute stream and the host goes on; from or to pageable memory the copy would block it. Without CUDA a copy
    returns when it is done."""
    def __init__(self, device):
        self.cuda = device.type == "cuda"
        # the stream the copies are queued on: the compute stream, so they run in order with compute
        self.stream = torch.cuda.current_stream(device) if self.cuda else None

    def host(self, numel, dtype):
        """A zeroed host buffer, pinned with CUDA (zeros_like of a pinned tensor is not)."""
        return torch.zeros(numel, dtype=dtype, pin_memory=self.cuda)

    def copy(self, dst, src):  # one end from host()
        return dst.copy_(src, non_blocking=self.cuda)

    def landed(self):
        """The host waits until every copy queued so far has landed (and so may read or rewrite its ends)."""
        if self.cuda:
            self.stream.synchronize()

    def after(self, work, *spent):
        """The copies queued next wait for collective `work` (which used `spent`): on one stream, compute waits too."""
        work.wait()

    def joined(self):
        """Make what the compute stream runs next wait for every copy queued so far. On one stream it waits already;
        lesson 7's copy stream overrides this."""

# [Copy stream] with CUDA, the copies run on a stream of their own, beside compute instead of between it
class CopyStream(Copies):
    """Copies on a copy stream: each waits for the work queued so far on the compute stream; landed() waits for the
    copy stream alone, and joined() makes the compute stream wait for it (the host goes on)."""
    def __init__(self, device):
        super().__init__(device)
        self.stream = torch.cuda.Stream(device)

    def copy(self, dst, src):
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            dst.copy_(src, non_blocking=True)
        # the allocator must not hand a device end's memory out before the copy is done
        for t in [t for t in (src, dst) if t.is_cuda]:
            t.record_stream(self.stream)
        return dst

    def after(self, work, *spent):
        # the copy stream waits for the collective, and the compute stream goes on with backward; the allocator must
        # not hand out the memory the collective uses until the copy stream has passed it
        with torch.cuda.stream(self.stream):
            work.wait()
        for t in spent:
            t.record_stream(self.stream)

    def joined(self):
        torch.cuda.current_stream().wait_stream(self.stream)
# [/Copy stream]

class Bucket:
    """A module's parameters, gathered by one collective and reduced by another, with flat buffers for both, padded to
    a multiple of N: rank r owns elements [start + r*s, start + (r+1)*s) with s = (end - start) / N."""
    def __init__(self, start, module):
        # The bucket holds elements [start, end) of the flat numbering of all parameters. `waiting` counts the
        # gradients still to arrive in this backward; `work` is the bucket's collective while it is in flight.
        self.start = self.end = start
        self.module = module  # the unit
        self.params = []
        self.waiting = 0
        self.work = None
        self.grad = None  # the bucket's full gradient: exists only until reduced
        self.gather = None  # the all-gather of its parameters in flight

class ZeROOffloadEngine:
    """ZeRO-Offload: stage 3 with the gradient shard, master weights and Adam on the CPU, updated by C++ AdamW."""
    # main() builds the model on the meta device (shapes, no storage), and __init__ makes it bucket by bucket.
    from_meta = True

    @staticmethod
    def add_args(parser):
        parser.add_argument("--no_prefetch", action="store_true", help="gather each unit only when it is needed")

    def __init__(self, model, args, device, units=None):
        self.model, self.args = model, args
        self.world_size, self.rank = dist.get_world_size(), dist.get_rank()
        # a bucket per unit (each ModuleList child, or each of `units`; the root last): its trained parameters
        # trained parameter -> its unit: the innermost enclosing every module that registers it (units_of)
        unit_of = units_of(model, units or [m for ml in model.modules() if isinstance(ml, nn.ModuleList) for m in ml])
        # the trained parameters, unit by unit (a unit with nothing to train gets no bucket and no hooks)
        params = list(unit_of)
        self.buckets = [Bucket(0, unit_of[params[0]])]
        self.bucket_of = {}  # parameter -> its bucket
        self.offset = {}  # parameter -> where its elements start in its bucket
        for p in params:
            if unit_of[p] is not self.buckets[-1].module:  # the next unit: a bucket of its own
                self.buckets.append(Bucket(self._pad(self.buckets[-1]), unit_of[p]))
            b = self.buckets[-1]
            self.bucket_of[p], self.offset[p] = b, b.end - b.start
            b.params.append(p)
            b.end += p.numel()
        self.padded_numel = self._pad(self.buckets[-1])

        # Model states. Each bucket's parameters become views of one flat buffer, so one collective moves them all.
        # this rank's shard of every bucket's parameters: the only parameters it keeps
        self.param_shard = torch.empty(self.padded_numel // self.world_size, dtype=params[0].dtype, device=device)
        for b in self.buckets:
            b.param = torch.zeros(b.end - b.start, dtype=params[0].dtype, device=device)
            for p in b.params:
                # A parameter built on the meta device gets its storage, and its initial values, only here.
                if p.is_meta:
                    torch.utils.swap_tensors(p, nn.Parameter(torch.empty_like(p, device=device)))
                    model.init_weight(p)
                b.param[self.offset[p]:self.offset[p] + p.numel()].copy_(p.detach().view(-1))
                p.data = b.param[self.offset[p]:self.offset[p] + p.numel()].view_as(p)
            # Once, before training, so that every rank starts from rank 0's weights.
            dist.broadcast(b.param, src=0)
            # keep this rank's shard of the bucket, free the rest: the whole model never exists on any rank
            self.param_shard[self._shard_range(b)] = self._my_shard_of(b.param)
            b.param.untyped_storage().resize_(0)  # the storage itself, which every view of the bucket shares
        # Frozen parameters and buffers are rank 0's too (buffers are broadcast again before each forward).
        share_rank0s(model, args)
        # [Offload] in host memory: the fp32 master, Adam's moments, the gradient shard and staging (for the copies up)
        self.copies = Copies(device)
        self.master = self._host_master()
        self.optimizer = AdamW(self.master, args)
        self.grad_shard = self.copies.host(self.param_shard.numel(), params[0].dtype)
        self.staging = self.copies.host(self.param_shard.numel(), params[0].dtype)
        # --grad_accum > 1: the micro-steps' reduced shards summed in one device buffer, grad_shard's size
        self.grad_acc = torch.zeros_like(self.grad_shard, device=device) if args.grad_accum > 1 else None
        # each bucket's part of the global norm: its shard's squares, summed on the device before the shard goes down
        self.squares = torch.zeros(len(self.buckets), dtype=torch.float64, device=device)
        self.adam = load_cpu_adam(announce=self.rank == 0)
        # [/Offload]
        # [Copy stream] with CUDA, the copies on a stream of their own (the pinned buffers made above serve it too)
        if self.copies.cuda:
            self.copies = CopyStream(device)
        # [/Copy stream]
        # hook every unit's forward: gather its parameters just before, free them right after
        for b in self.buckets:
            b.module.register_forward_pre_hook(lambda m, inputs, b=b: self._use(b, backward=False))
            b.module.register_forward_hook(lambda m, inputs, out, b=b: self._after_forward(b, out))
        # a parameter that leaves its unit (returned, or read outside it) keeps the unit gathered (outside.py)
        self.outside = Outside(self, model)
        # the units in the order they ran, forward and backward: which unit to gather early
        self.forward_order, self.backward_order = [], []
        for p in params:
            p.register_post_accumulate_grad_hook(self._grad_ready)
        # sync is True from a backward(loss, sync=True) until the step that uses its gradient.
        self.sync = False
        # torch counts each parameter's in-place writes: one written outside the engine is refused (step)
        self.versions = [p._version for p in self.bucket_of]

    # the partition: pad each bucket to a multiple of N; rank r owns the r-th of N equal slices of each
    def _pad(self, b):
        """Round the bucket up to a multiple of N elements (the padding is zeros, and stays zero)."""
        b.end = -(-b.end // self.world_size) * self.world_size
        return b.end

    def _my_shard_of(self, flat):
        """This rank's shard of a bucket-sized buffer."""
        s = flat.numel() // self.world_size
        return flat[self.rank * s:(self.rank + 1) * s]

    def _shard_range(self, b):
        """Where this rank's shard of bucket b lies in the rank's flat shards (master, moments)."""
        return slice(b.start // self.world_size, b.end // self.world_size)

    # gather just in time (async, prefetching the next unit in the recorded order), free right after use
    def _gather(self, b):
        """Start gathering bucket b's full parameters from every rank's shard (asynchronously)."""
        # its storage is freed: neither gathered nor being gathered
        if b.param.untyped_storage().nbytes() == 0:
            b.param.untyped_storage().resize_(b.param.numel() * b.param.element_size())
            b.gather = comm.all_gather(b.param, self.param_shard[self._shard_range(b)], async_op=True)
            self.outside.order.issued(b)

    def _use(self, b, backward):
        """Bucket b runs next (forward or backward): have its parameters; prefetch the next bucket's."""
        # b waits for gradients, so this is its forward run again in backward (--checkpoint_activations)
        backward = backward or b.waiting > 0
        # b awaits no gradient: its backward is over (this output's gradient does not reach its parameters)
        if backward and not b.waiting:
            require(any(n.waiting for n in self.buckets), Misuse.OUTSIDE_BACKWARD)
            return
        self._gather(b)
        self._wait(b)
        # start gathering the unit that runs next while b computes, by the order the first pass recorded;
        # in backward never one whose backward is over: it would stay gathered
        order = self.backward_order if backward else self.forward_order
        if b not in order:
            order.append(b)
        after = [n for n in order[order.index(b) + 1:] if n.waiting or not backward]
        if after and not self.args.no_prefetch:
            self._gather(after[0])

    def _wait(self, b):  # b's all-gather in flight, if any, has landed
        if b.gather is not None:
            b.gather.wait()
            b.gather = None

    def _free(self, b):
        self._wait(b)
        b.param.untyped_storage().resize_(0)

    def _after_forward(self, b, out):
        """Free b's parameters; if backward will come, gather them again just before it."""
        # b's recompute, in its backward: keep its parameters for that backward (_grad_ready frees them)
        if b.waiting:
            return
        # autograd's saved views of the parameters share the bucket's storage: they are freed too; but a parameter that
        # left b (in its output, or read outside it) keeps b gathered for its reader until b's backward is done
        self.outside.free_unless_kept(b, out)
        before_backward(out, lambda: self._use(b, backward=True))

    def _grad_ready(self, p):
        """p's gradient is done: add it to its bucket; a complete bucket's reduce-scatter starts now, under backward."""
        b = self.bucket_of[p]
        # Only engine.backward arms this hook: it counts the gradients each bucket waits for.
        require(b.waiting > 0, Misuse.OUTSIDE_BACKWARD)
        # a bucket's full gradient exists only from its first gradient until it is reduced
        if b.grad is None:
            b.grad = torch.zeros_like(b.param)
        # The bucket holds the only copy of the gradient.
        b.grad[self.offset[p]:self.offset[p] + p.numel()].add_(p.grad.view(-1))
        p.grad = None
        b.waiting -= 1
        # Reduced once complete: the ranks run their units, and so complete their buckets, in one order (step() checks
        # it). Every micro-step reduces its complete buckets, so only the shard accumulates.
        if b.waiting == 0:
            # the bucket's backward is done: free its full parameters
            self._free(b)
            # reduce-scatter the complete bucket into b.reduced (async), and queue its copy down behind it at once
            b.reduced = torch.empty_like(self._my_shard_of(b.grad))  # gets this rank's shard of the bucket's average
            b.work = comm.reduce_scatter(b.reduced, b.grad, op=dist.ReduceOp.AVG, async_op=True)
            self.outside.order.issued(b)
            self._release(b)

    # [Offload] on the copies' stream, after the reduce-scatter: the last micro-step's squares and shard to the CPU
    def _release(self, b):
        self.copies.after(b.work, b.grad, b.reduced)
        where = self._shard_range(b)
        with torch.cuda.stream(self.copies.stream):  # (without CUDA the stream is None: this `with` changes nothing)
            # --grad_accum > 1: summed over the micro-steps on the device (zeroed by the step, once the sum is down)
            if self.grad_acc is not None:
                b.reduced = self.grad_acc[where].add_(b.reduced)
            if self.sync:
                self.squares[self.buckets.index(b)] = sum_of_squares(b.reduced)
                self.copies.copy(self.grad_shard[where], b.reduced)
        b.grad = b.reduced = b.work = None
    # [/Offload]

    def forward(self, *args, **kwargs):
        require({id(p) for _, p in trained(self.model)} == set(map(id, self.bucket_of)), Misuse.CHANGED)
        return self.model(*args, **kwargs)

    def backward(self, loss, sync):
        # sync is True on the step's last micro-step: its gradient will be complete, and step() may follow.
        self.sync = sync
        for b in self.buckets:
            b.waiting = len(b.params)
        loss.backward()
        # Every gradient must have come.
        require(not any(b.waiting for b in self.buckets), Misuse.NO_GRADIENT)

    def step(self, lr, scaler=None):
        # This gradient is used up: the next step needs another backward.
        require(self.sync, Misuse.NO_BACKWARD)
        self.sync = False
        # the master weights never see a write to a parameter: the update would undo it
        require([p._version for p in self.bucket_of] == self.versions, Misuse.WRITTEN)
        # no unit stays gathered across the step (a forward's prefetch may leave one): the next gathers anew
        for b in self.buckets:
            self._free(b)
        # [Offload] the global norm on the device, from the squares the buckets' shards left on their way down
        self.copies.joined()
        norm = self.squares.sum()
        comm.all_reduce(norm, op=dist.ReduceOp.SUM)  # the global norm: sum the shards' squares
        norm = norm.sqrt()
        # AdamW on the CPU (C++), and the new parameters back; the next copies down overwrite the gradient shard
        self._update(lr, norm, scaler)
        # [/Offload]
        self._drop_gradient()
        return norm

    def _update(self, lr, norm, scaler):
        """Clip by the global norm; AdamW bucket by bucket, each bucket's new parameters up while the next updates."""
        # every rank's collectives paired the same units (outside.Order), or the run stops here, before the update
        self.outside.order.agree()
        # the host reads the norm, after the copies (joined): the gradient shard has landed too
        coef = clip_coef(norm, self.args.grad_clip, scaler)
        self.outside.order.check()
        # None: fp16 overflowed on some rank. The norm is global, so every rank skips this step.
        if coef is None:
            return
        self.optimizer.t += 1
        for k, b in enumerate(self.buckets):
            # coef as a number on the host: the C++ AdamW reads no device memory
            self._adam_step(self.grad_shard, k, self._shard_range(b), self.optimizer.t, lr, float(coef))
            self._send(self._shard_range(b))
        # The next forward's gathers run after the copies up; the host goes on (the next step's read of the norm waits
        # for them too, before AdamW rewrites staging).
        self.copies.joined()

    def _params_from_master(self):
        """The model's parameters from the updated master."""
        self.param_shard.copy_(self.master)

    def _drop_gradient(self):
        """The step used (or skipped) this gradient: the sum over the next micro-steps starts from zero."""
        if self.grad_acc is not None:
            self.grad_acc.zero_()

    # [Offload] AdamW on the host, in C++
    def _host_master(self):
        """The fp32 master: a copy of this rank's parameter shard in host memory (lesson 10 puts it on disk)."""
        return self.param_shard.to("cpu", torch.float32, copy=True)

    def _adam_step(self, grad_shard, k, where, step, lr, coef):
        """C++ AdamW on bucket k's part of this rank's flat shards (the slice `where`), clipping the gradient by coef
        and writing the new parameters into staging in the same pass (the host has waited for staging's last copies
        up). Lesson 9 passes its second gradient shard; lesson 10 reads bucket k's states from disk."""
        self.adam.adam_step(self.master[where], grad_shard[where], self.optimizer.exp_avg[where],
                            self.optimizer.exp_avg_sq[where], self.staging[where], step=step, lr=lr, grad_scale=coef,
                            **self.optimizer.recipe)
    # [/Offload]

    def _send(self, where):  # staging's new parameters [where] up to the parameter shard
        self.copies.copy(self.param_shard[where], self.staging[where])

    # ---- for checkpoints and the ledgers; skip on a first reading ----
    def grad(self, p):
        """(lo, view): the elements [lo, lo + view.numel()) of p's averaged gradient this rank holds."""
        # every copy queued so far has landed: the gradient shard's too
        self.copies.landed()
        lo, hi, at = self.piece_of(p)
        return lo, self.grad_shard[at:at + hi - lo]

    def model_states(self):
        # --grad_accum > 1: the gradient shard summed on the device
        summed = {"grad_acc": [self.grad_acc]} if self.grad_acc is not None else {}
        return {"params": [self.param_shard], "grads": [self.grad_shard], **summed,
                "master": [self.master], "adam_m": [self.optimizer.exp_avg], "adam_v": [self.optimizer.exp_avg_sq]}

    def state_pieces(self):
        """This rank's training state: (name, [lo, hi) of p's elements, [master, Adam m, v views])."""
        return pieces_of(self, [self.master, self.optimizer.exp_avg, self.optimizer.exp_avg_sq])

    def piece_of(self, p):
        """The elements [lo, hi) of p (flattened) this rank holds, from `at` in its flat state."""
        b = self.bucket_of[p]
        # This rank owns elements [rank*s, (rank+1)*s) of the bucket.
        s = (b.end - b.start) // self.world_size
        lo, hi = max(self.offset[p], self.rank * s), min(self.offset[p] + p.numel(), (self.rank + 1) * s)
        return lo - self.offset[p], max(lo, hi) - self.offset[p], self._shard_range(b).start + lo - self.rank * s

    def resume(self, step):
        """A checkpoint filled this rank's master and moments: count its steps, and update the model."""
        self.optimizer.t = step
        self._params_from_master()

# main runs the newest lesson's engine: each lesson below names its own class OffloadEngine in turn
OffloadEngine = ZeROOffloadEngine

# [ZeRO-3 Offload] --offload_params: the parameter shard in CPU memory too, brought up for each gather
# ZeRO-3 Offload (ZeRO-Infinity's name) extends the engine above; without the option, each method is the one above.
class ZeRO3OffloadEngine(ZeROOffloadEngine):
    @classmethod
    def add_args(cls, parser):
        super().add_args(parser)
        parser.add_argument("--offload_params", action="store_true", help="keep the parameter shard on the CPU too "
                            "(with --grad_accum > 1 the gradient shard is summed on the device)")

    def __init__(self, model, args, device, units=None):
        super().__init__(model, args, device, units)
        if args.offload_params:
            on_host = self.copies.host(self.param_shard.numel(), self.param_shard.dtype)
            self.param_shard = on_host.copy_(self.param_shard)

    def _gather(self, b):
        if not self.args.offload_params or b.param.untyped_storage().nbytes() > 0:
            return super()._gather(b)
        b.param.untyped_storage().resize_(b.param.numel() * b.param.element_size())
        # the shard comes up, and the all-gather is issued on the copies' stream (NCCL waits for the current stream):
        # it waits for the copy, and compute only for the gather, at b.gather.wait()
        shard = torch.empty_like(self._my_shard_of(b.param))
        self.copies.copy(shard, self.param_shard[self._shard_range(b)])
        # (without CUDA the stream is None, and this `with` changes nothing)
        with torch.cuda.stream(self.copies.stream):
            b.gather = comm.all_gather(b.param, shard, async_op=True)
        self.outside.order.issued(b)

    def _send(self, where):
        if not self.args.offload_params:
            return super()._send(where)
        # the parameter shard is in CPU memory: staging's values go there, once no copy reads it
        self.copies.landed()
        self.param_shard[where].copy_(self.staging[where])
OffloadEngine = ZeRO3OffloadEngine
# [/ZeRO-3 Offload]

# [DPU] --delayed_update: step t's CPU update runs in a thread during step t+1's forward and backward
# The ZeRO-Offload paper's delayed parameter update (DPU) extends the engine above: step t's update runs in a thread
# during step t+1, sending each bucket up once its AdamW is done, into a second parameter shard that step t+2 gathers
# from (each forward from the second on runs one update old); only that thread waits for copies, on the host.
class DelayedUpdateEngine(ZeRO3OffloadEngine):
    @classmethod
    def add_args(cls, parser):
        super().add_args(parser)
        parser.add_argument("--delayed_update", action="store_true", help="run step t's CPU update during step t+1")

    def __init__(self, model, args, device, units=None):
        super().__init__(model, args, device, units)
        self.update = None  # step t's update, in flight during step t+1
        # A second gradient shard (step t's update reads one, step t+1 fills the other), a second parameter shard
        # (the update writes one, step t+1 gathers from the other; with --offload_params, staging), the norm on the
        # host, and the update's thread, beside forward and backward: AdamW leaves them a core.
        if args.delayed_update:
            self.spare_grad_shard = self.copies.host(self.grad_shard.numel(), self.grad_shard.dtype)
            if not args.offload_params:
                self.next_param_shard = torch.empty_like(self.param_shard)
            self.host_norm = self.copies.host(1, torch.float64)
            from concurrent.futures import ThreadPoolExecutor
            from devices import set_cpu_adam_threads
            self.updater = ThreadPoolExecutor(1)
            set_cpu_adam_threads(self.adam, spare=1, announce=self.rank == 0)

    def _update(self, lr, norm, scaler):
        if not self.args.delayed_update:
            return super()._update(lr, norm, scaler)
        # fp16's loss scale changes only between steps, so its skip-or-update is decided now (the host reads the
        # norm); in bf16 and fp32 the update's thread reads the norm once it is on the host
        coef = None
        if scaler is not None and scaler.enabled:
            coef = clip_coef(norm, self.args.grad_clip, scaler)
            if coef is None:  # an fp16 overflow: the update in flight is used at the next step
                return
        self._finish_update()
        self.grad_shard, self.spare_grad_shard = self.spare_grad_shard, self.grad_shard
        # the ranks' unit orders compared (read by the update's thread, which refuses to update where they differ)
        self.outside.order.agree()
        # the norm goes down behind the gradient and this step's gathers; the update's thread waits for the event after
        self.copies.copy(self.host_norm, norm.view(1))
        landed = self.copies.stream.record_event() if self.copies.cuda else None
        self.update = self.updater.submit(self._cpu_update, self.spare_grad_shard, landed, lr, coef, scaler)

    def _cpu_update(self, grad_shard, landed, lr, coef, scaler):
        """Step t's update, in its own thread: AdamW bucket by bucket, each bucket's new parameters sent up at once."""
        if landed is not None:
            landed.synchronize()
        if coef is None:
            coef = clip_coef(self.host_norm[0], self.args.grad_clip, scaler)
        self.outside.order.check(explain=False)
        self.optimizer.t += 1
        with torch.cuda.stream(self.copies.stream):  # this thread's copies queue on the copy stream alone
            for k, b in enumerate(self.buckets):
                self._adam_step(grad_shard, k, self._shard_range(b), self.optimizer.t, lr, float(coef))
                self._send(self._shard_range(b))

    def _send(self, where):
        if not self.args.delayed_update:
            return super()._send(where)
        # into the parameter shard the next step uses (with --offload_params, staging itself becomes it)
        if not self.args.offload_params:
            self.copies.copy(self.next_param_shard[where], self.staging[where])

    def _finish_update(self):
        if self.update is not None:
            update = self.update
            self.update = None
            # exception() waits for the update's thread (its copies queued, not landed); an error there stops the run
            if (e := update.exception()) is not None:
                if isinstance(e, FloatingPointError):
                    raise e
                raise SystemExit(f"error: --delayed_update's CPU update failed: {type(e).__name__}: {e}".split("\n")[0])
            # the new parameters become the ones gathered: the next gathers wait for their copies up on the device
            if self.args.offload_params:
                self.param_shard, self.staging = self.staging, self.param_shard
            else:
                self.param_shard, self.next_param_shard = self.next_param_shard, self.param_shard
            self.copies.joined()

    def model_states(self):
        states = super().model_states()
        # its second gradient shard, and its second parameter shard (on the device)
        if self.args.delayed_update:
            states["grads"].append(self.spare_grad_shard)
            if not self.args.offload_params:
                states["params"].append(self.next_param_shard)
        return states

    def state_pieces(self):
        # the update in flight lands first (a one-step shift)
        self._finish_update()
        return super().state_pieces()
OffloadEngine = DelayedUpdateEngine
# [/DPU]

# [NVMe] --offload_optimizer nvme: the optimizer states in a file, streamed through a few host buffers
# ZeRO-Infinity's NVMe tier (arXiv 2104.07857) extends the engine above: this rank's fp32 master and Adam's moments
# (12Ψ/N bytes) live in a file under --nvme_path, and host memory keeps only --nvme_buffer_count buffers of one
# bucket's states each. The update walks the buckets: while the C++ AdamW updates bucket k in its buffer, bucket k+1's
# states are read into the next and bucket k-1's are written back from the one before (nvme.py: O_DIRECT, threads).
class NVMeEngine(DelayedUpdateEngine):
    @classmethod
    def add_args(cls, parser):
        super().add_args(parser)
        parser.add_argument("--offload_optimizer", choices=["cpu", "nvme"], default="cpu", help="the states' place")
        parser.add_argument("--nvme_path", help="the directory of the state files (with --offload_optimizer nvme)")
        parser.add_argument("--nvme_buffer_count", type=int, default=3, help="3 overlaps reads and writes with AdamW")

    def _host_master(self):
        if self.args.offload_optimizer == "cpu":
            return super()._host_master()
        from nvme import DiskStates
        numels = [(b.end - b.start) // self.world_size for b in self.buckets]
        self.disk = DiskStates(self.args.nvme_path, f"rank{self.rank}", numels, self.args.nvme_buffer_count)
        # the states are made a bucket at a time in a buffer and written to the file; AdamW, given an empty master,
        # keeps the step count and recipe (as DeepSpeed's swapper leaves its optimizer's tensors empty while on disk)
        zeros = torch.zeros(()).expand(self.param_shard.numel())
        self.disk.scatter([self.param_shard, zeros, zeros])
        return torch.empty(0)

    def _adam_step(self, grad_shard, k, where, step, lr, coef):
        if self.args.offload_optimizer == "cpu":
            return super()._adam_step(grad_shard, k, where, step, lr, coef)
        # once a step, before the first bucket: a checkpoint's copy of the states in host memory (state_pieces) goes
        if k == 0:
            self.held = None
        # bucket k's states pass through buffer k % count: this read waits for that buffer's last write (nvme.py)
        master, exp_avg, exp_avg_sq = self.disk.states(k)
        # the next bucket's states come in while this one's update runs (with one buffer, after it)
        if k + 1 < len(self.buckets) and len(self.disk.buffers) > 1:
            self.disk.read(k + 1)
        self.adam.adam_step(master, grad_shard[where], exp_avg, exp_avg_sq, self.staging[where], step=step, lr=lr,
                            grad_scale=coef, **self.optimizer.recipe)
        self.disk.write(k)

    def state_pieces(self):
        if self.args.offload_optimizer == "cpu":
            return super().state_pieces()
        self._finish_update()
        # the states, read into host memory for a checkpoint (until resume() or the next update)
        self.held = self.disk.gather()
        return pieces_of(self, self.held)

    def _params_from_master(self):
        if self.args.offload_optimizer == "cpu":
            return super()._params_from_master()
        # resume(): a checkpoint has filled the states in host memory; they set the parameters, then go to disk
        self.param_shard.copy_(self.held[0])
        self.disk.scatter(self.held)
        self.held = None

    def model_states(self):
        states = super().model_states()
        # in host memory: the buffers; on disk: the states (instruments measure the file)
        if self.args.offload_optimizer == "nvme":
            states = {name: tensors for name, tensors in states.items() if name not in ("master", "adam_m", "adam_v")}
            states["nvme_buffers"] = self.disk.buffers
        return states

    def close(self):
        """The end of a run (after state_pieces(), which lands an update in flight): the state file is removed."""
        if self.args.offload_optimizer == "nvme":
            self.disk.close()
OffloadEngine = NVMeEngine
# [/NVMe]

if __name__ == "__main__":
    main(OffloadEngine, stage="offload")
