"""
bench/peers.py: each of our stages beside the torch peer that does the same job, in one run.

    stage0_ddp.py  vs  torch DistributedDataParallel + stage 0's own fp32-master AdamW step  (peer "ddp")
    stage1.py      vs  DDP + torch.distributed.optim.ZeroRedundancyOptimizer on fp32 masters (peer "zero1")
    stage2.py      vs  FSDP2 fully_shard, reshard_after_forward=False, bf16 compute/reduce     (peer "fsdp2")
    stage3.py      vs  FSDP2 fully_shard, reshard_after_forward=True                          (peer "fsdp3")

Same model, data, dtype (train_gpt's --dtype auto unless given after --), global batch and N ranks: each peer is an Engine that train_gpt.main drives through
exactly the loop, data and timing our stages use. This file is both the launcher and the worker:

    python bench/peers.py                                   # 4 pairs x 3 rounds, small preset, 25 steps, N = 2
    python bench/peers.py --pairs stage0,stage3 --rounds 5 --steps 40
    python bench/peers.py --preset tiny --steps 10 --rounds 1 -- --grad_accum 2   # after --: passed to every run
    torchrun --standalone --nproc_per_node 2 bench/peers.py --peer fsdp2 --preset small --steps 25   # one worker

The launcher interleaves the runs round-robin (ours, peer, next pair, ...; the order within a pair alternates by
round) so that machine noise hits both sides alike, then prints the median tokens/s over rounds, the ratio, and the
final losses of both (same data and recipe: they should be close).

Notes. The DDP peer steps with train_gpt's AdamW (the very step stage 0 takes), so that pair compares gradient
synchronization alone; the other peers need torch's optimizer (ZeroRedundancyOptimizer wraps an optimizer class; FSDP2
steps DTensors) and use torch.optim.AdamW(fused=True) with our hyperparameters: those pairs include the optimizer's
speed. The launcher prints a hash of every file it runs, before and after, so edits during a run are visible.
The peers' comm_bytes_per_step in their JSON counts only our own ledger (their collectives are torch's own),
so it reads 0 or the norm's scalar. ZeroRedundancyOptimizer shards the Adam moments but every rank keeps all fp32
masters (it broadcasts them after each step, in fp32): its model states are 8Ψ + 8Ψ/N, not ZeRO-1's 4Ψ + 12Ψ/N.
FSDP2 keeps fp32 sharded parameters (the masters) and fp32 sharded gradients; its bf16 working copies exist only
between its all-gathers and reshards, so "params" is reported empty at the measured point.
"""
import argparse, inspect, json, math, os, statistics, subprocess, sys, time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch
import torch.distributed as dist

import train_gpt
from results import add_flag as results_flag, publish
from train_gpt import clip_coef, main, trained


def _no_fp16(args):
    """The torch peers train in bf16 or fp32: they have no loss scaler, so an fp16 overflow would reach their update."""
    if args.dtype == "fp16":
        raise SystemExit("error: bench/peers.py: the torch peers have no fp16 loss scaler; pass -- --dtype bf16 (or fp32)")


def _broadcast_from_rank0(model):
    """main seeds each rank differently; every stage starts from rank 0's weights, so do the peers."""
    for p in model.parameters():
        dist.broadcast(p.data, src=0)


def _adamw_kwargs(args):
    """Keyword arguments for torch.optim.AdamW (fused: torch's fastest on CPU) with our recipe's hyperparameters: read
    from train_gpt.make_adamw when it exists, else from args and train_gpt.AdamW's eps."""
    if hasattr(train_gpt, "make_adamw"):
        defaults = train_gpt.make_adamw([torch.zeros(1)], args).defaults
    else:
        eps = inspect.signature(train_gpt.AdamW.__init__).parameters["eps"].default
        defaults = dict(lr=args.lr, betas=(args.beta1, args.beta2), eps=eps, weight_decay=args.weight_decay, fused=True)
    accepted = inspect.signature(torch.optim.AdamW.__init__).parameters
    return {k: v for k, v in defaults.items() if k in accepted}


def torch_adamw(params, args):
    return torch.optim.AdamW(params, **_adamw_kwargs(args))


class FlatAdamW:
    """Stage 0's optimizer on one flat fp32 master, whichever train_gpt offers: its own AdamW(param, args) with
    step(grad, lr), or (older train_gpt) make_adamw, torch's fused AdamW."""
    def __init__(self, master, args):
        self.master = master
        if hasattr(train_gpt, "AdamW"):
            self.ours = train_gpt.AdamW(master, args)
        else:
            self.ours, self.torch = None, train_gpt.make_adamw([master], args)

    def step(self, grad, lr):
        if self.ours is not None:
            return self.ours.step([(slice(None), grad)], lr)
        self.master.grad = grad
        self.torch.param_groups[0]["lr"] = lr
        self.torch.step()
        self.master.grad = None

    def moments(self):
        if self.ours is not None:
            return [self.ours.exp_avg], [self.ours.exp_avg_sq]
        st = self.torch.state.get(self.master, {})
        return ([st["exp_avg"]], [st["exp_avg_sq"]]) if st else ([], [])


def pieces(model, ranges, views):
    """(name, lo, hi, [master, m, v]) of each trained parameter, from its element range and its three views."""
    return [(name, lo, hi, [vs[i].view(-1) for vs in views])
            for i, ((name, _), (lo, hi)) in enumerate(zip(trained(model), ranges))]


class DDPPeer:
    """torch DDP (bf16 model, default 25 MB buckets), then stage 0's step: one flat fp32 master, stage 0's AdamW."""

    def __init__(self, model, args, device):
        from torch.nn.parallel import DistributedDataParallel as DDP
        _no_fp16(args)
        self.model, self.args = model, args
        self.ddp = DDP(model)  # broadcasts rank 0's parameters at construction
        self.params = list(model.parameters())
        self.padded_numel = sum(p.numel() for p in self.params)
        self.master = torch.cat([p.detach().view(-1) for p in self.params]).float()
        self.views = list(torch.split(self.master, [p.numel() for p in self.params]))
        self.master_views = [v.view_as(p) for v, p in zip(self.views, self.params)]
        self.optimizer = FlatAdamW(self.master, args)  # the same step as stage 0's
        self.micro = 0

    def forward(self, x, y):
        if not torch.is_grad_enabled():  # evaluation: no reducer involved
            return self.model(x, y)
        last = self.micro == self.args.grad_accum - 1
        self.micro += 1
        if last:  # DDP's no_sync must wrap the forward too: decide it here from the micro-step count
            return self.ddp(x, y)
        with self.ddp.no_sync():
            return self.ddp(x, y)

    def backward(self, loss, sync):
        loss.backward()  # DDP's hooks all-reduce (average) its buckets asynchronously; it waits at the end

    def step(self, lr, scaler=None):
        self.micro = 0
        grad = torch.cat([p.grad.view(-1) for p in self.params]).float()
        norm = torch.linalg.vector_norm(grad)
        self.optimizer.step(grad.mul_(clip_coef(norm, self.args.grad_clip, scaler)), lr)
        with torch.no_grad():
            torch._foreach_copy_(self.params, self.master_views)
        for p in self.params:
            p.grad = None
        return norm

    def model_states(self):
        m, v = self.optimizer.moments()
        return {"params": self.params, "grads": [p.grad for p in self.params if p.grad is not None],
                "master": [self.master], "adam_m": m, "adam_v": v}

    def state_pieces(self):
        """Every parameter whole, as stage 0 holds it: views of the flat master and moments (zeros before a step)."""
        m, v = self.optimizer.moments()
        m, v = (m[0], v[0]) if m else (torch.zeros_like(self.master), torch.zeros_like(self.master))
        return pieces(self.model, [(0, p.numel()) for p in self.params], [self.views, list(torch.split(m, [p.numel() for p in self.params])),
                      list(torch.split(v, [p.numel() for p in self.params]))])

    def resume(self, step):
        raise SystemExit("error: the torch peers take no checkpoints (--resume); run our stages for that")


class ZeroRedundancyPeer(DDPPeer):
    """DDP (bf16) + ZeroRedundancyOptimizer(AdamW) over fp32 master copies of each parameter; global-norm clipping on
    the averaged bf16 gradients; after the step (which broadcasts every shard's masters), masters cast back."""

    def __init__(self, model, args, device):
        from torch.distributed.optim import ZeroRedundancyOptimizer
        from torch.nn.parallel import DistributedDataParallel as DDP
        _no_fp16(args)
        self.model, self.args = model, args
        self.ddp = DDP(model)
        self.params = list(model.parameters())
        self.padded_numel = sum(p.numel() for p in self.params)
        self.master_views = [p.detach().float().clone() for p in self.params]
        self.optimizer = ZeroRedundancyOptimizer(self.master_views, optimizer_class=torch.optim.AdamW,
                                                 **_adamw_kwargs(args))
        owned = {id(m) for g in self.optimizer.optim.param_groups for m in g["params"]}
        self.owned = [(p, m) for p, m in zip(self.params, self.master_views) if id(m) in owned]
        self.micro = 0

    def step(self, lr, scaler=None):
        self.micro = 0
        grads = [p.grad for p in self.params]
        norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, dtype=torch.float32)))
        coef = clip_coef(norm, self.args.grad_clip, scaler)
        for p, m in self.owned:  # only this rank's shard is stepped: it alone needs fp32 gradients
            m.grad = p.grad.float().mul_(coef)
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        self.optimizer.step()  # steps the owned shard, then broadcasts every rank's updated masters
        with torch.no_grad():
            torch._foreach_copy_(self.params, self.master_views)
        for p, m in zip(self.params, self.master_views):
            p.grad = m.grad = None
        return norm

    def model_states(self):
        st = [self.optimizer.optim.state[m] for _, m in self.owned if m in self.optimizer.optim.state]
        return {"params": self.params, "grads": [p.grad for p in self.params if p.grad is not None],
                "master": self.master_views, "adam_m": [s["exp_avg"] for s in st], "adam_v": [s["exp_avg_sq"] for s in st]}

    def state_pieces(self):
        """The parameters whose optimizer state this rank owns, whole (every rank holds every master, but only these
        masters' moments)."""
        owned = {id(m) for _, m in self.owned}
        out = []
        for (name, p), m in zip(trained(self.model), self.master_views):
            if id(m) in owned:
                st = self.optimizer.optim.state.get(m, {})
                out.append((name, 0, p.numel(), [m.view(-1)] + [st[k].view(-1) if k in st else torch.zeros(p.numel())
                                                                 for k in ("exp_avg", "exp_avg_sq")]))
        return out


class FSDP2Peer:
    """FSDP2: fully_shard on each block, then the root; fp32 sharded parameters are the masters, bf16 compute and
    gradient reduction; AdamW over the DTensor parameters; clip_coef on the global norm of the sharded gradients."""
    reshard_after_forward = False

    def __init__(self, model, args, device):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        _no_fp16(args)
        self.model, self.args = model, args
        _broadcast_from_rank0(model)  # in bf16, as built: the fp32 masters then equal our stages' float(bf16) ones
        model.float()  # main builds in --dtype; FSDP2's sharded params must be fp32 to be the masters
        low = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]  # main has resolved auto by now
        mp = MixedPrecisionPolicy(param_dtype=low, reduce_dtype=low)
        # the mesh on main's device, named: unnamed, FSDP2 takes torch's accelerator, which need not be that device
        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        for block in model.blocks:
            fully_shard(block, mesh=mesh, reshard_after_forward=self.reshard_after_forward, mp_policy=mp)
        fully_shard(model, mesh=mesh, reshard_after_forward=self.reshard_after_forward, mp_policy=mp)
        self.params = list(model.parameters())
        self.padded_numel = sum(p.numel() for p in self.params)
        self.optimizer = torch_adamw(self.params, args)

    def _reshard(self):
        """Evaluation runs forward without backward: with reshard_after_forward=False the full parameters would stay
        (stale after the next step, and not DTensors). Reshard every FSDP module."""
        for m in self.model.modules():
            if hasattr(m, "reshard"):
                m.reshard()

    def forward(self, x, y):
        loss = self.model(x, y)
        if not torch.is_grad_enabled():
            self._reshard()
        return loss

    def backward(self, loss, sync):
        loss.backward()  # every micro-step reduce-scatters into the sharded fp32 gradients, as our stages 2 and 3

    def step(self, lr, scaler=None):
        local = [p.grad.to_local() for p in self.params]
        sq = torch.stack(torch._foreach_norm(local, dtype=torch.float32)).square().sum()
        dist.all_reduce(sq, op=dist.ReduceOp.SUM)  # the shards' squares: the global norm
        norm = sq.sqrt()
        torch._foreach_mul_(local, clip_coef(norm, self.args.grad_clip, scaler))
        self.optimizer.param_groups[0]["lr"] = lr
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm

    def model_states(self):
        st = [self.optimizer.state[p] for p in self.params if p in self.optimizer.state]
        return {"params": [], "grads": [p.grad.to_local() for p in self.params if p.grad is not None],
                "master": [p.to_local() for p in self.params],
                "adam_m": [s["exp_avg"].to_local() for s in st], "adam_v": [s["exp_avg_sq"].to_local() for s in st]}

    def state_pieces(self):
        """This rank's shard of each parameter: FSDP2 splits dim 0 as torch.chunk does, so rank r holds rows
        [r * ceil(rows / N), ...) and, flattened, one contiguous range of elements."""
        rank, n = dist.get_rank(), dist.get_world_size()
        out = []
        for name, p in trained(self.model):
            local = p.to_local()
            row = math.prod(p.shape[1:]) if p.dim() else 1
            lo = min(rank * -(-p.shape[0] // n), p.shape[0]) * row if p.dim() else 0
            st = self.optimizer.state.get(p, {})
            moments = [st[k].to_local().reshape(-1) if k in st else torch.zeros(local.numel()) for k in ("exp_avg", "exp_avg_sq")]
            out.append((name, lo, lo + local.numel(), [local.reshape(-1)] + moments))
        return out


class FSDP2ReshardPeer(FSDP2Peer):
    """FSDP2 with reshard_after_forward=True: parameters gathered again for backward, as ZeRO-3."""
    reshard_after_forward = True


# pair name: (our stage file, peer name, peer Engine, the stage whose formulas apply, table label)
PAIRS = {
    "stage0": ("stage0_ddp.py", "ddp", DDPPeer, "stage0", "stage0 vs DDP"),
    "stage1": ("stage1.py", "zero1", ZeroRedundancyPeer, "stage1", "stage1 vs DDP+ZeroRedundancyOptimizer"),
    "stage2": ("stage2.py", "fsdp2", FSDP2Peer, "stage2", "stage2 vs FSDP2 (reshard_after_forward=False)"),
    "stage3": ("stage3.py", "fsdp3", FSDP2ReshardPeer, "stage3", "stage3 vs FSDP2 (reshard_after_forward=True)"),
}
PEERS = {peer: (engine, formula) for _, peer, engine, formula, _ in PAIRS.values()}


# ----------------------------------------------------------------------------------------------------------
# The launcher.

def file_hashes(files):
    import hashlib
    out = {}
    for f in files:
        with open(os.path.join(ROOT, f), "rb") as fh:
            out[f] = hashlib.sha256(fh.read()).hexdigest()[:10]
    return out


def run_one(cmd, out, log, timeout):
    """One torchrun; returns (summary or None, wall seconds). Trusts the JSON file, not the exit code."""
    if os.path.exists(out):
        os.remove(out)
    t0 = time.perf_counter()
    with open(log, "w") as f:
        try:
            rc = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            rc = f"timeout after {timeout} s"
    wall = time.perf_counter() - t0
    if os.path.exists(out):
        with open(out) as f:
            return json.load(f), wall
    with open(log, errors="replace") as f:
        tail = f.read().splitlines()[-30:]
    print(f"  FAILED (exit {rc}, no {out}): {' '.join(cmd)}\n  --- last lines of {log} ---\n    "
          + "\n    ".join(tail) + "\n  ---", flush=True)
    return None, wall


def launcher():
    p = argparse.ArgumentParser(description="Our ZeRO stages vs their torch peers: tokens/s, interleaved rounds.",
                                epilog="Arguments after -- go to every run (e.g. -- --grad_accum 2).")
    p.add_argument("--preset", default="small")
    p.add_argument("--steps", type=int, default=25)
    p.add_argument("--batch_size", type=int, default=16)
    p.add_argument("--lr", type=float, default=2e-3, help="the peak learning rate; min_lr is a tenth of it")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--pairs", default=",".join(PAIRS), help=f"comma-separated, of {','.join(PAIRS)}")
    p.add_argument("--outdir", default=os.path.join(ROOT, "runs", "peers"))
    p.add_argument("--timeout", type=float, default=900, help="seconds per run")
    p.add_argument("--report_only", action="store_true", help="no runs: print the table from the JSON files in --outdir")
    results_flag(p)
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    args = p.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    pairs = [s.strip() for s in args.pairs.split(",") if s.strip()]
    bad = [s for s in pairs if s not in PAIRS]
    if bad or not pairs:
        raise SystemExit(f"error: --pairs {args.pairs}: unknown {bad}; choose from {','.join(PAIRS)}")
    os.makedirs(args.outdir, exist_ok=True)
    common = ["--preset", args.preset, "--steps", str(args.steps), "--batch_size", str(args.batch_size),
              "--lr", str(args.lr), "--min_lr", str(args.lr / 10),
              "--no_progress", "--sample_chars", "0", "--eval_every", str(10**9)] + extra
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(args.nproc)]
    results = {(s, side): [] for s in pairs for side in ("ours", "peer")}
    print(f"{len(pairs)} pair(s) x {args.rounds} round(s), --preset {args.preset} --steps {args.steps} "
          f"--batch_size {args.batch_size}, {args.nproc} ranks {' '.join(extra)}; logs and JSON in {args.outdir}", flush=True)
    t_all = time.perf_counter()
    files = ["train_gpt.py", os.path.join("bench", "peers.py")] + [PAIRS[s][0] for s in pairs]
    before = file_hashes(files)
    if args.report_only:
        for (s, side), found in results.items():
            for r in range(args.rounds):
                path = os.path.join(args.outdir, f"r{r}_{s}_{side}.json")
                if os.path.exists(path):
                    with open(path) as f:
                        found.append(json.load(f))
        return publish_table(args, pairs, results)
    for r in range(args.rounds):
        for s in pairs:
            ours, peer, _, _, _ = PAIRS[s]
            sides = [("ours", [ours]), ("peer", [os.path.join("bench", "peers.py"), "--peer", peer])]
            for side, script in (sides if r % 2 == 0 else sides[::-1]):
                name = f"r{r}_{s}_{side}"
                out, log = os.path.join(args.outdir, name + ".json"), os.path.join(args.outdir, name + ".log")
                summary, wall = run_one(torchrun + script + common + ["--out", out], out, log, args.timeout)
                if summary:
                    results[s, side].append(summary)
                    print(f"  round {r + 1}/{args.rounds} {s:6s} {side} ({summary['stage']}): {summary['tokens_per_s']:9,.0f} "
                          f"tokens/s, final loss {summary['losses'][-1]:.4f}, wall {wall:5.1f} s", flush=True)
    print(f"total wall time {time.perf_counter() - t_all:.0f} s")
    after = file_hashes(files)
    print("files run: " + ", ".join(f"{f} {h}" for f, h in before.items()))
    changed = [f for f in files if before[f] != after[f]]
    if changed:
        print(f"WARNING: edited during the benchmark: {', '.join(changed)}: rounds may mix versions")
    print()
    return publish_table(args, pairs, results)


def publish_table(args, pairs, results):
    """Print the table; with --results, write it (bench/results/peers.md), headed by the machine, torch, dtype, command."""
    text = report(pairs, results)
    if args.results:
        dtypes = sorted({x["dtype"] for runs in results.values() for x in runs}) or ["no run finished"]
        publish("peers", text, "/".join(dtypes), args.results)
    if any(not runs for runs in results.values()):
        raise SystemExit("error: a run failed (its row says which; the log is in --outdir)")


def report(pairs, results):
    """The Markdown table. Besides the ratio of the medians, the median of the per-round (paired) ratios: each round's
    two runs are neighbours in time, so on a shared, noisy machine that pairing cancels slow drifts in load."""
    lines = ["| pair | ours tokens/s | peer tokens/s | ours/peer | ratio by round (median) | TFLOP/s per rank ours / peer "
             "| final loss ours | final loss peer |",
             "|---|---:|---:|---:|---|---:|---:|---:|"]
    for s in pairs:
        ours, peer = results[s, "ours"], results[s, "peer"]
        if not ours or not peer:
            lines.append(f"| {PAIRS[s][4]} | {'failed' if not ours else ''} | {'failed' if not peer else ''} | | | | | |")
            continue
        o = statistics.median(x["tokens_per_s"] for x in ours)
        q = statistics.median(x["tokens_per_s"] for x in peer)
        ratios = [a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(ours, peer)]
        by_round = ", ".join(f"{x:.2f}" for x in ratios) + f" ({statistics.median(ratios):.2f})"
        lo = "/".join(sorted({f"{x['losses'][-1]:.4f}" for x in ours}))
        lq = "/".join(sorted({f"{x['losses'][-1]:.4f}" for x in peer}))
        # model FLOPs (instruments.flops_per_token) per second per rank, of each side's median run
        tflops = [statistics.median(x["tflops_per_rank"] for x in side) for side in (ours, peer)]
        flops = " / ".join(f"{t:.3g}" for t in tflops)
        lines.append(f"| {PAIRS[s][4]} | {o:,.0f} | {q:,.0f} | {o / q:.3f} | {by_round} | {flops} | {lo} | {lq} |")
    lines += ["", "median over rounds of each run's median step; final loss = last step's training loss (all rounds' "
              "values, deduplicated). Target: ours/peer >= 0.95."]
    text = "\n".join(lines)
    print(text)
    return text


def worker():
    i = sys.argv.index("--peer")
    name = sys.argv[i + 1] if i + 1 < len(sys.argv) else None
    if name not in PEERS:
        raise SystemExit(f"error: --peer {name}: choose from {', '.join(PEERS)}")
    del sys.argv[i:i + 2]  # main parses the rest
    if {"--ckpt_dir", "--resume", "--save_every"} & set(sys.argv):
        raise SystemExit("error: the torch peers take no checkpoints (--ckpt_dir, --resume): run our stages for that")
    engine, formula = PEERS[name]
    main(engine, stage=f"{name}_torch", formula=formula)


if __name__ == "__main__":
    worker() if "--peer" in sys.argv else launcher()
