"""
stage2.py: ZeRO-2, stage 1 plus one idea: each rank keeps the gradients of its 1/N shard only.

Per rank, for Ψ parameters on N ranks (ZeRO paper; fp16 as bf16): model states in bytes, and elements sent per step
    P_os+g    bf16 parameters 2Ψ + bf16 gradients 2Ψ/N + (fp32 master, Adam m, Adam v) 12Ψ/N  =  2Ψ + 14Ψ/N
    sent      reduce-scatter of the gradients Ψ(N-1)/N per micro-step + all-gather of the parameters Ψ(N-1)/N

The idea: no full gradient survives backward. A bucket's gradient lives from its first gradient until its
reduce-scatter is done (two buckets in flight at most); its reduced shard is added into this rank's gradient shard, the
only one kept. So every micro-step communicates: --grad_accum A costs A reduce-scatters a step, where stage 1 pays one.

Run (gloo on CPU, NCCL with one rank per GPU; plain `python` runs a world of one, through the same code):
    torchrun --standalone --nproc_per_node 2 stage2.py --preset tiny --steps 100
"""
import torch
import torch.distributed as dist
import torch.nn as nn

from comm import comm
from options import Misuse, require
from train_gpt import AdamW, clip_coef, main, pieces_of, share_rank0s, sum_of_squares, trained

class Bucket:
    """A run of parameters whose gradients are reduced by one collective, with flat buffers for both, padded to
    a multiple of N: rank r owns elements [start + r*s, start + (r+1)*s) with s = (end - start) / N."""
    def __init__(self, start):
        # The bucket holds elements [start, end) of the flat numbering of all parameters. `waiting` counts the
        # gradients still to arrive in this backward; `work` is the bucket's collective while it is in flight.
        self.start = self.end = start
        self.params = []
        self.waiting = 0
        self.work = None
        self.grad = None  # the bucket's full gradient: exists only until reduced

class ZeRO2Engine:
    """Stage 2: optimizer states and gradients sharded; a bucket's gradient is freed once reduce-scattered."""
    # main() builds the model on the meta device (shapes, no storage), and __init__ makes it bucket by bucket.
    from_meta = True

    @staticmethod
    def add_args(parser):
        parser.add_argument("--bucket_mb", type=float, default=4.0, help="gradient bucket size, MB")

    def __init__(self, model, args, device):
        self.model, self.args = model, args
        self.world_size, self.rank = dist.get_world_size(), dist.get_rank()
        # Backward meets the last layers first, so the buckets are filled from the last parameter to the first.
        params = [p for _, p in trained(model)][::-1]
        # DDP's default is 25 MB (1 MB for the first); our models are small, and one bucket would overlap nothing
        bucket_numel = max(1, int(args.bucket_mb * 2**20) // params[0].element_size())
        self.buckets = [Bucket(0)]
        self.bucket_of = {}  # parameter -> its bucket
        self.offset = {}  # parameter -> where its elements start in its bucket
        for p in params:
            if self.buckets[-1].end - self.buckets[-1].start >= bucket_numel:
                self.buckets.append(Bucket(self._pad(self.buckets[-1])))
            b = self.buckets[-1]
            self.bucket_of[p], self.offset[p] = b, b.end - b.start
            b.params.append(p)
            b.end += p.numel()
        self.padded_numel = self._pad(self.buckets[-1])

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
        # Frozen parameters and buffers are rank 0's too (buffers are broadcast again before each forward).
        share_rank0s(model, args)
        # [ZeRO-1] the fp32 master weights (and so Adam's moments) of this rank's shard of every bucket only
        self.master = torch.cat([self._my_shard_of(b.param) for b in self.buckets]).float()
        # [/ZeRO-1]
        self.optimizer = AdamW(self.master, args)
        # This rank's gradient shard (ZeRO-2's 2Ψ/N of gradients). Every micro-step's reduce-scatter adds into it (stage
        # 1's received only the last), so it lives from the first backward to the step, which zeroes it.
        self.grad_shard = torch.zeros_like(self.master, dtype=params[0].dtype)
        self.in_flight = []
        for p in params:
            p.register_post_accumulate_grad_hook(self._grad_ready)
        # sync is True from a backward(loss, sync=True) until the step that uses its gradient.
        self.sync = False
        # torch counts each parameter's in-place writes: one written outside the engine is refused (step)
        self.versions = [p._version for p in self.bucket_of]

    # [ZeRO-1] the partition: pad each bucket to a multiple of N; rank r owns the r-th of N equal slices of each
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
    # [/ZeRO-1]

    def _grad_ready(self, p):
        """p's gradient is done: add it to its bucket; a complete bucket's reduce-scatter starts now, under backward."""
        b = self.bucket_of[p]
        # Only engine.backward arms this hook: it counts the gradients each bucket waits for.
        require(b.waiting > 0, Misuse.OUTSIDE_BACKWARD)
        # [ZeRO-2] a bucket's full gradient exists only from its first gradient until it is reduced
        if b.grad is None:
            b.grad = torch.zeros_like(b.param)
        # [/ZeRO-2]
        # The bucket holds the only copy of the gradient.
        b.grad[self.offset[p]:self.offset[p] + p.numel()].add_(p.grad.view(-1))
        p.grad = None
        b.waiting -= 1
        # Complete buckets are reduced in bucket order, as DDP's Reducer does: a rank that completes them in another
        # order (a data-dependent branch) must not pair its bucket's collective with another bucket on another rank.
        # Every micro-step reduces its complete buckets, so only the shard accumulates.
        while self.next_bucket < len(self.buckets) and not self.buckets[self.next_bucket].waiting:
            b = self.buckets[self.next_bucket]
            self.next_bucket += 1
            # [ZeRO-2] reduce-scatter the complete bucket into b.reduced (async); release the bucket reduced before it
            b.reduced = torch.empty_like(self._my_shard_of(b.grad))  # gets this rank's shard of the bucket's average
            b.work = comm.reduce_scatter(b.reduced, b.grad, op=dist.ReduceOp.AVG, async_op=True)
            while self.in_flight:  # by now the previous bucket's reduction is (nearly always) done: release it
                self._release(self.in_flight.pop())
            self.in_flight.append(b)
            # [/ZeRO-2]

    # [ZeRO-2] wait for the bucket's reduce-scatter, add b.reduced into this rank's grad_shard, free the full gradient
    def _release(self, b):
        b.work.wait()
        self.grad_shard[self._shard_range(b)] += b.reduced
        b.grad = b.reduced = b.work = None
    # [/ZeRO-2]

    def forward(self, *args, **kwargs):
        require({id(p) for _, p in trained(self.model)} == set(map(id, self.bucket_of)), Misuse.CHANGED)
        return self.model(*args, **kwargs)

    def backward(self, loss, sync):
        # sync is True on the step's last micro-step: its gradient will be complete, and step() may follow.
        self.sync = sync
        for b in self.buckets:
            b.waiting = len(b.params)
        self.next_bucket = 0  # the first bucket whose collective has not started
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
        # [ZeRO-1] the global gradient norm, from every rank's shard of the gradient; AdamW on this rank's shard only
        norm = sum(sum_of_squares(self.grad_shard[self._shard_range(b)]) for b in self.buckets)
        comm.all_reduce(norm, op=dist.ReduceOp.SUM)
        norm = norm.sqrt()
        coef = clip_coef(norm, self.args.grad_clip, scaler)
        # None: fp16 overflowed on some rank. The norm is global, so every rank skips this step.
        if coef is None:
            self._drop_gradient()
            return norm
        # One bucket's shard of the gradient in fp32 at a time.
        self.optimizer.step(((self._shard_range(b), self.grad_shard[self._shard_range(b)].float().mul_(coef))
                             for b in self.buckets), lr)
        # [/ZeRO-1]
        self._params_from_master()
        self._drop_gradient()
        return norm

    def _params_from_master(self):
        """The model's parameters from the updated master."""
        # [ZeRO-1] all-gather every rank's updated shard, cast to the model's dtype, into each bucket's parameters
        for b in self.buckets:
            comm.all_gather(b.param, self.master[self._shard_range(b)].to(b.param.dtype))
        # [/ZeRO-1]

    def _drop_gradient(self):
        """The step used (or skipped) this gradient: the next one starts from zero."""
        self.grad_shard.zero_()

    # ---- for checkpoints and the ledgers; skip on a first reading ----
    def grad(self, p):
        """(lo, view): the elements [lo, lo + view.numel()) of p's averaged gradient this rank holds."""
        lo, hi, at = self.piece_of(p)
        return lo, self.grad_shard[at:at + hi - lo]

    def model_states(self):
        return {"params": [b.param for b in self.buckets], "grads": [self.grad_shard],
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
    main(ZeRO2Engine, stage="stage2")
