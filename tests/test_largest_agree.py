"""bench/largest.py at N > 1: the ranks take every decision together, so none enters a collective the others skip.
Two ranks search stage 0's largest GPT (--quick's 24 MiB, 128 wide, fp32) while rank 1 alone meets trouble: it runs
out of memory building GPTs of 4 layers or more, or its clock runs 1000x fast (its probes "take" 1000x longer), or it
runs out of memory in a training step, where rank 0 waits for it in a collective. Both ranks end with the same row;
the last ends the run with one line from rank 1. A hang fails the test at a deadline far above a run's length."""
import argparse
import json
import os
import sys
import time

import pytest
import torch
import torch.multiprocessing as mp

from conftest import ROOT

sys.path.insert(0, str(ROOT / "bench"))
import largest  # noqa: E402

DEADLINE = 240  # seconds: a run takes well under a minute on 2 cores; a hang never ends


def search_rank(local_rank, world_size, port, out_dir, trouble):
    """On each rank: the search for stage 0's largest depth, as bench/largest.py's worker runs it, with rank 1's
    trouble patched in; each rank writes the row it ends with."""
    os.environ.update(RANK=str(local_rank), LOCAL_RANK=str(local_rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch.distributed as dist
    import train_gpt
    from devices import init_distributed
    rank, world_size, device = init_distributed(argparse.Namespace(device="cpu"))
    if rank == 1 and trouble == "out of memory building":
        build_model = train_gpt.build_model

        def build_or_fail(Engine, cfg, *args, **kwargs):
            if cfg.n_layer >= 4:
                raise torch.OutOfMemoryError("out of memory on rank 1 alone (the test's)")
            return build_model(Engine, cfg, *args, **kwargs)
        train_gpt.build_model = build_or_fail
    if rank == 1 and trouble == "slow clock":
        perf_counter = time.perf_counter
        time.perf_counter = lambda: 1000 * perf_counter()
    if rank == 1 and trouble == "out of memory training":
        def fail(*args, **kwargs):
            raise torch.OutOfMemoryError("out of memory on rank 1 alone (the test's)")
        train_gpt.train_step = fail
    opts = argparse.Namespace(budget_mb=24, n_embd=128, n_head=4, block_size=64, micro_batch=1, dtype="fp32",
                              host_budget_mb=None, probe_seconds=60, checkpoint_activations=False, limit="device",
                              nvme_path=None)
    row = largest.Prober(opts, rank, world_size, device).search("stage0")
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(row, f)
    dist.barrier()
    dist.destroy_process_group()


def run_ranks(trouble, out_dir, world_size=2):
    """Start the ranks and wait for them, at most DEADLINE seconds; return each rank's row."""
    from devices import free_port
    context = mp.start_processes(search_rank, args=(world_size, free_port(), str(out_dir), trouble),
                                 nprocs=world_size, start_method="spawn", join=False)
    start = time.monotonic()
    try:
        while not context.join(timeout=2):
            assert time.monotonic() - start < DEADLINE, f"{trouble}: the ranks still ran after {DEADLINE} s: a hang"
    finally:
        for process in context.processes:  # (after a failed assertion: the ranks this test started)
            if process.is_alive():
                process.kill()
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(world_size)]


def test_one_rank_out_of_memory_building_ends_the_probe_on_both(tmp_path):
    """Depth 5 (the prediction) and 4 fail on rank 1 alone, while building the GPT: both ranks call them "does not
    fit" and settle on 3 layers, whose GPT fits on both."""
    rows = run_ranks("out of memory building", tmp_path)
    assert rows[0] == rows[1], rows
    assert rows[0]["largest_layers"] == 3 and rows[0]["limit"] == "device memory", rows[0]


def test_one_rank_slow_clock_stops_both_searches(tmp_path):
    """Rank 1's clock says the first probe (5 layers, which fits) took over --probe_seconds; rank 0's says it did not.
    Both stop searching deeper there, with "time" for the limit."""
    rows = run_ranks("slow clock", tmp_path)
    assert rows[0] == rows[1], rows
    assert rows[0]["largest_layers"] == 5 and rows[0]["limit"] == "time" and rows[0]["probes"] == 1, rows[0]


def test_one_rank_out_of_memory_in_a_step_ends_the_run_with_its_line(tmp_path, capfd):
    """Rank 1 runs out of memory in its first training step while rank 0 waits for it in the step's all-reduce: no
    agreement can reach rank 0 there, so rank 1 ends the run with one line, and torch.multiprocessing stops rank 0."""
    with pytest.raises(mp.ProcessExitedException) as stopped:
        run_ranks("out of memory training", tmp_path)
    assert stopped.value.error_index == 1 and stopped.value.exit_code == 1, stopped.value
    err = capfd.readouterr().err
    assert "largest: rank 1 ran out of device memory in stage0's engine or steps at 5 layers" in err, err[-3000:]
