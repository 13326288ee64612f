// Dev check: the engine's sluice_ggml_* layer ops (engine_image/sluice_engine/cpu_kernels/layer_ops.cpp)
// against ggml's own CPU backend, float for float: RMSNorm times its weight, residual add + RMSNorm, the
// rope cache and rotation (rope type NORM over GGUF's permuted head layout, compared after un-permuting),
// and SwiGLU (ggml_swiglu_split), on inputs of the bundled SmolLM2-135M's sizes (hidden 576, 9 query and
// 3 key heads of 64, ffn 1536) and edge values for the exp. Prints the number of bit-different floats per
// op; every count must be 0 (exit status 1 otherwise).
//
// Needs llama.cpp's static libraries (llama-cpp-python 0.3.36's vendored llama.cpp under .tools, from
// scripts/get-llama-server.sh), of the instruction set of the kernel level checked; layer_ops.cpp is compiled in
// with that level's flags (cpu_kernels.isa_flags). From the repository root:
//
//   .venv/bin/python benchmarks/ggml_check/run_checks.py --isa avx2 --check layer_ops   (or --isa avx512-vnni)
//
// GGML_CPU_DISABLE_FUSION=1 runs ggml's RMSNorm and weight multiply as two ops instead of its fused one.

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "ggml-cpu.h"
#include "ggml.h"

extern "C" {
void sluice_ggml_rms_norm_f32(const float* x, int64_t ldx, const float* w, float* out, int64_t ldo, int rows,
                              int n, float eps, int threads);
void sluice_ggml_add_rms_norm_f32(const float* x, int64_t ldx, const float* res, int64_t ldr, const float* w,
                                  float* out, int64_t ldo, float* sum, int64_t lds, int rows, int n, float eps,
                                  int threads);
void sluice_ggml_rope_cache_f32(const int64_t* positions, int count, int n_dims, float freq_base, float freq_scale,
                                float* cos, float* sin);
void sluice_ggml_rotary_f32(float* x, int64_t ldt, int64_t ldh, int tokens, int heads, int dim, const float* cos,
                            const float* sin, int64_t ldc, int threads);
void sluice_ggml_swiglu_f32(const float* gate_up, int64_t ldg, float* out, int64_t ldo, int rows, int inter,
                            int threads);
}

namespace {

constexpr int kThreads = 2;
int g_failures = 0;

std::mt19937 rng(1234);

std::vector<float> normal(size_t n, float scale) {
    std::normal_distribution<float> d(0.f, scale);
    std::vector<float> v(n);
    for (auto& x : v) x = d(rng);
    return v;
}

// Floats whose bits differ (a NaN against a NaN with other bits counts too).
size_t bit_diffs(const float* a, const float* b, size_t n) {
    size_t bad = 0;
    for (size_t i = 0; i < n; ++i) bad += std::memcmp(a + i, b + i, sizeof(float)) != 0;
    return bad;
}

void report(const char* what, size_t bad, size_t total) {
    std::printf("%-58s %9zu floats, %zu bit-different\n", what, total, bad);
    if (bad) ++g_failures;
}

struct Ggml {
    ggml_context* ctx;
    Ggml() {
        ggml_init_params p = {size_t(1) << 30, nullptr, false};
        ctx = ggml_init(p);
    }
    ~Ggml() { ggml_free(ctx); }
    ggml_tensor* tensor(const std::vector<float>& v, int64_t ne0, int64_t ne1 = 1, int64_t ne2 = 1) {
        ggml_tensor* t = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, ne0, ne1, ne2);
        std::memcpy(t->data, v.data(), v.size() * sizeof(float));
        return t;
    }
    void compute(ggml_tensor* out) {
        ggml_cgraph* gf = ggml_new_graph(ctx);
        ggml_build_forward_expand(gf, out);
        ggml_graph_compute_with_ctx(ctx, gf, kThreads);
    }
};

const float* data(const ggml_tensor* t) { return static_cast<const float*>(t->data); }

// The residual stream's scale varies by row, with a few large outliers, as a Llama's does.
std::vector<float> residual_rows(int rows, int n) {
    std::vector<float> x(size_t(rows) * n);
    std::uniform_real_distribution<float> scale(0.05f, 8.f);
    std::uniform_int_distribution<int> col(0, n - 1);
    for (int r = 0; r < rows; ++r) {
        std::normal_distribution<float> d(0.f, scale(rng));
        for (int i = 0; i < n; ++i) x[size_t(r) * n + i] = d(rng);
        for (int k = 0; k < 3; ++k) x[size_t(r) * n + col(rng)] *= 40.f;
    }
    return x;
}

void check_norms(int rows, int n, float eps) {
    const auto x = residual_rows(rows, n), res = residual_rows(rows, n);
    std::vector<float> w(n);
    std::uniform_real_distribution<float> wd(0.02f, 3.f);
    for (auto& v : w) v = wd(rng);
    char name[96];
    {
        Ggml g;
        ggml_tensor* y = ggml_mul(g.ctx, ggml_rms_norm(g.ctx, g.tensor(x, n, rows), eps), g.tensor(w, n));
        g.compute(y);
        std::vector<float> ours(x.size());
        sluice_ggml_rms_norm_f32(x.data(), n, w.data(), ours.data(), n, rows, n, eps, kThreads);
        std::snprintf(name, sizeof name, "rms_norm * w        [%d x %d]", rows, n);
        report(name, bit_diffs(data(y), ours.data(), x.size()), x.size());
    }
    {
        Ggml g;
        ggml_tensor* sum = ggml_add(g.ctx, g.tensor(x, n, rows), g.tensor(res, n, rows));
        ggml_tensor* y = ggml_mul(g.ctx, ggml_rms_norm(g.ctx, sum, eps), g.tensor(w, n));
        ggml_cgraph* gf = ggml_new_graph(g.ctx);
        ggml_build_forward_expand(gf, sum);
        ggml_build_forward_expand(gf, y);
        ggml_graph_compute_with_ctx(g.ctx, gf, kThreads);
        std::vector<float> ours(x.size()), ours_sum(x.size());
        sluice_ggml_add_rms_norm_f32(x.data(), n, res.data(), n, w.data(), ours.data(), n, ours_sum.data(), n, rows,
                                     n, eps, kThreads);
        std::snprintf(name, sizeof name, "add + rms_norm * w  [%d x %d]: the sum", rows, n);
        report(name, bit_diffs(data(sum), ours_sum.data(), x.size()), x.size());
        std::snprintf(name, sizeof name, "add + rms_norm * w  [%d x %d]: the norm", rows, n);
        report(name, bit_diffs(data(y), ours.data(), x.size()), x.size());
    }
}

// Rope over heads of `dim` in our (HF, rotate-half) layout: pair i is elements i and i + dim/2. GGUF's
// permuted rows put that pair at 2i, 2i + 1, where ggml's NORM rope rotates it.
void check_rope(const std::vector<int64_t>& positions, int heads, int dim, float base, float freq_scale,
                bool inplace) {
    const int tokens = static_cast<int>(positions.size()), half = dim / 2;
    const size_t total = size_t(tokens) * heads * dim;
    const auto x = normal(total, 2.5f);
    std::vector<float> perm(total);
    for (size_t h = 0; h < size_t(tokens) * heads; ++h)
        for (int i = 0; i < half; ++i) {
            perm[h * dim + 2 * i] = x[h * dim + i];
            perm[h * dim + 2 * i + 1] = x[h * dim + half + i];
        }
    Ggml g;
    ggml_tensor* in = g.tensor(perm, dim, heads, tokens);
    ggml_tensor* pos = ggml_new_tensor_1d(g.ctx, GGML_TYPE_I32, tokens);
    for (int t = 0; t < tokens; ++t) static_cast<int32_t*>(pos->data)[t] = static_cast<int32_t>(positions[t]);
    // n_ctx_orig 8192, ext_factor 0, attn_factor 1, beta 32/1: llama.cpp's values for a llama GGUF
    // without rope scaling (the betas only matter with ext_factor != 0).
    ggml_tensor* y = inplace ? ggml_rope_ext_inplace(g.ctx, in, pos, nullptr, dim, 0, 8192, base, freq_scale, 0.f,
                                                     1.f, 32.f, 1.f)
                             : ggml_rope_ext(g.ctx, in, pos, nullptr, dim, 0, 8192, base, freq_scale, 0.f, 1.f, 32.f,
                                             1.f);
    g.compute(y);
    std::vector<float> want(total);
    for (size_t h = 0; h < size_t(tokens) * heads; ++h)
        for (int i = 0; i < half; ++i) {
            want[h * dim + i] = data(y)[h * dim + 2 * i];
            want[h * dim + half + i] = data(y)[h * dim + 2 * i + 1];
        }
    std::vector<float> cos(size_t(tokens) * half), sin(size_t(tokens) * half), ours = x;
    sluice_ggml_rope_cache_f32(positions.data(), tokens, dim, base, freq_scale, cos.data(), sin.data());
    sluice_ggml_rotary_f32(ours.data(), int64_t(heads) * dim, dim, tokens, heads, dim, cos.data(), sin.data(), half,
                           kThreads);
    char name[96];
    std::snprintf(name, sizeof name, "rope %-7s dim %3d, %2d heads, %4d positions, scale %g", inplace ? "inplace" : "",
                  dim, heads, tokens, freq_scale);
    report(name, bit_diffs(want.data(), ours.data(), total), total);
}

void check_swiglu(int rows, int inter, bool edges) {
    auto gate = normal(size_t(rows) * inter, 3.f);
    const auto up = normal(size_t(rows) * inter, 1.f);
    if (edges) {
        // Around exp's over/underflow (|x| ~ 87..104), the scalef range (|n| in 126..192: subnormal and
        // infinite results), past |n| > 192 (|x| > ~133), infinities, signed zeros and tiny values.
        const float inf = std::numeric_limits<float>::infinity();
        const float fixed[] = {0.f,    -0.f,   1e-30f, -1e-30f, 1e-45f, 87.f,   -87.f,  88.5f,  -88.5f,  89.f,
                               -89.f,  100.f,  -100.f, 103.9f,  -103.9f, 104.f, -104.f, 133.f,  -133.f,  133.5f,
                               -133.5f, 200.f, -200.f, 1e30f,   -1e30f, inf,    -inf,   16.f,   -16.f,   0.5f};
        size_t k = 0;
        for (float v : fixed) gate[k++] = v;
        std::uniform_real_distribution<float> wide(-210.f, 210.f);
        for (size_t r = 1; r < size_t(rows); r += 2)
            for (int i = 0; i < inter; ++i) gate[r * inter + i] = wide(rng);
    }
    Ggml g;
    ggml_tensor* y = ggml_swiglu_split(g.ctx, g.tensor(gate, inter, rows), g.tensor(up, inter, rows));
    g.compute(y);
    std::vector<float> gate_up(size_t(rows) * 2 * inter), ours(size_t(rows) * inter);
    for (int r = 0; r < rows; ++r) {
        std::memcpy(&gate_up[size_t(r) * 2 * inter], &gate[size_t(r) * inter], inter * sizeof(float));
        std::memcpy(&gate_up[size_t(r) * 2 * inter + inter], &up[size_t(r) * inter], inter * sizeof(float));
    }
    sluice_ggml_swiglu_f32(gate_up.data(), 2 * inter, ours.data(), inter, rows, inter, kThreads);
    char name[96];
    std::snprintf(name, sizeof name, "swiglu              [%d x %d]%s", rows, inter, edges ? ", edge gates" : "");
    report(name, bit_diffs(data(y), ours.data(), ours.size()), ours.size());
}

}  // namespace

int main() {
    ggml_cpu_init();
    check_norms(1, 576, 1e-5f);
    check_norms(64, 576, 1e-5f);
    check_norms(37, 64, 1e-6f);
    check_norms(16, 1536, 1e-5f);

    std::vector<int64_t> all(4096);
    for (int p = 0; p < 4096; ++p) all[p] = p;
    std::vector<int64_t> far = {0, 1, 2, 4095, 4096, 8191, 8192, 32767, 65535, 131071, 1000003};
    std::vector<int64_t> sampled;
    std::uniform_int_distribution<int64_t> pd(0, 4095);
    for (int i = 0; i < 200; ++i) sampled.push_back(pd(rng));
    for (int heads : {9, 3}) {
        check_rope(all, heads, 64, 100000.f, 1.f, false);
        check_rope(all, heads, 64, 100000.f, 1.f, true);
    }
    check_rope(sampled, 12, 64, 100000.f, 1.f, false);
    check_rope(far, 12, 64, 100000.f, 1.f, false);
    check_rope(sampled, 8, 64, 10000.f, 0.25f, false);  // linear rope scaling
    for (int dim : {128, 96, 80, 72, 68, 70, 66, 8, 6, 4, 2})  // odd pair counts too
        for (bool inplace : {false, true}) check_rope(sampled, 4, dim, 500000.f, 1.f, inplace);

    check_swiglu(1, 1536, false);
    check_swiglu(64, 1536, false);
    check_swiglu(16, 1536, true);
    check_swiglu(9, 1547, true);  // an 11-float tail per row: libm's expf
    check_swiglu(5, 7, true);     // all tail

    std::printf(g_failures ? "FAIL: %d checks differ from ggml\n" : "OK: bit-identical to ggml\n", g_failures);
    return g_failures ? 1 : 0;
}
