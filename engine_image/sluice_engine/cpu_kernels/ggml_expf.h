// ggml's vector expf, one lane at a time, in the two forms llama.cpp's x86 builds round differently: AVX-512's
// and AVX2's. Shared by the llama.cpp-exact ops (layer_ops.cpp's SwiGLU, ggml_attention.cpp's tiled softmax),
// which must round exactly as llama.cpp's build of the same instruction set does (see ggml_attention.cpp);
// ggml_expf_lane and kExpfBlock below pick the form of this build's level.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace sluice_ggml {

static inline float pow2f(int e) {  // 2^e for e in [-126, 127]
    const int32_t bits = (e + 127) << 23;
    float f;
    std::memcpy(&f, &bits, sizeof f);
    return f;
}

// ggml_v_expf's AVX-512 form (ggml-cpu/vec.h), one lane at a time: n = round(x / ln2) by the 1.5 * 2^23
// trick, b = x - n ln2 (ln2 in two parts), e^b by a degree-5 polynomial in Estrin form, then scaled by 2^n
// with one rounding as vscalefps does: j * 2^(n/2) is exact (|n| <= 192, j in [0.7, 1.5]), and the second
// factor's multiply rounds once, subnormal results included. |n| > 192: 0 below, +inf above. Branch-free,
// so that the loop over a row vectorizes.
static inline float ggml_v_expf_lane(float x) {
    const float r = 0x1.8p23f;
    const float z = std::fma(x, 0x1.715476p+0f, r);
    const float n = z - r;
    const float b = std::fma(-n, 0x1.7f7d1cp-20f, std::fma(-n, 0x1.62e4p-1f, x));
    const float u = b * b;
    const float j = std::fma(std::fma(std::fma(0x1.0e4020p-7f, b, 0x1.573e2ep-5f), u,
                                      std::fma(0x1.555e66p-3f, b, 0x1.fffdb6p-2f)),
                             u, std::fma(0x1.ffffecp-1f, b, 1.0f));
    const float size = std::fabs(n);
    const int e = static_cast<int>(size <= 192.0f ? n : 0.0f);  // (a NaN n: 0; j is NaN then)
    const int e1 = e >> 1;
    const float scaled = j * pow2f(e1) * pow2f(e - e1);
    const float limit = n <= 0.0f ? 0.0f : std::numeric_limits<float>::infinity();
    return size > 192.0f ? limit : scaled;
}

static inline float from_bits(uint32_t u) {
    float f;
    std::memcpy(&f, &u, sizeof f);
    return f;
}

// ggml_v_expf's AVX2+FMA form (ggml-cpu/vec.h), one lane at a time. The same reduction and polynomial
// coefficients as above, but the polynomial leaves out its constant 1 (its linear term a plain product, not
// an FMA with 1) and the scaling by 2^n is in the bits: k = 2^n from z's low bits shifted into the exponent,
// e^x = fma(k, j, k) for |n| <= 126; for 126 < |n| <= 192 the scale is split in two factors (s2 from the bits
// minus a bias, s1 = 2^127 or 2^-125), fma(s2, j, s2) * s1; beyond, s1 * s1 (inf above, 0 below). Branch-free.
static inline float ggml_v_expf_avx2_lane(float x) {
    const float r = 0x1.8p23f;
    const float z = std::fma(x, 0x1.715476p+0f, r);
    const float n = z - r;
    const float b = std::fma(-n, 0x1.7f7d1cp-20f, std::fma(-n, 0x1.62e4p-1f, x));
    uint32_t zb;
    std::memcpy(&zb, &z, sizeof zb);
    const uint32_t e = zb << 23;
    const float k = from_bits(e + 0x3f800000u);  // + the bits of 1.0f
    const float u = b * b;
    const float lin = 0x1.ffffecp-1f * b;
    const float j = std::fma(std::fma(std::fma(0x1.0e4020p-7f, b, 0x1.573e2ep-5f), u,
                                      std::fma(0x1.555e66p-3f, b, 0x1.fffdb6p-2f)),
                             u, lin);
    const float size = std::fabs(n);
    const uint32_t g = (0u - static_cast<uint32_t>(n <= 0.0f)) & 0x82000000u;  // (mask arithmetic: no branch)
    // huge and split from 1 where they are not selected (as in ggml_v_expf_avx2: no underflow assists)
    const bool wide = size > 126.0f, beyond = size > 192.0f;
    const float s1 = from_bits(g + 0x7f000000u);
    const float s2 = from_bits(e - g);
    const float s1b = beyond ? s1 : 1.0f, s1w = wide ? s1 : 1.0f, s2w = wide ? s2 : 1.0f;
    const float huge = s1b * s1b;
    const float split = std::fma(s2w, j, s2w) * s1w;
    const float plain = std::fma(k, j, k);
    const float inner = wide ? split : plain;
    return beyond ? huge : inner;
}

// The form of this build's level: the avx2 level's llama.cpp counterpart is its AVX2 build; every other level
// (AVX-512, and the portable build, which has no llama.cpp twin to match) takes AVX-512's. kExpfBlock: the
// vector width of that form, in floats (a row's softmax sums and SwiGLU's blocks go by it).
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
constexpr int kExpfBlock = 8;
static inline float ggml_expf_lane(float x) { return ggml_v_expf_avx2_lane(x); }
// ggml_v_expf_avx2_lane for 8 lanes at once (GCC does not vectorize the lane form's selects): the same
// operations, the selects as blends.
static inline __m256 ggml_v_expf_avx2(__m256 x) {
    const __m256 r = _mm256_set1_ps(0x1.8p23f);
    const __m256 z = _mm256_fmadd_ps(x, _mm256_set1_ps(0x1.715476p+0f), r);
    const __m256 n = _mm256_sub_ps(z, r);
    const __m256 b = _mm256_fnmadd_ps(n, _mm256_set1_ps(0x1.7f7d1cp-20f),
                                      _mm256_fnmadd_ps(n, _mm256_set1_ps(0x1.62e4p-1f), x));
    const __m256i e = _mm256_slli_epi32(_mm256_castps_si256(z), 23);
    const __m256 k = _mm256_castsi256_ps(_mm256_add_epi32(e, _mm256_set1_epi32(0x3f800000)));
    const __m256 u = _mm256_mul_ps(b, b);
    const __m256 lin = _mm256_mul_ps(_mm256_set1_ps(0x1.ffffecp-1f), b);
    const __m256 j = _mm256_fmadd_ps(
        _mm256_fmadd_ps(_mm256_fmadd_ps(_mm256_set1_ps(0x1.0e4020p-7f), b, _mm256_set1_ps(0x1.573e2ep-5f)), u,
                        _mm256_fmadd_ps(_mm256_set1_ps(0x1.555e66p-3f), b, _mm256_set1_ps(0x1.fffdb6p-2f))),
        u, lin);
    const __m256 size = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), n);
    const __m256i g = _mm256_and_si256(_mm256_castps_si256(_mm256_cmp_ps(n, _mm256_setzero_ps(), _CMP_LE_OQ)),
                                       _mm256_set1_epi32(static_cast<int>(0x82000000u)));
    const __m256 s1 = _mm256_castsi256_ps(_mm256_add_epi32(g, _mm256_set1_epi32(0x7f000000)));
    const __m256 s2 = _mm256_castsi256_ps(_mm256_sub_epi32(e, g));
    // `huge` is selected only where size > 192 and `split` only where size > 126, but computed in every lane, where
    // for common arguments they underflow (s1 * s1 for every n <= 0; s2 (1 + j) for n = 1, j < 0: a subnormal),
    // which Intel CPUs finish in microcode assists of ~100 cycles each (SwiGLU ran 10x slower than AVX-512's
    // form). So each is computed from its inputs only in the lanes that select it (from 1 in the others): the same
    // value wherever it is used.
    const __m256 one = _mm256_set1_ps(1.0f);
    const __m256 beyond = _mm256_cmp_ps(size, _mm256_set1_ps(192.0f), _CMP_GT_OQ);
    const __m256 wide = _mm256_cmp_ps(size, _mm256_set1_ps(126.0f), _CMP_GT_OQ);
    const __m256 s1_beyond = _mm256_blendv_ps(one, s1, beyond);
    const __m256 huge = _mm256_mul_ps(s1_beyond, s1_beyond);
    const __m256 s1_wide = _mm256_blendv_ps(one, s1, wide), s2_wide = _mm256_blendv_ps(one, s2, wide);
    const __m256 split = _mm256_mul_ps(_mm256_fmadd_ps(s2_wide, j, s2_wide), s1_wide);
    const __m256 plain = _mm256_fmadd_ps(k, j, k);
    const __m256 inner = _mm256_blendv_ps(plain, split, wide);
    return _mm256_blendv_ps(inner, huge, beyond);
}
// The sum of 8 floats as ggml_vec_soft_max_f32's AVX2 branch adds them: the halves, then pairs, then the two.
static inline float expf_block_sum(const float* v) {
    const float a0 = v[4] + v[0], a1 = v[5] + v[1], a2 = v[6] + v[2], a3 = v[7] + v[3];
    return (a0 + a2) + (a1 + a3);
}
#else
constexpr int kExpfBlock = 16;
static inline float ggml_expf_lane(float x) { return ggml_v_expf_lane(x); }
// The sum of 16 floats in the order of GCC's _mm512_reduce_add_ps (halves, quarters, then pairs).
static inline float expf_block_sum(const float* x) {
    float t3[8], t6[4];
    for (int i = 0; i < 8; ++i) t3[i] = x[i + 8] + x[i];
    for (int i = 0; i < 4; ++i) t6[i] = t3[i + 4] + t3[i];
    const float a = t6[0] + t6[2], b = t6[1] + t6[3];
    return a + b;
}
#endif

}  // namespace sluice_ggml
