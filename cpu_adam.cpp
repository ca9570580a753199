// cpu_adam.cpp: a fast, exact AdamW step for fp32 master weights on the CPU (ZeRO-Offload's optimizer).
//
//     adam_step(param, grad, exp_avg, exp_avg_sq, param_out, step, lr, beta1, beta2, eps, weight_decay, grad_scale)
//
// The algorithm: torch.optim.AdamW for one fp32 tensor, with torch's operations in torch's order, so that
// exp_avg and exp_avg_sq come out bit-identical to torch's:
//     g = g * grad_scale                                    in fp32, as grad.float().mul_(grad_scale) would
//     p = p * (1 - lr*wd)                                   decoupled weight decay
//     m = fma(1-beta1, g - m, m)                            torch's lerp: one fused multiply-add
//     v = fma((1-beta2)*g, g, v*beta2)                      torch's mul_ + addcmul_ (compiled into one FMA)
//     p = p + (-lr/bc1 * m) / (sqrt(v)/sqrt(bc2) + eps)     bc1 = 1 - beta1^step, bc2 = 1 - beta2^step
// The bias corrections are computed once per call, in double; `step` comes from the caller, never counted here.
// (p can differ from torch's by one ulp in rare elements: torch's CPU sqrt is not always correctly rounded.)
//
// grad_scale is the caller's gradient-clipping coefficient (1.0 when nothing is clipped). Applied here, in the same
// pass, it saves the caller a pass of its own that scales an fp32 copy of the gradient: for a bf16 gradient, a
// temporary of 4 bytes per parameter and ~16 bytes per parameter of memory traffic on top of the step's 26-28.
// It is rounded to fp32 first, as torch rounds a Python scalar that multiplies an fp32 tensor, so the result is
// bit for bit what torch's AdamW does with the scaled gradient. Multiplying by 1.0 is exact, and one multiply per
// vector is nothing beside the two divisions and the square root (measured at 2^24 and 2^26 parameters: no
// difference beyond this machine's +-2% noise), so there is no separate unscaled path.
//
// Why it is bandwidth bound: per parameter we read p, g, m, v and write p, m, v: 28 bytes for a dozen flops.
// So: one pass, no temporaries, each value loaded once and stored once. The arithmetic is not free either (two
// divisions and a square root per element, ~1 G elements/s per core here, little more than memory's
// ~0.7 G/s per core), so the loop prefetches ahead in software to keep memory busy while the divider works.
// Non-temporal (streaming) stores were measured and rejected: p, m, v are updated in place, so their lines are in
// the cache already and bypassing it only slowed the step down (by 10-15%).
//
// Structure: OpenMP splits the arrays into large tiles (static schedule: each thread walks one contiguous run);
// inside a tile, one of three code paths chosen at compile time: AVX-512 (16 floats per vector), AVX2 (8), or
// the portable scalar loop, which also does the tails. All paths compute the same bits: the FMAs are written
// out, and the build passes -ffp-contract=off so that the compiler adds none of its own.
// bf16 gradients are widened to fp32 with a shift (exact), then scaled. The optional `param_out` receives the
// updated parameters in the same pass (fp32, or bf16 rounded to nearest even: what ZeRO-Offload copies back to
// the device).
#include <torch/extension.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#if defined(__AVX2__) || defined(__AVX512F__)
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
constexpr int kLocality = 2;     // __builtin_prefetch locality 2 = prefetcht1: into L2 (measured a little better)

// Ask for the cache lines needed kAhead elements from now: one line (16 floats) of each array per 16 elements.
// With the hardware prefetcher alone the core waits on memory more often (measured: the step is 5-10% slower).
template <typename G>
inline void prefetch(const float* p, const G* g, const float* m, const float* v, int64_t i, int64_t end) {
    if (i + kAhead >= end) return;  // stay inside this tile (and the arrays)
    __builtin_prefetch(p + i + kAhead, 0, kLocality); __builtin_prefetch(g + i + kAhead, 0, kLocality);
    __builtin_prefetch(m + i + kAhead, 0, kLocality); __builtin_prefetch(v + i + kAhead, 0, kLocality);
}

// Call f(begin, end) on tiles covering [0, n), in parallel. A short first piece makes every tile start at a
// 64-byte boundary of p (whole cache lines per vector; p, m, v share that alignment in practice).
template <typename F>
void for_each_tile(const float* p, int64_t n, F f) {
    const int64_t head = std::min<int64_t>(n, (64 - reinterpret_cast<uintptr_t>(p) % 64) % 64 / sizeof(float));
    if (head) f(0, head);
    const int64_t tiles = (n - head + kTile - 1) / kTile;
#pragma omp parallel for schedule(static) if (tiles > 1)
    for (int64_t t = 0; t < tiles; ++t) f(head + t * kTile, std::min(n, head + (t + 1) * kTile));
}

// ---- bf16 <-> fp32. bf16 is the top half of an fp32; rounding adds 0x7fff + (lowest kept bit).
inline float bf16_to_float(uint16_t b) {
    uint32_t u = uint32_t(b) << 16; float f; std::memcpy(&f, &u, 4); return f;
}
inline uint16_t float_to_bf16(float f) {  // round to nearest even, NaN stays a (quiet) NaN
    if (std::isnan(f)) return 0x7fc0;
    uint32_t u; std::memcpy(&u, &f, 4);
    return uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
inline float load1(const float* g, int64_t i) { return g[i]; }
inline float load1(const uint16_t* g, int64_t i) { return bf16_to_float(g[i]); }
inline void store1(float* o, int64_t i, float x) { o[i] = x; }
inline void store1(uint16_t* o, int64_t i, float x) { o[i] = float_to_bf16(x); }

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

#if defined(__AVX512F__)
inline __m512 load16(const float* g) { return _mm512_loadu_ps(g); }
inline __m512 load16(const uint16_t* g) {  // widen 16 bf16 -> 16 fp32
    __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)g));
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}
inline void store16(float* o, __m512 x) { _mm512_storeu_ps(o, x); }
inline void store16(uint16_t* o, __m512 x) {
    // Integer round-to-nearest-even, bit-identical to torch's .to(bfloat16). (vcvtneps2bf16 from
    // AVX512_BF16 would also round to nearest even, but it flushes denormals to zero.)
    __m512i u = _mm512_castps_si512(x);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    u = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
    __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    u = _mm512_mask_blend_epi32(nan, u, _mm512_set1_epi32(0x7fc00000));
    _mm256_storeu_si256((__m256i*)o, _mm512_cvtepi32_epi16(_mm512_srli_epi32(u, 16)));
}
#endif

#if defined(__AVX2__) && !defined(__AVX512F__)
inline __m256 load8(const float* g) { return _mm256_loadu_ps(g); }
inline __m256 load8(const uint16_t* g) {
    __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)g));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}
inline void store8(float* o, __m256 x) { _mm256_storeu_ps(o, x); }
inline void store8(uint16_t* o, __m256 x) {
    __m256i u = _mm256_castps_si256(x);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    u = _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
    __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    u = _mm256_blendv_epi8(u, _mm256_set1_epi32(0x7fc00000), nan);
    u = _mm256_srli_epi32(u, 16);  // 8 x 16-bit values in 32-bit lanes: pack the two halves
    _mm_storeu_si128((__m128i*)o, _mm_packus_epi32(_mm256_castsi256_si128(u), _mm256_extracti128_si256(u, 1)));
}
#endif

// Update elements [begin, end) of one tile.
template <typename G, typename O>
void adam_tile(float* p, const G* g, float* m, float* v, O* out, int64_t begin, int64_t end, const Hyper& h) {
    int64_t i = begin;
#if defined(__AVX512F__)
    const __m512 decay = _mm512_set1_ps(h.decay), w1 = _mm512_set1_ps(h.w1), b2 = _mm512_set1_ps(h.beta2),
                 w2 = _mm512_set1_ps(h.w2), ns = _mm512_set1_ps(h.neg_step), bc2s = _mm512_set1_ps(h.bc2_sqrt),
                 eps = _mm512_set1_ps(h.eps), gs = _mm512_set1_ps(h.scale);
    for (; i + 16 <= end; i += 16) {
        prefetch(p, g, m, v, i, end);
        __m512 gi = _mm512_mul_ps(load16(g + i), gs), mi = _mm512_loadu_ps(m + i), vi = _mm512_loadu_ps(v + i);
        mi = _mm512_fmadd_ps(w1, _mm512_sub_ps(gi, mi), mi);
        vi = _mm512_fmadd_ps(_mm512_mul_ps(w2, gi), gi, _mm512_mul_ps(vi, b2));
        __m512 denom = _mm512_add_ps(_mm512_div_ps(_mm512_sqrt_ps(vi), bc2s), eps);
        __m512 pi = _mm512_add_ps(_mm512_mul_ps(_mm512_loadu_ps(p + i), decay),
                                  _mm512_div_ps(_mm512_mul_ps(ns, mi), denom));
        _mm512_storeu_ps(p + i, pi); _mm512_storeu_ps(m + i, mi); _mm512_storeu_ps(v + i, vi);
        if (out) store16(out + i, pi);
    }
#elif defined(__AVX2__)
    const __m256 decay = _mm256_set1_ps(h.decay), w1 = _mm256_set1_ps(h.w1), b2 = _mm256_set1_ps(h.beta2),
                 w2 = _mm256_set1_ps(h.w2), ns = _mm256_set1_ps(h.neg_step), bc2s = _mm256_set1_ps(h.bc2_sqrt),
                 eps = _mm256_set1_ps(h.eps), gs = _mm256_set1_ps(h.scale);
    for (; i + 8 <= end; i += 8) {
        if (i % 16 == 0) prefetch(p, g, m, v, i, end);
        __m256 gi = _mm256_mul_ps(load8(g + i), gs), mi = _mm256_loadu_ps(m + i), vi = _mm256_loadu_ps(v + i);
        mi = _mm256_fmadd_ps(w1, _mm256_sub_ps(gi, mi), mi);
        vi = _mm256_fmadd_ps(_mm256_mul_ps(w2, gi), gi, _mm256_mul_ps(vi, b2));
        __m256 denom = _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(vi), bc2s), eps);
        __m256 pi = _mm256_add_ps(_mm256_mul_ps(_mm256_loadu_ps(p + i), decay),
                                  _mm256_div_ps(_mm256_mul_ps(ns, mi), denom));
        _mm256_storeu_ps(p + i, pi); _mm256_storeu_ps(m + i, mi); _mm256_storeu_ps(v + i, vi);
        if (out) store8(out + i, pi);
    }
#endif
    for (; i < end; ++i) adam1(p, g, m, v, out, i, h);  // portable path, and the tail of the SIMD paths
}

template <typename G, typename O>
void adam_all(float* p, const G* g, float* m, float* v, O* out, int64_t n, const Hyper& h) {
    for_each_tile(p, n, [&](int64_t b, int64_t e) { adam_tile(p, g, m, v, out, b, e, h); });
}

void check(const at::Tensor& t, const char* name, int64_t n, bool allow_bf16) {
    TORCH_CHECK(t.device().is_cpu(), "adam_step: ", name, " is on ", t.device(), "; pass a CPU tensor (.cpu())");
    TORCH_CHECK(t.scalar_type() == at::kFloat || (allow_bf16 && t.scalar_type() == at::kBFloat16), "adam_step: ",
                name, " has dtype ", t.scalar_type(), "; it must be float32", allow_bf16 ? " or bfloat16" : "",
                " (convert it once, outside the step)");
    TORCH_CHECK(t.is_contiguous(), "adam_step: ", name, " is not contiguous; pass a contiguous tensor (e.g. a "
                "flat buffer). No hidden copy is made: an update of a copy would be lost");
    TORCH_CHECK(t.numel() == n, "adam_step: ", name, " has ", t.numel(), " elements but param has ", n,
                "; all tensors must have the same number of elements");
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
    const bool g16 = grad.scalar_type() == at::kBFloat16;
    const auto* gf = static_cast<const float*>(grad.data_ptr());
    const auto* gb = static_cast<const uint16_t*>(grad.data_ptr());
    void* o = param_out ? param_out->data_ptr() : nullptr;
    const bool o16 = param_out && param_out->scalar_type() == at::kBFloat16;

    pybind11::gil_scoped_release no_gil;  // let other Python threads run during the step
    if (!o16) {
        auto* of = static_cast<float*>(o);
        g16 ? adam_all(p, gb, m, v, of, n, h) : adam_all(p, gf, m, v, of, n, h);
    } else {
        auto* ob = static_cast<uint16_t*>(o);
        g16 ? adam_all(p, gb, m, v, ob, n, h) : adam_all(p, gf, m, v, ob, n, h);
    }
}

// ---- For the benchmark only: the memory-traffic ceiling. Same tiles, threads, vectors and prefetching as
// adam_step, the same 28 bytes per parameter (read p, g, m, v; write p, m, v), trivial arithmetic.
void touch_28_bytes(at::Tensor p_, at::Tensor g_, at::Tensor m_, at::Tensor v_) {
    const int64_t n = p_.numel();
    check(p_, "p", n, false); check(g_, "g", n, false); check(m_, "m", n, false); check(v_, "v", n, false);
    float *p = p_.data_ptr<float>(), *m = m_.data_ptr<float>(), *v = v_.data_ptr<float>();
    const float* g = g_.data_ptr<float>();
    pybind11::gil_scoped_release no_gil;
    for_each_tile(p, n, [&](int64_t i, int64_t end) {
#if defined(__AVX512F__)
        for (; i + 16 <= end; i += 16) {
            prefetch(p, g, m, v, i, end);
            __m512 gi = _mm512_loadu_ps(g + i);
            _mm512_storeu_ps(p + i, _mm512_add_ps(_mm512_loadu_ps(p + i), gi));
            _mm512_storeu_ps(m + i, _mm512_add_ps(_mm512_loadu_ps(m + i), gi));
            _mm512_storeu_ps(v + i, _mm512_add_ps(_mm512_loadu_ps(v + i), gi));
        }
#elif defined(__AVX2__)
        for (; i + 8 <= end; i += 8) {
            if (i % 16 == 0) prefetch(p, g, m, v, i, end);
            __m256 gi = _mm256_loadu_ps(g + i);
            _mm256_storeu_ps(p + i, _mm256_add_ps(_mm256_loadu_ps(p + i), gi));
            _mm256_storeu_ps(m + i, _mm256_add_ps(_mm256_loadu_ps(m + i), gi));
            _mm256_storeu_ps(v + i, _mm256_add_ps(_mm256_loadu_ps(v + i), gi));
        }
#endif
        for (; i < end; ++i) { p[i] += g[i]; m[i] += g[i]; v[i] += g[i]; }
    });
}
