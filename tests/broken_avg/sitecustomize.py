"""gloo's AVG as older torch had it, faked on the torch installed, for test_torch.py. Python imports this file at
start-up when its directory is on PYTHONPATH; BROKEN_AVG names the fault:
    BROKEN_AVG=reduce_scatter_sums  reduce_scatter with op=AVG sums (gloo up to torch 2.8)
    BROKEN_AVG=all_reduce_refuses   all_reduce with op=AVG raises (gloo before torch 2.8)"""
import os

fault = os.environ.get("BROKEN_AVG")
if fault == "reduce_scatter_sums":
    import torch.distributed as dist

    def summing(real):
        def reduce_scatter(output, input, op=dist.ReduceOp.SUM, *args, **kwargs):
            return real(output, input, dist.ReduceOp.SUM if op == dist.ReduceOp.AVG else op, *args, **kwargs)
        return reduce_scatter
    for name in ("reduce_scatter_single", "reduce_scatter_tensor"):
        if hasattr(dist, name):
            setattr(dist, name, summing(getattr(dist, name)))
elif fault == "all_reduce_refuses":
    import torch.distributed as dist
    all_reduce = dist.all_reduce

    def refusing(tensor, op=dist.ReduceOp.SUM, *args, **kwargs):
        if op == dist.ReduceOp.AVG:
            raise RuntimeError("Cannot use ReduceOp.AVG with Gloo")
        return all_reduce(tensor, op, *args, **kwargs)
    dist.all_reduce = refusing
elif fault:
    raise SystemExit(f"BROKEN_AVG={fault}: expected reduce_scatter_sums or all_reduce_refuses")
