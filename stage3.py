"""
stage3.py: ZeRO-3, stage 2 plus one idea: each rank keeps the parameters of its 1/N shard only.

Per rank, for Ψ parameters on N ranks (ZeRO paper; fp16 as bf16): model states in bytes, and elements sent per step
    P_os+g+p  bf16 parameters 2Ψ/N + bf16 gradients 2Ψ/N + (fp32 master, Adam m, Adam v) 12Ψ/N  =  16Ψ/N
    sent      per micro-step: 2 all-gathers of the parameters (forward, backward) + 1 reduce-scatter  =  3Ψ(N-1)/N

The idea: a bucket is a module's parameters, the unit of gathering. Each block of an nn.ModuleList (or each module of
`units=[...]`) is a unit, and the root takes the rest; a tied weight goes to its modules' innermost common unit
(units_of). Hooks gather a unit's parameters just before each call of its forward and its backward, prefetching the next
unit's, and free them right after (the storage resized to zero; none stays gathered across a step): a rank holds a unit
or two beyond the formula. Nor is the model ever whole: the engine makes it unit by unit (from the meta device) and
keeps its shard.

Run (gloo on CPU, NCCL with one rank per GPU; plain `python` runs a world of one, through the same code):
    torchrun --standalone --nproc_per_node 2 stage3.py --preset tiny --steps 100
"""
import torch
import torch.distributed as dist
import torch.nn as nn

from comm import comm
from options import Misuse, require
from train_gpt import AdamW, clip_coef, main, pieces_of, share_rank0s, sum_of_squares, trained
from train_gpt import Outside, before_backward, units_of

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

class ZeRO3Engine:
    """Stage 3: everything sharded; a module's parameters are gathered just before use and freed right after."""
    # main() builds the model on the meta device (shapes, no storage), and __init__ makes it bucket by bucket.
    from_meta = True

    @staticmethod
    def add_args(parser):
        parser.add_argument("--no_prefetch", action="store_true", help="gather each unit only when it is needed")

    def __init__(self, model, args, device, units=None):
        self.model, self.args = model, args
        self.world_size, self.rank = dist.get_world_size(), dist.get_rank()
        # [ZeRO-3] a bucket per unit (each ModuleList child, or each of `units`; the root last): its trained parameters
        # trained parameter -> its unit: the innermost enclosing every module that registers it (units_of)
        unit_of = units_of(model, units or [m for ml in model.modules() if isinstance(ml, nn.ModuleList) for m in ml])
        # the trained parameters, unit by unit (a unit with nothing to train gets no bucket and no hooks)
        params = list(unit_of)
        # [/ZeRO-3]
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
        # [ZeRO-3] each bucket made and broadcast; this rank keeps its shard of it, and the rest is freed
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
        # [/ZeRO-3]
        # Frozen parameters and buffers are rank 0's too (buffers are broadcast again before each forward).
        share_rank0s(model, args)
        # the fp32 master weights (and so Adam's moments) of this rank's shard of every bucket only
        self.master = self.param_shard.to(torch.float32, copy=True)  # fp32 master: this rank's shard (a copy)
        self.optimizer = AdamW(self.master, args)
        # This rank's gradient shard (ZeRO-2's 2Ψ/N of gradients). Every micro-step's reduce-scatter adds into it (stage
        # 1's received only the last), so it lives from the first backward to the step, which zeroes it.
        self.grad_shard = torch.zeros_like(self.master, dtype=params[0].dtype)
        self.in_flight = []
        # [ZeRO-3] hook every unit's forward: gather its parameters just before, free them right after
        for b in self.buckets:
            b.module.register_forward_pre_hook(lambda m, inputs, b=b: self._use(b, backward=False))
            b.module.register_forward_hook(lambda m, inputs, out, b=b: self._after_forward(b, out))
        # a parameter that leaves its unit (returned, or read outside it) keeps the unit gathered (outside.py)
        self.outside = Outside(self, model)
        # [/ZeRO-3]
        # [Prefetch] the units in the order they ran, forward and backward: which unit to gather early
        self.forward_order, self.backward_order = [], []
        # [/Prefetch]
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

    # [ZeRO-3] gather just in time (async, prefetching the next unit in the recorded order), free right after use
    def _gather(self, b):
        """Start gathering bucket b's full parameters from every rank's shard (asynchronously)."""
        # its storage is freed: neither gathered nor being gathered
        if b.param.untyped_storage().nbytes() == 0:
            b.param.untyped_storage().resize_(b.param.numel() * b.param.element_size())
            b.gather = comm.all_gather(b.param, self.param_shard[self._shard_range(b)], async_op=True)
            self.outside.order.issued(b)

    def _use(self, b, backward):
        """Bucket b runs next (forward or backward): have its parameters; prefetch the next bucket's."""
        # [Recompute] b waits for gradients, so this is its forward run again in backward (--checkpoint_activations)
        backward = backward or b.waiting > 0
        # [/Recompute]
        # b awaits no gradient: its backward is over (this output's gradient does not reach its parameters)
        if backward and not b.waiting:
            require(any(n.waiting for n in self.buckets), Misuse.OUTSIDE_BACKWARD)
            return
        self._gather(b)
        self._wait(b)
        # [Prefetch] start gathering the unit that runs next while b computes, by the order the first pass recorded;
        # in backward never one whose backward is over: it would stay gathered
        order = self.backward_order if backward else self.forward_order
        if b not in order:
            order.append(b)
        after = [n for n in order[order.index(b) + 1:] if n.waiting or not backward]
        if after and not self.args.no_prefetch:
            self._gather(after[0])
        # [/Prefetch]

    def _wait(self, b):  # b's all-gather in flight, if any, has landed
        if b.gather is not None:
            b.gather.wait()
            b.gather = None

    def _free(self, b):
        self._wait(b)
        b.param.untyped_storage().resize_(0)

    def _after_forward(self, b, out):
        """Free b's parameters; if backward will come, gather them again just before it."""
        # [Recompute] b's recompute, in its backward: keep its parameters for that backward (_grad_ready frees them)
        if b.waiting:
            return
        # [/Recompute]
        # autograd's saved views of the parameters share the bucket's storage: they are freed too; but a parameter that
        # left b (in its output, or read outside it) keeps b gathered for its reader until b's backward is done
        self.outside.free_unless_kept(b, out)
        before_backward(out, lambda: self._use(b, backward=True))
    # [/ZeRO-3]

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
            # reduce-scatter the complete bucket into b.reduced (async); release the bucket reduced before it
            b.reduced = torch.empty_like(self._my_shard_of(b.grad))  # gets this rank's shard of the bucket's average
            b.work = comm.reduce_scatter(b.reduced, b.grad, op=dist.ReduceOp.AVG, async_op=True)
            self.outside.order.issued(b)
            while self.in_flight:  # by now the previous bucket's reduction is (nearly always) done: release it
                self._release(self.in_flight.pop())
            self.in_flight.append(b)

    # wait for the bucket's reduce-scatter, add b.reduced into this rank's grad_shard, free the full gradient
    def _release(self, b):
        b.work.wait()
        self.grad_shard[self._shard_range(b)] += b.reduced
        b.grad = b.reduced = b.work = None

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
        while self.in_flight:
            self._release(self.in_flight.pop())

    def step(self, lr, scaler=None):
        # This gradient is used up: the next step needs another backward.
        require(self.sync, Misuse.NO_BACKWARD)
        self.sync = False
        # the master weights never see a write to a parameter: the update would undo it
        require([p._version for p in self.bucket_of] == self.versions, Misuse.WRITTEN)
        # [ZeRO-3] no unit stays gathered across the step (a forward's prefetch may leave one): the next gathers anew
        for b in self.buckets:
            self._free(b)
        # [/ZeRO-3]
        # every rank's collectives paired the same units (outside.Order), or the run stops below, before the update
        self.outside.order.agree()
        # the global gradient norm, from every rank's shard of the gradient; AdamW on this rank's shard only
        norm = sum(sum_of_squares(self.grad_shard[self._shard_range(b)]) for b in self.buckets)
        comm.all_reduce(norm, op=dist.ReduceOp.SUM)
        norm = norm.sqrt()
        coef = clip_coef(norm, self.args.grad_clip, scaler)
        self.outside.order.check()
        # None: fp16 overflowed on some rank. The norm is global, so every rank skips this step.
        if coef is None:
            self._drop_gradient()
            return norm
        # One bucket's shard of the gradient in fp32 at a time.
        self.optimizer.step(((self._shard_range(b), self.grad_shard[self._shard_range(b)].float().mul_(coef))
                             for b in self.buckets), lr)
        self._params_from_master()
        self._drop_gradient()
        return norm

    def _params_from_master(self):
        """The model's parameters from the updated master."""
        # the updated shard, cast into this rank's parameter shard (no all-gather: gathered when next used)
        self.param_shard.copy_(self.master)

    def _drop_gradient(self):
        """The step used (or skipped) this gradient: the next one starts from zero."""
        self.grad_shard.zero_()

    # ---- for checkpoints and the ledgers; skip on a first reading ----
    def grad(self, p):
        """(lo, view): the elements [lo, lo + view.numel()) of p's averaged gradient this rank holds."""
        lo, hi, at = self.piece_of(p)
        return lo, self.grad_shard[at:at + hi - lo]

    def model_states(self):
        return {"params": [self.param_shard], "grads": [self.grad_shard],
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

if __name__ == "__main__":
    main(ZeRO3Engine, stage="stage3")
