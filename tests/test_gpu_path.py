"""The decisions the CUDA path takes, checked on a CPU by giving them a GPU's answers: the dtype --dtype auto picks
(bf16 where the GPU computes it, else fp16 with loss scaling), the C++ AdamW's threads beside a delayed update, what
bench/largest.py refuses to run on a GPU, what bench/compare.py counts as "other" memory when the peak is the
device's alone, the measured peak without cuBLAS's workspaces, and which GPU each local rank takes. (Where tensors
live on a GPU is tests/test_fake_cuda.py's part; what a real GPU does, tests/test_gpu.py's.)"""
import sys

import pytest
import torch

from conftest import ROOT
from devices import adam_threads, pick_device, pick_dtype
from offload import load_cpu_adam

sys.path.insert(0, str(ROOT / "bench"))
import compare  # noqa: E402
import largest  # noqa: E402


@pytest.mark.parametrize("capability, dtype", [((6, 0), torch.float16), ((7, 0), torch.float16),
                                               ((7, 5), torch.float16), ((8, 0), torch.bfloat16),
                                               ((8, 9), torch.bfloat16), ((9, 0), torch.bfloat16)])
def test_auto_dtype_is_bf16_where_the_gpu_computes_it_else_fp16(monkeypatch, capability, dtype):
    """A P100 (6.0), V100 (7.0) or T4 (7.5) emulates bf16, slowly, though torch.cuda.is_bf16_supported() says yes
    there: fp16 with loss scaling, as the ZeRO papers trained on V100s. An A100 (8.0), L4 (8.9) or H100 (9.0) computes
    bf16: bf16. The reason names the GPU and its capability, and for fp16 the loss scaling."""
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Some GPU")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)  # what torch says on all of them
    picked, why = pick_dtype("auto", torch.device("cuda", 0))
    assert picked == dtype, why
    assert why.startswith(f"auto: Some GPU (compute capability {capability[0]}.{capability[1]})"), why
    assert ("fp16, with dynamic loss scaling" in why) == (dtype == torch.float16), why
    assert pick_dtype("fp16", torch.device("cuda", 0)) == (torch.float16, "--dtype fp16")  # asked for: kept


def test_delayed_update_leaves_the_rank_a_core(monkeypatch, capsys):
    """With --delayed_update the C++ AdamW runs beside forward and backward: it takes the rank's share of the cores
    less one (at least one thread), and its line says so; without, the whole share."""
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    share = adam_threads()[0]
    assert adam_threads(spare=1)[0] == max(1, share - 1)
    try:
        mod = load_cpu_adam(announce=True, spare=1)
        assert mod.threads() == max(1, share - 1)
        assert "1 left to the rank's own threads" in capsys.readouterr().out
    finally:
        assert load_cpu_adam().threads() == share  # the next engine sets its own count


def test_largest_refuses_what_only_an_out_of_memory_error_would_decide():
    """On a GPU: host states beyond the host memory available are refused (the kernel's OOM killer would end the
    process); at N > 1 a formula beyond the GPU's free memory is refused (one rank's OOM error would hang the others);
    at N = 1 the GPU's own error decides. On a CPU nothing is refused."""
    GiB = 2**30
    assert largest.refused(True, 1, 200 * GiB, 100 * GiB, 1 * GiB, 80 * GiB) == "host memory"
    assert largest.refused(True, 4, 1 * GiB, 100 * GiB, 79 * GiB, 80 * GiB) == "device memory"
    assert largest.refused(True, 1, 1 * GiB, 100 * GiB, 79 * GiB, 80 * GiB) is None
    assert largest.refused(True, 4, 1 * GiB, None, 10 * GiB, 80 * GiB) is None
    assert largest.refused(False, 4, 200 * GiB, 100 * GiB, 200 * GiB, None) is None


def test_largest_charges_offload_params_host_states():
    """The --offload_params row keeps the parameter shard in host memory too: none of its model states is charged to
    the device, and with CUDA its pinned buffers count as the pinned-memory cache allocates them (powers of two)."""
    psi, n = 3 * 2**20, 1
    assert largest.device_states("offload_params", psi, n, 2) == 0
    assert largest.device_states("offload", psi, n, 2) == 2 * psi
    bucket = 2**20  # the largest bucket's elements (only the NVMe tier's buffers depend on it)
    pinned = largest.host_states("offload_params", psi, n, 2, cuda=True, largest_bucket=bucket) - 12 * psi
    assert pinned == 3 * 2**23  # gradient shard, staging and parameter shard: 6 MiB each, rounded up to 8 MiB
    assert largest.host_states("offload_params", psi, n, 2, cuda=False, largest_bucket=bucket) == 12 * psi + 3 * 2 * psi
    # the NVMe tier: its three buffers of the largest bucket's states instead of the 12Ψ/N
    nvme = largest.host_states("offload_nvme", psi, n, 2, cuda=False, largest_bucket=bucket)
    assert nvme == largest.NVME_BUFFERS * 12 * bucket + 2 * 2 * psi


def summary(stage, device, peak, offload_params=False):
    states = {"params": 100, "grads": 100, "master": 200, "adam_m": 200, "adam_v": 200}
    return dict(stage=stage, device=device, peak_memory_bytes=peak, args=dict(offload_params=offload_params),
                model_state_bytes={k: dict(measured=v) for k, v in states.items()})


def test_compare_other_subtracts_only_what_the_peak_counts():
    """A GPU's peak is device memory: offload's host-resident states (gradients, master, moments; the parameters too
    with --offload_params) are not in it. A CPU's peak counts every state. A peak below what it must hold is an error,
    never a bar clamped to zero."""
    assert compare.other_bytes(summary("offload", "cuda", 150)) == 50
    assert compare.other_bytes(summary("offload", "cuda", 150, offload_params=True)) == 150
    assert compare.other_bytes(summary("offload", "cpu", 900)) == 100
    assert compare.other_bytes(summary("stage3", "cuda", 900)) == 100
    with pytest.raises(ValueError, match="below the model states"):
        compare.other_bytes(summary("stage3", "cuda", 150))


def test_peak_names_cublas_workspaces_apart(monkeypatch):
    """On a GPU the allocator's peak holds cuBLAS's workspaces (32 MiB per handle and stream on Hopper, more than the
    tiny presets' model states): the meter frees them after the measured step, counts what that frees as
    `workspace`, and reports the peak without it. Given a GPU's answers: 100 MiB allocated of which 64 MiB are
    workspaces, a peak of 200 MiB: 136 MiB states + activations, 64 MiB workspace. It never synchronizes."""
    from instruments import PeakMemory
    MiB = 2**20
    held = {"allocated": 100 * MiB}
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 200 * MiB)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: held["allocated"])
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: pytest.fail("the meter synchronized"))
    monkeypatch.setattr(torch._C, "_cuda_clearCublasWorkspaces", lambda: held.update(allocated=36 * MiB),
                        raising=False)
    with PeakMemory(torch.device("cuda", 0)) as meter:
        pass
    assert (meter.peak, meter.workspace) == (136 * MiB, 64 * MiB)


def test_norm_is_a_few_launches_per_bucket_on_cuda(monkeypatch):
    """train_gpt.sum_of_squares, the global norm's part per bucket: on the CPU, squares summed per block of 1M elements
    (about 4 ops a block, accurate where one fp32 sum of 124M elements is not); on CUDA, whose reductions are trees,
    one norm kernel over the whole bucket, a handful of ops in all. A tensor is made to say it is on CUDA; the ops
    dispatched are counted. (That kernel's accuracy is CUDA's tree reduction's, which no CPU shows: here the CPU's
    norm kernel runs it, 1.3e-4 off at 3M elements, so only the formula is checked, to 1e-3.)"""
    from torch.utils._python_dispatch import TorchDispatchMode
    from train_gpt import sum_of_squares

    class Count(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.ops += 1
            return func(*args, **(kwargs or {}))

    t = torch.randn(3 << 20, generator=torch.Generator().manual_seed(0))
    exact = t.double().square().sum().item()
    with Count():
        on_cpu = sum_of_squares(t)
    cpu_ops, Count.ops = Count.ops, 0
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    with Count():
        on_cuda = sum_of_squares(t)
    assert Count.ops <= 5 and cpu_ops >= 12, (Count.ops, cpu_ops)
    assert abs(on_cpu.item() - exact) <= 1e-6 * exact and abs(on_cuda.item() - exact) <= 1e-3 * exact


def test_each_local_rank_takes_its_gpu_and_one_too_many_is_refused(monkeypatch):
    """On a node of 2 GPUs local rank r takes cuda:r; local rank 2 has none, and is refused in one line that names
    the node's count; --device cpu takes the host whatever the rank."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert [pick_device("auto", r) for r in (0, 1)] == [torch.device("cuda", 0), torch.device("cuda", 1)]
    with pytest.raises(SystemExit) as e:
        pick_device("cuda", 2)
        pytest.fail("local rank 2 given a GPU on a node of 2")
    assert str(e.value) == ("error: local rank 2 but this node has 2 GPUs; use --nproc_per_node 2 or fewer"), e.value
    assert pick_device("cpu", 5) == torch.device("cpu")
