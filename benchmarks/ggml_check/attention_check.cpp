// Dev check: cpu_kernels/ggml_attention.cpp against llama.cpp's own flash attention (ggml_flash_attn_ext on
// the CPU backend), bit for bit, for one kernel level against llama.cpp's build of the same instruction set
// (scripts/get-llama-server.sh; LLAMA_CPU_ISA=avx2 for the AVX2 one). Build and run with
//   .venv/bin/python benchmarks/ggml_check/run_checks.py --isa avx2 --check attention   (or --isa avx512-vnni)
// Prints, per case, how many output floats differ from ggml's (0 is the point) and the largest difference.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "ggml-cpu.h"
#include "ggml.h"

extern "C" {
void sluice_ggml_write_kv(const float* k, int64_t ldk, const float* v, int64_t ldv, uint16_t* k_cache,
                          uint16_t* v_cache, const int64_t* slots, int tokens, int kv_heads, int d, int threads);
void sluice_ggml_attention(float* out, int64_t ldo, const float* q, int64_t ldq, const uint16_t* k_cache,
                           const uint16_t* v_cache, const int32_t* block_tables, int64_t ldt, const int32_t* seq_lens,
                           const int32_t* query_start, int num_seqs, int heads, int kv_heads, int d, int block_size,
                           float scale, int threads);
}

static int hf_index(int e, int d) { return (e >> 1) + (e & 1) * (d >> 1); }

// One case: n_q new rows at the end of a context of ctx tokens; llama.cpp's KV view has n_kv >= ctx cells.
static int run_case(int heads, int kv_heads, int d, int n_q, int ctx, int n_kv, int threads, unsigned seed) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> nd(0.f, 1.f);
    const float scale = 1.0f / std::sqrt(static_cast<float>(d));
    std::vector<float> q_hf(static_cast<size_t>(n_q) * heads * d), k_hf(static_cast<size_t>(n_kv) * kv_heads * d),
        v_hf(static_cast<size_t>(n_kv) * kv_heads * d);
    for (auto& x : q_hf) x = 2.5f * nd(rng);
    for (auto& x : k_hf) x = 2.5f * nd(rng);
    for (auto& x : v_hf) x = nd(rng);
    // ours: a paged cache of blocks of 16, blocks in reverse order to exercise the table
    const int bs = 16, nblocks = (n_kv + bs - 1) / bs;
    std::vector<uint16_t> kc(static_cast<size_t>(nblocks) * bs * kv_heads * d), vc(kc.size());
    std::vector<int32_t> table(nblocks);
    for (int b = 0; b < nblocks; ++b) table[b] = nblocks - 1 - b;
    std::vector<int64_t> slots(n_kv);
    for (int p = 0; p < n_kv; ++p) slots[p] = static_cast<int64_t>(table[p / bs]) * bs + p % bs;
    sluice_ggml_write_kv(k_hf.data(), kv_heads * d, v_hf.data(), kv_heads * d, kc.data(), vc.data(), slots.data(), n_kv,
                         kv_heads, d, 1);
    std::vector<float> ours(q_hf.size());
    const int32_t seq_len = ctx, qs[2] = {0, n_q};
    sluice_ggml_attention(ours.data(), heads * d, q_hf.data(), heads * d, kc.data(), vc.data(), table.data(), nblocks,
                          &seq_len, qs, 1, heads, kv_heads, d, bs, scale, threads);

    // ggml: q [d, n_q, heads] f32 in pair order; k, v [d, n_kv, kv_heads] f16; mask [n_kv, n_q] f16
    ggml_init_params ip = {static_cast<size_t>(256) << 20, nullptr, false};
    ggml_context* ctx0 = ggml_init(ip);
    ggml_tensor* q = ggml_new_tensor_3d(ctx0, GGML_TYPE_F32, d, n_q, heads);
    ggml_tensor* k = ggml_new_tensor_3d(ctx0, GGML_TYPE_F16, d, n_kv, kv_heads);
    ggml_tensor* v = ggml_new_tensor_3d(ctx0, GGML_TYPE_F16, d, n_kv, kv_heads);
    ggml_tensor* mask = ggml_new_tensor_2d(ctx0, GGML_TYPE_F16, n_kv, n_q);
    for (int t = 0; t < n_q; ++t)
        for (int h = 0; h < heads; ++h)
            for (int e = 0; e < d; ++e)
                reinterpret_cast<float*>(q->data)[(static_cast<size_t>(h) * n_q + t) * d + e] =
                    q_hf[(static_cast<size_t>(t) * heads + h) * d + hf_index(e, d)];
    for (int p = 0; p < n_kv; ++p)
        for (int h = 0; h < kv_heads; ++h)
            for (int e = 0; e < d; ++e) {
                const size_t dst = (static_cast<size_t>(h) * n_kv + p) * d + e, src = (static_cast<size_t>(p) * kv_heads + h) * d;
                reinterpret_cast<ggml_fp16_t*>(k->data)[dst] = ggml_fp32_to_fp16(k_hf[src + hf_index(e, d)]);
                reinterpret_cast<ggml_fp16_t*>(v->data)[dst] = ggml_fp32_to_fp16(v_hf[src + e]);
            }
    for (int t = 0; t < n_q; ++t)
        for (int p = 0; p < n_kv; ++p)
            reinterpret_cast<ggml_fp16_t*>(mask->data)[static_cast<size_t>(t) * n_kv + p] =
                ggml_fp32_to_fp16(p <= ctx - n_q + t ? 0.f : -INFINITY);
    ggml_tensor* out = ggml_flash_attn_ext(ctx0, q, k, v, mask, scale, 0.f, 0.f);
    ggml_flash_attn_ext_set_prec(out, GGML_PREC_F32);
    ggml_cgraph* gf = ggml_new_graph(ctx0);
    ggml_build_forward_expand(gf, out);
    ggml_graph_compute_with_ctx(ctx0, gf, threads);
    // out: [d, heads, n_q]
    int diff = 0;
    double maxd = 0;
    const float* ref = reinterpret_cast<const float*>(out->data);
    for (size_t i = 0; i < ours.size(); ++i) {
        if (std::memcmp(&ours[i], &ref[i], 4) != 0) {
            ++diff;
            maxd = std::max(maxd, static_cast<double>(std::fabs(ours[i] - ref[i])));
        }
    }
    std::printf("heads %d/%d d %d rows %3d ctx %4d n_kv %4d threads %d: %6d of %zu differ (max %.3g)\n", heads,
                kv_heads, d, n_q, ctx, n_kv, threads, diff, ours.size(), maxd);
    ggml_free(ctx0);
    return diff;
}

int main() {
    int bad = 0;
    const int cases[][3] = {{1, 1, 256},  {1, 37, 256},  {1, 255, 256}, {5, 40, 256}, {63, 63, 256},
                            {64, 64, 256}, {100, 100, 256}, {70, 200, 256}, {200, 200, 256}};
    for (auto& c : cases)
        for (int threads : {1, 2}) bad += run_case(9, 3, 64, c[0], c[1], c[2], threads, 1234u + c[0] * 7 + c[1]) != 0;
    for (int threads : {1, 2}) {  // a GQA group of 8 (query heads per KV head), decode and a short prompt
        bad += run_case(8, 1, 64, 1, 150, 256, threads, 99u) != 0;
        bad += run_case(8, 1, 64, 9, 40, 256, threads, 98u) != 0;
    }
    for (int d : {128, 80}) {  // other head dims: the generic vec path's sums (d % 32, d % 64 left over), tiled
        bad += run_case(4, 2, d, 1, 90, 256, 2, 77u + d) != 0;
        bad += run_case(4, 2, d, 70, 100, 256, 2, 76u + d) != 0;
    }
    std::printf(bad ? "MISMATCH in %d cases\n" : "all bit-identical\n", bad);
    return bad != 0;
}
