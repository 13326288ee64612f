// The decoder's small fp32 ops for the C++ CPU path (layer_ops/cpu_ops.py): RMSNorm, residual add + RMSNorm,
// the rotary embedding (rotate-half layout, in place) and SiLU-and-multiply.
// Why: at decode a layer's norms, rotary and activation are a few hundred floats each, and in torch every
// one is several ops whose dispatch costs more than the arithmetic (~1.6 ms of a 16 ms batch-1 step of
// the bundled model); here each is one call. Rows run in parallel only when there are enough of them
// for the OpenMP fork to pay (prefill); a decode step's few rows run on the calling thread.
// Arithmetic as torch's reference (layer_ops/torch_ops.py) in fp32; sums and exp are vectorized, so
// results differ from it by float rounding.
//
// The sluice_ggml_* entry points further down (layer_ops/ggml_ops.py) are the same ops done with llama.cpp's
// CPU arithmetic, bit for bit: see the comment above them.

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "ggml_expf.h"

namespace {

constexpr int kParallelRows = 16;  // below this a call stays on one thread

// exp(x) for the SiLU, as plain arithmetic the compiler vectorizes (libm's expf is a scalar call without
// -ffast-math): x = n ln2 + r, |r| <= ln2 / 2, e^r by its Taylor series to r^7 (relative error < 2e-7
// there), times 2^n built in the exponent bits. Inputs are clamped to [-87, 88]: e^-87 is still a normal
// float, and silu(x) for x < -87 is -0 either way.
inline float exp_approx(float x) {
    x = x < -87.f ? -87.f : (x > 88.f ? 88.f : x);
    const float n = std::nearbyint(x * 1.44269504088896341f);
    const float r = x - n * 0.693359375f + n * 2.12194440e-4f;  // ln2 split in two for an exact n*ln2_hi
    float p = 1.f / 5040.f;
    p = p * r + 1.f / 720.f;
    p = p * r + 1.f / 120.f;
    p = p * r + 1.f / 24.f;
    p = p * r + 1.f / 6.f;
    p = p * r + 0.5f;
    p = p * r + 1.f;
    p = p * r + 1.f;
    const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
    float scale;
    std::memcpy(&scale, &bits, 4);
    return p * scale;
}

inline void norm_row(const float* x, const float* w, float* out, int n, float eps) {
    float ss = 0.f;
#pragma omp simd reduction(+ : ss)
    for (int i = 0; i < n; ++i) ss += x[i] * x[i];
    const float inv = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
#pragma omp simd
    for (int i = 0; i < n; ++i) out[i] = x[i] * inv * w[i];
}

}  // namespace

extern "C" {

// out[r] = x[r] / rms(x[r]) * w, for `rows` rows of n floats.
void sluice_rms_norm_f32(const float* x, int64_t ldx, const float* w, float* out, int64_t ldo, int rows, int n,
                         float eps, int threads) {
#pragma omp parallel for if (rows >= kParallelRows) num_threads(threads) schedule(static)
    for (int r = 0; r < rows; ++r) norm_row(x + r * ldx, w, out + r * ldo, n, eps);
}

// sum[r] = x[r] + res[r]; out[r] = rmsnorm(sum[r]) * w.
void sluice_add_rms_norm_f32(const float* x, int64_t ldx, const float* res, int64_t ldr, const float* w, float* out,
                             int64_t ldo, float* sum, int64_t lds, int rows, int n, float eps, int threads) {
#pragma omp parallel for if (rows >= kParallelRows) num_threads(threads) schedule(static)
    for (int r = 0; r < rows; ++r) {
        const float* xr = x + r * ldx;
        const float* rr = res + r * ldr;
        float* sr = sum + r * lds;
#pragma omp simd
        for (int i = 0; i < n; ++i) sr[i] = xr[i] + rr[i];
        norm_row(sr, w, out + r * ldo, n, eps);
    }
}

// x: [tokens, heads, dim] (token stride ldt, head stride ldh, dims contiguous), rotated in place by each
// token's angles: cos/sin [tokens, dim / 2], rows ldc apart. Rotate-half: (x1, x2) ->
// (x1 cos - x2 sin, x2 cos + x1 sin) over the two halves of each head.
void sluice_rotary_f32(float* x, int64_t ldt, int64_t ldh, int tokens, int heads, int dim, const float* cos,
                       const float* sin, int64_t ldc, int threads) {
    const int half = dim / 2;
#pragma omp parallel for if (tokens >= kParallelRows) num_threads(threads) schedule(static)
    for (int t = 0; t < tokens; ++t) {
        const float* c = cos + t * ldc;
        const float* s = sin + t * ldc;
        for (int h = 0; h < heads; ++h) {
            float* x1 = x + t * ldt + h * ldh;
            float* x2 = x1 + half;
#pragma omp simd
            for (int i = 0; i < half; ++i) {
                const float a = x1[i], b = x2[i];
                x1[i] = a * c[i] - b * s[i];
                x2[i] = b * c[i] + a * s[i];
            }
        }
    }
}

// out[r] = silu(gate_up[r, :inter]) * gate_up[r, inter:].
void sluice_silu_mul_f32(const float* gate_up, int64_t ldg, float* out, int64_t ldo, int rows, int inter,
                         int threads) {
#pragma omp parallel for if (rows >= kParallelRows) num_threads(threads) schedule(static)
    for (int r = 0; r < rows; ++r) {
        const float* g = gate_up + r * ldg;
        const float* u = g + inter;
        float* o = out + r * ldo;
#pragma omp simd
        for (int i = 0; i < inter; ++i) o[i] = g[i] / (1.f + exp_approx(-g[i])) * u[i];
    }
}

}  // extern "C"

// ---- llama.cpp's CPU arithmetic, bit for bit ------------------------------------------------------------------
// The same four ops with the IEEE operations of ggml's CPU backend (llama-cpp-python 0.3.36's vendored
// llama.cpp, built -O3 -march=native by GCC 12, i.e. with its default -ffp-contract=fast, on an AVX-512
// CPU), in the same order, so that an engine quantizing activations to 8 bits as llama.cpp does reaches
// the same tokens. Where GCC fused a multiply-add in that build, std::fma says so here; where it did not,
// either no multiply feeds an add or the products go through a volatile, so no compiler can contract
// them differently (the results are the same at -O0, -O3 and -ffp-contract=off/on/fast). Each result
// depends on its own row only: threads do not change it. benchmarks/ggml_check/layer_ops_check.cpp
// compares every op with ggml itself (0 differing floats).

namespace {

// ggml_compute_forward_rms_norm_f32 (ggml-cpu/ops.cpp) and the ggml_mul by the norm weight: squares
// rounded to float and summed in double in order, the mean rounded to float, then x * scale * w.
inline void ggml_norm_row(const float* x, const float* w, float* out, int n, float eps) {
    double sum = 0.0;
    for (int i = 0; i < n; ++i) {
        const float sq = x[i] * x[i];
        sum += static_cast<double>(sq);
    }
    const float mean = static_cast<float>(sum / static_cast<double>(n));
    const float scale = 1.0f / std::sqrt(mean + eps);
    for (int i = 0; i < n; ++i) out[i] = x[i] * scale * w[i];
}

// Positions' rotary angles as ggml_rope_cache_init makes them (ggml-cpu/ops.cpp), rope type NORM with no
// frequency factors, ext_factor 0 and attn_factor 1 (llama.cpp's values without YaRN): theta starts at the
// position as a float and is multiplied by powf(base, -2 / n_dims) after each pair; the angle is
// freq_scale * theta; cos and sin from glibc's sincosf (GCC merged the cosf/sinf pair into that call).
inline void ggml_rope_row(int64_t pos, int pairs, float theta_scale, float freq_scale, float* cos, float* sin) {
    float theta = static_cast<float>(pos);
    for (int i = 0; i < pairs; ++i) {
        const float angle = freq_scale * theta;
#if defined(__GLIBC__)
        sincosf(angle, &sin[i], &cos[i]);
#else
        cos[i] = std::cos(angle);
        sin[i] = std::sin(angle);
#endif
        theta *= theta_scale;
    }
}

}  // namespace

extern "C" {

// As sluice_rms_norm_f32, with ggml's arithmetic.
void sluice_ggml_rms_norm_f32(const float* x, int64_t ldx, const float* w, float* out, int64_t ldo, int rows,
                              int n, float eps, int threads) {
#pragma omp parallel for if (rows >= kParallelRows) num_threads(threads) schedule(static)
    for (int r = 0; r < rows; ++r) ggml_norm_row(x + r * ldx, w, out + r * ldo, n, eps);
}

// As sluice_add_rms_norm_f32, with ggml's arithmetic (the add is ggml_add's: one float add).
void sluice_ggml_add_rms_norm_f32(const float* x, int64_t ldx, const float* res, int64_t ldr, const float* w,
                                  float* out, int64_t ldo, float* sum, int64_t lds, int rows, int n, float eps,
                                  int threads) {
#pragma omp parallel for if (rows >= kParallelRows) num_threads(threads) schedule(static)
    for (int r = 0; r < rows; ++r) {
        const float* xr = x + r * ldx;
        const float* rr = res + r * ldr;
        float* sr = sum + r * lds;
        for (int i = 0; i < n; ++i) sr[i] = xr[i] + rr[i];
        ggml_norm_row(sr, w, out + r * ldo, n, eps);
    }
}

// cos/sin [count, n_dims / 2] (rows n_dims / 2 apart) for positions[count], as ggml's rope cache: the rows
// sluice_ggml_rotary_f32 takes. Built once for a table of positions 0..max-1 (a row depends on its
// position only), or per call.
void sluice_ggml_rope_cache_f32(const int64_t* positions, int count, int n_dims, float freq_base, float freq_scale,
                                float* cos, float* sin) {
    const int pairs = n_dims / 2;
    const float theta_scale = std::pow(freq_base, -2.0f / static_cast<float>(n_dims));
    for (int t = 0; t < count; ++t)
        ggml_rope_row(positions[t], pairs, theta_scale, freq_scale, cos + static_cast<int64_t>(t) * pairs,
                      sin + static_cast<int64_t>(t) * pairs);
}

// As sluice_rotary_f32 (rotate-half layout, in place), with the arithmetic of ggml's rope (type NORM, over
// GGUF's permuted Q/K rows, where our pair (i, i + dim / 2) is its adjacent pair i). GCC vectorized
// rotate_pairs four pairs at a time with vfmaddsub, two at a time in the remainder:
// x0' = fma(x0, cos, -(x1 sin)), x1' = fma(x0, sin, x1 cos), x1's products rounded first. A last single pair
// (dim / 2 odd) it does unfused: x0 cos - x1 sin, x0 sin + x1 cos, each product rounded.
void sluice_ggml_rotary_f32(float* x, int64_t ldt, int64_t ldh, int tokens, int heads, int dim, const float* cos,
                            const float* sin, int64_t ldc, int threads) {
    const int half = dim / 2, fused = half / 2 * 2;
#pragma omp parallel for if (tokens >= kParallelRows) num_threads(threads) schedule(static)
    for (int t = 0; t < tokens; ++t) {
        const float* c = cos + t * ldc;
        const float* s = sin + t * ldc;
        for (int h = 0; h < heads; ++h) {
            float* x0 = x + t * ldt + h * ldh;
            float* x1 = x0 + half;
            for (int i = 0; i < fused; ++i) {
                const float a = x0[i], b = x1[i];
                const float bs = b * s[i], bc = b * c[i];
                x0[i] = std::fma(a, c[i], -bs);
                x1[i] = std::fma(a, s[i], bc);
            }
            if (fused < half) {
                const int i = fused;
                const float a = x0[i], b = x1[i];
                // volatile: products stored, so that no compiler contracts them into an FMA here.
                const volatile float ac = a * c[i], as = a * s[i], bs = b * s[i], bc = b * c[i];
                x0[i] = ac - bs;
                x1[i] = as + bc;
            }
        }
    }
}

// As sluice_silu_mul_f32, with ggml_vec_swiglu_f32's arithmetic (ggml-cpu/vec.cpp, its AVX-512 branch, or its
// AVX2 one in the avx2 build): silu(g) = g / (1 + e^(0 - g)) with ggml_v_expf for each full block of 16 (AVX2:
// 8) floats of a row, then times up; the row's last floats with libm's expf (ggml_silu_f32).
void sluice_ggml_swiglu_f32(const float* gate_up, int64_t ldg, float* out, int64_t ldo, int rows, int inter,
                            int threads) {
    const int blocked = inter / sluice_ggml::kExpfBlock * sluice_ggml::kExpfBlock;
#pragma omp parallel for if (rows >= kParallelRows) num_threads(threads) schedule(static)
    for (int r = 0; r < rows; ++r) {
        const float* g = gate_up + r * ldg;
        const float* u = g + inter;
        float* o = out + r * ldo;
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
        const __m256 one = _mm256_set1_ps(1.0f);
        for (int i = 0; i < blocked; i += 8) {
            const __m256 gv = _mm256_loadu_ps(g + i);
            const __m256 e = sluice_ggml::ggml_v_expf_avx2(_mm256_sub_ps(_mm256_setzero_ps(), gv));
            _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_div_ps(gv, _mm256_add_ps(one, e)), _mm256_loadu_ps(u + i)));
        }
#else
        for (int i = 0; i < blocked; ++i) o[i] = g[i] / (1.0f + sluice_ggml::ggml_expf_lane(0.0f - g[i])) * u[i];
#endif
        for (int i = blocked; i < inter; ++i) o[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];
    }
}

}  // extern "C"
