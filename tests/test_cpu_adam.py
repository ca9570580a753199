"""The C++ AdamW (cpu_adam.cpp) against torch.optim.AdamW, element by element (not by norms, as DeepSpeed's test does)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pytest
import torch

from offload import load_cpu_adam

BETAS, EPS = (0.9, 0.999), 1e-8
LRS = [1e-4, 3e-4, 6e-4, 1e-3, 1e-3, 8e-4]  # warm-up then decay: the lr changes between steps

# Tolerance for the parameters. The kernel does torch's fp32 operations in torch's order (lerp and addcmul are one
# fused multiply-add each, as in torch's compiled kernels), so exp_avg and exp_avg_sq come out bit-identical and
# are compared exactly. The parameters differ in a few elements per 100,000 by one ulp: torch's CPU sqrt (MKL's
# vectorised one) is not always correctly rounded and ours (vsqrtps) is. One ulp of |p| is <= 1.2e-7 * |p|;
# rtol 1e-6 allows a few such ulps over the steps, and atol 1e-9 covers parameters near zero, where a one-ulp
# change of the update (lr-sized, ~1e-3) is ~1e-10.
P_TOL = dict(rtol=1e-6, atol=1e-9)


@pytest.fixture(scope="module")
def cpu_adam():
    return load_cpu_adam()


def run_both(cpu_adam, n, grad_dtype, wd, steps=6, seed=0):
    """Run `steps` AdamW steps with torch and with ours from the same start; return both states."""
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
        ref.grad = g.float()  # for bf16 grads, torch gets the same bf16 values widened
        opt.step()
        cpu_adam.adam_step(p, g, m, v, out, step, lr, *BETAS, EPS, wd)
    st = opt.state[ref]
    return (p, m, v, out), (ref.detach(), st["exp_avg"], st["exp_avg_sq"])


@pytest.mark.parametrize("wd", [0.0, 0.1])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [1, 7, 55, 127, 1000003, 2**22])
def test_matches_torch_adamw(cpu_adam, n, grad_dtype, wd):
    (p, m, v, out), (p_ref, m_ref, v_ref) = run_both(cpu_adam, n, grad_dtype, wd)
    torch.testing.assert_close(m, m_ref, rtol=0, atol=0)
    torch.testing.assert_close(v, v_ref, rtol=0, atol=0)
    torch.testing.assert_close(p, p_ref, **P_TOL)
    assert (p != p_ref).float().mean().item() < 1e-3  # and nearly all parameters are bit-identical
    assert torch.equal(out, p.to(torch.bfloat16))  # both round to nearest even


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
        cpu_adam.adam_step(p, g, m, v, None, step, 1e-3, *BETAS, EPS, 0.01)
        cpu_adam.adam_step(pv, g_view, mv, vv, out, step, 1e-3, *BETAS, EPS, 0.01)
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
        cpu_adam.adam_step(p, g, m, v, None, 1, 1e-3, *BETAS, EPS, 0.1)
        torch.testing.assert_close(p, ref.detach(), **P_TOL)
        torch.testing.assert_close(m, opt.state[ref]["exp_avg"], rtol=0, atol=0)


def _args(n=64, **over):
    a = dict(param=torch.zeros(n), grad=torch.zeros(n), exp_avg=torch.zeros(n), exp_avg_sq=torch.zeros(n), out=None)
    a.update(over)
    return a["param"], a["grad"], a["exp_avg"], a["exp_avg_sq"], a["out"], 1, 1e-3, *BETAS, EPS, 0.0


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
