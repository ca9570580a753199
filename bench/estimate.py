"""
bench/estimate.py: the model-state memory per rank of every stage, for a model of any size.

It uses train_gpt's own formulas (model_state_theory, host_categories): the numbers the stage files measure
themselves against.

    python bench/estimate.py --params 7.5e9 --world_size 64          # the ZeRO paper's worked example
    python bench/estimate.py --preset gpt2-xl --nodes 4 --gpus_per_node 8 --gpu_mem 80
    python bench/estimate.py --params 1e12 --world_size 1024 --dtype bf16
    python bench/estimate.py --check_paper                           # the paper's numbers beside ours

Model states only: bf16/fp16 parameters and gradients (2 + 2 bytes, or 4 + 4 in fp32) plus fp32 master weights and
Adam moments (12 bytes), each divided by N where the stage shards it. Not counted: activations, the temporary buffers
of collectives, stage 3's working set (the gathered parameters of the unit in use and the one prefetched), the
allocator's fragmentation, the CUDA context. Sharded stages pad Ψ to a multiple of N, as the stage files do.
ZeRO-Offload ("offload": stage 3's partitioning) keeps gradients, master weights and Adam moments in CPU memory, and
with --offload_params the parameters too: "host" is that CPU memory, per rank and per node (ranks per node x per
rank). "host used" is what a rank allocates there with CUDA: the buffers device-host copies touch (gradient shard,
a second one with --delayed_update, the staging buffer of updated parameters, the parameter shard with
--offload_params) are pinned, and PyTorch's pinned-memory cache rounds each allocation up to a power of two: up to
twice their size (instruments.pinned_theory). DeepSpeed's own estimator multiplies CPU memory by a 1.5 safety factor;
this one does not.
"""
import argparse, math, os, sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for path in (ROOT, os.path.join(ROOT, "bench")):  # the formulas; results.py, beside this file
    if path not in sys.path:
        sys.path.insert(0, path)

from results import add_flag, publish  # noqa: E402
from train_gpt import GPT, GPTConfig, PRESETS, host_categories, model_state_theory, pinned_theory  # THE formulas

STAGES = ["stage0", "stage1", "stage2", "stage3", "offload"]
PARAM_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
# ZeRO paper (arXiv 1910.02054), section 1 and Figure 1: Ψ = 7.5B, N = 64, fp16 mixed precision with Adam (K = 12).
PAPER = [(7.5e9, 64, {"stage0": 120, "stage1": 31.4, "stage2": 16.6, "stage3": 1.88}),
         (1e12, 1024, {"stage3": 15.6})]


def preset_params(preset, **overrides):
    """Ψ of the preset's GPT (tied head counted once), built on the meta device: no memory, any size."""
    import torch
    n_layer, n_head, n_embd, block_size, vocab_size = PRESETS[preset]
    cfg = GPTConfig(block_size, vocab_size, n_layer, n_head, n_embd)
    for k, v in overrides.items():
        if v is not None:
            setattr(cfg, k, v)
    if not cfg.vocab_size:  # character-level presets: the built-in corpus's alphabet, as train_gpt.main does
        from train_gpt import load_text
        cfg.vocab_size = len(set(load_text(None)))
    with torch.device("meta"):
        model = GPT(cfg)
    return sum(p.numel() for p in model.parameters())


def padded(n_params, stage, world_size):
    """The count a sharded stage partitions: Ψ rounded up to a multiple of N."""
    return n_params if stage == "stage0" else math.ceil(n_params / world_size) * world_size


def estimate(n_params, world_size, param_bytes=2, offload_params=False, gpus_per_node=None, delayed_update=False):
    """{stage: {"by_category", "device", "host", "host_used", "host_per_node", "total"}} in bytes per rank
    (host_per_node: per node; host_used: host memory allocated with CUDA, pinned buffers as PyTorch rounds them)."""
    out = {}
    for stage in STAGES:
        n = padded(int(n_params), stage, world_size)
        # the delayed update's second gradient shard, and its second parameter shard where they are on the device
        grad_shards = 1 + (delayed_update and stage == "offload")
        param_shards = 1 + (grad_shards == 2 and not offload_params)
        by_cat = model_state_theory(stage, n, world_size, param_bytes, grad_shards, param_shards=param_shards)
        on_host = host_categories(stage, offload_params)
        host = sum(v for k, v in by_cat.items() if k in on_host)
        pageable = sum(v for k, v in by_cat.items() if k in on_host and k not in ("grads", "params"))  # no copy touches them
        out[stage] = dict(by_category=by_cat, device=sum(by_cat.values()) - host, host=host,
                          host_used=pageable + pinned_theory(stage, n, world_size, param_bytes, offload_params, delayed_update),
                          host_per_node=host * (gpus_per_node or world_size), total=sum(by_cat.values()))
    return out


def bytes_per_param(world_size, param_bytes=2, offload_params=False):
    """{stage: (device, host) bytes per rank per parameter}, exact for Ψ a multiple of N: memory is linear in Ψ."""
    est = estimate(world_size, world_size, param_bytes, offload_params)  # Ψ = N: each sharded category is pb/N per param
    return {s: (r["device"] / world_size, r["host"] / world_size) for s, r in est.items()}


def largest_model(gpu_mem_bytes, world_size, param_bytes=2, offload_params=False, host_mem_bytes=None, gpus_per_node=None):
    """{stage: largest Ψ whose model states fit} in device memory (and in host memory per node, if given); None: no limit."""
    out = {}
    for stage, (dev, host) in bytes_per_param(world_size, param_bytes, offload_params).items():
        limits = [gpu_mem_bytes / dev] if dev else []
        if host_mem_bytes and host:
            limits.append(host_mem_bytes / (host * (gpus_per_node or world_size)))
        out[stage] = math.floor(min(limits)) if limits else None
    return out


def fmt_params(n):
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return str(int(n))


def report(n_params, world_size, param_bytes, offload_params, gpus_per_node, nodes, unit, gpu_mem=None, host_mem=None,
           delayed_update=False):
    scale, uname = (2**30, "GiB") if unit == "GiB" else (1e9, "GB")
    est = estimate(n_params, world_size, param_bytes, offload_params, gpus_per_node, delayed_update)
    where = (f"{nodes} node(s) x {gpus_per_node} GPU(s)" if nodes else
             f"{world_size} rank(s); host/node assumes ONE node of {world_size} ranks: give --nodes and --gpus_per_node")
    lines = [f"Model states per rank, Ψ = {n_params:,} ({fmt_params(n_params)}) parameters, N = {world_size} ({where}), "
             f"{param_bytes}-byte params/grads + 12 bytes fp32 master/Adam; in {uname} ({'2^30' if unit == 'GiB' else '1e9'} bytes)",
             "(model states only: no activations, no collective buffers, no stage-3 working set; host used: with CUDA, "
             "the staging buffer too, and each pinned buffer rounded up to a power of two)", "",
             "| stage | params | grads | master+adam_m+adam_v | device/rank | host/rank | host used/rank | host/node | total/rank |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for stage, r in est.items():
        c, on_host = r["by_category"], host_categories(stage, offload_params)
        cell = lambda v, host: f"{v / scale:,.3g}" + (" (host)" if host else "")
        name = stage + (" (+params)" if stage == "offload" and offload_params else "")
        lines.append(f"| {name} | {cell(c['params'], 'params' in on_host)} | {cell(c['grads'], 'grads' in on_host)} | "
                     f"{cell(c['master'] + c['adam_m'] + c['adam_v'], 'master' in on_host)} | {r['device'] / scale:,.3g} | "
                     f"{r['host'] / scale:,.3g} | {r['host_used'] / scale:,.3g} | {r['host_per_node'] / scale:,.3g} | "
                     f"{r['total'] / scale:,.3g} |")
    if gpu_mem:
        fit = largest_model(gpu_mem * scale, world_size, param_bytes, offload_params,
                            host_mem * scale if host_mem else None, gpus_per_node)
        lines += ["", f"Largest model whose MODEL STATES fit in {gpu_mem:g} {uname} per device"
                  + (f" and {host_mem:g} {uname} of host memory per node" if host_mem else "")
                  + f" at N = {world_size} (activations and buffers need more: a ceiling, not a promise):"]
        for stage, n in fit.items():
            lines.append(f"  {stage:8s} " + (f"{fmt_params(n):>8s} parameters ({n:,})" if n is not None else
                                             "no device limit: all model states on the host (pass --host_mem GB per node)"))
    return "\n".join(lines)


def check_paper(unit="GB"):
    """Our formulas on the paper's two worked examples, beside the paper's numbers (GB = 1e9 bytes, fp16)."""
    lines = ["ZeRO paper (arXiv 1910.02054) worked examples, fp16 (2-byte) parameters, K = 12, GB = 1e9 bytes:"]
    ok = True
    for n_params, world_size, paper in PAPER:
        est = estimate(n_params, world_size, 2)
        for stage, gb in paper.items():
            ours = est[stage]["total"] / 1e9
            good = abs(ours - gb) <= 0.051 * 10 ** math.floor(math.log10(gb))  # the paper rounds to 3 significant digits
            ok &= good
            lines.append(f"  Ψ = {fmt_params(n_params):>5s}, N = {world_size:4d}, {stage}: ours {ours:8.3f} GB, paper {gb:g} GB"
                         f"  {'ok' if good else 'MISMATCH'}")
    return ok, "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.strip().split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n".join(__doc__.strip().split("\n")[2:]))
    size = p.add_mutually_exclusive_group()
    size.add_argument("--params", type=float, help="Ψ, the parameter count (e.g. 7.5e9)")
    size.add_argument("--preset", choices=sorted(PRESETS), help="Ψ of train_gpt's GPT preset, built on the meta device")
    for k in ("n_layer", "n_head", "n_embd", "block_size", "vocab_size"):
        p.add_argument(f"--{k}", type=int, help="override the preset's (with --preset)")
    p.add_argument("--world_size", type=int, help="N, the number of ranks (or --nodes x --gpus_per_node)")
    p.add_argument("--nodes", type=int, help="nodes (N = nodes x gpus_per_node)")
    p.add_argument("--gpus_per_node", type=int, help="ranks per node (host memory per node = this x host per rank)")
    p.add_argument("--dtype", default="bf16", choices=sorted(PARAM_BYTES), help="parameters and gradients (default bf16)")
    p.add_argument("--offload_params", action="store_true", help="ZeRO-Offload also keeps the parameters' shard on the host")
    p.add_argument("--delayed_update", action="store_true", help="ZeRO-Offload's delayed update: a second gradient shard on the host")
    p.add_argument("--gpu_mem", type=float, help="device memory per rank, in GB (GiB with --gib): print the largest model that fits")
    p.add_argument("--host_mem", type=float, help="host memory per node, in GB (GiB with --gib): a limit for offload")
    p.add_argument("--gib", action="store_true", help="print GiB (2^30 bytes) instead of GB (1e9, the paper's unit)")
    p.add_argument("--check_paper", action="store_true", help="compare with the ZeRO paper's worked examples and exit")
    add_flag(p)
    a = p.parse_args(argv)
    unit = "GiB" if a.gib else "GB"
    if a.check_paper:
        ok, text = check_paper()
        print(text)
        return 0 if ok else 1
    if a.params is None and a.preset is None:
        p.error("give --params (e.g. 7.5e9) or --preset (e.g. gpt2-xl), or --check_paper")
    for name in ("world_size", "nodes", "gpus_per_node"):
        if getattr(a, name) is not None and getattr(a, name) < 1:
            p.error(f"--{name} {getattr(a, name)}: must be at least 1")
    if a.world_size and (a.nodes or a.gpus_per_node):
        if a.world_size != (a.nodes or 1) * (a.gpus_per_node or 1):
            p.error(f"--world_size {a.world_size} is not --nodes x --gpus_per_node = {(a.nodes or 1) * (a.gpus_per_node or 1)}")
    if a.nodes or a.gpus_per_node:
        nodes, gpn = a.nodes or 1, a.gpus_per_node or 1
    else:
        nodes, gpn = None, a.world_size or 1
    world_size = (nodes or 1) * gpn
    if min(world_size, gpn) < 1 or (nodes is not None and nodes < 1):
        p.error("--world_size, --nodes and --gpus_per_node must be at least 1")
    if a.params is not None:
        if a.params < 1:
            p.error("--params must be at least 1")
        if any(getattr(a, k) is not None for k in ("n_layer", "n_head", "n_embd", "block_size", "vocab_size")):
            p.error("--n_layer etc. override a --preset; with --params they mean nothing")
        n_params = int(round(a.params))
    else:
        n_params = preset_params(a.preset, n_layer=a.n_layer, n_head=a.n_head, n_embd=a.n_embd,
                                 block_size=a.block_size, vocab_size=a.vocab_size)
    text = report(n_params, world_size, PARAM_BYTES[a.dtype], a.offload_params, gpn, nodes, unit, a.gpu_mem, a.host_mem,
                  a.delayed_update)
    print(text)
    if a.results:
        publish("estimate", text, a.dtype, a.results, argv=None if argv is None else [os.path.abspath(__file__), *argv])
    return 0


if __name__ == "__main__":
    sys.exit(main())
