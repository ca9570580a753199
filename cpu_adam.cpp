// cpu_adam.cpp: a fast, exact AdamW step for fp32 master weights on the CPU (ZeRO-Offload's optimizer).
//
//     adam_step(param, grad, exp_avg, exp_avg_sq, param_out=None, *, step, lr, beta1, beta2, eps, weight_decay,
//               grad_scale)    the tensors by position, the step and the hyperparameters by name (the binding below)
//     sum_of_squares(grad) -> float: Σ grad² in double, for the gradient norm that decides the clipping
//
// The algorithm: torch.optim.AdamW for one fp32 tensor, with torch's operations in torch's order, each rounded once
// to fp32 (the two multiply-adds fused), so the result is defined bit for bit by these lines on every CPU and path:
//     g = g * grad_scale                                    in fp32, as grad.float().mul_(grad_scale) would
//     p = p * (1 - lr*wd)                                   decoupled weight decay
//     m = fma(1-beta1, g - m, m)                            torch's lerp (one fused multiply-add in its AVX2 kernel)
//     v = fma((1-beta2)*g, g, v*beta2)                      torch's mul_ + addcmul_
//     p = p + (-lr/bc1 * m) / (sqrt(v)/sqrt(bc2) + eps)     bc1 = 1 - beta1^step, bc2 = 1 - beta2^step
// The constants (struct Hyper) are computed once per call in double and rounded to fp32; `step` comes from the
// caller, never counted here. torch's own AdamW agrees to a few ulps, not always bit for bit: its sqrt comes from
// the CPU's math library (MKL's is not correctly rounded for ~15% of inputs on some AMD CPUs; vsqrtps is), and
// whether its lerp and addcmul are fused depends on its build and on the CPU (not on its scalar DEFAULT path).
// The hyperparameters are checked as torch checks them: lr, eps, weight_decay >= 0, betas in [0, 1).
//
// grad_scale is the caller's gradient-clipping coefficient (1.0 when nothing is clipped); in fp16 it also divides
// out the loss scale (train_gpt.clip_coef folds both into one factor). Applied here, in the same
// pass, it saves the caller a pass of its own that scales an fp32 copy of the gradient: for a bf16 gradient, a
// temporary of 4 bytes per parameter and ~16 bytes per parameter of memory traffic on top of the step's 26-28.
// It is rounded to fp32 first, as torch rounds a Python scalar that multiplies an fp32 tensor, so the result is
// bit for bit what the step does with the scaled gradient. Multiplying by 1.0 is exact, and one multiply per
// vector is nothing beside the two divisions and the square root, so there is no separate unscaled path.
//
// Why it is bandwidth bound: per parameter we read p, g, m, v and write p, m, v: 28 bytes for a dozen flops.
// So: one pass, no temporaries, each value loaded once and stored once. The arithmetic is not free either (two
// divisions and a square root per element, of the order of memory's own rate per core), so the loop prefetches
// ahead in software to keep memory busy while the divider works. The stores are ordinary, not streaming: p, m, v
// are updated in place, so their lines are in the cache already (bench/bench_adam.py's ceiling loops measure both
// kinds of store on any machine).
//
// Structure: OpenMP splits the arrays into large tiles (static schedule: each thread walks one contiguous run);
// inside a tile, one of three code paths chosen at compile time: AVX-512 (16 floats per vector), AVX2 + FMA (8),
// or the portable scalar loop, which also does the tails. All paths compute the same bits: the FMAs are written
// out, and the build passes -ffp-contract=off so that the compiler adds none of its own.
// The loader (load_cpu_adam) picks the path from torch's own CPU check and compiles it with explicit
// flags, never -march=native: AVX-512 with -mavx512f -mavx512bw -mavx512vl -mavx512dq -mavx2 -mfma, AVX2 with
// -mavx2 -mfma -mf16c (every AVX2 CPU has F16C), scalar with none (the only path on aarch64, where the compiler may
// still vectorise it with NEON).
// isa() reports the path that was compiled, and the module is named after it (cpu_adam_avx2, ...), so a build
// cached on one CPU (a shared home, a container image) is never loaded on a CPU that cannot run it.
// set_threads(n) sets the threads of this kernel's parallel region only (torch's own thread count is untouched);
// the loader gives each rank its share of the node's cores.
// bf16 and fp16 gradients are widened to fp32 (exactly: a shift; vcvtph2ps, or its portable equivalent), then scaled.
// The optional `param_out` receives the updated parameters in the same pass (fp32, or bf16 or fp16 rounded to
// nearest even: what ZeRO-Offload copies back to the device). fp16's narrowing is vcvtps2ph on the vector paths
// and integer arithmetic on the portable one, the same bits: ties to even, overflow to inf, subnormals kept (no
// flush to zero), and NaN as the quiet NaN 0x7e00 (bf16's: 0x7fc0).
//
// sum_of_squares(grad) (fp32, bf16 or fp16) runs on the same threads and tiles: each element is widened to double and
// squared there, exactly (a float's 24-bit significand squared fits a double's 53 bits, and no float squared leaves
// a double's range), then summed in double: per tile in the vector path's lanes (or the portable loop's 8
// accumulators), the tiles' sums added in tile order, so the result does not depend on the number of threads. Its
// error is that of the additions alone, under n * 2^-53 of the sum; an inf or NaN element makes the sum inf or NaN.
#include <torch/extension.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <vector>
#ifdef _OPENMP
#include <omp.h>
#endif
// The vector path this build has: each needs FMA beside it (the kernel's multiply-adds are fused, tails too).
#if defined(__AVX512F__) && defined(__FMA__)
#define CPU_ADAM_AVX512 1
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define CPU_ADAM_AVX2 1
#include <immintrin.h>
#endif

namespace {

struct Hyper {        // per-call constants, all as float like torch's fp32 kernels
    float decay;      // 1 - lr*wd
    float w1;         // 1 - beta1 (the lerp weight)
    float beta2, w2;  // beta2, 1 - beta2
    float neg_step;   // -lr / bc1
    float bc2_sqrt;   // sqrt(bc2)
    float eps;
    float scale;      // grad_scale, rounded to fp32
};

constexpr int64_t kTile = 1 << 16;  // elements per OpenMP work item (a multiple of 16; 1.75 MiB of traffic)
constexpr int64_t kAhead = 512;  // software prefetch distance in elements (2 KiB of each fp32 array)
constexpr int kLocality = 2;     // __builtin_prefetch locality 2 = prefetcht1: into L2
int g_threads = 0;               // threads of the parallel region; 0: OpenMP's default (set_threads)

int num_threads() {
#ifdef _OPENMP
    return g_threads > 0 ? g_threads : omp_get_max_threads();
#else
    return 1;
#endif
}

// Ask for the cache lines needed kAhead elements from now: one line (16 floats) of each array per 16 elements,
// so that the core waits on memory less often than with the hardware prefetcher alone.
template <typename G>
inline void prefetch(const float* p, const G* g, const float* m, const float* v, int64_t i, int64_t end) {
    if (i + kAhead >= end) return;  // stay inside this tile (and the arrays)
    __builtin_prefetch(p + i + kAhead, 0, kLocality); __builtin_prefetch(g + i + kAhead, 0, kLocality);
    __builtin_prefetch(m + i + kAhead, 0, kLocality); __builtin_prefetch(v + i + kAhead, 0, kLocality);
}

// Call f(begin, end) on tiles of `tile` elements covering [0, n), in parallel. A short first piece makes every
// tile start at a 64-byte boundary of p (whole cache lines per vector; p, m, v share that alignment in practice).
template <typename F>
void for_each_tile(const float* p, int64_t n, int64_t tile, F f) {
    const int64_t head = std::min<int64_t>(n, (64 - reinterpret_cast<uintptr_t>(p) % 64) % 64 / sizeof(float));
    if (head) f(0, head);
    const int64_t tiles = (n - head + tile - 1) / tile;
#pragma omp parallel for schedule(static) num_threads(num_threads()) if (tiles > 1)
    for (int64_t t = 0; t < tiles; ++t) f(head + t * tile, std::min(n, head + (t + 1) * tile));
}

// ---- bf16 <-> fp32. bf16 is the top half of an fp32; rounding adds 0x7fff + (lowest kept bit).
inline float bf16_to_float(uint16_t b) {
    uint32_t u = uint32_t(b) << 16; float f; std::memcpy(&f, &u, 4); return f;
}
inline uint16_t float_to_bf16(float f) {  // round to nearest even, NaN stays a (quiet) NaN
    uint32_t u; std::memcpy(&u, &f, 4);
    const uint16_t rounded = uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
    return f != f ? uint16_t(0x7fc0) : rounded;  // a select, not a branch: the loop stays vectorisable
}

// ---- fp16 <-> fp32 (IEEE binary16: 5 exponent bits, bias 15; 10 mantissa bits). Branch-free, like bf16's: selects.
struct Half { uint16_t bits; };  // fp16 (bf16 is a plain uint16_t)
inline float half_to_float(uint16_t h) {  // exact
    const uint32_t sign = uint32_t(h & 0x8000u) << 16, rest = uint32_t(h & 0x7fffu) << 13, m = h & 0x3ffu;
    float sub = float(m) * 5.9604644775390625e-8f;  // exponent 0: m * 2^-24 (m < 2^10: exact), zero included
    uint32_t s; std::memcpy(&s, &sub, 4);
    const uint32_t e = h & 0x7c00u, u = e == 0x7c00u ? (rest | 0x7f800000u | (m ? 0x00400000u : 0u))  // inf, quiet NaN
                                      : e == 0 ? s : rest + 0x38000000u;  // normal: rebias 15 -> 127
    const uint32_t w = sign | u; float f; std::memcpy(&f, &w, 4); return f;
}
inline uint16_t float_to_half(float f) {  // round to nearest even, NaN -> 0x7e00
    uint32_t u; std::memcpy(&u, &f, 4);
    const uint32_t sign = (u >> 16) & 0x8000u, a = u & 0x7fffffffu;
    // |f| < 2^-14 (a subnormal half, or 0): adding 0.5 rounds |f| to a multiple of 2^-24, the subnormal half's step,
    // to nearest even (the sum's ulp is 2^-24); the sum's low bits are then the half (0x400 if it rounds up to 2^-14)
    float sub = std::fabs(f) + 0.5f;
    uint32_t s; std::memcpy(&s, &sub, 4);
    // a normal half: rebias 127 -> 15 and round off 13 bits to nearest even; a carry may reach the exponent, even inf
    const uint32_t normal = (a - 0x38000000u + 0xfffu + ((a >> 13) & 1u)) >> 13;
    const uint32_t h = a >= 0x47800000u ? 0x7c00u : a < 0x38800000u ? s - 0x3f000000u : normal;  // >= 2^16: inf
    return f != f ? uint16_t(0x7e00) : uint16_t(sign | h);
}
inline float load1(const float* g, int64_t i) { return g[i]; }
inline float load1(const uint16_t* g, int64_t i) { return bf16_to_float(g[i]); }
inline float load1(const Half* g, int64_t i) { return half_to_float(g[i].bits); }
inline void store1(float* o, int64_t i, float x) { o[i] = x; }
inline void store1(uint16_t* o, int64_t i, float x) { o[i] = float_to_bf16(x); }
inline void store1(Half* o, int64_t i, float x) { o[i].bits = float_to_half(x); }

// One element, the reference math (scalar path and tails).
template <typename G, typename O>
inline void adam1(float* p, const G* g, float* m, float* v, O* out, int64_t i, const Hyper& h) {
    float gi = load1(g, i) * h.scale;
    float mi = std::fma(h.w1, gi - m[i], m[i]);
    float vi = std::fma(h.w2 * gi, gi, v[i] * h.beta2);
    float denom = std::sqrt(vi) / h.bc2_sqrt + h.eps;
    float pi = p[i] * h.decay + (h.neg_step * mi) / denom;
    p[i] = pi; m[i] = mi; v[i] = vi;
    if (out) store1(out, i, pi);
}

// ---- The vector path: one struct of the few operations the loops use, so each loop is written once.
#if defined(CPU_ADAM_AVX512)
constexpr const char* kIsa = "avx512";
struct Simd {
    using F = __m512;
    static constexpr int64_t width = 16;
    static F set1(float x) { return _mm512_set1_ps(x); }
    static F load(const float* x) { return _mm512_loadu_ps(x); }
    static F load(const uint16_t* x) {  // widen 16 bf16 -> 16 fp32
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)x)), 16));
    }
    static void store(float* o, F x) { _mm512_storeu_ps(o, x); }
    static void store(uint16_t* o, F x) {
        // Integer round-to-nearest-even, bit-identical to torch's .to(bfloat16). (vcvtneps2bf16 from
        // AVX512_BF16 would also round to nearest even, but it flushes denormals to zero.)
        __m512i u = _mm512_castps_si512(x);
        __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
        u = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
        __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
        u = _mm512_mask_blend_epi32(nan, u, _mm512_set1_epi32(0x7fc00000));
        _mm256_storeu_si256((__m256i*)o, _mm512_cvtepi32_epi16(_mm512_srli_epi32(u, 16)));
    }
    static F load(const Half* x) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)x)); }  // 16 fp16
    static void store(Half* o, F x) {  // vcvtps2ph to nearest even; NaN -> 0x7e00, as the portable path has it
        __m256i h = _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        h = _mm256_mask_blend_epi16(_mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), h, _mm256_set1_epi16(0x7e00));
        _mm256_storeu_si256((__m256i*)o, h);
    }
    static F add(F a, F b) { return _mm512_add_ps(a, b); }
    static F sub(F a, F b) { return _mm512_sub_ps(a, b); }
    static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
    static F div(F a, F b) { return _mm512_div_ps(a, b); }
    static F sqrt(F a) { return _mm512_sqrt_ps(a); }
    static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
    // sum_of_squares: the two halves of x widened to 8 doubles each, squared (exactly) and added to lo and hi
    using D = __m512d;
    static D dzero() { return _mm512_setzero_pd(); }
    static void add_squares(D& lo, D& hi, F x) {
        const D a = _mm512_cvtps_pd(_mm512_castps512_ps256(x)), b = _mm512_cvtps_pd(_mm512_extractf32x8_ps(x, 1));
        lo = _mm512_add_pd(lo, _mm512_mul_pd(a, a));
        hi = _mm512_add_pd(hi, _mm512_mul_pd(b, b));
    }
    static double total(D lo, D hi) { return _mm512_reduce_add_pd(_mm512_add_pd(lo, hi)); }
};
#elif defined(CPU_ADAM_AVX2)
constexpr const char* kIsa = "avx2";
struct Simd {
    using F = __m256;
    static constexpr int64_t width = 8;
    static F set1(float x) { return _mm256_set1_ps(x); }
    static F load(const float* x) { return _mm256_loadu_ps(x); }
    static F load(const uint16_t* x) {  // widen 8 bf16 -> 8 fp32
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)x)), 16));
    }
    static void store(float* o, F x) { _mm256_storeu_ps(o, x); }
    static void store(uint16_t* o, F x) {
        __m256i u = _mm256_castps_si256(x);
        __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
        u = _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
        __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
        u = _mm256_blendv_epi8(u, _mm256_set1_epi32(0x7fc00000), nan);
        u = _mm256_srli_epi32(u, 16);  // 8 x 16-bit values in 32-bit lanes: pack the two halves
        _mm_storeu_si128((__m128i*)o, _mm_packus_epi32(_mm256_castsi256_si128(u), _mm256_extracti128_si256(u, 1)));
    }
    static F load(const Half* x) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)x)); }  // 8 fp16 (F16C)
    static void store(Half* o, F x) {  // vcvtps2ph to nearest even; NaN -> 0x7e00, as the portable path has it
        __m128i h = _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));  // 8 x 32-bit masks -> 8 x 16-bit
        __m128i nan16 = _mm_packs_epi32(_mm256_castsi256_si128(nan), _mm256_extracti128_si256(nan, 1));
        _mm_storeu_si128((__m128i*)o, _mm_blendv_epi8(h, _mm_set1_epi16(0x7e00), nan16));
    }
    static F add(F a, F b) { return _mm256_add_ps(a, b); }
    static F sub(F a, F b) { return _mm256_sub_ps(a, b); }
    static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
    static F div(F a, F b) { return _mm256_div_ps(a, b); }
    static F sqrt(F a) { return _mm256_sqrt_ps(a); }
    static F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
    // sum_of_squares: the two halves of x widened to 4 doubles each, squared (exactly) and added to lo and hi
    using D = __m256d;
    static D dzero() { return _mm256_setzero_pd(); }
    static void add_squares(D& lo, D& hi, F x) {
        const D a = _mm256_cvtps_pd(_mm256_castps256_ps128(x)), b = _mm256_cvtps_pd(_mm256_extractf128_ps(x, 1));
        lo = _mm256_add_pd(lo, _mm256_mul_pd(a, a));
        hi = _mm256_add_pd(hi, _mm256_mul_pd(b, b));
    }
    static double total(D lo, D hi) {
        double d[4];
        _mm256_storeu_pd(d, _mm256_add_pd(lo, hi));
        return (d[0] + d[1]) + (d[2] + d[3]);
    }
};
#else
constexpr const char* kIsa = "scalar";
#endif

// Update elements [begin, end) of one tile.
template <typename G, typename O>
void adam_tile(float* p, const G* g, float* m, float* v, O* out, int64_t begin, int64_t end, const Hyper& h) {
    int64_t i = begin;
#if defined(CPU_ADAM_AVX512) || defined(CPU_ADAM_AVX2)
    using S = Simd;
    const S::F decay = S::set1(h.decay), w1 = S::set1(h.w1), b2 = S::set1(h.beta2), w2 = S::set1(h.w2),
               ns = S::set1(h.neg_step), bc2s = S::set1(h.bc2_sqrt), eps = S::set1(h.eps), gs = S::set1(h.scale);
    for (; i + S::width <= end; i += S::width) {
        if ((i - begin) % 16 == 0) prefetch(p, g, m, v, i, end);
        S::F gi = S::mul(S::load(g + i), gs), mi = S::load(m + i), vi = S::load(v + i);
        mi = S::fma(w1, S::sub(gi, mi), mi);
        vi = S::fma(S::mul(w2, gi), gi, S::mul(vi, b2));
        S::F denom = S::add(S::div(S::sqrt(vi), bc2s), eps);
        S::F pi = S::add(S::mul(S::load(p + i), decay), S::div(S::mul(ns, mi), denom));
        S::store(p + i, pi); S::store(m + i, mi); S::store(v + i, vi);
        if (out) S::store(out + i, pi);
    }
#endif
    // The portable path, and the tail of the SIMD paths, written so that the compiler can vectorise it where there
    // is no path above (with NEON on aarch64: vector fma, sqrt and div round as the scalar ones do, so the bits are
    // the same): no branch inside (two loops, not `if (out)` in one; -fno-math-errno, or sqrt has a branch to set
    // errno), and ivdep: the arrays do not overlap at different indices, as the SIMD paths above assume too.
    if (out) {
#pragma GCC ivdep
        for (; i < end; ++i) adam1(p, g, m, v, out, i, h);
    } else {
#pragma GCC ivdep
        for (; i < end; ++i) adam1(p, g, m, v, static_cast<O*>(nullptr), i, h);
    }
}

template <typename G, typename O>
void adam_all(float* p, const G* g, float* m, float* v, O* out, int64_t n, const Hyper& h) {
    for_each_tile(p, n, kTile, [&](int64_t b, int64_t e) { adam_tile(p, g, m, v, out, b, e, h); });
}

// Σ g² over elements [begin, end) of one tile, in double (see the header).
template <typename G>
double sum_of_squares_tile(const G* g, int64_t begin, int64_t end) {
    int64_t i = begin;
    double total = 0.0;
#if defined(CPU_ADAM_AVX512) || defined(CPU_ADAM_AVX2)
    using S = Simd;
    S::D lo = S::dzero(), hi = S::dzero();
    for (; i + S::width <= end; i += S::width) S::add_squares(lo, hi, S::load(g + i));
    total = S::total(lo, hi);
#endif
    // The portable path (8 sums side by side, which the compiler may vectorise), and the SIMD paths' tail.
    double acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (; i + 8 <= end; i += 8) {
        for (int k = 0; k < 8; ++k) {
            const double x = load1(g, i + k);
            acc[k] += x * x;
        }
    }
    for (int k = 0; i < end; ++i, ++k) {
        const double x = load1(g, i);
        acc[k] += x * x;
    }
    return total + (((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7])));
}

void check(const at::Tensor& t, const char* name, int64_t n, bool allow_16) {
    TORCH_CHECK(t.device().is_cpu(), "adam_step: ", name, " is on ", t.device(), "; pass a CPU tensor (.cpu())");
    const bool is16 = t.scalar_type() == at::kBFloat16 || t.scalar_type() == at::kHalf;
    TORCH_CHECK(t.scalar_type() == at::kFloat || (allow_16 && is16), "adam_step: ", name, " has dtype ",
                t.scalar_type(), "; it must be float32", allow_16 ? ", bfloat16 or float16" : "",
                " (convert it once, outside the step)");
    TORCH_CHECK(t.is_contiguous(), "adam_step: ", name, " is not contiguous; pass a contiguous tensor (e.g. a "
                "flat buffer). No hidden copy is made: an update of a copy would be lost");
    TORCH_CHECK(t.numel() == n, "adam_step: ", name, " has ", t.numel(), " elements but param has ", n,
                "; all tensors must have the same number of elements");
}

// f(pointer) with the pointer typed by dtype: float, bf16 (uint16_t) or fp16 (Half). One instantiation of the
// loops per pair of gradient and param_out types.
template <typename F>
void with_type(at::ScalarType dtype, void* ptr, F f) {
    if (dtype == at::kBFloat16) f(static_cast<uint16_t*>(ptr));
    else if (dtype == at::kHalf) f(static_cast<Half*>(ptr));
    else f(static_cast<float*>(ptr));
}

}  // namespace

void adam_step(at::Tensor param, at::Tensor grad, at::Tensor exp_avg, at::Tensor exp_avg_sq,
               std::optional<at::Tensor> param_out, int64_t step, double lr, double beta1, double beta2,
               double eps, double weight_decay, double grad_scale) {
    const int64_t n = param.numel();
    check(param, "param", n, false);
    check(grad, "grad", n, true);
    check(exp_avg, "exp_avg", n, false);
    check(exp_avg_sq, "exp_avg_sq", n, false);
    if (param_out) check(*param_out, "param_out", n, true);
    TORCH_CHECK(step >= 1, "adam_step: step must be >= 1 (the optimizer step number), got ", step);
    // torch.optim.AdamW's checks, written so that a NaN fails them too.
    TORCH_CHECK(lr >= 0.0, "adam_step: lr must be in [0, inf), got ", lr);
    TORCH_CHECK(eps >= 0.0, "adam_step: eps must be in [0, inf), got ", eps);
    TORCH_CHECK(weight_decay >= 0.0, "adam_step: weight_decay must be in [0, inf), got ", weight_decay);
    TORCH_CHECK(beta1 >= 0.0 && beta1 < 1.0, "adam_step: beta1 must be in [0, 1), got ", beta1);
    TORCH_CHECK(beta2 >= 0.0 && beta2 < 1.0, "adam_step: beta2 must be in [0, 1), got ", beta2);
    // A NaN or infinite scale would quietly turn every parameter and both moments into NaN, for good. (Also
    // rejected: a double beyond fp32's range, which would round to inf.)
    TORCH_CHECK(std::isfinite(grad_scale) && std::fabs(grad_scale) <= std::numeric_limits<float>::max(),
                "adam_step: grad_scale must be finite (the gradient-clipping coefficient, 1.0 for none), got ",
                grad_scale, "; a NaN or infinite gradient norm must be dealt with before the step");
    const float scale = float(grad_scale);

    const double bc1 = 1.0 - std::pow(beta1, double(step)), bc2 = 1.0 - std::pow(beta2, double(step));
    const Hyper h{float(1.0 - lr * weight_decay), float(1.0 - beta1), float(beta2), float(1.0 - beta2),
                  float(-(lr / bc1)), float(std::pow(bc2, 0.5)), float(eps), scale};
    float *p = param.data_ptr<float>(), *m = exp_avg.data_ptr<float>(), *v = exp_avg_sq.data_ptr<float>();
    void* o = param_out ? param_out->data_ptr() : nullptr;  // (no param_out: a null float*)
    const at::ScalarType o_type = param_out ? param_out->scalar_type() : at::kFloat;

    pybind11::gil_scoped_release no_gil;  // let other Python threads run during the step
    with_type(grad.scalar_type(), grad.data_ptr(), [&](auto* g) {
        with_type(o_type, o, [&](auto* out) { adam_all(p, g, m, v, out, n, h); });
    });
}

// Σ grad² in double over a contiguous fp32, bf16 or fp16 CPU tensor, on the kernel's threads (see the header).
double sum_of_squares(at::Tensor grad) {
    const int64_t n = grad.numel();
    TORCH_CHECK(grad.device().is_cpu(), "sum_of_squares: grad is on ", grad.device(), "; pass a CPU tensor (.cpu())");
    TORCH_CHECK(grad.scalar_type() == at::kFloat || grad.scalar_type() == at::kBFloat16 ||
                grad.scalar_type() == at::kHalf, "sum_of_squares: grad has dtype ", grad.scalar_type(),
                "; it must be float32, bfloat16 or float16");
    TORCH_CHECK(grad.is_contiguous(), "sum_of_squares: grad is not contiguous; pass a contiguous tensor (a flat "
                "buffer, or .contiguous())");
    const int64_t tiles = (n + kTile - 1) / kTile;
    std::vector<double> sums(tiles, 0.0);  // one per tile, added in order below: the same result on any threads
    pybind11::gil_scoped_release no_gil;
    with_type(grad.scalar_type(), grad.data_ptr(), [&](auto* g) {
#pragma omp parallel for schedule(static) num_threads(num_threads()) if (tiles > 1)
        for (int64_t t = 0; t < tiles; ++t) sums[t] = sum_of_squares_tile(g, t * kTile, std::min(n, (t + 1) * kTile));
    });
    double total = 0.0;
    for (const double s : sums) total += s;
    return total;
}

// The code path this build was compiled with: "avx512", "avx2" or "scalar".
std::string isa() { return kIsa; }

// Threads of the kernel's parallel region (this module's only; torch's own thread count is left alone).
void set_threads(int64_t n) {
    TORCH_CHECK(n >= 1, "set_threads: the number of threads must be >= 1, got ", n);
    g_threads = int(n);
}
int64_t threads() { return num_threads(); }

// The Python binding, written here rather than by load_inline's functions=[...], so that adam_step's arguments have
// names and its scalars can only be passed by name (a swapped beta1 and lr would otherwise run without a word).
// A file that compiles this one in with bindings of its own (bench/touch.cpp) defines CPU_ADAM_NO_MODULE first.
#ifndef CPU_ADAM_NO_MODULE
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.def("adam_step", &adam_step, "one AdamW step of param (fp32) in place, its new values also into param_out",
          py::arg("param"), py::arg("grad"), py::arg("exp_avg"), py::arg("exp_avg_sq"),
          py::arg("param_out") = py::none(), py::kw_only(), py::arg("step"), py::arg("lr"), py::arg("beta1"),
          py::arg("beta2"), py::arg("eps"), py::arg("weight_decay"), py::arg("grad_scale"));
    m.def("sum_of_squares", &sum_of_squares, "Σ grad² in double", py::arg("grad"));
    m.def("isa", &isa, "the code path this build was compiled with");
    m.def("set_threads", &set_threads, "the threads of the kernel's parallel region", py::arg("n"));
    m.def("threads", &threads, "the threads of the kernel's parallel region");
}
#endif
