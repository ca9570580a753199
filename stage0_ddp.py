"""
stage0_ddp.py: data parallelism by hand, the baseline every ZeRO stage improves on.

Per rank, for Ψ parameters on N ranks (ZeRO paper; fp16 as bf16): model states in bytes, and elements sent per step
    DP        bf16 parameters 2Ψ + bf16 gradients 2Ψ + (fp32 master, Adam m, Adam v) 12Ψ  =  16Ψ
    sent      all-reduce of the gradients 2Ψ(N-1)/N (a ring all-reduce: a reduce-scatter, then an all-gather)

The idea: every rank holds every model state, and the ranks average their gradients while backward runs. A hook
adds each finished gradient into its bucket (about --bucket_mb), and the bucket's all-reduce starts as soon as the
bucket is complete. With --grad_accum only the last micro-step communicates (DDP's no_sync). Every rank then runs the
same AdamW on the same averaged gradient, so the memory per rank stays the same whatever the number of ranks.
main() builds the model on the meta device (shapes, no storage), and the engine makes it a bucket at a time, in place.
ZeRO-3 needs that (DeepSpeed's zero.Init), and every stage does it alike.

Run (gloo on CPU, NCCL with one rank per GPU; plain `python` runs a world of one, through the same code):
    torchrun --standalone --nproc_per_node 2 stage0_ddp.py --preset tiny --steps 100
"""
import torch
import torch.distributed as dist
import torch.nn as nn

from comm import comm
from options import Misuse, require
from train_gpt import AdamW, clip_coef, main, pieces_of, share_rank0s, sum_of_squares, trained

class Bucket:
    """A run of parameters whose gradients are reduced by one collective, with flat buffers for both."""
    def __init__(self, start):
        # The bucket holds elements [start, end) of the flat numbering of all parameters. `waiting` counts the
        # gradients still to arrive in this backward; `work` is the bucket's collective while it is in flight.
        self.start = self.end = start
        self.params = []
        self.waiting = 0
        self.work = None

class DDPEngine:
    """Stage 0: every rank holds everything; gradient buckets are all-reduced during backward."""
    # main() builds the model on the meta device (shapes, no storage), and __init__ makes it bucket by bucket.
    from_meta = True

    @staticmethod
    def add_args(parser):
        parser.add_argument("--bucket_mb", type=float, default=4.0, help="gradient bucket size, MB")

    def __init__(self, model, args, device):
        self.model, self.args = model, args
        self.world_size = dist.get_world_size()
        # Backward meets the last layers first, so the buckets are filled from the last parameter to the first.
        params = [p for _, p in trained(model)][::-1]
        # DDP's default is 25 MB (1 MB for the first); our models are small, and one bucket would overlap nothing
        bucket_numel = max(1, int(args.bucket_mb * 2**20) // params[0].element_size())
        self.buckets = [Bucket(0)]
        self.bucket_of = {}  # parameter -> its bucket
        self.offset = {}  # parameter -> where its elements start in its bucket
        for p in params:
            if self.buckets[-1].end - self.buckets[-1].start >= bucket_numel:
                self.buckets.append(Bucket(self.buckets[-1].end))
            b = self.buckets[-1]
            self.bucket_of[p], self.offset[p] = b, b.end - b.start
            b.params.append(p)
            b.end += p.numel()
        self.padded_numel = self.buckets[-1].end

        # Model states. Each bucket's parameters become views of one flat buffer, so one collective moves them all.
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
            b.grad = torch.zeros_like(b.param)
        # Frozen parameters and buffers are rank 0's too (buffers are broadcast again before each forward).
        share_rank0s(model, args)
        # The fp32 master weights, all of them on every rank, and so Adam's moments too.
        self.master = torch.cat([b.param for b in self.buckets]).float()
        self.optimizer = AdamW(self.master, args)
        for p in params:
            p.register_post_accumulate_grad_hook(self._grad_ready)
        # sync is True from a backward(loss, sync=True) until the step that uses its gradient.
        self.sync = False
        # torch counts each parameter's in-place writes: one written outside the engine is refused (step)
        self.versions = [p._version for p in self.bucket_of]

    # [DDP] add p's gradient into its bucket; once it is complete (and sync), start its async all-reduce (an average)
    def _grad_ready(self, p):
        """p's gradient is done: add it to its bucket; a complete bucket's all-reduce starts now, under backward."""
        b = self.bucket_of[p]
        # Only engine.backward arms this hook: it counts the gradients each bucket waits for.
        require(b.waiting > 0, Misuse.OUTSIDE_BACKWARD)
        # The bucket holds the only copy of the gradient.
        b.grad[self.offset[p]:self.offset[p] + p.numel()].add_(p.grad.view(-1))
        p.grad = None
        b.waiting -= 1
        # Complete buckets are reduced in bucket order, as DDP's Reducer does: a rank that completes them in another
        # order (a data-dependent branch) must not pair its bucket's collective with another bucket on another rank.
        while self.sync and self.next_bucket < len(self.buckets) and not self.buckets[self.next_bucket].waiting:
            b = self.buckets[self.next_bucket]
            self.next_bucket += 1
            b.work = comm.all_reduce(b.grad, op=dist.ReduceOp.AVG, async_op=True)
    # [/DDP]

    def forward(self, *args, **kwargs):
        require({id(p) for _, p in trained(self.model)} == set(map(id, self.bucket_of)), Misuse.CHANGED)
        return self.model(*args, **kwargs)

    # [DDP] run backward (communicating only if sync: no_sync before the last micro-step), then wait for every bucket
    def backward(self, loss, sync):
        # sync is True on the step's last micro-step: its gradient will be complete, and step() may follow.
        self.sync = sync
        for b in self.buckets:
            b.waiting = len(b.params)
        self.next_bucket = 0  # the first bucket whose collective has not started
        loss.backward()
        # Every gradient must have come.
        require(not any(b.waiting for b in self.buckets), Misuse.NO_GRADIENT)
        if sync:
            for b in self.buckets:
                b.work.wait()
    # [/DDP]

    def step(self, lr, scaler=None):
        # This gradient is used up: the next step needs another backward.
        require(self.sync, Misuse.NO_BACKWARD)
        self.sync = False
        # the master weights never see a write to a parameter: the update would undo it
        require([p._version for p in self.bucket_of] == self.versions, Misuse.WRITTEN)
        # Every rank holds the whole averaged gradient, and so computes the norm alone.
        norm = sum(sum_of_squares(b.grad) for b in self.buckets)
        norm = norm.sqrt()
        coef = clip_coef(norm, self.args.grad_clip, scaler)
        # None: fp16 overflowed on some rank. The norm is global, so every rank skips this step.
        if coef is None:
            self._drop_gradient()
            return norm
        # AdamW bucket by bucket: one bucket's gradient in fp32 at a time, never a copy of the whole gradient
        self.optimizer.step(((slice(b.start, b.end), b.grad.float().mul_(coef)) for b in self.buckets), lr)
        self._params_from_master()
        self._drop_gradient()
        return norm

    def _params_from_master(self):
        """The model's parameters from the updated master."""
        for b in self.buckets:
            b.param.copy_(self.master[b.start:b.end])

    def _drop_gradient(self):
        """The step used (or skipped) this gradient: the next one starts from zero."""
        for b in self.buckets:
            b.grad.zero_()

    # ---- for checkpoints and the ledgers; skip on a first reading ----
    def grad(self, p):
        """(lo, view): the elements [lo, lo + view.numel()) of p's averaged gradient this rank holds."""
        b = self.bucket_of[p]
        return 0, b.grad[self.offset[p]:self.offset[p] + p.numel()]

    def model_states(self):
        return {"params": [b.param for b in self.buckets], "grads": [b.grad for b in self.buckets],
                "master": [self.master], "adam_m": [self.optimizer.exp_avg], "adam_v": [self.optimizer.exp_avg_sq]}

    def state_pieces(self):
        """This rank's training state: (name, [lo, hi) of p's elements, [master, Adam m, v views])."""
        return pieces_of(self, [self.master, self.optimizer.exp_avg, self.optimizer.exp_avg_sq])

    def piece_of(self, p):
        """The elements [lo, hi) of p (flattened) this rank holds, from `at` in its flat state."""
        return 0, p.numel(), self.bucket_of[p].start + self.offset[p]

    def resume(self, step):
        """A checkpoint filled this rank's master and moments: count its steps, and update the model."""
        self.optimizer.t = step
        self._params_from_master()

if __name__ == "__main__":
    main(DDPEngine, stage="stage0")
