// Paged causal attention over an fp16 KV cache with llama.cpp's CPU arithmetic, bit for bit
// (attention/ggml_cpu.py; the numerics of llama.cpp as vendored by llama-cpp-python 0.3.36, built for x86 with
// AVX-512 as llama-server is on such a CPU; the avx2 level's build matches llama.cpp's AVX2+FMA+F16C build, which
// sums the vec path's dot products and the tiled path's softmax in another order and has another vector expf).
//
// Why bit for bit: a GGUF served in its blocks quantizes every matmul's activations to 8 bits per block, as
// llama.cpp does. Such rounding turns any difference, however small, into a whole quantization step in some
// element, and 30 layers later into a different token wherever two candidates were close. So a user who
// moves a GGUF from llama.cpp to sluice gets llama.cpp's answers only if every op rounds as llama.cpp's does.
// This file is the attention op; layer_ops.cpp (sluice_ggml_*) and quant_gemm.cpp do the others.
//
// llama.cpp's CPU flash attention (ggml_compute_forward_flash_attn_ext_f16) takes one of two paths per
// micro-batch, with different rounding, and we take the same one per sequence:
// - "vec" (fewer than 64 query rows: decode and short prompts). Q is rounded to fp16; each key's score is an
//   fp16 x fp16 dot product (exact products, summed in float in the AVX-512 reduction order below, or the AVX2
//   one in the avx2 build: 4 accumulators of 8 lanes, FMA per 32 dims, then halves and pairs; then through a
//   double); online softmax over keys in order with libm's expf; the output accumulates in fp16:
//   acc = fp16(acc * ms) on a new maximum, then acc = fp16(acc + v * vs) per key; out = float(acc) * (1 / S).
// - "tiled" (64 or more query rows: longer prompts). Q stays fp32; keys in tiles of 64: scores are FMA
//   chains over the head dim, times the scale, masked; per tile a running max, exp(x - max) by ggml's
//   vector expf polynomial (ggml_expf.h: AVX-512's form, or AVX2's in the avx2 build), the tile's sum added
//   through a double per vector of 16 (AVX2: 8); the output accumulates in fp32 as FMA
//   chains over the tile's keys; out = acc * (1 / S).
// The dimension order matters for the sums: llama.cpp's K (and Q) hold each rotary pair side by side
// (GGUF's layout), ours holds the two halves of a head apart (HF's), so the cache keeps K in llama.cpp's
// order (sluice_ggml_write_kv permutes it) and Q is permuted on read. V is not permuted anywhere.
// Not reproduced: llama.cpp's split-KV decode (one query row with 512 or more KV cells), which llama-server
// takes once a sequence passes ~256 tokens; there the rounding differs slightly.
//
// Floating-point contraction is off in this file: every FMA below is written as one, every other product
// is rounded on its own, as llama.cpp's build computes them.
#pragma GCC optimize("fp-contract=off")

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "ggml_expf.h"
#include "libm_expf.h"

namespace {

constexpr int kTile = 64;      // llama.cpp's GGML_FA_TILE_Q and GGML_FA_TILE_KV
constexpr int kMaxDim = 256;   // head dims up to this

#if defined(__F16C__)
inline float h2f(uint16_t h) { return _cvtsh_ss(h); }
inline uint16_t f2h(float f) { return _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT); }
#else  // the portable build: the compiler's half type (round to nearest even, as F16C)
inline float h2f(uint16_t h) {
    _Float16 x;
    std::memcpy(&x, &h, 2);
    return static_cast<float>(x);
}
inline uint16_t f2h(float f) {
    const _Float16 x = static_cast<_Float16>(f);
    uint16_t h;
    std::memcpy(&h, &x, 2);
    return h;
}
#endif

// GGUF pair order <-> HF halves: element e of a head in llama.cpp's order is element (e / 2) + (e % 2) * d / 2
// of ours.
inline int hf_index(int e, int d) { return (e >> 1) + (e & 1) * (d >> 1); }

// Sum of 16 floats in the order of GCC's _mm512_reduce_add_ps (halves, quarters, then pairs).
inline float reduce16(const float* x) {
    float t3[8], t6[4];
    for (int i = 0; i < 8; ++i) t3[i] = x[i + 8] + x[i];
    for (int i = 0; i < 4; ++i) t6[i] = t3[i + 4] + t3[i];
    const float a = t6[0] + t6[2], b = t6[1] + t6[3];
    return a + b;
}

struct Geometry {
    const uint16_t* k_cache;  // [slots, kv_heads, d] fp16, K in pair order
    const uint16_t* v_cache;
    const int32_t* table;     // this sequence's block table
    int kv_heads, d, block_size;
    const uint16_t* k_at(int pos, int kvh) const { return k_cache + slot(pos) * kv_heads * d + kvh * d; }
    const uint16_t* v_at(int pos, int kvh) const { return v_cache + slot(pos) * kv_heads * d + kvh * d; }
    int64_t slot(int pos) const { return static_cast<int64_t>(table[pos / block_size]) * block_size + pos % block_size; }
};

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#define SLUICE_GGML_AVX2_ORDER 1  // llama.cpp's AVX2 build: its ggml_vec_dot_f16 and softmax orders
#endif

#if defined(SLUICE_GGML_AVX2_ORDER)
// ggml_vec_dot_f16 as llama.cpp's AVX2 build computes it: 4 accumulators of 8 lanes, accumulator j taking dims
// 32 i + 8 j + lane by FMA for each whole 32 dims; then accumulators 0 + 2 and 1 + 3, those two added, the
// register's halves added (lane + lane 4), then pairs ((0 + 1) + (2 + 3)); the last d % 32 dims' products
// (rounded to float) added one by one in double.
inline double dot_avx2_order(const float* qh, const uint16_t* k, int d) {
    float sum[4][8] = {};
    const int np = d / 32 * 32;
    for (int i = 0; i < np; i += 32)
        for (int j = 0; j < 4; ++j)
            for (int l = 0; l < 8; ++l) sum[j][l] = std::fma(qh[i + 8 * j + l], h2f(k[i + 8 * j + l]), sum[j][l]);
    float x[8], t[4];
    for (int l = 0; l < 8; ++l) x[l] = (sum[0][l] + sum[2][l]) + (sum[1][l] + sum[3][l]);
    for (int l = 0; l < 4; ++l) t[l] = x[l] + x[l + 4];
    double sumf = static_cast<float>((t[0] + t[1]) + (t[2] + t[3]));
    for (int e = np; e < d; ++e) sumf += static_cast<double>(qh[e] * h2f(k[e]));
    return sumf;
}
#endif

// The vec path's online softmax for one head, over its n scores in key order: the running max M; on a new maximum
// ms = expf(M_old - s) (0 at the first key) and vs = 1, else ms = 1 and vs = expf(s - M); S = fma(S, ms, vs).
// Returns S, and each key's (ms, vs), which the fp16 accumulation applies afterwards. Split from the
// accumulation (llama.cpp interleaves the two per key) so that neither waits on the other's latency: the same
// operations on the same values, so the same floats.
inline float softmax_weights(const float* s, int n, float* ms, float* vs) {
    float M = -INFINITY, S = 0.f;
    for (int p = 0; p < n; ++p) {
        float m = 1.f, v = 1.f;
        if (s[p] > M) {
            m = std::exp(M - s[p]);
            M = s[p];
        } else {
            v = std::exp(s[p] - M);
        }
        ms[p] = m;
        vs[p] = v;
        S = std::fma(S, m, v);
    }
    return S;
}

#if defined(__AVX512F__) && defined(__AVX512DQ__)
// softmax_weights for nh heads at once (up to kMaxHeads), S[h] each: the same expf arguments and the same results, in
// passes: the arguments (the heads' running maxima, serial chains run side by side), libm's expf 8 at a time
// (libm_expf.h: glibc's algorithm, bit for bit, checked against the running libm once), then each key's (ms, vs) and
// the heads' S chains, side by side. Falls back to softmax_weights where the check failed.
constexpr int kMaxHeads = 4;
inline void softmax_weights_heads(float* const* s, int nh, int n, float* const* ms, float* const* vs, float* S) {
    if (!sluice_libm::libm_expf_matches() || nh > kMaxHeads) {
        for (int h = 0; h < nh; ++h) S[h] = softmax_weights(s[h], n, ms[h], vs[h]);
        return;
    }
    float M[kMaxHeads];
    for (int h = 0; h < nh; ++h) M[h] = -INFINITY;
    for (int p = 0; p < n; ++p)  // vs: the argument; ms: 0 where the key is a new maximum, 1 elsewhere
        for (int h = 0; h < nh; ++h) {
            const float sp = s[h][p];
            const bool new_max = sp > M[h];
            vs[h][p] = new_max ? M[h] - sp : sp - M[h];
            ms[h][p] = new_max ? 0.f : 1.f;
            M[h] = new_max ? sp : M[h];
        }
    for (int h = 0; h < nh; ++h) {
        int p = 0;
        for (; p + 8 <= n; p += 8) {
            const __m256 arg = _mm256_loadu_ps(vs[h] + p);
            __m256 e = sluice_libm::expf8(arg);
            if (const __mmask8 odd = sluice_libm::needs_libm(arg)) {  // |arg| >= 88, inf, nan: glibc's other paths
                alignas(32) float a[8], r[8];
                _mm256_store_ps(a, arg);
                _mm256_store_ps(r, e);
                for (int i = 0; i < 8; ++i)
                    if (odd >> i & 1) r[i] = std::exp(a[i]);
                e = _mm256_load_ps(r);
            }
            const __m256 one = _mm256_set1_ps(1.f);
            const __m256 not_new = _mm256_cmp_ps(_mm256_loadu_ps(ms[h] + p), one, _CMP_EQ_OQ);
            _mm256_storeu_ps(ms[h] + p, _mm256_blendv_ps(e, one, not_new));  // a new maximum: ms = expf, vs = 1
            _mm256_storeu_ps(vs[h] + p, _mm256_blendv_ps(one, e, not_new));  // else ms = 1, vs = expf
        }
        for (; p < n; ++p) {
            const float e = std::exp(vs[h][p]);
            const bool new_max = ms[h][p] == 0.f;
            ms[h][p] = new_max ? e : 1.f;
            vs[h][p] = new_max ? 1.f : e;
        }
    }
    float acc[kMaxHeads] = {};
    for (int p = 0; p < n; ++p)
        for (int h = 0; h < nh; ++h) acc[h] = std::fma(acc[h], ms[h][p], vs[h][p]);
    for (int h = 0; h < nh; ++h) S[h] = acc[h];
}
#endif

// A key's 64 fp16 values (two cache lines), fetched kPrefetchKeys keys ahead: the keys of a sequence jump from
// block to block of the cache, where the hardware prefetchers lose the stream.
constexpr int kPrefetchKeys = 16;
// A work item that is a whole row (its KV heads in turn) also asks, during its first head's scores, for each token's
// whole K and V rows kPrefetchTokens ahead (every KV head's: 6 cache lines each for 3 heads of 64): its later heads
// and its V passes then read from L2. A decode batch's cache is DRAM-sized (~160 MB at B=32, 30 layers, ctx 200),
// and once its blocks are scattered (a long-running server) the per-head prefetch alone left ~30% of the kernel's
// time waiting on memory: 1.14x faster over shuffled blocks (AMD EPYC, avx512-vnni), the same over contiguous ones.
constexpr int kPrefetchTokens = 32;
inline void prefetch_row(const uint16_t* p) {
    _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(p) + 64, _MM_HINT_T0);
}

// A cached token's whole K and V rows (every KV head: kv_heads x d fp16 each), into L2.
inline void prefetch_token(const uint16_t* k_row, const uint16_t* v_row, int elems) {
    for (int b = 0; b < elems * 2; b += 64) {
        _mm_prefetch(reinterpret_cast<const char*>(k_row) + b, _MM_HINT_T1);
        _mm_prefetch(reinterpret_cast<const char*>(v_row) + b, _MM_HINT_T1);
    }
}

// A work item's per-key scores and softmax weights, [heads][n] each, in per-thread memory kept between calls.
struct VecScratch {
    float* base;
    int64_t* rows;  // each key's element offset in the caches (its slot's, for KV head 0)
    int heads, n;
    VecScratch(const Geometry& g, int heads_, int n_) : heads(heads_), n(n_) {
        thread_local std::vector<float> buf;
        thread_local std::vector<int64_t> offsets;
        const size_t need = static_cast<size_t>(3) * heads * n;
        if (buf.size() < need) buf.resize(need);
        if (offsets.size() < static_cast<size_t>(n)) offsets.resize(n);
        base = buf.data();
        rows = offsets.data();
        const int64_t row = static_cast<int64_t>(g.kv_heads) * g.d;
        for (int p0 = 0, b = 0; p0 < n; p0 += g.block_size, ++b) {  // block by block: no division per key
            const int64_t first = static_cast<int64_t>(g.table[b]) * g.block_size * row;
            for (int o = 0; o < g.block_size && p0 + o < n; ++o) rows[p0 + o] = first + o * row;
        }
    }
    float* score(int h) const { return base + static_cast<int64_t>(h) * n; }
    float* ms(int h) const { return base + static_cast<int64_t>(heads + h) * n; }
    float* vs(int h) const { return base + static_cast<int64_t>(2 * heads + h) * n; }
};

#if defined(__AVX512F__) && defined(__F16C__)
// The "vec" path for a 64-dim head with AVX-512: the same operations as attend_vec below, 16 lanes at a time.
// Up to 4 query heads of one KV head at once (GQA): each key and value is loaded and widened once for all of
// them, and their independent update chains overlap (one head's chain is a serial fp16 round trip per key).
constexpr int kVecHeads = 4;

void attend_vec64(const Geometry& g, const float* q_hf, int nh, int kvh, int pos, float scale, float* out,
                  bool whole) {
    const int n = pos + 1, row_elems = g.kv_heads * 64;
    VecScratch w(g, nh, n);
    __m512 q4[kVecHeads][4], acc[kVecHeads][4];  // acc: the fp16 accumulators, held widened
    for (int h = 0; h < nh; ++h) {
        alignas(64) float qh[64];
        for (int e = 0; e < 64; ++e) qh[e] = h2f(f2h(q_hf[h * 64 + hf_index(e, 64)]));
        for (int j = 0; j < 4; ++j) {
            q4[h][j] = _mm512_load_ps(qh + 16 * j);
            acc[h][j] = _mm512_setzero_ps();
        }
    }
    const auto round16 = [](__m512 x) { return _mm512_cvtph_ps(_mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT)); };
    const auto load16 = [](const uint16_t* p) {
        return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    };
    for (int p = 0; p < n; ++p) {  // every key's score: independent of one another
        const uint16_t* kp = g.k_cache + w.rows[p] + kvh * 64;
        if (p + kPrefetchKeys < n) prefetch_row(g.k_cache + w.rows[p + kPrefetchKeys] + kvh * 64);
        if (whole && p + kPrefetchTokens < n)
            prefetch_token(g.k_cache + w.rows[p + kPrefetchTokens], g.v_cache + w.rows[p + kPrefetchTokens], row_elems);
        __m512 k[4];
        for (int j = 0; j < 4; ++j) k[j] = load16(kp + 16 * j);
        for (int h = 0; h < nh; ++h) {
            __m512 prod[4];
            for (int j = 0; j < 4; ++j) prod[j] = _mm512_mul_ps(q4[h][j], k[j]);  // exact: fp16 x fp16
            const __m512 lanes = _mm512_add_ps(_mm512_add_ps(prod[0], prod[2]), _mm512_add_ps(prod[1], prod[3]));
            const float s = static_cast<float>(static_cast<double>(_mm512_reduce_add_ps(lanes)));
            w.score(h)[p] = s * scale;
        }
    }
    float S[kVecHeads];
    {
        float* sc[kVecHeads];
        float* m[kVecHeads];
        float* v[kVecHeads];
        for (int h = 0; h < nh; ++h) {
            sc[h] = w.score(h);
            m[h] = w.ms(h);
            v[h] = w.vs(h);
        }
        softmax_weights_heads(sc, nh, n, m, v, S);
    }
    for (int p = 0; p < n; ++p) {  // the fp16 accumulation, key by key
        const uint16_t* vp = g.v_cache + w.rows[p] + kvh * 64;
        if (p + kPrefetchKeys < n) prefetch_row(g.v_cache + w.rows[p + kPrefetchKeys] + kvh * 64);
        __m512 v[4];
        for (int j = 0; j < 4; ++j) v[j] = load16(vp + 16 * j);
        for (int h = 0; h < nh; ++h) {
            const float ms = w.ms(h)[p];
            if (ms != 1.f) {  // a new maximum (acc holds fp16 values, so a scale of exactly 1 changes nothing)
                const __m512 vms = _mm512_set1_ps(ms);
                for (int j = 0; j < 4; ++j) acc[h][j] = round16(_mm512_mul_ps(acc[h][j], vms));
            }
            const __m512 vvs = _mm512_set1_ps(w.vs(h)[p]);
            for (int j = 0; j < 4; ++j) acc[h][j] = round16(_mm512_fmadd_ps(v[j], vvs, acc[h][j]));
        }
    }
    for (int h = 0; h < nh; ++h) {
        const __m512 inv = _mm512_set1_ps(S[h] == 0.f ? 0.f : 1.f / S[h]);
        for (int j = 0; j < 4; ++j) _mm512_storeu_ps(out + h * 64 + 16 * j, _mm512_mul_ps(acc[h][j], inv));
    }
}
#elif defined(SLUICE_GGML_AVX2_ORDER) && defined(__F16C__)
// The same with AVX2, 8 lanes at a time and dot_avx2_order's sums: each key and value widened once into L1
// for up to 4 query heads (16 ymm registers hold neither 4 heads' Q nor their accumulators, so both live in
// L1 and each head streams them: the heads' update chains still overlap).
constexpr int kVecHeads = 4;

void attend_vec64(const Geometry& g, const float* q_hf, int nh, int kvh, int pos, float scale, float* out,
                  bool whole) {
    const int n = pos + 1, row_elems = g.kv_heads * 64;
    VecScratch w(g, nh, n);
    alignas(32) float qh[kVecHeads][64], kf[64];
    __m256 acc[kVecHeads][8];  // the fp16 accumulators, held widened
    for (int h = 0; h < nh; ++h) {
        for (int e = 0; e < 64; ++e) qh[h][e] = h2f(f2h(q_hf[h * 64 + hf_index(e, 64)]));
        for (int j = 0; j < 8; ++j) acc[h][j] = _mm256_setzero_ps();
    }
    const auto round8 = [](__m256 x) { return _mm256_cvtph_ps(_mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT)); };
    const auto load8 = [](const uint16_t* p) {
        return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    };
    for (int p = 0; p < n; ++p) {  // every key's score: independent of one another
        const uint16_t* kp = g.k_cache + w.rows[p] + kvh * 64;
        if (p + kPrefetchKeys < n) prefetch_row(g.k_cache + w.rows[p + kPrefetchKeys] + kvh * 64);
        if (whole && p + kPrefetchTokens < n)
            prefetch_token(g.k_cache + w.rows[p + kPrefetchTokens], g.v_cache + w.rows[p + kPrefetchTokens], row_elems);
        for (int j = 0; j < 8; ++j) _mm256_store_ps(kf + 8 * j, load8(kp + 8 * j));
        for (int h = 0; h < nh; ++h) {
            __m256 sum[4];
            for (int j = 0; j < 4; ++j) {  // dims 0..31 (exact products), then 32..63 by FMA
                sum[j] = _mm256_mul_ps(_mm256_load_ps(qh[h] + 8 * j), _mm256_load_ps(kf + 8 * j));
                sum[j] = _mm256_fmadd_ps(_mm256_load_ps(qh[h] + 32 + 8 * j), _mm256_load_ps(kf + 32 + 8 * j), sum[j]);
            }
            const __m256 x = _mm256_add_ps(_mm256_add_ps(sum[0], sum[2]), _mm256_add_ps(sum[1], sum[3]));
            const __m128 t = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
            alignas(16) float tl[4];
            _mm_store_ps(tl, t);
            const float s = static_cast<float>(static_cast<double>((tl[0] + tl[1]) + (tl[2] + tl[3])));
            w.score(h)[p] = s * scale;
        }
    }
    float S[kVecHeads];
    for (int h = 0; h < nh; ++h) S[h] = softmax_weights(w.score(h), n, w.ms(h), w.vs(h));
    for (int p = 0; p < n; ++p) {  // the fp16 accumulation, key by key
        const uint16_t* vp = g.v_cache + w.rows[p] + kvh * 64;
        if (p + kPrefetchKeys < n) prefetch_row(g.v_cache + w.rows[p + kPrefetchKeys] + kvh * 64);
        __m256 v[8];
        for (int j = 0; j < 8; ++j) v[j] = load8(vp + 8 * j);
        for (int h = 0; h < nh; ++h) {
            const float ms = w.ms(h)[p];
            if (ms != 1.f) {  // a new maximum (acc holds fp16 values, so a scale of exactly 1 changes nothing)
                const __m256 vms = _mm256_set1_ps(ms);
                for (int j = 0; j < 8; ++j) acc[h][j] = round8(_mm256_mul_ps(acc[h][j], vms));
            }
            const __m256 vvs = _mm256_set1_ps(w.vs(h)[p]);
            for (int j = 0; j < 8; ++j) acc[h][j] = round8(_mm256_fmadd_ps(v[j], vvs, acc[h][j]));
        }
    }
    for (int h = 0; h < nh; ++h) {
        const __m256 inv = _mm256_set1_ps(S[h] == 0.f ? 0.f : 1.f / S[h]);
        for (int j = 0; j < 8; ++j) _mm256_storeu_ps(out + h * 64 + 8 * j, _mm256_mul_ps(acc[h][j], inv));
    }
}
#endif

// ggml_vec_dot_f16 as llama.cpp's AVX-512 build computes it: blocks of 64 dims (4 accumulators of 16 lanes by
// FMA), the accumulators (0 + 2) + (1 + 3), the 16 lanes in _mm512_reduce_add_ps's order, then the last d % 64
// dims' products one by one in double.
inline double dot_avx512_order(const float* qh, const uint16_t* k, int d) {
    const int groups = d / 64, rest = d % 64;
    double sumf = 0.0;
    if (groups == 1) {  // the only case a 64-dim head has (the reduction of a single block of 64)
        float lane[16];
        for (int l = 0; l < 16; ++l) {
            const float a = qh[l] * h2f(k[l]) + qh[32 + l] * h2f(k[32 + l]);
            const float b = qh[16 + l] * h2f(k[16 + l]) + qh[48 + l] * h2f(k[48 + l]);
            lane[l] = a + b;
        }
        sumf = reduce16(lane);
    } else {
        float sum[4][16] = {};
        for (int gi = 0; gi < groups; ++gi)
            for (int j = 0; j < 4; ++j)
                for (int l = 0; l < 16; ++l) {
                    const int e = gi * 64 + j * 16 + l;
                    sum[j][l] = std::fma(qh[e], h2f(k[e]), sum[j][l]);
                }
        float lane[16];
        for (int l = 0; l < 16; ++l) lane[l] = (sum[0][l] + sum[2][l]) + (sum[1][l] + sum[3][l]);
        sumf = reduce16(lane);
    }
    for (int e = groups * 64; e < groups * 64 + rest; ++e) sumf += static_cast<double>(qh[e] * h2f(k[e]));
    return sumf;
}

// The "vec" path for one query row of one head: keys 0..pos.
void attend_vec(const Geometry& g, const float* q_hf, int kvh, int pos, float scale, float* out) {
    const int d = g.d;
    float qh[kMaxDim];  // Q rounded to fp16, in pair order
    for (int e = 0; e < d; ++e) qh[e] = h2f(f2h(q_hf[hf_index(e, d)]));
    uint16_t acc[kMaxDim];
    std::memset(acc, 0, sizeof(acc));
    float S = 0.f, M = -INFINITY;
    for (int p = 0; p <= pos; ++p) {
#if defined(SLUICE_GGML_AVX2_ORDER)
        const double sumf = dot_avx2_order(qh, g.k_at(p, kvh), d);
#else
        const double sumf = dot_avx512_order(qh, g.k_at(p, kvh), d);
#endif
        float s = static_cast<float>(sumf);
        s = s * scale;
        const float Mold = M;
        float ms = 1.f, vs = 1.f;
        if (s > M) {
            M = s;
            ms = std::exp(Mold - M);
            for (int i = 0; i < d; ++i) acc[i] = f2h(h2f(acc[i]) * ms);
        } else {
            vs = std::exp(s - M);
        }
        const uint16_t* v = g.v_at(p, kvh);
        for (int i = 0; i < d; ++i) acc[i] = f2h(std::fma(h2f(v[i]), vs, h2f(acc[i])));
        S = std::fma(S, ms, vs);
    }
    const float inv = S == 0.f ? 0.f : 1.f / S;
    for (int i = 0; i < d; ++i) out[i] = h2f(acc[i]) * inv;
}

// A tile's scores, kq[c] = sum over e of q[e] k_c[e] as one FMA chain per key from 0 (llama.cpp's simd_gemm),
// and its values' contribution, acc[i] += sum over c of p[c] v_c[i], one FMA chain per dim. ktile is the tile's
// K transposed ([d][64]), vt its V ([64][d]).
#if defined(__AVX512F__)
void tile_scores(const float* q, const float* ktile, int d, float* kq) {
    __m512 a[kTile / 16];
    for (auto& x : a) x = _mm512_setzero_ps();
    for (int e = 0; e < d; ++e) {
        const __m512 b = _mm512_set1_ps(q[e]);
        for (int j = 0; j < kTile / 16; ++j) a[j] = _mm512_fmadd_ps(b, _mm512_loadu_ps(ktile + e * kTile + 16 * j), a[j]);
    }
    for (int j = 0; j < kTile / 16; ++j) _mm512_storeu_ps(kq + 16 * j, a[j]);
}

void tile_accumulate(const float* p, const float* vt, int d, float* acc) {
    for (int i0 = 0; i0 < d; i0 += 64) {  // d is a multiple of 16 (sluice_ggml_attention_supports_head_dim)
        const int nv = std::min(4, (d - i0) / 16);
        __m512 a[4];
        for (int j = 0; j < nv; ++j) a[j] = _mm512_loadu_ps(acc + i0 + 16 * j);
        for (int c = 0; c < kTile; ++c) {
            const __m512 pc = _mm512_set1_ps(p[c]);
            for (int j = 0; j < nv; ++j) a[j] = _mm512_fmadd_ps(_mm512_loadu_ps(vt + c * d + i0 + 16 * j), pc, a[j]);
        }
        for (int j = 0; j < nv; ++j) _mm512_storeu_ps(acc + i0 + 16 * j, a[j]);
    }
}
#elif defined(__AVX2__) && defined(__FMA__)
void tile_scores(const float* q, const float* ktile, int d, float* kq) {
    __m256 a[kTile / 8];
    for (auto& x : a) x = _mm256_setzero_ps();
    for (int e = 0; e < d; ++e) {
        const __m256 b = _mm256_set1_ps(q[e]);
        for (int j = 0; j < kTile / 8; ++j) a[j] = _mm256_fmadd_ps(b, _mm256_loadu_ps(ktile + e * kTile + 8 * j), a[j]);
    }
    for (int j = 0; j < kTile / 8; ++j) _mm256_storeu_ps(kq + 8 * j, a[j]);
}

void tile_accumulate(const float* p, const float* vt, int d, float* acc) {
    for (int i0 = 0; i0 < d; i0 += 64) {  // d is a multiple of 16 (sluice_ggml_attention_supports_head_dim)
        const int nv = std::min(8, (d - i0) / 8);
        __m256 a[8];
        for (int j = 0; j < nv; ++j) a[j] = _mm256_loadu_ps(acc + i0 + 8 * j);
        for (int c = 0; c < kTile; ++c) {
            const __m256 pc = _mm256_set1_ps(p[c]);
            for (int j = 0; j < nv; ++j) a[j] = _mm256_fmadd_ps(_mm256_loadu_ps(vt + c * d + i0 + 8 * j), pc, a[j]);
        }
        for (int j = 0; j < nv; ++j) _mm256_storeu_ps(acc + i0 + 8 * j, a[j]);
    }
}
#else
void tile_scores(const float* q, const float* ktile, int d, float* kq) {
    for (int c = 0; c < kTile; ++c) kq[c] = 0.f;
    for (int e = 0; e < d; ++e)
        for (int c = 0; c < kTile; ++c) kq[c] = std::fma(q[e], ktile[e * kTile + c], kq[c]);
}

void tile_accumulate(const float* p, const float* vt, int d, float* acc) {
    for (int c = 0; c < kTile; ++c)
        for (int i = 0; i < d; ++i) acc[i] = std::fma(vt[c * d + i], p[c], acc[i]);
}
#endif

// The "tiled" path for one sequence: rows [0, rows) at positions first_pos + r, heads [0, heads).
void attend_tiled(const Geometry& g, const float* q, int64_t ldq, float* out, int64_t ldo, int rows, int first_pos,
                  int heads, float scale, int threads) {
    const int d = g.d, kvh_n = g.kv_heads, group = heads / kvh_n;
    const int ctx = first_pos + rows, tiles = (ctx + kTile - 1) / kTile;
    // K transposed ([kv head][tile][dim][key]) and V ([kv head][key][dim]) in fp32, zero-padded to whole tiles.
    std::vector<float> kt(static_cast<size_t>(kvh_n) * tiles * d * kTile, 0.f);
    std::vector<float> vf(static_cast<size_t>(kvh_n) * tiles * kTile * d, 0.f);
#pragma omp parallel for num_threads(threads) schedule(static) collapse(2)
    for (int h = 0; h < kvh_n; ++h)
        for (int p = 0; p < ctx; ++p) {
            const uint16_t* k = g.k_at(p, h);
            const uint16_t* v = g.v_at(p, h);
            float* ktile = &kt[(static_cast<size_t>(h) * tiles + p / kTile) * d * kTile];
            for (int e = 0; e < d; ++e) ktile[e * kTile + p % kTile] = h2f(k[e]);
            float* vrow = &vf[(static_cast<size_t>(h) * tiles * kTile + p) * d];
            for (int i = 0; i < d; ++i) vrow[i] = h2f(v[i]);
        }
#pragma omp parallel for num_threads(threads) schedule(dynamic, 4) collapse(2)
    for (int r = 0; r < rows; ++r)
        for (int h = 0; h < heads; ++h) {
            const int kvh = h / group, pos = first_pos + r;
            const float* qr = q + r * ldq + h * d;
            float qp[kMaxDim], acc[kMaxDim], kq[kTile];
            for (int e = 0; e < d; ++e) qp[e] = qr[hf_index(e, d)];
            for (int i = 0; i < d; ++i) acc[i] = 0.f;
            float S = 0.f, M = -INFINITY;
            for (int t = 0; t * kTile <= pos; ++t) {
                const float* ktile = &kt[(static_cast<size_t>(kvh) * tiles + t) * d * kTile];
                tile_scores(qp, ktile, d, kq);
                float tile_max = -INFINITY;
                for (int c = 0; c < kTile; ++c) {
                    kq[c] = t * kTile + c <= pos ? kq[c] * scale : -INFINITY;  // masked: x + -inf
                    tile_max = std::max(tile_max, kq[c]);
                }
                const float Mnew = std::fmax(M, tile_max);
                if (Mnew > M) {
                    const float ms = std::exp(M - Mnew);
                    for (int i = 0; i < d; ++i) acc[i] = acc[i] * ms;
                    S = S * ms;
                }
                M = Mnew;
                double sum = 0.0;
                constexpr int vw = sluice_ggml::kExpfBlock;  // ggml_vec_soft_max_f32: a double sum per vector
                for (int c0 = 0; c0 < kTile; c0 += vw) {
#if defined(SLUICE_GGML_AVX2_ORDER)
                    _mm256_storeu_ps(kq + c0, sluice_ggml::ggml_v_expf_avx2(
                                                  _mm256_sub_ps(_mm256_loadu_ps(kq + c0), _mm256_set1_ps(Mnew))));
#else
                    for (int c = c0; c < c0 + vw; ++c) kq[c] = sluice_ggml::ggml_expf_lane(kq[c] - Mnew);
#endif
                    sum += static_cast<double>(sluice_ggml::expf_block_sum(kq + c0));
                }
                S = static_cast<float>(static_cast<double>(S) + sum);
                const float* vt = &vf[(static_cast<size_t>(kvh) * tiles + t) * kTile * d];
                tile_accumulate(kq, vt, d, acc);
            }
            const float inv = S == 0.f ? 0.f : 1.f / S;
            float* o = out + r * ldo + h * d;
            for (int i = 0; i < d; ++i) o[i] = acc[i] * inv;
        }
}

}  // namespace

extern "C" {

int sluice_ggml_attention_supports_head_dim(int d) { return d > 0 && d % 2 == 0 && d <= kMaxDim && d % 16 == 0; }

// K and V rows [T, kv_heads, d] (fp32; row stride ldk/ldv, heads contiguous) into the fp16 caches at their slots;
// K permuted into pair order. Tokens shared among the threads: the arithmetic is nothing, but a token's first write
// into a never-used page of the cache faults it in (~2 ms per MB on the VMs measured, 5% of a fresh server's time
// at concurrency 32 when one thread took them all while the other waited), and two threads fault in parallel.
void sluice_ggml_write_kv(const float* k, int64_t ldk, const float* v, int64_t ldv, uint16_t* k_cache,
                          uint16_t* v_cache, const int64_t* slots, int tokens, int kv_heads, int d, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (tokens >= 2 * threads && threads > 1)
    for (int t = 0; t < tokens; ++t) {
        const int64_t base = slots[t] * kv_heads * d;
        for (int h = 0; h < kv_heads; ++h) {
            const float* kr = k + t * ldk + h * d;
            const float* vr = v + t * ldv + h * d;
            uint16_t* kc = k_cache + base + h * d;
            uint16_t* vc = v_cache + base + h * d;
            for (int e = 0; e < d; ++e) kc[e] = f2h(kr[hf_index(e, d)]);
            for (int i = 0; i < d; ++i) vc[i] = f2h(vr[i]);
        }
    }
}

// out[T, heads, d] = causal attention of q[T, heads, d] (fp32, HF layout; rows ldq apart, heads contiguous) over
// each sequence's cached context. Sequence i owns rows query_start[i]..query_start[i+1] and has seq_lens[i]
// tokens after this step; its cache slots come from block_tables (row i, ldt apart).
void sluice_ggml_attention(float* out, int64_t ldo, const float* q, int64_t ldq, const uint16_t* k_cache,
                           const uint16_t* v_cache, const int32_t* block_tables, int64_t ldt, const int32_t* seq_lens,
                           const int32_t* query_start, int num_seqs, int heads, int kv_heads, int d, int block_size,
                           float scale, int threads) {
    const int group = heads / kv_heads;
    for (int s = 0; s < num_seqs; ++s) {
        const int q0 = query_start[s], rows = query_start[s + 1] - q0, first = seq_lens[s] - rows;
        if (rows >= kTile) {
            const Geometry g{k_cache, v_cache, block_tables + s * ldt, kv_heads, d, block_size};
            attend_tiled(g, q + q0 * ldq, ldq, out + q0 * ldo, ldo, rows, first, heads, scale, threads);
        }
    }
    // Every short sequence's rows x heads in one parallel loop (a decode batch is many sequences of one row).
    std::vector<int> row_seq, row_idx;  // each short row's sequence and its index in q
    for (int s = 0; s < num_seqs; ++s) {
        const int rows = query_start[s + 1] - query_start[s];
        if (rows < kTile)
            for (int r = 0; r < rows; ++r) {
                row_seq.push_back(s);
                row_idx.push_back(query_start[s] + r);
            }
    }
#if (defined(__AVX512F__) || defined(SLUICE_GGML_AVX2_ORDER)) && defined(__F16C__)
    if (d == 64) {  // (row, KV head, up to 4 of its query heads) per work item
        const int chunks = (group + kVecHeads - 1) / kVecHeads;
        const int64_t units = static_cast<int64_t>(row_idx.size()) * kv_heads * chunks;
        // With rows enough to share out, a work item is a whole row (its KV heads in turn): it then reads each
        // cached token's K (and V) row of all KV heads, contiguous in the cache, where one KV head's share of
        // it is a strided read that the prefetchers serve badly (~2x the time of a decode batch's attention).
        const int per_item = static_cast<int64_t>(row_idx.size()) >= 4 * threads ? kv_heads * chunks : 1;
        const int64_t n = units / per_item;
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1) if (n > 2)
        for (int64_t item = 0; item < n; ++item)
        for (int64_t w = item * per_item; w < (item + 1) * per_item; ++w) {
            const int i = static_cast<int>(w / (kv_heads * chunks)), rest = static_cast<int>(w % (kv_heads * chunks));
            const int kvh = rest / chunks, h0 = kvh * group + (rest % chunks) * kVecHeads;
            const int nh = std::min(kVecHeads, (kvh + 1) * group - h0), s = row_seq[i], row = row_idx[i];
            const int pos = seq_lens[s] - (query_start[s + 1] - query_start[s]) + (row - query_start[s]);
            const Geometry g{k_cache, v_cache, block_tables + s * ldt, kv_heads, d, block_size};
            attend_vec64(g, q + row * ldq + h0 * d, nh, kvh, pos, scale, out + row * ldo + h0 * d,
                         per_item > 1 && w == item * per_item);  // whole: a row's first head
        }
        return;
    }
#endif
    const int64_t n = static_cast<int64_t>(row_idx.size()) * heads;
#pragma omp parallel for num_threads(threads) schedule(dynamic, 4) if (n > 4)
    for (int64_t w = 0; w < n; ++w) {
        const int i = static_cast<int>(w / heads), h = static_cast<int>(w % heads), s = row_seq[i], row = row_idx[i];
        const int rows = query_start[s + 1] - query_start[s];
        const int pos = seq_lens[s] - rows + (row - query_start[s]);
        const Geometry g{k_cache, v_cache, block_tables + s * ldt, kv_heads, d, block_size};
        attend_vec(g, q + row * ldq + h * d, h / group, pos, scale, out + row * ldo + h * d);
    }
}

}  // extern "C"
