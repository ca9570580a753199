"""The C++ AdamW (cpu_adam.cpp) against torch.optim.AdamW, element by element (not by norms, as DeepSpeed's test does)."""
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import pytest
import torch

from offload import load_cpu_adam
from train_gpt import clip_coef

BETAS, EPS = (0.9, 0.999), 1e-8
LRS = [1e-4, 3e-4, 6e-4, 1e-3, 1e-3, 8e-4]  # warm-up then decay: the lr changes between steps

# Tolerance for the parameters. The kernel does torch's fp32 operations in torch's order (lerp and addcmul are one
# fused multiply-add each, as in torch's compiled kernels), so exp_avg and exp_avg_sq come out bit-identical and
# are compared exactly. The parameters differ in a few elements per 100,000 by one ulp: torch's CPU sqrt (MKL's
# vectorised one) is not always correctly rounded and ours (vsqrtps) is. One ulp of |p| is <= 1.2e-7 * |p|;
# rtol 1e-6 allows a few such ulps over the steps, and atol 1e-9 covers parameters near zero, where a one-ulp
# change of the update (lr-sized, ~1e-3) is ~1e-10.
P_TOL = dict(rtol=1e-6, atol=1e-9)

# grad_scale values: not representable in fp32 (so rounding the scale to fp32 first, as torch does, matters), and the
# coefficient gradient clipping gives for a gradient norm of 7.3 with max norm 1.0 (what offload.py passes), and > 1.
CLIP = float(clip_coef(torch.tensor(7.3), 1.0))
SCALES = [0.37, CLIP, 3.0]


@pytest.fixture(scope="module")
def cpu_adam():
    return load_cpu_adam()


def run_both(cpu_adam, n, grad_dtype, wd, steps=6, seed=0, scale=1.0):
    """Run `steps` AdamW steps with torch and with ours from the same start; return both states. Torch gets the
    gradient scaled as a caller would scale it without the kernel's grad_scale: in fp32, by a Python float."""
    gen = torch.Generator().manual_seed(seed)
    p = torch.randn(n, generator=gen)
    ref = p.clone().requires_grad_(True)
    opt = torch.optim.AdamW([ref], lr=LRS[0], betas=BETAS, eps=EPS, weight_decay=wd, foreach=False)
    m, v = torch.zeros(n), torch.zeros(n)
    out = torch.empty(n, dtype=torch.bfloat16)
    for step in range(1, steps + 1):
        g = torch.randn(n, generator=gen).to(grad_dtype)
        lr = LRS[(step - 1) % len(LRS)]
        opt.param_groups[0]["lr"] = lr
        # For bf16 grads, torch gets the same bf16 values widened. Out of place: .float() of an fp32 tensor is the
        # tensor itself, and an in-place multiply would hand ours the scaled gradient too.
        ref.grad = g.float().mul(scale)
        opt.step()
        cpu_adam.adam_step(p, g, m, v, out, step, lr, *BETAS, EPS, wd, scale)
    st = opt.state[ref]
    return (p, m, v, out), (ref.detach(), st["exp_avg"], st["exp_avg_sq"])


def assert_matches_torch(ours, theirs):
    """Moments bit-identical; parameters within P_TOL and nearly all bit-identical; the bf16 output rounded alike."""
    (p, m, v, out), (p_ref, m_ref, v_ref) = ours, theirs
    torch.testing.assert_close(m, m_ref, rtol=0, atol=0)
    torch.testing.assert_close(v, v_ref, rtol=0, atol=0)
    torch.testing.assert_close(p, p_ref, **P_TOL)
    assert (p != p_ref).float().mean().item() < 1e-3  # and nearly all parameters are bit-identical
    assert torch.equal(out, p.to(torch.bfloat16))  # both round to nearest even


@pytest.mark.parametrize("wd", [0.0, 0.1])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [1, 7, 55, 127, 1000003, 2**22])
def test_matches_torch_adamw(cpu_adam, n, grad_dtype, wd):
    assert_matches_torch(*run_both(cpu_adam, n, grad_dtype, wd))


@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [1, 7, 127, 1000003])
def test_grad_scale_matches_torch_adamw_on_scaled_grads(cpu_adam, n, grad_dtype, scale):
    """grad_scale (the clipping coefficient) is torch's AdamW on grad.float().mul_(scale): SIMD body and tails."""
    assert_matches_torch(*run_both(cpu_adam, n, grad_dtype, 0.1, scale=scale))


def test_grad_scale_is_applied_once_and_leaves_grad_alone(cpu_adam):
    """Scaling by s equals passing the gradient already scaled (with s exact in fp32), and grad is read-only."""
    n = 100_003
    gen = torch.Generator().manual_seed(3)
    p0, g = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    g_before = g.clone()
    a = [p0.clone(), torch.zeros(n), torch.zeros(n)]
    b = [p0.clone(), torch.zeros(n), torch.zeros(n)]
    for step in (1, 2):
        cpu_adam.adam_step(a[0], g, a[1], a[2], None, step, 1e-3, *BETAS, EPS, 0.1, 0.25)
        cpu_adam.adam_step(b[0], g * 0.25, b[1], b[2], None, step, 1e-3, *BETAS, EPS, 0.1, 1.0)
    assert torch.equal(g, g_before)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


def test_misaligned_views_and_fp32_out(cpu_adam):
    """Contiguous views at odd offsets (as slices of a flat buffer are) give the same bits as aligned tensors."""
    n = 300_001
    gen = torch.Generator().manual_seed(1)
    p0, g = torch.randn(n, generator=gen), torch.randn(n, generator=gen).bfloat16()
    aligned = [p0.clone(), torch.zeros(n), torch.zeros(n)]  # p, m, v
    views = [torch.empty(n + k)[k:] for k in (3, 5, 1)]  # misaligned by 12, 20 and 4 bytes
    views[0].copy_(p0)
    views[1].zero_()
    views[2].zero_()
    g_view = torch.empty(n + 7, dtype=torch.bfloat16)[7:].copy_(g)
    out = torch.empty(n)
    for step in (1, 2, 3):
        (p, m, v), (pv, mv, vv) = aligned, views
        cpu_adam.adam_step(p, g, m, v, None, step, 1e-3, *BETAS, EPS, 0.01, CLIP)
        cpu_adam.adam_step(pv, g_view, mv, vv, out, step, 1e-3, *BETAS, EPS, 0.01, CLIP)
    for a, b in zip(aligned, views):
        assert torch.equal(a, b)
    assert torch.equal(out, views[0])  # an fp32 param_out is an exact copy


def test_step_is_taken_as_given(cpu_adam):
    """No hidden counter: step=1 on two fresh copies gives torch's first step twice (DeepSpeed 2020 counted per call)."""
    n = 1000
    gen = torch.Generator().manual_seed(2)
    p0, g = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    ref = p0.clone().requires_grad_(True)
    opt = torch.optim.AdamW([ref], lr=1e-3, betas=BETAS, eps=EPS, weight_decay=0.1, foreach=False)
    ref.grad = g.clone()
    opt.step()
    for _ in range(2):
        p, m, v = p0.clone(), torch.zeros(n), torch.zeros(n)
        cpu_adam.adam_step(p, g, m, v, None, 1, 1e-3, *BETAS, EPS, 0.1, 1.0)
        torch.testing.assert_close(p, ref.detach(), **P_TOL)
        torch.testing.assert_close(m, opt.state[ref]["exp_avg"], rtol=0, atol=0)


def _args(n=64, **over):
    a = dict(param=torch.zeros(n), grad=torch.ones(n), exp_avg=torch.zeros(n), exp_avg_sq=torch.zeros(n), out=None,
             grad_scale=1.0)
    a.update(over)
    return a["param"], a["grad"], a["exp_avg"], a["exp_avg_sq"], a["out"], 1, 1e-3, *BETAS, EPS, 0.0, a["grad_scale"]


@pytest.mark.parametrize(
    "over, words",
    [
        (dict(exp_avg=torch.zeros(128)[::2]), ["exp_avg", "not contiguous", "no hidden copy"]),
        (dict(param=torch.zeros(8, 16).t()), ["param", "not contiguous"]),
        (dict(grad=torch.zeros(64, dtype=torch.float16)), ["grad", "Half", "float32 or bfloat16"]),
        (dict(param=torch.zeros(64, dtype=torch.float64)), ["param", "Double", "float32"]),
        (dict(exp_avg_sq=torch.zeros(63)), ["exp_avg_sq", "63 elements", "64"]),
        (dict(out=torch.zeros(65, dtype=torch.bfloat16)), ["param_out", "65 elements"]),
        (dict(grad=torch.zeros(64, device="meta")), ["grad", "meta", "CPU"]),
        (dict(grad_scale=float("nan")), ["grad_scale", "finite", "got nan"]),
        (dict(grad_scale=float("inf")), ["grad_scale", "finite", "got inf"]),
        (dict(grad_scale=float("-inf")), ["grad_scale", "finite", "got -inf"]),
        (dict(grad_scale=1e39), ["grad_scale", "finite", "got 1e+39"]),  # finite as a double, inf as a float32
    ],
)
def test_bad_inputs_raise_clear_errors(cpu_adam, over, words):
    args = _args(**over)
    before = args[0].clone() if args[0].device.type == "cpu" else None
    with pytest.raises(RuntimeError) as e:
        cpu_adam.adam_step(*args)
    for w in words:
        assert w.lower() in str(e.value).lower(), (w, str(e.value))
    if before is not None:
        assert torch.equal(args[0], before)  # nothing was touched


@pytest.mark.skipif(not os.environ.get("CPU_ADAM_ALL_PATHS"),
                    reason="builds two more variants of the kernel (~25 s each, cached after): CPU_ADAM_ALL_PATHS=1")
@pytest.mark.parametrize("path", ["avx2", "scalar"])
def test_other_code_paths_match_torch(path):
    """The AVX2 and the portable path, which a machine with AVX-512 runs only in tails: built on purpose."""
    if path == "avx2" and torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        pytest.skip("this CPU has no AVX2")
    import torch.utils.cpp_extension as ext

    # offload.py's flags, minus the vector extensions this path must not see.
    isa = {"avx2": ["-march=native", "-mno-avx512f"], "scalar": []}[path]
    mod = ext.load_inline(name=f"cpu_adam_{path}", cpp_sources=[(ROOT / "cpu_adam.cpp").read_text()],
                          functions=["adam_step"], extra_cflags=["-O3", "-fopenmp", "-ffp-contract=off"] + isa,
                          extra_ldflags=["-fopenmp"])
    for n in (127, 100_003):
        for grad_dtype in (torch.float32, torch.bfloat16):
            for scale in (1.0, 0.37):
                assert_matches_torch(*run_both(mod, n, grad_dtype, 0.1, scale=scale))
