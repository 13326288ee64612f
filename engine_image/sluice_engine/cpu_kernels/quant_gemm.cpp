// y[M, N] = x[M, K] . W^T with W held in a GGUF block format, and x quantized to 8 bits per block of
// 32 inside the call, so that each block's dot product is an integer one (what llama.cpp does: its
// numerics, and 4x the multiply-adds per instruction of fp32 FMAs).
//
// Weight formats (GGUF; a row of W is K/32 blocks of 32 weights):
//   Q8_0: fp16 d, 32 int8 q               (34 bytes)  w = q * d
//   Q4_0: fp16 d, 16 bytes of nibbles     (18 bytes)  w = (q - 8) * d
//   Q4_1: fp16 d, fp16 m, 16 bytes        (20 bytes)  w = q * d + m
// where byte j of a 4-bit block holds weight j in its low nibble and weight j + 16 in its high one.
//
// Activations (per row, per block of 32, GGUF's Q8_0/Q8_1 as llama.cpp's x86 quantize_row_q8_0/_q8_1
// make them, bit for bit):
//   d = max|x| / 127, q = round-half-even(x * (127 / max|x|)) (0 where max|x| == 0), stored d = fp16(d),
//   s = fp16(d * float(sum q)) (Q8_1's s field, used with Q4_1 weights); d and s unrounded are float32,
//   and fp16 rounding is to nearest even (what ggml's software fp32->fp16 also gives).
//
// The float arithmetic reproduces llama.cpp's x86 dot products bit for bit (ggml_vec_dot_q4_1_q8_1,
// _q4_0_q8_0, _q8_0_q8_0, as GCC -O3 -march=native builds them for an AVX2/AVX-512 CPU; llamafile's
// tinyBLAS_Q0_AVX, which llama.cpp uses for Q8_0 and Q4_0 at 2+ rows, does the same arithmetic). Those
// split a block's 32 products into 8 "lanes" of 4 consecutive ones (lane l: weights 4l..4l+3, so for the
// 4-bit formats lanes 0..3 are low nibbles and 4..7 high nibbles), each lane with its own float
// accumulator over K. Per output, per block b in order:
//   isum_l = the lane's integer sum (exact in int32; Q4_0 with (q - 8), Q8_0 with the signed q)
//   dd = float(d_w) * float(d_x)                               rounded to float
//   acc_l = fma(dd, float(isum_l), acc_l)                      l = 0..7, one rounding each
//   summs = fma(m_w, s_x, summs)                               Q4_1 only (GCC contracts llama.cpp's
//                                                              `summs += m * s` into an FMA)
// and at the end, hsum_float_8's order: y = ((acc_0 + acc_4) + (acc_2 + acc_6)) + ((acc_1 + acc_5) +
// (acc_3 + acc_7)), then y + summs for Q4_1. Each output is that sequence whatever M, the tile or the
// thread count. Near-ties in greedy decoding are why: both engines round activations to 8 bits per block
// again at every matmul, so one ulp of difference anywhere can grow through the layers into another token.
// benchmarks/ggml_check/quant_gemm_check.cpp compares every build with ggml itself (0 bits differ), and
// tests/test_cpu_quant_gemm.py pins the sequence with a float32 emulation. It costs about twice the vector
// instructions of one int32 sum per block (8 conversions and 8 FMAs per block where 1 and 1 would do): ~2x
// the time when compute-bound (prefill, batched decode), little at one row (reading the weights).
// (Caveat: llama.cpp repacks Q4_0 weights to its own 8x8 layout on AVX2 CPUs when N % 8 == 0, by default,
// whose kernels add differently; its Q4_1 and Q8_0 have no such repack on x86.)
//
// Rounding per block (format code | kRoundPerBlock; `--numerics fast`): per output, per block b,
//   isum = the block's whole integer sum (the 8 lanes' sums added in int32: exact)
//   acc = fma(dd, float(isum), acc)                            one rounding per block instead of 8
// and y = acc (+ summs for Q4_1, as above). One conversion and one FMA per block where the exact order has 8
// and 8 plus the final 8-way sum: the order llama.cpp's own repacked and AMX kernels use (its
// ggml_gemm_q4_0_8x8 and kin), not the one its vec-dot build runs for these files on x86. The last bits of
// outputs differ from llama.cpp's vec-dot (and from the exact order), by about one float rounding of the
// block terms; every level (AVX-512, AVX2, plain loops) computes this sequence identically too.
//
// Packed weight layout (sluice_quant_repack, once at load; built for AVX-512 VNNI's vpdpbusd, which
// multiplies 4 unsigned bytes by 4 signed bytes and adds the 4 products into each int32 lane):
//   16 output rows per group (a ragged last group zero-padded); per group, first every block's weights,
//   then every block's scales: [group][block][weights] then [group][block][scales].
//   - 4-bit: a group-block's weights are 4 vectors of 64 bytes; byte 4 r + t of vector v is byte 4 v + t
//     of output row r's GGUF nibbles, so its low nibble is weight k = 4 v + t and its high nibble weight
//     k = 16 + 4 v + t. Masking the low nibbles of vector v gives 16 rows x 4 k as unsigned bytes, and one
//     vpdpbusd with x's bytes 4v..4v+3 broadcast to every lane gives lane v of 16 outputs; the high
//     nibbles (shift, mask; or one vgf2p8affineqb where GFNI is) with x's bytes 16+4v..16+4v+3 give lane
//     4 + v. 256 bytes per group-block.
//   - Q8_0: 8 vectors of 64 bytes, vector v = k 4v..4v+3 (lane v), stored q + 128 (vpdpbusd needs one
//     unsigned operand); the lane's integer sum then has 128 (x's 4 q) too much, taken off in int32.
//   - Scales: the 16 rows' d (then for Q4_1 their 16 m) as fp16, 32 (64) bytes per group-block: half the
//     bytes of fp32 (a decode step is reading the weights: 20 bytes per 32 Q4_1 weights, as in the GGUF),
//     and one vcvtph2ps makes 16 floats. Weights and scales in separate runs keep every weight vector on
//     a 64-byte line.
// The quantized x carries, per block, each lane's integer correction (Q8_0: -128 x the lane's 4 q; Q4_0:
// -8 x them), so a lane's vpdpbusd starts from it. The micro-kernel holds 2 rows of x x 1 group (16
// outputs): per block 8 vpdpbusd per row (4 vectors' low and high nibbles, or Q8_0's 8 vectors), each
// converted and FMA'd into its lane's float accumulator (8 zmm per row, + Q4_1's summs: 18 of the 32
// registers), the weight vectors loaded and unpacked once for both rows. Threads take whole output
// groups; with many rows, x is quantized in chunks of rows (in parallel) so a chunk of quantized x stays
// in L2 while a group's weights (1 group x K: 5.6 KB at K = 576 in Q4_1) stay in L1 across the chunk's
// row tiles.
//
// Three implementations of the same layout, the same integer lane sums and the same float sequence:
// AVX-512 VNNI (above), AVX2 (vpmaddubsw then vpmaddwd by ones gives each lane's sum of 4 products, as
// llama.cpp's AVX2 build does; nibble pairs cannot saturate int16, Q8_0 uses |w| x sign(x, w) as llama.cpp
// does, as +128 could saturate; one row x 8 outputs at a time: 9 accumulators in 16 ymm registers), and
// plain loops with std::fma everywhere else (the portable level). The avx512 level (no VNNI) takes the AVX2 path.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512VNNI__) && defined(__AVX512F__) && defined(__AVX512BW__)
#define SLUICE_QUANT_AVX512 1
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__F16C__)
#define SLUICE_QUANT_AVX2 1
#include <immintrin.h>
#elif defined(__F16C__)
#include <immintrin.h>
#endif

namespace {

enum Format { kQ8_0 = 0, kQ4_0 = 1, kQ4_1 = 2 };
// A GEMM format code with this bit set rounds once per block (--numerics fast): see "Rounding per block" above.
constexpr int kRoundPerBlock = 16;
constexpr int kBlock = 32;  // weights per block, all formats
constexpr int kGroup = 16;  // output rows per packed group: the 16 int32 lanes of a 512-bit vector
constexpr int kDecodeRows = 8;  // up to this many rows, x is quantized by the calling thread alone
constexpr int64_t kChunkBytes = 256 << 10;  // quantized x per pass over the weights (kept in L2)

#if defined(SLUICE_QUANT_AVX512)
constexpr int kMR = 2, kNG = 1;  // tile: rows of x x groups of 16 outputs (9 float accumulators per row)
constexpr int kMRFast = 4;  // rounding per block: 1.60x the exact order at 32-512 rows of Q4_1 (2 rows: 1.39x), Zen 4
constexpr int kIsa = 2;
#elif defined(SLUICE_QUANT_AVX2)
constexpr int kMR = 3, kNG = 1;  // 3 rows x 8 outputs per unpacked weight (27 accumulators: some in L1); 2 as fast, 1 and 4 ~12% slower
constexpr int kMRFast = kMR;  // rounding per block: 1.1x (Q4_1) to 1.5x (Q4_0) the exact order; 4 rows no faster
constexpr int kIsa = 1;
#else
constexpr int kMR = 4, kNG = 1;
constexpr int kMRFast = 4;
constexpr int kIsa = 0;
#endif

constexpr int gguf_block_bytes(int fmt) { return fmt == kQ8_0 ? 34 : fmt == kQ4_0 ? 18 : 20; }
constexpr int qs_bytes(int fmt) { return fmt == kQ8_0 ? kGroup * kBlock : kGroup * kBlock / 2; }  // a group-block's weights
constexpr int sc_bytes(int fmt) { return fmt == kQ4_1 ? 4 * kGroup : 2 * kGroup; }  // its d's (and m's), fp16
constexpr int64_t group_bytes(int fmt, int nb) { return static_cast<int64_t>(nb) * (qs_bytes(fmt) + sc_bytes(fmt)); }

inline int32_t load32(const void* p) {
    int32_t v;
    std::memcpy(&v, p, 4);
    return v;
}

// IEEE half <-> float. With F16C the instructions; elsewhere bit manipulation that gives the same
// results (round to nearest even, subnormals, inf), so every build quantizes x identically.
#if defined(__F16C__)
inline float half_to_float(uint16_t h) { return _cvtsh_ss(h); }
inline uint16_t float_to_half(float f) { return _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT); }
#else
inline float half_to_float(uint16_t h) {
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

inline uint16_t float_to_half(float f) {
    uint32_t x;
    std::memcpy(&x, &f, 4);
    const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000);
    const uint32_t ax = x & 0x7FFFFFFFu;
    if (ax > 0x7F800000u) return sign | 0x7E00;  // nan
    if (ax >= 0x477FF000u) return sign | 0x7C00;  // >= 65520 (halfway past the largest half, 65504): inf
    if (ax >= 0x38800000u) {  // normal in half: rebias the exponent, round the 13 dropped bits
        uint32_t h = (ax - 0x38000000u) >> 13;
        const uint32_t rem = ax & 0x1FFF;
        if (rem > 0x1000 || (rem == 0x1000 && (h & 1))) ++h;  // a carry into the exponent is right
        return sign | static_cast<uint16_t>(h);
    }
    const int e = static_cast<int>(ax >> 23);  // subnormal in half: the value in units of 2^-24, rounded
    if (e < 102) return sign;  // below 2^-25
    const uint32_t mant = (ax & 0x7FFFFF) | 0x800000;
    const int shift = 126 - e;  // 14..24
    uint32_t h = mant >> shift;
    const uint32_t rem = mant & ((1u << shift) - 1), half = 1u << (shift - 1);
    if (rem > half || (rem == half && (h & 1))) ++h;
    return sign | static_cast<uint16_t>(h);
}
#endif

inline float half_at(const uint8_t* p) {
    uint16_t h;
    std::memcpy(&h, p, 2);
    return half_to_float(h);
}

inline float round_to_half(float f) { return half_to_float(float_to_half(f)); }

// -- activations ----------------------------------------------------------------------------------------
// A chunk of x's rows quantized: q [rows][K] int8, d [rows][nb] (fp16-rounded, as float), aux [rows][nb]:
// Q4_1: s's bits as a float; Q4_0: -8 sum q; Q8_0: -128 sum q (the integer correction of the block sum,
// for sluice_quant_activations); corr [rows][nb][8]: Q4_0/Q8_0 that correction per lane (-8 or -128 x the
// lane's 4 q: what the kernels use; + kCorrBias), Q4_1 unused.
constexpr int kLanes = 8;  // llama.cpp's lanes per block: 4 consecutive products each
constexpr int32_t kMagicBits = 0x4B400000;  // 1.5 * 2^23: the AVX-512 kernel's int32 -> float (magic_f, below)
// The AVX-512 kernel starts each lane's vpdpbusd from its correction plus the magic bits: stored so, a lane's
// start is one broadcast (adding the bits per lane in the kernel cost Q8_0 1.25-1.3x at 32-512 rows, Zen 4).
#if defined(SLUICE_QUANT_AVX512)
constexpr int32_t kCorrBias = kMagicBits;
#else
constexpr int32_t kCorrBias = 0;
#endif

struct XQ {
    int8_t* q;
    float* d;
    int32_t* aux;
    int32_t* corr;
    int K, nb;
};

// Block i's scales and corrections from its (already stored) q and its unrounded d.
template <int F>
inline void finish_block(XQ& xq, int64_t i, const int8_t* q, float d) {
    int32_t lane[kLanes], sum = 0;
#if defined(__AVX2__)
    // The 8 lane sums at once (integers: any order is exact): bytes times 1 in pairs, then the pairs' pairs.
    const __m256i qv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q));
    const __m256i pairs = _mm256_maddubs_epi16(_mm256_set1_epi8(1), qv);  // u8 1 x s8 q: no saturation
    const __m256i lanes = _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(lane), lanes);
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(lanes), _mm256_extracti128_si256(lanes, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
    sum = _mm_cvtsi128_si32(s4);
#else
    for (int l = 0; l < kLanes; ++l) {
        lane[l] = q[4 * l] + q[4 * l + 1] + q[4 * l + 2] + q[4 * l + 3];
        sum += lane[l];
    }
#endif
    xq.d[i] = round_to_half(d);
    if constexpr (F == kQ4_1) {
        const float s = round_to_half(d * static_cast<float>(sum));  // llama.cpp: d * (float)sum, then fp16
        std::memcpy(&xq.aux[i], &s, 4);
    } else {
        constexpr int32_t c = F == kQ4_0 ? -8 : -128;
        xq.aux[i] = c * sum;
        for (int l = 0; l < kLanes; ++l) xq.corr[i * kLanes + l] = c * lane[l] + kCorrBias;
    }
}

template <int F>
void quantize_row(const float* x, XQ& xq, int row) {
    const int K = xq.K, nb = xq.nb;
    int8_t* q = xq.q + static_cast<int64_t>(row) * K;
    for (int b = 0; b < nb; ++b) {
        const float* xb = x + b * kBlock;
        int8_t* qb = q + b * kBlock;
#if defined(__AVX2__)
        // llama.cpp's x86 quantize_row_q8_0/_q8_1 (its AVX code, which its AVX-512 builds run too), 8 lanes at a
        // time: max|x| (a NaN skipped, as std::max skips it), q = x * id rounded to nearest even (vcvtps2dq under
        // the default MXCSR, as nearbyint), packed to bytes in order. (A 512-bit form with vpmovdb was 1.4-1.75x
        // slower on a Sapphire Rapids Xeon: its cross-lane max reduction and byte narrowing cost more than they save.)
        __m256 v[4], amax8 = _mm256_setzero_ps();
        for (int k = 0; k < 4; ++k) {
            v[k] = _mm256_loadu_ps(xb + 8 * k);
            amax8 = _mm256_max_ps(_mm256_andnot_ps(_mm256_set1_ps(-0.0f), v[k]), amax8);
        }
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax8), _mm256_extractf128_ps(amax8, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
        const float amax = _mm_cvtss_f32(m4);
        const float d = amax / 127.f, id = amax != 0.f ? 127.f / amax : 0.f;
        const __m256 vid = _mm256_set1_ps(id);
        __m256i q32[4];
        for (int k = 0; k < 4; ++k) q32[k] = _mm256_cvtps_epi32(_mm256_mul_ps(v[k], vid));
        // packs interleave the two 128-bit halves: bytes come out as dwords 0 4 1 5 2 6 3 7 of the order wanted
        const __m256i q8 = _mm256_packs_epi16(_mm256_packs_epi32(q32[0], q32[1]), _mm256_packs_epi32(q32[2], q32[3]));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(qb),
                            _mm256_permutevar8x32_epi32(q8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
#else
        float amax = 0.f;
        for (int i = 0; i < kBlock; ++i) amax = std::max(amax, std::fabs(xb[i]));
        const float d = amax / 127.f, id = amax != 0.f ? 127.f / amax : 0.f;
        for (int i = 0; i < kBlock; ++i)
            qb[i] = static_cast<int8_t>(static_cast<int>(std::nearbyint(xb[i] * id)));  // rounding mode: nearest even
#endif
        finish_block<F>(xq, static_cast<int64_t>(row) * nb + b, qb, d);
    }
}

// Rows m .. m + MR - 1 of a quantized chunk: where each row's q, d, aux and lane corrections start.
template <int MR>
struct XRows {
    const int8_t* q[MR];
    const float* d[MR];
    const int32_t* aux[MR];
    const int32_t* corr[MR];
    XRows(const XQ& xq, int m) {
        for (int i = 0; i < MR; ++i) {
            q[i] = xq.q + static_cast<int64_t>(m + i) * xq.K;
            d[i] = xq.d + static_cast<int64_t>(m + i) * xq.nb;
            aux[i] = xq.aux + static_cast<int64_t>(m + i) * xq.nb;
            corr[i] = xq.corr + static_cast<int64_t>(m + i) * xq.nb * kLanes;
        }
    }
};

// -- the micro-kernel: MR rows of x (from row m of the chunk) x NG groups (from group g) ----------------
// w: group g's start; y: row m's start (column 0); writes columns 16 g .. min(N, 16 (g + NG)).
using TileFn = void (*)(const XQ&, int, const uint8_t*, int64_t, float*, int64_t, int, int);

inline int group_cols(int g, int N) { return std::min(kGroup, N - g * kGroup); }

#if defined(SLUICE_QUANT_AVX512)
// int32 -> float without vcvtdq2ps: an int32 i with |i| < 2^22 added to the bits of 1.5 * 2^23 are the bits of the
// float 1.5 * 2^23 + i exactly (the same exponent; i lands in the mantissa), and subtracting 1.5 * 2^23 gives
// float(i) exactly. The addition rides in vpdpbusd's accumulator for free (every lane sum here is far below 2^22:
// at most 4 x 255 x 128 plus a correction of 4 x 128 x 128). Why: on Intel's AVX-512 cores vpdpbusd and
// vcvtdq2ps both issue on port 0 only, so a block's 8 of each (per row and 16 outputs) took 16 cycles there while
// port 5 idled; vsubps issues on either.
inline __m512 magic_f() { return _mm512_castsi512_ps(_mm512_set1_epi32(kMagicBits)); }

// One lane of 16 outputs: its integer sum (from init: the magic bits plus the lane's correction, or plus 0), as a
// float, then acc = fma(dd, float(sum), acc), as llama.cpp's _mm256_fmadd_ps(d, q, acc).
inline __m512 lane_fma(__m512 acc, __m512 dd, __m512i init, __m512i w, __m512i x) {
    const __m512 sum = _mm512_sub_ps(_mm512_castsi512_ps(_mm512_dpbusd_epi32(init, w, x)), magic_f());
    return _mm512_fmadd_ps(dd, sum, acc);
}

// hsum_float_8's order over the 8 lanes, for 16 outputs at once.
inline __m512 hsum_lanes(const __m512* a) {
    return _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(a[0], a[4]), _mm512_add_ps(a[2], a[6])),
                         _mm512_add_ps(_mm512_add_ps(a[1], a[5]), _mm512_add_ps(a[3], a[7])));
}

template <int F, int MR, int NG, bool PB>
void tile(const XQ& xq, int m, const uint8_t* w, int64_t gbytes, float* y, int64_t ldy, int g, int N) {
    constexpr int QS = qs_bytes(F), SC = sc_bytes(F);
    constexpr int L = PB ? 1 : kLanes;  // float accumulators per row and group: a block's one sum, or its 8 lanes
    const int nb = xq.nb;
    const uint8_t* qs[NG];
    const uint8_t* sc[NG];
    for (int j = 0; j < NG; ++j) {
        qs[j] = w + j * gbytes;
        sc[j] = qs[j] + static_cast<int64_t>(nb) * QS;
    }
    const XRows<MR> rows(xq, m);
    const int8_t* const* xr = rows.q;
    const float* const* dx = rows.d;
    const int32_t* const* ax = rows.aux;
    const int32_t* const* cr = rows.corr;
    __m512 acc[MR][NG][L], ms[MR][NG];
    for (int i = 0; i < MR; ++i)
        for (int j = 0; j < NG; ++j) {
            for (int l = 0; l < L; ++l) acc[i][j][l] = _mm512_setzero_ps();
            ms[i][j] = _mm512_setzero_ps();
        }
    const __m512i nib = _mm512_set1_epi8(0x0F);
#if defined(__GFNI__)
    // vgf2p8affineqb's bit matrix for byte >> 4: output bit i is the parity of (input & byte 7 - i of the
    // qword), so bytes 7..4 select input bits 4..7 and bytes 3..0 nothing
    const __m512i hi_nib = _mm512_set1_epi64(0x1020408000000000LL);
#endif
    for (int b = 0; b < nb; ++b) {
        __m512 dd[MR][NG];
        for (int j = 0; j < NG; ++j) {
            const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sc[j] + b * SC)));
            for (int i = 0; i < MR; ++i) dd[i][j] = _mm512_mul_ps(dw, _mm512_set1_ps(dx[i][b]));
        }
        // lane l's starting integer: the magic bits (lane_fma) plus the format's correction (Q4_1: none)
        auto init = [&](int i, int l) {
            return F == kQ4_1 ? _mm512_set1_epi32(kMagicBits) : _mm512_set1_epi32(cr[i][b * kLanes + l]);
        };
        // PB: the block's whole integer sum in one register (the lanes' vpdpbusd chained, from the magic bits plus
        // the block's correction), then one conversion and one FMA
        __m512i isum[MR][NG];
        if constexpr (PB) {
            for (int i = 0; i < MR; ++i)
                for (int j = 0; j < NG; ++j)
                    isum[i][j] = _mm512_set1_epi32(F == kQ4_1 ? kMagicBits : ax[i][b] + kMagicBits);
        }
        if constexpr (F == kQ8_0) {
            for (int v = 0; v < 8; ++v) {
                __m512i wv[NG];
                for (int j = 0; j < NG; ++j) wv[j] = _mm512_loadu_si512(qs[j] + b * QS + v * 64);
                for (int i = 0; i < MR; ++i) {
                    const __m512i xv = _mm512_set1_epi32(load32(xr[i] + b * kBlock + 4 * v));
                    for (int j = 0; j < NG; ++j) {
                        if constexpr (PB) isum[i][j] = _mm512_dpbusd_epi32(isum[i][j], wv[j], xv);
                        else acc[i][j][v] = lane_fma(acc[i][j][v], dd[i][j], init(i, v), wv[j], xv);
                    }
                }
            }
        } else {
            for (int v = 0; v < 4; ++v) {
                __m512i lo[NG], hi[NG];
                for (int j = 0; j < NG; ++j) {
                    const __m512i raw = _mm512_loadu_si512(qs[j] + b * QS + v * 64);
                    lo[j] = _mm512_and_si512(raw, nib);
#if defined(__GFNI__)
                    hi[j] = _mm512_gf2p8affine_epi64_epi8(raw, hi_nib, 0);  // each byte >> 4: one instruction
#else
                    hi[j] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), nib);
#endif
                }
                for (int i = 0; i < MR; ++i) {
                    const __m512i xl = _mm512_set1_epi32(load32(xr[i] + b * kBlock + 4 * v));
                    const __m512i xh = _mm512_set1_epi32(load32(xr[i] + b * kBlock + 16 + 4 * v));
                    for (int j = 0; j < NG; ++j) {
                        if constexpr (PB) {
                            isum[i][j] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(isum[i][j], lo[j], xl), hi[j], xh);
                        } else {
                            acc[i][j][v] = lane_fma(acc[i][j][v], dd[i][j], init(i, v), lo[j], xl);
                            acc[i][j][4 + v] = lane_fma(acc[i][j][4 + v], dd[i][j], init(i, 4 + v), hi[j], xh);
                        }
                    }
                }
            }
        }
        if constexpr (PB) {
            for (int i = 0; i < MR; ++i)
                for (int j = 0; j < NG; ++j)
                    acc[i][j][0] = _mm512_fmadd_ps(
                        dd[i][j], _mm512_sub_ps(_mm512_castsi512_ps(isum[i][j]), magic_f()), acc[i][j][0]);
        }
        if constexpr (F == kQ4_1) {
            for (int j = 0; j < NG; ++j) {
                const __m512 mw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sc[j] + b * SC + 32)));
                for (int i = 0; i < MR; ++i) {
                    float sx;
                    std::memcpy(&sx, &ax[i][b], 4);
                    ms[i][j] = _mm512_fmadd_ps(mw, _mm512_set1_ps(sx), ms[i][j]);
                }
            }
        }
    }
    for (int j = 0; j < NG; ++j) {
        const int cols = group_cols(g + j, N);
        const __mmask16 mask = cols >= kGroup ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << cols) - 1);
        for (int i = 0; i < MR; ++i) {
            __m512 r = PB ? acc[i][j][0] : hsum_lanes(acc[i][j]);
            if constexpr (F == kQ4_1) r = _mm512_add_ps(r, ms[i][j]);
            _mm512_mask_storeu_ps(y + i * ldy + (g + j) * kGroup, mask, r);
        }
    }
}

#elif defined(SLUICE_QUANT_AVX2)
// MR rows x one half (8 outputs: bytes 0..31 or 32..63 of each vector) at a time, over all of K: each block's weights
// are loaded and unpacked once for the MR rows (without VNNI a lane's sum is maddubs + madd per row, so the
// unpacking was a fifth of the work when done per row). MR rows' 9 accumulators exceed AVX2's 16 registers: the
// compiler keeps some in L1, whose loads and stores use other ports than the arithmetic.
template <int F, int MR, int NG, bool PB>
void tile(const XQ& xq, int m, const uint8_t* w, int64_t gbytes, float* y, int64_t ldy, int g, int N) {
    constexpr int QS = qs_bytes(F), SC = sc_bytes(F);
    constexpr int L = PB ? 1 : kLanes;  // float accumulators per row: a block's one sum, or its 8 lanes
    const int nb = xq.nb;
    const __m256i nib = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    const XRows<MR> rows(xq, m);
    const int8_t* const* xr = rows.q;
    const float* const* dx = rows.d;
    const int32_t* const* ax = rows.aux;
    const int32_t* const* cr = rows.corr;
    for (int j = 0; j < NG; ++j) {
        const uint8_t* qs = w + j * gbytes;
        const uint8_t* sc = qs + static_cast<int64_t>(nb) * QS;
        const int cols = group_cols(g + j, N);
        for (int h = 0; h < 2 && h * 8 < cols; ++h) {
            __m256 acc[MR][L], ms[MR];
            for (int i = 0; i < MR; ++i) {
                for (int l = 0; l < L; ++l) acc[i][l] = _mm256_setzero_ps();
                ms[i] = _mm256_setzero_ps();
            }
            for (int b = 0; b < nb; ++b) {
                const uint8_t* wb = qs + b * QS + h * 32;
                const uint8_t* s = sc + b * SC + h * 16;
                const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s)));
                __m256 dd[MR];
                for (int i = 0; i < MR; ++i) dd[i] = _mm256_mul_ps(dw, _mm256_set1_ps(dx[i][b]));
                // PB: the block's whole integer sum (Q4_0's correction once, for the block), one conversion, one FMA
                __m256i isum[MR];
                if constexpr (PB) {
                    for (int i = 0; i < MR; ++i) isum[i] = _mm256_set1_epi32(F == kQ4_0 ? ax[i][b] : 0);
                }
                if constexpr (F == kQ8_0) {
                    for (int v = 0; v < 8; ++v) {
                        const __m256i ws = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + v * 64)),
                                                            _mm256_set1_epi8(-128));
                        const __m256i aw = _mm256_abs_epi8(ws);
                        for (int i = 0; i < MR; ++i) {
                            // |q_w| (<= 128 as unsigned) x sign(q_x, q_w): pairs of products < 32767
                            const __m256i xs = _mm256_sign_epi8(_mm256_set1_epi32(load32(xr[i] + b * kBlock + 4 * v)), ws);
                            const __m256i lane = _mm256_madd_epi16(_mm256_maddubs_epi16(aw, xs), ones);
                            if constexpr (PB) isum[i] = _mm256_add_epi32(isum[i], lane);
                            else acc[i][v] = _mm256_fmadd_ps(dd[i], _mm256_cvtepi32_ps(lane), acc[i][v]);
                        }
                    }
                } else {
                    for (int v = 0; v < 4; ++v) {
                        const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + v * 64));
                        const __m256i lo = _mm256_and_si256(raw, nib), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), nib);
                        for (int i = 0; i < MR; ++i) {
                            const __m256i xl = _mm256_set1_epi32(load32(xr[i] + b * kBlock + 4 * v));
                            const __m256i xh = _mm256_set1_epi32(load32(xr[i] + b * kBlock + 16 + 4 * v));
                            __m256i il = _mm256_madd_epi16(_mm256_maddubs_epi16(lo, xl), ones);
                            __m256i ih = _mm256_madd_epi16(_mm256_maddubs_epi16(hi, xh), ones);
                            if constexpr (PB) {
                                isum[i] = _mm256_add_epi32(isum[i], _mm256_add_epi32(il, ih));
                                continue;
                            }
                            if constexpr (F == kQ4_0) {
                                il = _mm256_add_epi32(il, _mm256_set1_epi32(cr[i][b * kLanes + v]));
                                ih = _mm256_add_epi32(ih, _mm256_set1_epi32(cr[i][b * kLanes + 4 + v]));
                            }
                            acc[i][v] = _mm256_fmadd_ps(dd[i], _mm256_cvtepi32_ps(il), acc[i][v]);
                            acc[i][4 + v] = _mm256_fmadd_ps(dd[i], _mm256_cvtepi32_ps(ih), acc[i][4 + v]);
                        }
                    }
                }
                if constexpr (PB) {
                    for (int i = 0; i < MR; ++i) acc[i][0] = _mm256_fmadd_ps(dd[i], _mm256_cvtepi32_ps(isum[i]), acc[i][0]);
                }
                if constexpr (F == kQ4_1) {
                    const __m256 mw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 32)));
                    for (int i = 0; i < MR; ++i) {
                        float sx;
                        std::memcpy(&sx, &ax[i][b], 4);
                        ms[i] = _mm256_fmadd_ps(mw, _mm256_set1_ps(sx), ms[i]);
                    }
                }
            }
            for (int i = 0; i < MR; ++i) {
                const __m256* a = acc[i];
                __m256 r = a[0];
                if constexpr (!PB)
                    r = _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(a[0], a[4]), _mm256_add_ps(a[2], a[6])),
                                      _mm256_add_ps(_mm256_add_ps(a[1], a[5]), _mm256_add_ps(a[3], a[7])));
                if constexpr (F == kQ4_1) r = _mm256_add_ps(r, ms[i]);
                float* yr = y + i * ldy + (g + j) * kGroup + h * 8;
                if (cols >= (h + 1) * 8) {
                    _mm256_storeu_ps(yr, r);
                } else {
                    alignas(32) float tmp[8];
                    _mm256_store_ps(tmp, r);
                    std::memcpy(yr, tmp, sizeof(float) * (cols - h * 8));
                }
            }
        }
    }
}

#else
// Plain loops: the same lane sums, in int32, over the same layout; the same float sequence with std::fma.
template <int F, int MR, int NG, bool PB>
void tile(const XQ& xq, int m, const uint8_t* w, int64_t gbytes, float* y, int64_t ldy, int g, int N) {
    constexpr int QS = qs_bytes(F), SC = sc_bytes(F);
    const int nb = xq.nb, K = xq.K;
    for (int j = 0; j < NG; ++j) {
        const uint8_t* qs = w + j * gbytes;
        const uint8_t* sc = qs + static_cast<int64_t>(nb) * QS;
        const int cols = group_cols(g + j, N);
        for (int i = 0; i < MR; ++i) {
            float acc[kGroup][kLanes] = {}, ms[kGroup] = {};
            for (int b = 0; b < nb; ++b) {
                const uint8_t* wb = qs + b * QS;
                const uint8_t* s = sc + b * SC;
                const int8_t* xb = xq.q + static_cast<int64_t>(m + i) * K + b * kBlock;
                const int64_t xi = static_cast<int64_t>(m + i) * nb + b;
                const float dx = xq.d[xi];
                float sx = 0.f;
                if constexpr (F == kQ4_1) std::memcpy(&sx, &xq.aux[xi], 4);
                for (int r = 0; r < cols; ++r) {
                    const float dd = half_at(s + 2 * r) * dx;
                    int32_t lane[kLanes] = {};
                    if constexpr (F == kQ8_0) {
                        for (int v = 0; v < 8; ++v)
                            for (int t = 0; t < 4; ++t)
                                lane[v] += static_cast<int8_t>(wb[v * 64 + 4 * r + t] ^ 0x80) * xb[4 * v + t];
                    } else {
                        constexpr int off = F == kQ4_0 ? 8 : 0;
                        for (int v = 0; v < 4; ++v)
                            for (int t = 0; t < 4; ++t) {
                                const int byte = wb[v * 64 + 4 * r + t];
                                lane[v] += ((byte & 0x0F) - off) * xb[4 * v + t];
                                lane[4 + v] += ((byte >> 4) - off) * xb[16 + 4 * v + t];
                            }
                    }
                    if constexpr (PB) {
                        int32_t sum = 0;
                        for (int l = 0; l < kLanes; ++l) sum += lane[l];
                        acc[r][0] = std::fma(dd, static_cast<float>(sum), acc[r][0]);
                    } else {
                        for (int l = 0; l < kLanes; ++l) acc[r][l] = std::fma(dd, static_cast<float>(lane[l]), acc[r][l]);
                    }
                    if constexpr (F == kQ4_1) ms[r] = std::fma(half_at(s + 32 + 2 * r), sx, ms[r]);
                }
            }
            float* yr = y + i * ldy + (g + j) * kGroup;
            for (int r = 0; r < cols; ++r) {
                const float* a = acc[r];
                float v = PB ? a[0] : ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]));
                if constexpr (F == kQ4_1) v += ms[r];
                yr[r] = v;
            }
        }
    }
}
#endif

// Rows per tile: rounding per block keeps one float accumulator per row where the exact order keeps 8, so its
// tiles take more rows per unpacked weight vector.
template <bool PB>
constexpr int tile_rows() { return PB ? kMRFast : kMR; }

template <int F, int NG, bool PB>
TileFn tile_for(int mr) {
    constexpr int MR = tile_rows<PB>();
    if constexpr (MR >= 4) {
        if (mr >= 4) return tile<F, 4, NG, PB>;
    }
    if constexpr (MR >= 3) {
        if (mr == 3) return tile<F, 3, NG, PB>;
    }
    if constexpr (MR >= 2) {
        if (mr >= 2) return tile<F, 2, NG, PB>;
    }
    return tile<F, 1, NG, PB>;
}
static_assert(kMR >= 1 && kMR <= 4 && kMRFast >= 1 && kMRFast <= 4, "tile_for dispatches 1..4 rows");

template <int F, bool PB>
TileFn tile_fn(int mr, int ng) {
    if constexpr (kNG >= 2) {
        if (ng == 2) return tile_for<F, 2, PB>(mr);
    }
    return tile_for<F, 1, PB>(mr);
}

// Every row tile of the chunk's `rows` rows against groups g .. g + ng - 1.
template <int F, bool PB>
void run_unit(const XQ& xq, int rows, const uint8_t* w, int64_t gbytes, float* y, int64_t ldy, int g, int ng, int N) {
    const uint8_t* wg = w + g * gbytes;
    for (int m = 0; m < rows; m += tile_rows<PB>()) {
        const int mr = std::min(tile_rows<PB>(), rows - m);
        tile_fn<F, PB>(mr, ng)(xq, m, wg, gbytes, y + m * ldy, ldy, g, N);
    }
}

// The calling thread's scratch for quantized x: grown as needed, kept for the next call.
uint8_t* scratch(size_t bytes) {
    thread_local std::vector<uint8_t> buf;
    if (buf.size() < bytes) buf.resize(bytes);
    return buf.data();
}

// Quantized x of `rows` rows in buf: q, then d, aux and corr (4-byte aligned: K is a multiple of 32).
inline size_t xq_bytes(int rows, int K) {
    return static_cast<size_t>(rows) * (K + (8 + 4 * kLanes) * static_cast<size_t>(K / kBlock));
}

inline XQ xq_in(uint8_t* buf, int rows, int K) {
    const int nb = K / kBlock;
    const size_t r = static_cast<size_t>(rows);
    return XQ{reinterpret_cast<int8_t*>(buf), reinterpret_cast<float*>(buf + r * K),
              reinterpret_cast<int32_t*>(buf + r * (K + 4 * nb)), reinterpret_cast<int32_t*>(buf + r * (K + 8 * nb)), K,
              nb};
}

template <int F, bool PB>
void gemm(const float* x, int64_t ldx, const uint8_t* w, int M, int K, int N, float* y, int64_t ldy, int threads) {
    const int nb = K / kBlock, groups = (N + kGroup - 1) / kGroup, units = (groups + kNG - 1) / kNG;
    const int64_t gbytes = group_bytes(F, nb);
    // Rows per chunk: about kChunkBytes of quantized x, the chunks of one call evened out.
    const int max_rows = std::max(kDecodeRows, static_cast<int>(kChunkBytes / K));
    const int chunks = (M + max_rows - 1) / max_rows;
    const int chunk = (M + chunks - 1) / chunks;
    XQ xq = xq_in(scratch(xq_bytes(chunk, K)), chunk, K);
    if (M <= kDecodeRows) {  // decode: quantizing a few rows costs less than a barrier
        for (int r = 0; r < M; ++r) quantize_row<F>(x + r * ldx, xq, r);
#pragma omp parallel for schedule(static) num_threads(threads)
        for (int u = 0; u < units; ++u)
            run_unit<F, PB>(xq, M, w, gbytes, y, ldy, u * kNG, std::min(kNG, groups - u * kNG), N);
        return;
    }
    // Groups handed out guided (half, then halves of what is left...): each output's arithmetic is the same whichever
    // thread runs it, and a thread the OS (or the API process beside the engine) delays then leaves the rest of its
    // part to the other, where a static split made the other wait at the barrier. Served c32 on an AMD EPYC (Zen 4),
    // perf attached, two runs each (noisy): static 306.8 / 291.7 output tok/s, guided 305.3 / 318.8 (dynamic in
    // eighths 322.2 / 316.9, but ~4% slower at 16-32 rows in a quiet process, guided the same as static there);
    // the threads' samples in libgomp's waits 1585 / 1737 static, 1514 / 1364 guided. (The few-row path above keeps
    // its static split: calls of ~10 us.)
#pragma omp parallel num_threads(threads)
    for (int m0 = 0; m0 < M; m0 += chunk) {
        const int rows = std::min(chunk, M - m0);
#pragma omp for schedule(static)
        for (int r = 0; r < rows; ++r) quantize_row<F>(x + (m0 + r) * ldx, xq, r);
        // (the implicit barriers: x quantized before any tile reads it; every tile done before the next
        // chunk overwrites it)
#pragma omp for schedule(guided)
        for (int u = 0; u < units; ++u)
            run_unit<F, PB>(xq, rows, w, gbytes, y + m0 * ldy, ldy, u * kNG, std::min(kNG, groups - u * kNG), N);
    }
}

// -- repacking ------------------------------------------------------------------------------------------
template <int F>
void repack(const uint8_t* blocks, int N, int K, uint8_t* out) {
    constexpr int QS = qs_bytes(F), SC = sc_bytes(F), BB = gguf_block_bytes(F);
    const int nb = K / kBlock, groups = (N + kGroup - 1) / kGroup;
    const int64_t gbytes = group_bytes(F, nb);
    std::memset(out, 0, static_cast<size_t>(groups * gbytes));  // padded rows: d = 0 (and q = -128 in Q8_0)
    for (int n = 0; n < N; ++n) {
        const int g = n / kGroup, r = n % kGroup;
        uint8_t* qs = out + g * gbytes;
        uint8_t* sc = qs + static_cast<int64_t>(nb) * QS;
        for (int b = 0; b < nb; ++b) {
            const uint8_t* src = blocks + (static_cast<int64_t>(n) * nb + b) * BB;
            uint8_t* wb = qs + b * QS;
            uint8_t* s = sc + b * SC;
            std::memcpy(s + 2 * r, src, 2);  // d
            if constexpr (F == kQ8_0) {
                for (int k = 0; k < kBlock; ++k) wb[(k / 4) * 64 + 4 * r + k % 4] = static_cast<uint8_t>(src[2 + k] ^ 0x80);
            } else {
                const uint8_t* nibs = src + (F == kQ4_1 ? 4 : 2);
                if constexpr (F == kQ4_1) std::memcpy(s + 32 + 2 * r, src + 2, 2);  // m
                for (int j = 0; j < 16; ++j) wb[(j / 4) * 64 + 4 * r + j % 4] = nibs[j];
            }
        }
    }
}

// Rows of W back to fp32 from the packed layout, exactly as the GGUF formats define them (as gguf's
// dequantize computes them: q * d, then + m, each rounded to float).
template <int F>
void unpack_rows(const uint8_t* packed, int N, int K, const int64_t* rows, int nrows, float* out, int64_t ldo) {
    constexpr int QS = qs_bytes(F), SC = sc_bytes(F);
    const int nb = K / kBlock;
    const int64_t gbytes = group_bytes(F, nb);
    (void)N;
    for (int i = 0; i < nrows; ++i) {
        const int64_t n = rows[i];
        const int g = static_cast<int>(n / kGroup), r = static_cast<int>(n % kGroup);
        const uint8_t* qs = packed + g * gbytes;
        const uint8_t* sc = qs + static_cast<int64_t>(nb) * QS;
        float* o = out + i * ldo;
        for (int b = 0; b < nb; ++b) {
            const uint8_t* wb = qs + b * QS;
            const float d = half_at(sc + b * SC + 2 * r);
            float* ob = o + b * kBlock;
            if constexpr (F == kQ8_0) {
                for (int k = 0; k < kBlock; ++k)
                    ob[k] = static_cast<float>(static_cast<int8_t>(wb[(k / 4) * 64 + 4 * r + k % 4] ^ 0x80)) * d;
            } else {
                const float mw = F == kQ4_1 ? half_at(sc + b * SC + 32 + 2 * r) : 0.f;
                for (int j = 0; j < 16; ++j) {
                    const int byte = wb[(j / 4) * 64 + 4 * r + j % 4];
                    if constexpr (F == kQ4_0) {
                        ob[j] = static_cast<float>((byte & 0x0F) - 8) * d;
                        ob[j + 16] = static_cast<float>((byte >> 4) - 8) * d;
                    } else {
                        // The product is rounded to float before m is added (no FMA): as a double, the
                        // float product is exact and the compiler cannot contract across the conversion;
                        // the double sum of two floats rounds to the same float as a float sum would.
                        const float p0 = static_cast<float>(byte & 0x0F) * d, p1 = static_cast<float>(byte >> 4) * d;
                        ob[j] = static_cast<float>(static_cast<double>(p0) + static_cast<double>(mw));
                        ob[j + 16] = static_cast<float>(static_cast<double>(p1) + static_cast<double>(mw));
                    }
                }
            }
        }
    }
}

}  // namespace

extern "C" {

// 2: the packed layout (sluice_quant_repack) and int8 activations.
int sluice_quant_abi_version() { return 2; }

// Which implementation this build runs: 2 AVX-512 VNNI, 1 AVX2, 0 plain loops.
int sluice_quant_isa() { return kIsa; }

int sluice_quant_block_bytes(int fmt) { return fmt >= kQ8_0 && fmt <= kQ4_1 ? gguf_block_bytes(fmt) : 0; }

// Bytes of the packed layout of an [N, K] weight (0 for an unknown format or K not a multiple of 32).
int64_t sluice_quant_packed_bytes(int fmt, int N, int K) {
    if (fmt < kQ8_0 || fmt > kQ4_1 || K % kBlock || N < 0) return 0;
    return static_cast<int64_t>((N + kGroup - 1) / kGroup) * group_bytes(fmt, K / kBlock);
}

// blocks: [N, K / 32] GGUF blocks of format `fmt`, rows contiguous; out: sluice_quant_packed_bytes bytes.
void sluice_quant_repack(int fmt, const uint8_t* blocks, int N, int K, uint8_t* out) {
    switch (fmt) {
        case kQ8_0: repack<kQ8_0>(blocks, N, K, out); break;
        case kQ4_0: repack<kQ4_0>(blocks, N, K, out); break;
        case kQ4_1: repack<kQ4_1>(blocks, N, K, out); break;
        default: break;
    }
}

// out[i, :] = row rows[i] of W (each in 0..N-1: the caller checks), dequantized; out rows ldo apart.
void sluice_quant_unpack_rows(int fmt, const uint8_t* packed, int N, int K, const int64_t* rows, int nrows, float* out,
                              int64_t ldo) {
    switch (fmt) {
        case kQ8_0: unpack_rows<kQ8_0>(packed, N, K, rows, nrows, out, ldo); break;
        case kQ4_0: unpack_rows<kQ4_0>(packed, N, K, rows, nrows, out, ldo); break;
        case kQ4_1: unpack_rows<kQ4_1>(packed, N, K, rows, nrows, out, ldo); break;
        default: break;
    }
}

// The activation quantization the GEMM does, exposed for tests: q [M, K] int8, d [M, K / 32] (fp16-rounded),
// aux [M, K / 32] int32 (Q4_1: the bits of the fp16-rounded s; Q4_0: -8 sum q; Q8_0: -128 sum q).
void sluice_quant_activations(int fmt, const float* x, int64_t ldx, int M, int K, int8_t* q, float* d, int32_t* aux) {
    std::vector<int32_t> corr(static_cast<size_t>(M) * (K / kBlock) * kLanes);  // the lanes' corrections: internal
    XQ xq{q, d, aux, corr.data(), K, K / kBlock};
    for (int r = 0; r < M; ++r) {
        switch (fmt) {
            case kQ8_0: quantize_row<kQ8_0>(x + r * ldx, xq, r); break;
            case kQ4_0: quantize_row<kQ4_0>(x + r * ldx, xq, r); break;
            case kQ4_1: quantize_row<kQ4_1>(x + r * ldx, xq, r); break;
            default: break;
        }
    }
}

// x: [M, K] fp32, rows ldx apart; w: the packed layout of an [N, K] weight in format `fmt` (sluice_quant_repack;
// | kRoundPerBlock: rounded per block); y: [M, N], rows ldy apart. K must be a multiple of 32 (the caller checks).
void sluice_quant_gemm_f32(int fmt, const float* x, int64_t ldx, const uint8_t* w, int M, int K, int N, float* y,
                           int64_t ldy, int num_threads) {
    if (M <= 0 || N <= 0) return;
    if (fmt & kRoundPerBlock) {
        switch (fmt & ~kRoundPerBlock) {
            case kQ8_0: gemm<kQ8_0, true>(x, ldx, w, M, K, N, y, ldy, num_threads); break;
            case kQ4_0: gemm<kQ4_0, true>(x, ldx, w, M, K, N, y, ldy, num_threads); break;
            case kQ4_1: gemm<kQ4_1, true>(x, ldx, w, M, K, N, y, ldy, num_threads); break;
            default: break;
        }
        return;
    }
    switch (fmt) {
        case kQ8_0: gemm<kQ8_0, false>(x, ldx, w, M, K, N, y, ldy, num_threads); break;
        case kQ4_0: gemm<kQ4_0, false>(x, ldx, w, M, K, N, y, ldy, num_threads); break;
        case kQ4_1: gemm<kQ4_1, false>(x, ldx, w, M, K, N, y, ldy, num_threads); break;
        default: break;
    }
}

}  // extern "C"
