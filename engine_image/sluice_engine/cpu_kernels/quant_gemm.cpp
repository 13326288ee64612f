// y[M, N] = x[M, K] . W^T with W kept in a GGUF block format, row n of W being K/32 blocks of 32 weights:
//   Q8_0: fp16 d, 32 int8 q               (34 bytes)  w = q * d
//   Q4_0: fp16 d, 16 bytes of nibbles     (18 bytes)  w = (q - 8) * d
//   Q4_1: fp16 d, fp16 m, 16 bytes        (20 bytes)  w = q * d + m
// where byte j of a 4-bit block holds weight j in its low nibble and weight j + 16 in its high one.
// Why: a decode step is these matmuls at a few rows, and reading the weights from memory is its cost;
// 4-bit blocks are 5-6x fewer bytes than fp32 (what the engine held before, dequantized at load).
//
// Two paths:
// - decode (M <= kDecodeRows): each thread takes a range of output rows n; a block is widened to 32
//   floats in registers and multiplies every row of x (which stays in L1), so each weight byte is read
//   from memory once per call and never written out as floats.
// - prefill (more rows): the same tiles, 8 rows of x at a time, over a range of 16 output rows whose
//   blocks stay in L1 (below). Tried first and dropped: dequantizing a 32-column panel into gemm.cpp's
//   packed fp32 layout and running its tiles; the strided stores cost more than the tiles saved (5-7x
//   slower than this at 9-16 rows, 1.1x at 512; docs/BENCHMARKS.md).
// AVX-512 intrinsics for the decode path where the compiler targets it; elsewhere plain loops (which
// -O3 -march=native vectorizes for AVX2/NEON) that compute the same sums. Sums run in a different
// order from F.linear's: results differ by float rounding.

#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

enum Format { kQ8_0 = 0, kQ4_0 = 1, kQ4_1 = 2 };
constexpr int kBlock = 32;
constexpr int kDecodeRows = 8;
constexpr int64_t kChunkBytes = 512 << 10;  // rows of x per pass over the weights in the prefill path (as gemm.cpp)

constexpr int block_bytes(int fmt) { return fmt == kQ8_0 ? 34 : fmt == kQ4_0 ? 18 : 20; }

// IEEE half -> float by bit manipulation: right on every CPU, no F16C needed.
inline float half_to_float(const uint8_t* p) {
    uint16_t h;
    std::memcpy(&h, p, 2);
    const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
    uint32_t exp = (h >> 10) & 0x1F, mant = h & 0x3FF, bits;
    if (exp == 0x1F) {
        bits = sign | 0x7F800000u | (mant << 13);  // inf / nan
    } else if (exp == 0) {
        if (mant == 0) {
            bits = sign;
        } else {  // subnormal: normalise
            int e = -1;
            do { ++e; mant <<= 1; } while (!(mant & 0x400));
            bits = sign | (static_cast<uint32_t>(127 - 15 - e) << 23) | ((mant & 0x3FF) << 13);
        }
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
    }
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}

template <int F>
inline void dequant_block(const uint8_t* b, float* out) {
    const float d = half_to_float(b);
    if constexpr (F == kQ8_0) {
        const int8_t* q = reinterpret_cast<const int8_t*>(b + 2);
        for (int i = 0; i < kBlock; ++i) out[i] = static_cast<float>(q[i]) * d;
    } else if constexpr (F == kQ4_0) {
        const uint8_t* q = b + 2;
        for (int i = 0; i < 16; ++i) {
            out[i] = static_cast<float>((q[i] & 0x0F) - 8) * d;
            out[i + 16] = static_cast<float>((q[i] >> 4) - 8) * d;
        }
    } else {
        const float m = half_to_float(b + 2);
        const uint8_t* q = b + 4;
        for (int i = 0; i < 16; ++i) {
            out[i] = static_cast<float>(q[i] & 0x0F) * d + m;
            out[i + 16] = static_cast<float>(q[i] >> 4) * d + m;
        }
    }
}

#if defined(__AVX512F__)
// A block as two 16-float vectors (weights 0..15, 16..31), widened from bytes in registers.
template <int F>
inline void widen_block(const uint8_t* b, __m512& w0, __m512& w1) {
    const __m512 d = _mm512_set1_ps(half_to_float(b));
    if constexpr (F == kQ8_0) {
        const __m128i q0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 2));
        const __m128i q1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 18));
        w0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q0)), d);
        w1 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q1)), d);
    } else {
        const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + (F == kQ4_1 ? 4 : 2))));
        __m512i lo = _mm512_and_si512(q, _mm512_set1_epi32(0x0F)), hi = _mm512_srli_epi32(q, 4);
        if constexpr (F == kQ4_0) {
            lo = _mm512_sub_epi32(lo, _mm512_set1_epi32(8));
            hi = _mm512_sub_epi32(hi, _mm512_set1_epi32(8));
            w0 = _mm512_mul_ps(_mm512_cvtepi32_ps(lo), d);
            w1 = _mm512_mul_ps(_mm512_cvtepi32_ps(hi), d);
        } else {
            const __m512 m = _mm512_set1_ps(half_to_float(b + 2));
            w0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(lo), d, m);
            w1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(hi), d, m);
        }
    }
}

// Two output rows at a time: two independent dequantize-and-FMA chains keep the FMA units busy at M = 1.
template <int F, int MR>
void decode_rows(const float* x, int64_t ldx, const uint8_t* w, int64_t row_bytes, int nb, float* y, int64_t ldy,
                 int n0, int n1) {
    int n = n0;
    for (; n + 2 <= n1; n += 2) {
        const uint8_t* ra = w + n * row_bytes;
        const uint8_t* rb = ra + row_bytes;
        __m512 acc_a[MR], acc_b[MR];
        for (int m = 0; m < MR; ++m) acc_a[m] = acc_b[m] = _mm512_setzero_ps();
        for (int b = 0; b < nb; ++b) {
            _mm_prefetch(reinterpret_cast<const char*>(ra + (b + 8) * block_bytes(F)), _MM_HINT_T0);
            _mm_prefetch(reinterpret_cast<const char*>(rb + (b + 8) * block_bytes(F)), _MM_HINT_T0);
            __m512 a0, a1, b0, b1;
            widen_block<F>(ra + b * block_bytes(F), a0, a1);
            widen_block<F>(rb + b * block_bytes(F), b0, b1);
            for (int m = 0; m < MR; ++m) {
                const float* xb = x + m * ldx + b * kBlock;
                const __m512 x0 = _mm512_loadu_ps(xb), x1 = _mm512_loadu_ps(xb + 16);
                acc_a[m] = _mm512_fmadd_ps(a1, x1, _mm512_fmadd_ps(a0, x0, acc_a[m]));
                acc_b[m] = _mm512_fmadd_ps(b1, x1, _mm512_fmadd_ps(b0, x0, acc_b[m]));
            }
        }
        for (int m = 0; m < MR; ++m) {
            y[m * ldy + n] = _mm512_reduce_add_ps(acc_a[m]);
            y[m * ldy + n + 1] = _mm512_reduce_add_ps(acc_b[m]);
        }
    }
    for (; n < n1; ++n) {  // an odd last row
        const uint8_t* r = w + n * row_bytes;
        __m512 acc[MR];
        for (int m = 0; m < MR; ++m) acc[m] = _mm512_setzero_ps();
        for (int b = 0; b < nb; ++b) {
            __m512 w0, w1;
            widen_block<F>(r + b * block_bytes(F), w0, w1);
            for (int m = 0; m < MR; ++m) {
                const float* xb = x + m * ldx + b * kBlock;
                acc[m] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xb + 16), _mm512_fmadd_ps(w0, _mm512_loadu_ps(xb), acc[m]));
            }
        }
        for (int m = 0; m < MR; ++m) y[m * ldy + n] = _mm512_reduce_add_ps(acc[m]);
    }
}
#else
template <int F, int MR>
void decode_rows(const float* x, int64_t ldx, const uint8_t* w, int64_t row_bytes, int nb, float* y, int64_t ldy,
                 int n0, int n1) {
    float wb[kBlock];
    for (int n = n0; n < n1; ++n) {
        const uint8_t* r = w + n * row_bytes;
        float acc[MR][kBlock] = {};  // per-lane partial sums: a shape the compiler vectorizes
        for (int b = 0; b < nb; ++b) {
            dequant_block<F>(r + b * block_bytes(F), wb);
            for (int m = 0; m < MR; ++m) {
                const float* xb = x + m * ldx + b * kBlock;
                for (int i = 0; i < kBlock; ++i) acc[m][i] += wb[i] * xb[i];
            }
        }
        for (int m = 0; m < MR; ++m) {
            float s = 0.f;
            for (int i = 0; i < kBlock; ++i) s += acc[m][i];
            y[m * ldy + n] = s;
        }
    }
}
#endif

using DecodeFn = void (*)(const float*, int64_t, const uint8_t*, int64_t, int, float*, int64_t, int, int);

template <int F>
constexpr DecodeFn kDecode[kDecodeRows + 1] = {nullptr,           decode_rows<F, 1>, decode_rows<F, 2>,
                                              decode_rows<F, 3>, decode_rows<F, 4>, decode_rows<F, 5>,
                                              decode_rows<F, 6>, decode_rows<F, 7>, decode_rows<F, 8>};

template <int F>
void decode(const float* x, int64_t ldx, const uint8_t* w, int M, int K, int N, float* y, int64_t ldy, int threads) {
    const int nb = K / kBlock;
    const int64_t row_bytes = static_cast<int64_t>(nb) * block_bytes(F);
    // Ranges of 16 output rows (even, for the pairs): enough per thread to stream, many for balance.
    constexpr int kRange = 16;
    const int ranges = (N + kRange - 1) / kRange;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int r = 0; r < ranges; ++r)
        kDecode<F>[M](x, ldx, w, row_bytes, nb, y, ldy, r * kRange, std::min(N, (r + 1) * kRange));
}

// Many rows: the decode tiles over each 8-row tile of x in turn, for one range of 16 output rows at a
// time. The range's blocks (16 x K/32 blocks: 6 KB at K = 576 in Q4_1) stay in L1 across the row tiles
// and the chunk of x in L2, so weights come from memory once per chunk; each block is widened once per
// 8 rows of x instead of once per row.
template <int F>
void prefill(const float* x, int64_t ldx, const uint8_t* w, int M, int K, int N, float* y, int64_t ldy,
                   int threads) {
    const int nb = K / kBlock;
    const int64_t row_bytes = static_cast<int64_t>(nb) * block_bytes(F);
    constexpr int kRange = 16;
    const int ranges = (N + kRange - 1) / kRange;
    const int chunk = std::max(kDecodeRows, static_cast<int>(kChunkBytes / (static_cast<int64_t>(K) * sizeof(float))));
    for (int m0 = 0; m0 < M; m0 += chunk) {
        const int rows = std::min(chunk, M - m0);
#pragma omp parallel for schedule(static) num_threads(threads)
        for (int r = 0; r < ranges; ++r) {
            const int n0 = r * kRange, n1 = std::min(N, n0 + kRange);
            for (int m = m0; m < m0 + rows; m += kDecodeRows) {
                const int mr = std::min(kDecodeRows, m0 + rows - m);
                kDecode<F>[mr](x + m * ldx, ldx, w, row_bytes, nb, y + m * ldy, ldy, n0, n1);
            }
        }
    }
}

template <int F>
void gemm(const float* x, int64_t ldx, const uint8_t* w, int M, int K, int N, float* y, int64_t ldy, int threads) {
    if (M <= kDecodeRows)
        decode<F>(x, ldx, w, M, K, N, y, ldy, threads);
    else
        prefill<F>(x, ldx, w, M, K, N, y, ldy, threads);
}

}  // namespace

extern "C" {

int sluice_quant_block_bytes(int fmt) { return fmt >= kQ8_0 && fmt <= kQ4_1 ? block_bytes(fmt) : 0; }

// x: [M, K] fp32, rows ldx apart; w: [N, K / 32 blocks] in format `fmt`; y: [M, N], rows ldy apart.
// K must be a multiple of 32 (the caller checks). Rows 1..8 take the decode path.
void sluice_quant_gemm_f32(int fmt, const float* x, int64_t ldx, const uint8_t* w, int M, int K, int N, float* y,
                           int64_t ldy, int num_threads) {
    if (M <= 0 || N <= 0) return;
    switch (fmt) {
        case kQ8_0: gemm<kQ8_0>(x, ldx, w, M, K, N, y, ldy, num_threads); break;
        case kQ4_0: gemm<kQ4_0>(x, ldx, w, M, K, N, y, ldy, num_threads); break;
        case kQ4_1: gemm<kQ4_1>(x, ldx, w, M, K, N, y, ldy, num_threads); break;
        default: break;
    }
}

}  // extern "C"
