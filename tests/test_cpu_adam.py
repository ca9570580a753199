"""The C++ AdamW (cpu_adam.cpp), on every code path this CPU can run (AVX-512, AVX2, scalar): bit for bit against an
independent float64 reference of the same operations in the same order, each rounded once to fp32; and, element by
element within a few ulps, against torch.optim.AdamW, whose last bits depend on the CPU's math library. Its fp16
conversions (gradients in, parameters out), element by element against torch's, over every fp16 value and every
rounding boundary."""
import math
import platform
import shutil
import subprocess
import sys
from fractions import Fraction
from operator import add, mul, sub, truediv as div
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np
import pytest
import torch
import torch.utils.cpp_extension

import devices
from devices import adam_threads, cpu_adam_isas
from offload import load_cpu_adam
from train_gpt import clip_coef

BETAS, EPS = (0.9, 0.999), 1e-8
LRS = [1e-4, 3e-4, 6e-4, 1e-3, 1e-3, 8e-4]  # warm-up then decay: the lr changes between steps
# grad_scale values: 1 (nothing clipped), not representable in fp32 (so rounding the scale to fp32 first, as torch
# does, matters), the coefficient clipping gives for a gradient norm of 7.3 with max norm 1.0 (what offload.py
# passes), and > 1.
CLIP = float(clip_coef(torch.tensor(7.3), 1.0))
SCALES = [1.0, 0.37, CLIP, 3.0]
RUNNABLE = cpu_adam_isas()


@pytest.fixture(scope="module", params=list(devices.ISA_FLAGS))
def kernel(request):
    """Each code path of the kernel, built for it (a compile per path the first time, cached after); the paths this CPU
    cannot run are skipped."""
    if request.param not in RUNNABLE:
        pytest.skip(f"this CPU cannot run the {request.param} path (torch's CPU capability: "
                    f"{torch.backends.cpu.get_cpu_capability()})")
    return load_cpu_adam(request.param)


# ---- The reference: numpy, float64, each fp32 operation rounded once, so it does not depend on the CPU.
# +, -, *, / and sqrt of fp32 values computed in float64 and rounded to fp32 are correctly rounded: float64 has
# 53 >= 2*24 + 2 bits, so rounding twice is innocuous for these operations (Figueroa, "When is double rounding
# innocuous?", 1995). numpy's float64 + - * / are the hardware's IEEE operations; its sqrt may come from a math
# library, so sqrt32 checks its result exactly. fma is the exception: a*b is exact in float64 (48 bits), but
# a*b + c rounded to float64 and then to fp32 can round twice the wrong way (fma32 below).

def f32(x):
    return np.asarray(x, np.float64).astype(np.float32)  # round to nearest even (the hardware's conversion)


def op32(f, *xs):
    return f32(f(*(np.asarray(x, np.float32).astype(np.float64) for x in xs)))


def fma32(a, b, c):
    """fp32 fma(a, b, c), correctly rounded. ab = a*b is exact in float64; TwoSum (Knuth) splits ab + c into
    s = fl64(ab + c) and the exact error e = ab + c - s. If e != 0 and s's last bit is even, s is replaced by its
    float64 neighbour on e's side: that is ab + c rounded to odd in float64, and rounding to odd in a precision of at
    least p + 2 bits followed by rounding to nearest in p bits gives the correctly rounded result (Boldo and
    Melquiond, "Emulation of FMA and correctly rounded sums: proved algorithms using rounding to odd", IEEE TC
    2008); 53 >= 24 + 2. (No overflow: these values are far inside float64's range.)"""
    a, b, c = (np.asarray(x, np.float32).astype(np.float64) for x in (a, b, c))
    ab = a * b
    s = ab + c
    bb = s - ab
    e = (ab - (s - bb)) + (c - bb)
    even = (s.view(np.int64) & 1) == 0
    s = np.where((e != 0) & even, np.nextafter(s, np.where(e > 0, np.inf, -np.inf)), s)
    return f32(s)


def sqrt32(x):
    """fp32 sqrt, correctly rounded whatever numpy's sqrt does: r is right iff x lies strictly between the squares
    of the midpoints from r to its fp32 neighbours. A midpoint has 25 significant bits, so its square (<= 50 bits)
    is exact in float64, and never equal to an fp32 x (the square of an odd 25-bit number has 49 or 50 bits)."""
    x = np.asarray(x, np.float32).astype(np.float64)
    r = f32(np.sqrt(x))
    for _ in range(4):  # one pass suffices unless np.sqrt is off by more than an fp32 ulp
        up, down = np.nextafter(r, np.float32(np.inf)), np.nextafter(r, np.float32(-np.inf))
        hi = (r.astype(np.float64) + up) / 2
        lo = (r.astype(np.float64) + down) / 2
        fixed = np.where((x > 0) & (x >= hi * hi), up, np.where((x > 0) & (x <= lo * lo), down, r))
        if np.array_equal(fixed, r):
            return r
        r = fixed
    raise AssertionError("sqrt32 did not converge")


def to_bf16_bits(x):
    """fp32 -> bf16 bits, rounded to nearest even; NaN -> 0x7fc0."""
    u = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    b = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    return np.where(np.isnan(x), np.uint16(0x7FC0), b)


def reference_step(p, g, m, v, step, lr, beta1, beta2, eps, wd, scale):
    """One step of cpu_adam.cpp's documented math on fp32 numpy arrays; returns new (p, m, v). The constants are
    computed in double and rounded to fp32 as the C++ struct Hyper is (Python's ** is the same libm pow())."""
    bc1, bc2 = 1.0 - beta1 ** float(step), 1.0 - beta2 ** float(step)
    decay, w1, b2, w2 = f32(1.0 - lr * wd), f32(1.0 - beta1), f32(beta2), f32(1.0 - beta2)
    neg_step, bc2_sqrt, eps32, s = f32(-(lr / bc1)), f32(bc2 ** 0.5), f32(eps), f32(scale)
    g = op32(mul, g, s)
    m = fma32(w1, op32(sub, g, m), m)
    v = fma32(op32(mul, w2, g), g, op32(mul, v, b2))
    denom = op32(add, op32(div, sqrt32(v), bc2_sqrt), eps32)
    p = op32(add, op32(mul, p, decay), op32(div, op32(mul, neg_step, m), denom))
    return p, m, v


def bits(t):
    """The fp32, bf16 or fp16 bit patterns of a tensor (tells -0 from +0; NaN equals NaN of the same pattern)."""
    return t.view(torch.int32 if t.dtype == torch.float32 else torch.int16)


def to_fp16_bits(x):
    """fp32 -> fp16 bits as torch converts them (to nearest even), with NaN as the kernel's quiet NaN 0x7e00."""
    h = bits(torch.from_numpy(np.ascontiguousarray(x, np.float32)).half()).numpy()
    return np.where(np.isnan(x), np.int16(0x7E00), h)


def assert_bits_equal(ours, ref, what):
    ref = torch.from_numpy(np.ascontiguousarray(ref))
    same = bits(ours) == (ref if ref.dtype == torch.int16 else bits(ref))
    if not bool(same.all()):
        i = int((~same).nonzero()[0])
        pytest.fail(f"{what}: {int((~same).sum())} of {same.numel()} elements differ from the reference; first at "
                    f"[{i}]: {ours[i].item()!r} vs {ref[i].item()!r}", pytrace=False)


# Values where rounding, underflow and signs are easy to get wrong: zeros of both signs, gradients whose square
# underflows to a denormal or to zero, denormal gradients and parameters (no flush to zero on any path), large
# gradients, gradients that are powers of two.
SPECIAL_G = [0.0, -0.0, 1e-40, -3e-39, 1e-20, -1e-22, 3e18, -2e19, 1.0, -0.5, 2.0 ** -126, 1.0 + 2.0 ** -23]
SPECIAL_P = [1e-39, -0.0, 0.0, 1e30, -1e-30, 5.0, -7.0, 1.0, 2.0 ** -149, -2.0 ** -149, 3.0, 0.1]
# fp16 gradients: its subnormals (the smallest, 2^-24, and others), the smallest normal 2^-14, the largest value 65504
SPECIAL_G16 = [0.0, -0.0, 2.0 ** -24, -3 * 2.0 ** -20, 2.0 ** -14, -(2.0 ** -14), 65504.0, -65504.0, 1.0, -0.5,
               1.0 + 2.0 ** -10, 3e-5]


def random_state(n, grad_dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    p, m, v = torch.randn(n, generator=gen), 0.1 * torch.randn(n, generator=gen), 0.01 * torch.rand(n, generator=gen)
    k = min(n, len(SPECIAL_P))
    p[:k] = torch.tensor(SPECIAL_P[:k])
    grads = []
    special = SPECIAL_G16 if grad_dtype == torch.float16 else SPECIAL_G  # (inside fp16's range, for fp16)
    for step in range(6):
        g = torch.randn(n, generator=gen)
        g[:k] = torch.tensor(special[:k]) * (1 - 2 * (step % 2))  # signs change between steps
        grads.append(g.to(grad_dtype))
    return p, m, v, grads


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n", [1, 15, 17, 100_003])  # below one vector, a vector and a tail, two tiles (2 threads)
def test_bit_exact_against_reference(kernel, n, grad_dtype, out_dtype):
    """Six steps from a mid-training state, lr, weight decay and grad_scale changing between steps: p, m, v and the
    bf16 or fp16 copy of p equal the reference bit for bit."""
    p, m, v, grads = random_state(n, grad_dtype, seed=n)
    rp, rm, rv = (t.numpy().copy() for t in (p, m, v))
    out = torch.empty(n, dtype=out_dtype)
    for step, g in enumerate(grads, 1):
        lr, wd, scale = LRS[step - 1], [0.1, 0.0][step % 2], SCALES[step % len(SCALES)]
        kernel.adam_step(p, g, m, v, out, step=step, lr=lr, beta1=BETAS[0], beta2=BETAS[1], eps=EPS, weight_decay=wd,
                         grad_scale=scale)
        rp, rm, rv = reference_step(rp, g.float().numpy(), rm, rv, step, lr, *BETAS, EPS, wd, scale)
        for ours, ref, name in ((p, rp, "p"), (m, rm, "exp_avg"), (v, rv, "exp_avg_sq")):
            assert_bits_equal(ours, ref, f"{kernel.isa()} step {step} {name}")
        low = to_bf16_bits(rp).view(np.int16) if out_dtype == torch.bfloat16 else to_fp16_bits(rp)
        assert_bits_equal(out, low, f"{kernel.isa()} step {step} {out_dtype} param_out")


def every_fp16():
    """All 65536 fp16 bit patterns, as a float16 tensor (both zeros, subnormals, normals, both infinities, NaNs)."""
    return torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.float16)


def rounding_boundaries():
    """fp32 values where fp32 -> fp16 is easy to get wrong: every finite fp16 value, each midpoint between neighbours
    (a tie: to even) and the fp32 values on either side of it, in the subnormal range and the normal; the overflow
    boundary (65504 the largest; from 65520, the midpoint to 2^16, inf); values below half the smallest subnormal
    (to zero); infinities, NaNs; and a million random fp32 bit patterns, over the whole range. Both signs."""
    h = every_fp16().float()
    finite = h[torch.isfinite(h) & (h >= 0)].unique()  # sorted: 0, the subnormals, the normals, 65504
    mid = ((finite[:-1].double() + finite[1:].double()) / 2).float()  # exact in fp32 (12 significant bits)
    up, down = torch.nextafter(mid, torch.tensor(math.inf)), torch.nextafter(mid, torch.tensor(0.0))
    edges = torch.tensor([65504.0, 65519.996, 65520.0, 65536.0, 1e5, 3e38, math.inf, math.nan, 2.0**-25,
                          2.0**-25 * (1 + 2.0**-23), 2.0**-26, 1e-45, 2.0**-14 * (1 - 2.0**-11)])
    rnd = torch.from_numpy(np.random.default_rng(0).integers(0, 2**32, 1_000_000, dtype=np.uint64)
                           .astype(np.uint32).view(np.float32))
    x = torch.cat([finite, mid, up, down, edges])
    return torch.cat([x, -x, rnd])


def test_fp16_conversions_match_torch(kernel):
    """fp16 gradients are widened exactly: with beta1 = 0 and no other term, m after one step is the gradient itself,
    for every fp16 value. Parameters are narrowed to fp16 as torch's .half() does, to nearest even, on every boundary:
    with lr = 0 the step leaves p as it is, and param_out is fp16(p) (a NaN is the quiet NaN 0x7e00). Sizes not a
    multiple of the vector width: the vector loop and the portable tail both convert."""
    g = every_fp16()
    n = g.numel()
    p, m, v = torch.zeros(n), torch.zeros(n), torch.zeros(n)
    kernel.adam_step(p, g, m, v, None, step=1, lr=0.0, beta1=0.0, beta2=BETAS[1], eps=EPS, weight_decay=0.0,
                     grad_scale=1.0)
    want = g.float()
    wrong = ~((m == want) | (m.isnan() & want.isnan()))
    assert not bool(wrong.any()), (f"{kernel.isa()}: fp16 gradients widened wrong at "
                                   f"{g[wrong][:5].tolist()}: {m[wrong][:5].tolist()}")
    x = rounding_boundaries()
    n = x.numel()
    p, out = x.clone(), torch.empty(n, dtype=torch.float16)
    kernel.adam_step(p, torch.zeros(n, dtype=torch.float16), torch.zeros(n), torch.zeros(n), out, step=1, lr=0.0,
                     beta1=BETAS[0], beta2=BETAS[1], eps=EPS, weight_decay=0.0, grad_scale=1.0)
    assert torch.equal(bits(p)[~x.isnan()], bits(x)[~x.isnan()])  # lr = 0: p itself unchanged
    assert_bits_equal(out, to_fp16_bits(x.numpy()), f"{kernel.isa()} fp16 param_out of fp32 values")


def exact_fp32(x):
    """A Fraction rounded to the nearest fp32, ties to even (normal and denormal range)."""
    if x == 0:
        return 0.0
    sign, x = (-1 if x < 0 else 1), abs(x)
    e = x.numerator.bit_length() - x.denominator.bit_length()  # 2^e <= x < 2^(e+1), after the fix-up below
    if x < Fraction(2) ** e:
        e -= 1
    q = Fraction(2) ** max(e - 23, -149)  # the fp32 ulp at x
    n, rem = divmod(x / q, 1)
    n += 1 if rem > Fraction(1, 2) or (rem == Fraction(1, 2) and n % 2) else 0
    return sign * float(n * q)


# fma(a, b, c) where a*b + c rounded to float64 lands exactly on a midpoint between two fp32 values, but the exact
# value does not: rounding twice goes the wrong way. a*b = 0.75 * (1 + 2^-23) = 0.75 + 1.5 ulp is such a midpoint
# (rounding to even goes up); c = -2^-60 moves the exact value below it by less than half a float64 ulp.
# a*b = 0.75 * (1 + 3 * 2^-23) = 0.75 + 4.5 ulp likewise, rounding to even downwards where c pushes up.
HARD_FMA = [(0.75, 1 + 2.0**-23, -(2.0**-60)), (0.75, -(1 + 2.0**-23), 2.0**-60), (0.75, 1 + 3 * 2.0**-23, 2.0**-60),
            (0.75, 1 + 2.0**-23, 2.0**-60)]  # (the last one rounds alike either way)


def test_reference_is_correctly_rounded():
    """fma32 and sqrt32 against exact rational and integer arithmetic: the fma cases that round twice the wrong way,
    random ones, and square roots from denormals to 1e38."""
    rng = np.random.default_rng(0)
    a, b, c = (np.array([h[i] for h in HARD_FMA], np.float32) for i in range(3))
    naive = f32(a.astype(np.float64) * b + c)
    exact = np.array([exact_fp32(Fraction(float(x)) * Fraction(float(y)) + Fraction(float(z)))
                      for x, y, z in zip(a, b, c)], np.float32)
    assert not np.array_equal(naive, exact)  # the cases are hard: rounding to float64 first gets them wrong
    assert np.array_equal(fma32(a, b, c).view(np.int32), exact.view(np.int32))
    a, b = f32(rng.standard_normal(3000)), f32(rng.standard_normal(3000))
    c = f32(-a.astype(np.float64) * b * (1 + rng.uniform(-1e-6, 1e-6, 3000)))  # cancellation: the hard regime
    exact = np.array([exact_fp32(Fraction(float(x)) * Fraction(float(y)) + Fraction(float(z)))
                      for x, y, z in zip(a, b, c)], np.float32)
    assert np.array_equal(fma32(a, b, c).view(np.int32), exact.view(np.int32))
    x = f32(np.abs(rng.standard_normal(3000)) * 10.0 ** rng.integers(-40, 38, 3000))
    for y, r in zip(x, sqrt32(x)):
        # sqrt(y) = isqrt(y * 2^400) / 2^200, plus a sticky half if inexact: 2^-200 is far below the fp32 ulp of any
        # fp32 root (>= 2^-98), so no rounding boundary falls inside the last step.
        y_scaled = int(Fraction(float(y)) * 2**400)  # an integer: fp32 values are multiples of 2^-149
        s = math.isqrt(y_scaled)
        exact = exact_fp32(Fraction(s, 2**200) if s * s == y_scaled else Fraction(2 * s + 1, 2**201))
        assert np.float32(exact).view(np.int32) == r.view(np.int32), (y, r, exact)


def test_fused_multiply_adds_round_once(kernel):
    """The hard cases above, in the kernel's moment update m = fma(1 - beta1, g - m, m) with beta1 = 0.25 (so the
    weight is 0.75) and m = c: each path rounds once, as the reference does, and not as a multiply then an add."""
    a, b, c = (torch.tensor([h[i] for h in HARD_FMA]) for i in range(3))
    g = b + c  # (= b in fp32, and so is g - m = b + c - c rounded to fp32)
    n = 37  # the cases at the start of a vector, in the middle of one, and in the tail
    idx = torch.tensor([0, 16, 19, 35])
    gg, mm = torch.ones(n), torch.zeros(n)
    gg[idx], mm[idx] = g, c
    p, v = torch.ones(n), torch.ones(n)
    kernel.adam_step(p, gg, mm, v, None, step=1, lr=1e-3, beta1=0.25, beta2=BETAS[1], eps=EPS, weight_decay=0.0,
                     grad_scale=1.0)
    assert torch.equal(bits(mm[idx]), bits(torch.from_numpy(fma32(a.numpy(), b.numpy(), c.numpy()))))


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n", [127, 2**20 + 3])
def test_matches_torch_adamw(kernel, n, grad_dtype):
    """Against torch.optim.AdamW from the same start, within a few ulps (why those bounds: see below)."""
    steps = 6
    gen = torch.Generator().manual_seed(n)
    p = torch.randn(n, generator=gen)
    ref = p.clone().requires_grad_(True)
    opt = torch.optim.AdamW([ref], lr=LRS[0], betas=BETAS, eps=EPS, weight_decay=0.1, foreach=False)
    m, v, gmax = torch.zeros(n), torch.zeros(n), torch.zeros(n)
    for step in range(1, steps + 1):
        g, lr, scale = torch.randn(n, generator=gen).to(grad_dtype), LRS[step - 1], SCALES[step % len(SCALES)]
        opt.param_groups[0]["lr"] = lr
        # torch gets the gradient scaled as a caller would scale it without the kernel's grad_scale: in fp32, by a
        # Python float. Out of place: .float() of an fp32 tensor is the tensor itself.
        ref.grad = g.float().mul(scale)
        gmax = torch.maximum(gmax, ref.grad.abs())
        opt.step()
        kernel.adam_step(p, g, m, v, None, step=step, lr=lr, beta1=BETAS[0], beta2=BETAS[1], eps=EPS, weight_decay=0.1,
                         grad_scale=scale)
    st = opt.state[ref]
    # Where torch's last bits come from: its sqrt is the CPU's math library's (MKL's is within 1 ulp, not always
    # correctly rounded), and its lerp and addcmul are fused multiply-adds on its AVX2/AVX-512 paths but a multiply
    # and an add on its scalar one, which rounds once more. ulp = 2^-23 relative.
    ulp = 2.0**-23
    # v sums positive terms: each step adds at most ~1.5 ulp of relative difference, and old ones shrink by beta2.
    torch.testing.assert_close(v, st["exp_avg_sq"], rtol=2 * steps * ulp, atol=0)
    # m can cancel (g of either sign), so its difference is bounded in absolute terms, by one rounding of the largest
    # term per step: at most ~1 ulp of the largest scaled gradient the element has seen.
    assert bool(((m - st["exp_avg"]).abs() <= 2 * steps * ulp * gmax).all())
    # p moves by lr * m_hat / (sqrt(v_hat) + eps), |m_hat / sqrt(v_hat)| of order 1 here: per step a rounding of p
    # (1 ulp) and a few ulps of the update (the sqrt, the moments), i.e. ~4 * ulp * lr.
    torch.testing.assert_close(p, ref.detach(), rtol=2 * steps * ulp, atol=4 * steps * ulp * max(LRS))


def test_grad_scale_is_applied_once_and_leaves_grad_alone(kernel):
    """Scaling by s equals passing the gradient already scaled (with s exact in fp32), and grad is read-only."""
    n = 100_003
    gen = torch.Generator().manual_seed(3)
    p0, g = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    g_before = g.clone()
    a = [p0.clone(), torch.zeros(n), torch.zeros(n)]
    b = [p0.clone(), torch.zeros(n), torch.zeros(n)]
    for step in (1, 2):
        hyper = dict(step=step, lr=1e-3, beta1=BETAS[0], beta2=BETAS[1], eps=EPS, weight_decay=0.1)
        kernel.adam_step(a[0], g, a[1], a[2], None, grad_scale=0.25, **hyper)
        kernel.adam_step(b[0], g * 0.25, b[1], b[2], None, grad_scale=1.0, **hyper)
    assert torch.equal(g, g_before)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


def test_misaligned_views_fp32_out_and_threads(kernel):
    """Contiguous views at odd offsets (as slices of a flat buffer are), on 1 thread or 2, give the same bits as
    aligned tensors; an fp32 param_out is an exact copy."""
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
    threads = kernel.threads()
    try:
        for step in (1, 2, 3):
            (p, m, v), (pv, mv, vv) = aligned, views
            hyper = dict(step=step, lr=1e-3, beta1=BETAS[0], beta2=BETAS[1], eps=EPS, weight_decay=0.01,
                         grad_scale=CLIP)
            kernel.set_threads(1)
            kernel.adam_step(p, g, m, v, None, **hyper)
            kernel.set_threads(2)
            kernel.adam_step(pv, g_view, mv, vv, out, **hyper)
    finally:
        kernel.set_threads(threads)
    for a, b in zip(aligned, views):
        assert torch.equal(a, b)
    assert torch.equal(out, views[0])


def test_step_is_taken_as_given(kernel):
    """No hidden counter: step=1 on two fresh copies gives the first step twice (DeepSpeed 2020 counted per call)."""
    n = 1000
    gen = torch.Generator().manual_seed(2)
    p0, g = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    rp, rm, _ = reference_step(p0.numpy(), g.numpy(), np.zeros(n, np.float32), np.zeros(n, np.float32), 1, 1e-3,
                               *BETAS, EPS, 0.1, 1.0)
    for _ in range(2):
        p, m, v = p0.clone(), torch.zeros(n), torch.zeros(n)
        kernel.adam_step(p, g, m, v, None, step=1, lr=1e-3, beta1=BETAS[0], beta2=BETAS[1], eps=EPS, weight_decay=0.1,
                         grad_scale=1.0)
        assert_bits_equal(p, rp, "p")
        assert_bits_equal(m, rm, "exp_avg")


# ---- The build: one module per code path, named after it, that says which it is and holds only its instructions.

def test_each_path_is_its_own_build(kernel):
    isa = kernel.isa()
    assert Path(kernel.__file__).stem == f"cpu_adam_{isa}"  # so a cached build is found only by a CPU that runs it
    if shutil.which("objdump") is None or platform.machine() not in ("x86_64", "AMD64"):
        return  # (the instruction check below is for x86, with binutils)
    asm = subprocess.run(["objdump", "-d", kernel.__file__], capture_output=True, text=True).stdout
    registers = {"avx512": "zmm", "avx2": "ymm"}
    assert (registers.get(isa, "ymm") in asm) == (isa != "scalar")  # its own vector registers, if any
    if isa != "avx512":
        assert "zmm" not in asm  # no AVX-512 instruction: it runs on an AVX2-only CPU


def test_the_benchmarks_ceiling_is_a_build_of_its_own():
    """bench/touch.cpp, bench_adam.py's ceiling loops (built by bench_adam.load_touch, with the kernel compiled in),
    adds g to p, m and v in each variant the best code path has; the kernel's own module has none of them."""
    sys.path.insert(0, str(ROOT / "bench"))
    from bench_adam import ceiling_loops, load_touch
    touch = load_touch(RUNNABLE[0])
    n = 100_003  # and a tail
    g = torch.randn(n, generator=torch.Generator().manual_seed(3))
    for tile, prefetch, stream in ceiling_loops(touch).values():
        p, m, v = torch.ones(n), torch.zeros(n), torch.full((n,), 2.0)
        touch.touch_28_bytes(p, g, m, v, tile, prefetch, stream)
        assert torch.equal(p, 1 + g) and torch.equal(m, g) and torch.equal(v, 2 + g), (tile, prefetch, stream)
    assert touch.isa() == RUNNABLE[0] and not hasattr(load_cpu_adam(RUNNABLE[0]), "touch_28_bytes")


def test_each_path_built_once_loads_beside_the_others_without_a_compile():
    """Each code path built in a process of its own (as .ci/run builds them), then every path loaded in one process:
    none is compiled again. (load_inline appends torch's libraries to the extra_ldflags list it is given: were that
    list shared by the builds, the second path's flags would change, and torch would compile it again.)"""
    load = "import sys; from offload import load_cpu_adam; [load_cpu_adam(isa) for isa in sys.argv[1:]]"
    for isa in RUNNABLE:
        subprocess.run([sys.executable, "-c", load, isa], cwd=ROOT, check=True, capture_output=True, timeout=900)
    builds = [Path(torch.utils.cpp_extension._get_build_directory(f"cpu_adam_{isa}", False)) / f"cpu_adam_{isa}.so"
              for isa in RUNNABLE]
    built = [b.stat().st_mtime_ns for b in builds]
    subprocess.run([sys.executable, "-c", load, *RUNNABLE], cwd=ROOT, check=True, capture_output=True, timeout=900)
    again = [b.name for b, before in zip(builds, built) if b.stat().st_mtime_ns != before]
    assert not again, f"loaded beside the other paths, these were compiled again: {again}"


def test_default_path_and_override(monkeypatch):
    """Without CPU_ADAM_ISA the best path this CPU runs; CPU_ADAM_ISA picks another; one this CPU cannot run (or no
    such path) is refused with a line saying which it can."""
    monkeypatch.delenv("CPU_ADAM_ISA", raising=False)
    assert load_cpu_adam().isa() == RUNNABLE[0]
    monkeypatch.setenv("CPU_ADAM_ISA", "scalar")
    assert load_cpu_adam().isa() == "scalar"
    for bad in ["sse", *[isa for isa in devices.ISA_FLAGS if isa not in RUNNABLE]]:
        monkeypatch.setenv("CPU_ADAM_ISA", bad)
        with pytest.raises(RuntimeError, match=f"no '{bad}' code path for this CPU.*can be {', '.join(RUNNABLE)}"):
            load_cpu_adam()


def test_threads_are_the_ranks_share_of_the_cores(monkeypatch, capsys):
    """Each local rank gets cores / local ranks threads (at least 1), whatever OMP_NUM_THREADS says, and says so."""
    cores = adam_threads()[1]
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # what torchrun sets for nproc_per_node > 1
    for local, want in [(None, cores), ("1", cores), ("2", max(1, cores // 2)), (str(4 * cores), 1)]:
        if local is None:
            monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
        else:
            monkeypatch.setenv("LOCAL_WORLD_SIZE", local)
        assert adam_threads() == (want, cores, int(local or 1))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    mod = load_cpu_adam(announce=True)
    assert mod.threads() == cores
    assert f"cpu_adam: {mod.isa()} build, {cores} thread" in capsys.readouterr().out
    with pytest.raises(RuntimeError, match="threads must be >= 1, got 0"):
        mod.set_threads(0)


# ---- Bad input: refused with one clear error, and nothing touched.

def _args(n=64, **over):
    a = dict(param=torch.zeros(n), grad=torch.ones(n), exp_avg=torch.zeros(n), exp_avg_sq=torch.zeros(n), out=None,
             lr=1e-3, beta1=BETAS[0], beta2=BETAS[1], eps=EPS, weight_decay=0.0, grad_scale=1.0)
    a.update(over)
    tensors = (a.pop("param"), a.pop("grad"), a.pop("exp_avg"), a.pop("exp_avg_sq"), a.pop("out"))
    return tensors, dict(step=1, **a)  # the tensors by position, the rest by name


def test_the_scalars_are_passed_by_name():
    """adam_step takes its four tensors and param_out by position and the step and hyperparameters by name only: seven
    numbers in a row (lr and beta1 swapped, say) are refused before anything is touched."""
    cpu_adam = load_cpu_adam(RUNNABLE[0])
    (p, g, m, v, out), kwargs = _args()
    before = p.clone()
    with pytest.raises(TypeError, match="incompatible function arguments"):
        cpu_adam.adam_step(p, g, m, v, out, *kwargs.values())
    assert torch.equal(p, before)
    cpu_adam.adam_step(p, g, m, v, **kwargs)  # (param_out may be left out: None)
    assert not torch.equal(p, before)
    for name in ["step", "lr", "beta1", "beta2", "eps", "weight_decay", "grad_scale"]:
        assert f"{name}: " in cpu_adam.adam_step.__doc__, name  # named in its signature, as help() shows it


@pytest.mark.parametrize(
    "over, words",
    [
        (dict(exp_avg=torch.zeros(128)[::2]), ["exp_avg", "not contiguous", "no hidden copy"]),
        (dict(param=torch.zeros(8, 16).t()), ["param", "not contiguous"]),
        (dict(grad=torch.zeros(64, dtype=torch.float64)), ["grad", "Double", "float32, bfloat16 or float16"]),
        (dict(out=torch.zeros(64, dtype=torch.int16)), ["param_out", "Short", "float32, bfloat16 or float16"]),
        (dict(param=torch.zeros(64, dtype=torch.float64)), ["param", "Double", "float32"]),
        (dict(exp_avg_sq=torch.zeros(63)), ["exp_avg_sq", "63 elements", "64"]),
        (dict(out=torch.zeros(65, dtype=torch.bfloat16)), ["param_out", "65 elements"]),
        (dict(grad=torch.zeros(64, device="meta")), ["grad", "meta", "CPU"]),
        (dict(grad_scale=float("nan")), ["grad_scale", "finite", "got nan"]),
        (dict(grad_scale=float("inf")), ["grad_scale", "finite", "got inf"]),
        (dict(grad_scale=float("-inf")), ["grad_scale", "finite", "got -inf"]),
        (dict(grad_scale=1e39), ["grad_scale", "finite", "got 1e+39"]),  # finite as a double, inf as a float32
        # torch.optim.AdamW's checks, NaN included
        (dict(lr=-1e-3), ["lr must be in [0, inf), got -0.001"]),
        (dict(lr=float("nan")), ["lr must be in [0, inf), got nan"]),
        (dict(eps=-1e-8), ["eps must be in [0, inf), got -1e-08"]),
        (dict(weight_decay=-0.1), ["weight_decay must be in [0, inf), got -0.1"]),
        (dict(beta1=1.0), ["beta1 must be in [0, 1), got 1"]),
        (dict(beta1=-0.1), ["beta1 must be in [0, 1), got -0.1"]),
        (dict(beta2=1.0), ["beta2 must be in [0, 1), got 1"]),
        (dict(beta2=float("nan")), ["beta2 must be in [0, 1), got nan"]),
    ],
)
def test_bad_inputs_raise_clear_errors(over, words):
    cpu_adam = load_cpu_adam(RUNNABLE[0])
    args, kwargs = _args(**over)
    before = args[0].clone() if args[0].device.type == "cpu" else None
    with pytest.raises(RuntimeError) as e:
        cpu_adam.adam_step(*args, **kwargs)
    for w in words:
        assert w.lower() in str(e.value).lower(), (w, str(e.value))
    if before is not None:
        assert torch.equal(args[0], before)  # nothing was touched


# ---- sum_of_squares: Σ g² for offload's gradient norm, in double on the kernel's threads, against the exact sum.
# Each square of a float is exact in float64, so the only error is the additions': at most n * 2^-53 of the sum (all
# terms are >= 0). math.fsum gives the exactly rounded sum, on any CPU.

def exact_sum_of_squares(g):
    return math.fsum(x * x for x in g.double().tolist())


def gradient(n, grad_dtype, seed, scale=1.0):
    """n random values in grad_dtype, the first ones special: zeros, subnormals, the largest (fp16: its range's)."""
    gen = torch.Generator().manual_seed(seed)
    g = scale * torch.randn(n, generator=gen)
    huge = [65504.0, -65504.0] if grad_dtype == torch.float16 else [3e38, -2e19]
    special = (SPECIAL_G16 if grad_dtype == torch.float16 else SPECIAL_G) + huge
    k = min(n, len(special))
    g[:k] = torch.tensor(special[:k])
    return g.to(grad_dtype)


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n", [0, 1, 7, 15, 17, 33, 100_003, 2**17 + 5])  # tails, vectors and tails, several tiles
def test_sum_of_squares_against_exact(kernel, n, grad_dtype):
    """Random values with zeros, subnormals and huge values among them (a square beyond fp32's range is no inf):
    within the additions' bound of the exactly rounded sum; and small values alone (subnormal squares)."""
    for scale in (1.0, 1e-30):
        g = gradient(n, grad_dtype, seed=n, scale=scale)
        ours, exact = kernel.sum_of_squares(g), exact_sum_of_squares(g)
        assert isinstance(ours, float) and math.isfinite(ours), ours
        assert abs(ours - exact) <= n * 2.0**-53 * exact, (kernel.isa(), n, grad_dtype, scale, ours, exact)


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_sum_of_squares_zeros_and_non_finite(kernel, grad_dtype):
    """All zeros (-0.0 too) sum to 0.0; one inf or NaN anywhere (in a vector, a tail, another tile) makes the sum inf
    or NaN, so the step's non-finite check (fp16's skip) still sees it."""
    n = 2**17 + 21
    assert kernel.sum_of_squares(torch.zeros(n, dtype=grad_dtype)) == 0.0
    assert kernel.sum_of_squares(torch.full((n,), -0.0, dtype=grad_dtype)) == 0.0
    for at in (0, 5, 16, 2**16 + 3, n - 1):
        for bad, check in ((math.inf, math.isinf), (-math.inf, math.isinf), (math.nan, math.isnan)):
            g = gradient(n, grad_dtype, seed=at)
            g[at] = bad
            got = kernel.sum_of_squares(g)
            assert check(got) and (math.isnan(got) or got > 0), (kernel.isa(), grad_dtype, at, bad, got)
        g = gradient(n, grad_dtype, seed=at)
        g[at], g[n - 1 - at] = math.inf, math.nan
        assert math.isnan(kernel.sum_of_squares(g)), (kernel.isa(), grad_dtype, at)


def test_sum_of_squares_views_and_threads(kernel):
    """Contiguous views at odd offsets (a bucket's slice of the flat gradient shard), on 1 thread or 2: the same bits
    as an aligned tensor (the tiles' sums are added in tile order, whatever thread computed them)."""
    n = 300_001
    g = torch.randn(n, generator=torch.Generator().manual_seed(3)).bfloat16()
    view = torch.empty(n + 7, dtype=torch.bfloat16)[7:].copy_(g)
    threads = kernel.threads()
    try:
        kernel.set_threads(1)
        one = kernel.sum_of_squares(g)
        kernel.set_threads(2)
        two = kernel.sum_of_squares(view)
    finally:
        kernel.set_threads(threads)
    assert one == two, (kernel.isa(), one, two)
    assert abs(one - exact_sum_of_squares(g)) <= n * 2.0**-53 * one


@pytest.mark.parametrize("grad, words", [
    (torch.zeros(128)[::2], ["grad", "not contiguous"]),
    (torch.zeros(64, dtype=torch.float64), ["grad", "Double", "float32, bfloat16 or float16"]),
    (torch.zeros(64, device="meta"), ["grad", "meta", "CPU"]),
])
def test_sum_of_squares_bad_inputs_raise_clear_errors(grad, words):
    with pytest.raises(RuntimeError) as e:
        load_cpu_adam(RUNNABLE[0]).sum_of_squares(grad)
    for w in words:
        assert w.lower() in str(e.value).lower(), (w, str(e.value))
