// Dev check: cpu_kernels/quant_gemm.cpp against llama.cpp's own CPU backend (ggml), bit for bit.
//
// For Q4_1, Q8_0 and Q4_0 weights quantized by ggml (ggml_quantize_chunk), and activations of several
// magnitudes (hidden-state-like rows with outliers, all-zero blocks, blocks whose d is a subnormal or zero
// fp16), ggml's result for each (row, column) is its type traits' from_float (x86 quantize_row_q8_1 /
// _q8_0) then vec_dot (ggml_vec_dot_q4_1_q8_1 / _q8_0_q8_0 / _q4_0_q8_0); ours is sluice_quant_gemm_f32
// over the repacked weights at M = 1, 3, 8, 64, 300 rows and 1 and 2 threads. Both are also compared with
// ggml's whole matmul, a ggml_mul_mat graph computed by the CPU backend at the same M and thread count
// (which takes llamafile's tinyBLAS for Q8_0 and Q4_0 at M >= 2: the path llama-server runs, but for its
// Q4_0 repack, which needs the backend's extra buffer type and is not exercised here). Prints the number
// of outputs whose bits differ (must be 0), and the number of activation blocks (q, d, s) that differ.
// `--fp16` also compares ggml_fp32_to_fp16 (ggml's software conversion, which its x86 quantizers use) with
// the conversion quant_gemm.cpp uses (F16C's, or its own bit manipulation) over every finite float.
//
// Build and run (from the repository root; the static libraries of the llama-cpp-python build in .tools,
// -O3 -march=native by GCC 12; QG_FLAGS picks our build: "-march=native" (AVX-512 VNNI here),
// "-mavx2 -mfma -mf16c" (the AVX2 path) or "" (the plain loops)):
//
//   L=.tools/src/llama-cpp-python-0.3.36; G=$L/build/ggml/src
//   for QG_FLAGS in "-march=native" "-mavx2 -mfma -mf16c" ""; do
//     g++ -O3 $QG_FLAGS -fopenmp -std=c++17 -c engine_image/sluice_engine/cpu_kernels/quant_gemm.cpp -o /tmp/qg.o &&
//     g++ -O2 -march=native -fopenmp -std=c++17 -I$L/vendor/llama.cpp/ggml/include
//         benchmarks/ggml_check/quant_gemm_check.cpp /tmp/qg.o $G/libggml.a $G/libggml-cpu.a $G/libggml-base.a
//         -lpthread -ldl -lm -o /tmp/quant_gemm_check && /tmp/quant_gemm_check; done
//   (the second g++ command is one line)
//
// (A dev tool: it needs the llama.cpp build, so no test runs it; tests/test_cpu_quant_gemm.py pins the
// float order with an emulation instead.)

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include <immintrin.h>

#include "ggml-cpu.h"
#include "ggml.h"

extern "C" {
int sluice_quant_isa();
int64_t sluice_quant_packed_bytes(int fmt, int N, int K);
void sluice_quant_repack(int fmt, const uint8_t* blocks, int N, int K, uint8_t* out);
void sluice_quant_activations(int fmt, const float* x, int64_t ldx, int M, int K, int8_t* q, float* d, int32_t* aux);
void sluice_quant_gemm_f32(int fmt, const float* x, int64_t ldx, const uint8_t* w, int M, int K, int N, float* y,
                           int64_t ldy, int num_threads);
}

namespace {

struct Format {
    const char* name;
    int code;  // quant_gemm.cpp's
    ggml_type type;
};

uint32_t bits(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    return u;
}

// Activations: per row a magnitude from tiny to hidden-state-large, a few outlier channels, some blocks all
// zero, some tiny enough that d is a subnormal (or zero) fp16, and a row of exact ties.
std::vector<float> make_x(std::mt19937& rng, int M, int K) {
    std::normal_distribution<float> gauss(0.f, 1.f);
    std::uniform_real_distribution<float> uni(0.f, 1.f);
    const float scales[] = {1e-3f, 0.02f, 0.3f, 1.f, 4.f, 40.f};
    std::vector<float> x(static_cast<size_t>(M) * K);
    for (int m = 0; m < M; ++m) {
        float* row = x.data() + static_cast<size_t>(m) * K;
        const float scale = scales[rng() % 6];
        for (int k = 0; k < K; ++k) {
            row[k] = gauss(rng) * scale;
            if (uni(rng) < 0.01f) row[k] *= 60.f;  // massive activations
        }
        for (int b = 0; b < K / 32; ++b) {
            const float u = uni(rng);
            if (u < 0.06f) {
                for (int k = 0; k < 32; ++k) row[b * 32 + k] = 0.f;
            } else if (u < 0.09f) {
                for (int k = 0; k < 32; ++k) row[b * 32 + k] = gauss(rng) * 1e-7f;  // d a subnormal fp16
            } else if (u < 0.10f) {
                for (int k = 0; k < 32; ++k) row[b * 32 + k] = gauss(rng) * 1e-10f;  // d rounds to 0
            }
        }
        if (m % 37 == 5)  // max 127: d = 1, x * 127 / 127 lands on halves
            for (int k = 0; k < K; ++k) row[k] = k % 32 == 0 ? 127.f : 0.5f + static_cast<float>(k % 7) - 3.f;
    }
    return x;
}

std::vector<float> make_w(std::mt19937& rng, int N, int K) {
    std::normal_distribution<float> gauss(0.f, 1.f);
    std::vector<float> w(static_cast<size_t>(N) * K);
    for (int n = 0; n < N; ++n) {
        const float scale = 0.01f + 0.1f * static_cast<float>(rng() % 8), off = 0.02f * gauss(rng);
        for (int k = 0; k < K; ++k) w[static_cast<size_t>(n) * K + k] = gauss(rng) * scale + off;
    }
    return w;
}

struct Tally {
    long outputs = 0, differ = 0;
    double max_rel = 0;

    void add(const float* y, const float* ref, size_t n) {
        for (size_t i = 0; i < n; ++i) {
            ++outputs;
            if (bits(y[i]) != bits(ref[i])) {
                ++differ;
                const double rel = std::fabs(static_cast<double>(y[i]) - ref[i]) / std::max(1e-30, std::fabs(static_cast<double>(ref[i])));
                max_rel = std::max(max_rel, rel);
            }
        }
    }
};

// ggml's own matmul: y [M, N] = mul_mat(W [N, K] in format `type`, x [M, K] fp32), by the CPU backend.
std::vector<float> ggml_matmul(ggml_type type, const std::vector<uint8_t>& wg, const float* x, int M, int K, int N, int threads) {
    ggml_init_params ip = {wg.size() + static_cast<size_t>(M) * (K + N) * 4 + (64 << 20), nullptr, false};
    ggml_context* ctx = ggml_init(ip);
    ggml_tensor* a = ggml_new_tensor_2d(ctx, type, K, N);
    std::memcpy(a->data, wg.data(), wg.size());
    ggml_tensor* b = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, K, M);
    std::memcpy(b->data, x, static_cast<size_t>(M) * K * 4);
    ggml_tensor* c = ggml_mul_mat(ctx, a, b);  // [N, M]: row m is output row m
    ggml_cgraph* gf = ggml_new_graph(ctx);
    ggml_build_forward_expand(gf, c);
    ggml_graph_compute_with_ctx(ctx, gf, threads);
    std::vector<float> y(static_cast<size_t>(M) * N);
    std::memcpy(y.data(), c->data, y.size() * 4);
    ggml_free(ctx);
    return y;
}

// ggml's quantized activations vs ours, block by block: q bytes, d, and (Q8_1) s.
long activation_mismatches(const Format& f, const float* x, int M, int K, const std::vector<uint8_t>& xg, size_t row_bytes) {
    const int nb = K / 32;
    std::vector<int8_t> q(static_cast<size_t>(M) * K);
    std::vector<float> d(static_cast<size_t>(M) * nb);
    std::vector<int32_t> aux(static_cast<size_t>(M) * nb);
    sluice_quant_activations(f.code, x, K, M, K, q.data(), d.data(), aux.data());
    const bool q81 = f.type == GGML_TYPE_Q4_1;
    const int bb = q81 ? 36 : 34;  // block_q8_1: d, s, qs[32]; block_q8_0: d, qs[32]
    long bad = 0;
    for (int m = 0; m < M; ++m)
        for (int b = 0; b < nb; ++b) {
            const uint8_t* blk = xg.data() + m * row_bytes + static_cast<size_t>(b) * bb;
            ggml_fp16_t hd, hs;
            std::memcpy(&hd, blk, 2);
            std::memcpy(&hs, blk + 2, 2);
            const int8_t* qs = reinterpret_cast<const int8_t*>(blk + (q81 ? 4 : 2));
            const size_t i = static_cast<size_t>(m) * nb + b;
            bool ok = bits(ggml_fp16_to_fp32(hd)) == bits(d[i]) && std::memcmp(qs, &q[static_cast<size_t>(m) * K + b * 32], 32) == 0;
            if (q81) {
                float s;
                std::memcpy(&s, &aux[i], 4);
                ok = ok && bits(ggml_fp16_to_fp32(hs)) == bits(s);
            }
            bad += !ok;
        }
    return bad;
}

int check_fp16() {
    long bad = 0;
    for (uint64_t u = 0; u < (1ull << 32); ++u) {
        float f;
        const uint32_t b = static_cast<uint32_t>(u);
        std::memcpy(&f, &b, 4);
        if (!std::isfinite(f)) continue;
        if (ggml_fp32_to_fp16(f) != _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT)) ++bad;
    }
    std::printf("fp32->fp16 over every finite float: %ld differ between ggml_fp32_to_fp16 and vcvtps2ph\n", bad);
    return bad != 0;
}

}  // namespace

int main(int argc, char** argv) {
    ggml_cpu_init();
    int fail = 0;
    if (argc > 1 && std::strcmp(argv[1], "--fp16") == 0) fail |= check_fp16();
    const Format formats[] = {{"q4_1", 2, GGML_TYPE_Q4_1}, {"q8_0", 0, GGML_TYPE_Q8_0}, {"q4_0", 1, GGML_TYPE_Q4_0}};
    const int Ks[] = {32, 64, 576, 1536};
    const int Ns[] = {1, 5, 16, 17, 33, 70};
    const int Ms[] = {1, 3, 8, 64, 300};
    const int max_m = 300;
    std::printf("our kernel's path: %s\n", sluice_quant_isa() == 2 ? "AVX-512 VNNI" : sluice_quant_isa() == 1 ? "AVX2" : "plain loops");
    for (const Format& f : formats) {
        const ggml_type_traits_cpu* tw = ggml_get_type_traits_cpu(f.type);
        const ggml_type_traits_cpu* tx = ggml_get_type_traits_cpu(tw->vec_dot_type);
        Tally tally[5][2], graph[5][2], graph_vs_vec_dot[5][2];
        long act_bad = 0, act_blocks = 0;
        std::mt19937 rng(1234 + f.code);
        for (int K : Ks) {
            const std::vector<float> x = make_x(rng, max_m, K);
            const size_t xrow = ggml_row_size(tw->vec_dot_type, K);
            std::vector<uint8_t> xg(xrow * max_m);
            for (int m = 0; m < max_m; ++m) tx->from_float(x.data() + static_cast<size_t>(m) * K, xg.data() + m * xrow, K);
            act_bad += activation_mismatches(f, x.data(), max_m, K, xg, xrow);
            act_blocks += static_cast<long>(max_m) * (K / 32);
            for (int N : Ns) {
                const std::vector<float> w = make_w(rng, N, K);
                const size_t wrow = ggml_row_size(f.type, K);
                std::vector<uint8_t> wg(wrow * N);
                ggml_quantize_chunk(f.type, w.data(), wg.data(), 0, N, K, nullptr);
                std::vector<uint8_t> packed(static_cast<size_t>(sluice_quant_packed_bytes(f.code, N, K)));
                sluice_quant_repack(f.code, wg.data(), N, K, packed.data());
                std::vector<float> ref(static_cast<size_t>(max_m) * N);
                for (int m = 0; m < max_m; ++m)
                    for (int n = 0; n < N; ++n)
                        tw->vec_dot(K, &ref[static_cast<size_t>(m) * N + n], 0, wg.data() + n * wrow, 0, xg.data() + m * xrow, 0, 1);
                for (int mi = 0; mi < 5; ++mi)
                    for (int t = 0; t < 2; ++t) {
                        const int M = Ms[mi];
                        std::vector<float> y(static_cast<size_t>(M) * N, -1.f);
                        sluice_quant_gemm_f32(f.code, x.data(), K, packed.data(), M, K, N, y.data(), N, t + 1);
                        tally[mi][t].add(y.data(), ref.data(), y.size());
                        const std::vector<float> yg = ggml_matmul(f.type, wg, x.data(), M, K, N, t + 1);
                        graph[mi][t].add(y.data(), yg.data(), y.size());
                        graph_vs_vec_dot[mi][t].add(yg.data(), ref.data(), y.size());
                    }
            }
        }
        std::printf("%s vs ggml (from_float + %s vec_dot), K in {32, 64, 576, 1536}, N in {1, 5, 16, 17, 33, 70}:\n",
                    f.name, f.type == GGML_TYPE_Q4_1 ? "q4_1_q8_1" : f.type == GGML_TYPE_Q8_0 ? "q8_0_q8_0" : "q4_0_q8_0");
        std::printf("  activation blocks differing (q, d%s): %ld of %ld\n", f.type == GGML_TYPE_Q4_1 ? ", s" : "", act_bad, act_blocks);
        fail |= act_bad != 0;
        for (int mi = 0; mi < 5; ++mi)
            for (int t = 0; t < 2; ++t) {
                std::printf("  M=%-3d threads=%d: bit-different outputs, ours vs vec_dot", Ms[mi], t + 1);
                for (const Tally* ta : {&tally[mi][t], &graph[mi][t], &graph_vs_vec_dot[mi][t]}) {
                    if (ta == &graph[mi][t]) std::printf(", ours vs mul_mat");
                    if (ta == &graph_vs_vec_dot[mi][t]) std::printf(" (mul_mat vs vec_dot");
                    std::printf(" %ld of %ld", ta->differ, ta->outputs);
                    if (ta->differ) std::printf(", max relative difference %.3g", ta->max_rel);
                }
                std::printf(")\n");
                fail |= tally[mi][t].differ != 0 || graph[mi][t].differ != 0;
            }
    }
    std::printf("%s\n", fail ? "FAIL" : "OK: bit-identical");
    return fail;
}
