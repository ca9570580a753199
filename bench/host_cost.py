"""
bench/host_cost.py: what each engine costs the host per micro-step, where the model's compute costs nothing.

    python bench/host_cost.py --results            # N = 1, on the CPU (or --device cuda on a GPU)
    python bench/host_cost.py --rounds 1 --micro 2 --results DIR   # the CI size (tests/test_offload.py)

A GPT of many thin layers (--n_layer 48 of width 16, 8 tokens a micro-batch): its kernels take microseconds, so a
micro-step's time is the engine's own work on the host: Python, hooks, collective calls, the copies' bookkeeping. On
a GPU that host time sets the pace wherever the kernels are shorter than it (ZeRO-Offload's point is that a large
batch hides the CPU's AdamW; a host that is slow per micro-step hides nothing). Engines, one rank, fp32:
    stage 0   stage0_ddp.py                  the floor: one all-reduce per bucket
    stage 3   stage3.py                      gathers, frees and reduce-scatters per unit
    offload   offload.py                     stage 3's machinery, the copies, the C++ AdamW
    FSDP2     fully_shard per block and root, reshard_after_forward=True (bench/peers.py's peer of stage 3)
Each round times --micro optimizer steps of one micro-step each (forward, backward, step) of every engine in turn,
ours and theirs interleaved, so that machine noise hits all alike; the median over rounds is reported. The last line:
    host time per micro-step: offload / stage 0 X.XX, stage 3 / FSDP2 Y.YY
"""
import argparse, importlib, os, statistics, sys, time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for path in (str(ROOT), str(ROOT / "bench")):
    if path not in sys.path:
        sys.path.insert(0, path)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from devices import free_port, pick_device  # noqa: E402
from options import gpt_config, parse_args  # noqa: E402
from results import add_flag, publish  # noqa: E402
from train_gpt import GPTConfig, PRESETS, build_model  # noqa: E402

ENGINES = {"stage 0": ("stage0_ddp", "DDPEngine"), "stage 3": ("stage3", "ZeRO3Engine"),
           "offload": ("offload", "OffloadEngine"), "FSDP2": ("peers", "FSDP2ReshardPeer")}
MODEL = ["--preset", "tiny", "--n_layer", "48", "--n_embd", "16", "--n_head", "2", "--block_size", "8"]


def build(name, device):
    """One engine of ENGINES on a fresh thin GPT, and the micro-batch it trains on."""
    module, cls = ENGINES[name]
    Engine = getattr(importlib.import_module(module), cls)
    args = parse_args(Engine, PRESETS, GPTConfig, MODEL + ["--dtype", "fp32", "--device", device.type])
    cfg = gpt_config(args, PRESETS, GPTConfig)
    cfg.vocab_size = 32
    torch.manual_seed(0)
    engine = Engine(build_model(Engine, cfg, device, torch.float32), args, device)
    x = torch.randint(0, cfg.vocab_size, (1, cfg.block_size), device=device)
    return engine, x


def micro_steps(engine, x, count, device):
    """Seconds per micro-step over `count` optimizer steps of one micro-step each."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    for _ in range(count):
        loss = engine.forward(x, x)
        engine.backward(loss, sync=True)
        engine.step(1e-4)
    sync()
    return (time.perf_counter() - start) / count


def main():
    ap = argparse.ArgumentParser(description=__doc__.strip().split("\n")[0])
    ap.add_argument("--rounds", type=int, default=7, help="rounds of every engine in turn (the median is reported)")
    ap.add_argument("--micro", type=int, default=20, help="micro-steps per engine per round")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    add_flag(ap)
    args = ap.parse_args()
    device = pick_device(args.device, 0)
    # one thread: the kernels are microseconds, and a pool of threads would only add its own waits to the host time
    torch.set_num_threads(1)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, rank=0, world_size=1)
    engines = {name: build(name, device) for name in ENGINES}
    # a warm-up step each: the first step builds what later steps reuse (AdamW's states, recorded orders)
    for engine, x in engines.values():
        micro_steps(engine, x, 2, device)
    times = {name: [] for name in ENGINES}
    for _ in range(args.rounds):
        for name, (engine, x) in engines.items():
            times[name].append(micro_steps(engine, x, args.micro, device))
    median = {name: statistics.median(t) for name, t in times.items()}
    lines = [f"Host time per micro-step at N = 1 on {device.type} (a GPT of 48 layers of width 16, 8 tokens; one "
             f"thread), median of {args.rounds} rounds of {args.micro} micro-steps each:", "",
             "| engine | ms per micro-step | / stage 0 |", "|---|---:|---:|"]
    for name, t in median.items():
        lines.append(f"| {name} | {t * 1e3:.2f} | {t / median['stage 0']:.2f} |")
    lines += ["", f"host time per micro-step: offload / stage 0 {median['offload'] / median['stage 0']:.2f}, "
              f"stage 3 / FSDP2 {median['stage 3'] / median['FSDP2']:.2f}"]
    dist.barrier()
    dist.destroy_process_group()
    body = "\n".join(lines)
    if args.results:
        publish("host_cost", body, "fp32", args.results)
    print(body)


if __name__ == "__main__":
    main()
