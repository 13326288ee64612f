// The decoder's small fp32 ops for the C++ CPU path (layer_ops/cpu_ops.py): RMSNorm, residual add + RMSNorm,
// the rotary embedding (rotate-half layout, in place) and SiLU-and-multiply.
// Why: at decode a layer's norms, rotary and activation are a few hundred floats each, and in torch every
// one is several ops whose dispatch costs more than the arithmetic (~1.6 ms of a 16 ms batch-1 step of
// the bundled model); here each is one call. Rows run in parallel only when there are enough of them
// for the OpenMP fork to pay (prefill); a decode step's few rows run on the calling thread.
// Arithmetic as torch's reference (layer_ops/torch_ops.py) in fp32; sums and exp are vectorized, so
// results differ from it by float rounding.

#include <cmath>
#include <cstdint>
#include <cstring>

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
