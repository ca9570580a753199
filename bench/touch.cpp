// touch.cpp: the ceiling of bench/bench_adam.py, loops that move the memory an AdamW step moves and do nothing else.
//
//     touch_28_bytes(p, g, m, v, tile, prefetch_ahead, stream)      p += g; m += g; v += g
//
// Each moves the same 28 bytes per parameter as cpu_adam.cpp's adam_step (read p, g, m, v; write p, m, v) with
// trivial arithmetic, on the same threads, tiled by `tile` elements, with or without software prefetching, with
// ordinary or streaming (non-temporal) stores. The benchmark takes the fastest: no single loop is the fastest way to
// move memory on every CPU. The kernel is compiled into the same module (the #include), so these loops tile, prefetch
// and load as it does, with its flags for the same code path (bench_adam.load_touch); set_threads and isa are its own.
#define CPU_ADAM_NO_MODULE  // this module's bindings are load_inline's (functions=[...] in bench_adam.py)
#include "cpu_adam.cpp"

namespace {

#if defined(CPU_ADAM_AVX512)
inline void stream_store(float* o, __m512 x) { _mm512_stream_ps(o, x); }  // o must be 64-byte aligned
#elif defined(CPU_ADAM_AVX2)
inline void stream_store(float* o, __m256 x) { _mm256_stream_ps(o, x); }  // o must be 32-byte aligned
#endif

template <bool Prefetch, bool Stream>
void touch_all(float* p, const float* g, float* m, float* v, int64_t n, int64_t tile) {
    for_each_tile(p, n, tile, [&](int64_t i, int64_t end) {
        const int64_t begin = i;
#if defined(CPU_ADAM_AVX512) || defined(CPU_ADAM_AVX2)
        using S = Simd;
        for (; i + S::width <= end; i += S::width) {
            if (Prefetch && (i - begin) % 16 == 0) prefetch(p, g, m, v, i, end);
            S::F gi = S::load(g + i), pi = S::add(S::load(p + i), gi), mi = S::add(S::load(m + i), gi),
                 vi = S::add(S::load(v + i), gi);
            if (Stream) { stream_store(p + i, pi); stream_store(m + i, mi); stream_store(v + i, vi); }
            else { S::store(p + i, pi); S::store(m + i, mi); S::store(v + i, vi); }
        }
        if (Stream) _mm_sfence();  // streaming stores are weakly ordered: drain them before the tile counts as done
#endif
        for (; i < end; ++i) {  // the scalar path, and the tails
            if (Prefetch && (i - begin) % 16 == 0) prefetch(p, g, m, v, i, end);
            p[i] += g[i]; m[i] += g[i]; v[i] += g[i];
        }
    });
}

}  // namespace

// Whether this build has the streaming-store variant (the vector paths).
bool touch_can_stream() { return std::string(kIsa) != "scalar"; }

void touch_28_bytes(at::Tensor p_, at::Tensor g_, at::Tensor m_, at::Tensor v_, int64_t tile, bool prefetch_ahead,
                    bool stream) {
    const int64_t n = p_.numel();
    check(p_, "p", n, false); check(g_, "g", n, false); check(m_, "m", n, false); check(v_, "v", n, false);
    TORCH_CHECK(tile >= 64 && tile % 16 == 0, "touch_28_bytes: tile must be a multiple of 16, >= 64, got ", tile);
    float *p = p_.data_ptr<float>(), *m = m_.data_ptr<float>(), *v = v_.data_ptr<float>();
    const float* g = g_.data_ptr<float>();
    const auto aligned = [](const void* x) { return reinterpret_cast<uintptr_t>(x) % 64 == 0; };
    TORCH_CHECK(!stream || (touch_can_stream() && aligned(p) && aligned(m) && aligned(v)), "touch_28_bytes: "
                "streaming stores need a vector path and p, m, v aligned to 64 bytes");
    pybind11::gil_scoped_release no_gil;
#if defined(CPU_ADAM_AVX512) || defined(CPU_ADAM_AVX2)
    if (stream) {
        return prefetch_ahead ? touch_all<true, true>(p, g, m, v, n, tile)
                              : touch_all<false, true>(p, g, m, v, n, tile);
    }
#endif
    prefetch_ahead ? touch_all<true, false>(p, g, m, v, n, tile) : touch_all<false, false>(p, g, m, v, n, tile);
}
