// glibc's expf, 8 floats at a time, bit for bit: the llama.cpp-exact vec attention's online softmax calls libm's
// expf once per key and query head (as llama.cpp does), ~22% of that kernel at batch 32 as a scalar call each.
//
// The algorithm of glibc 2.27+'s expf (sysdeps/ieee754/flt-32/e_expf.c, Szabolcs Nagy's) as its FMA build
// (__expf_fma, what x86-64 CPUs with FMA resolve expf to) computes it, read from its disassembly on Debian 12's
// glibc 2.36: in double, with N = 32 table entries,
//   kd' = fma(x, N / ln 2, SHIFT)  (SHIFT = 1.5 * 2^52: rounds to an integer in the low bits)   ki = bits(kd')
//   kd = kd' - SHIFT              r = fma(N / ln 2, x, -kd)
//   s = bits(T[ki % N] + (ki << 47))   y = fma(fma(C0, r, C1), r * r, fma(C2, r, 1)) * s   ->  float(y)
// for |x| < 88; beyond (overflow, underflow, inf, nan) glibc takes other paths, left to the caller (needs_libm).
// Checked against this machine's expf over all 2^31 floats with |x| < 88 (0 differ), and at start-up against
// the running libm (libm_expf_matches): another libm, or a glibc whose expf differs, keeps the scalar calls.

#pragma once

#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <initializer_list>

namespace sluice_libm {

alignas(64) inline constexpr uint64_t kExp2fTable[32] = {  // __exp2f_data.tab: 2^(i/32) with the i/32 bits taken off
    0x3ff0000000000000, 0x3fefd9b0d3158574, 0x3fefb5586cf9890f, 0x3fef9301d0125b51, 0x3fef72b83c7d517b,
    0x3fef54873168b9aa, 0x3fef387a6e756238, 0x3fef1e9df51fdee1, 0x3fef06fe0a31b715, 0x3feef1a7373aa9cb,
    0x3feedea64c123422, 0x3feece086061892d, 0x3feebfdad5362a27, 0x3feeb42b569d4f82, 0x3feeab07dd485429,
    0x3feea47eb03a5585, 0x3feea09e667f3bcd, 0x3fee9f75e8ec5f74, 0x3feea11473eb0187, 0x3feea589994cce13,
    0x3feeace5422aa0db, 0x3feeb737b0cdc5e5, 0x3feec49182a3f090, 0x3feed503b23e255d, 0x3feee89f995ad3ad,
    0x3feeff76f2fb5e47, 0x3fef199bdd85529c, 0x3fef3720dcef9069, 0x3fef5818dcfba487, 0x3fef7c97337b9b5f,
    0x3fefa4afa2a490da, 0x3fefd0765b6e4540};

inline double from_bits(uint64_t u) {
    double d;
    std::memcpy(&d, &u, 8);
    return d;
}

#if defined(__AVX512F__) && defined(__AVX512DQ__)
// expf of 8 floats with |x| < 88 (other lanes: garbage; see needs_libm).
inline __m256 expf8(__m256 x) {
    const __m512d xd = _mm512_cvtps_pd(x);
    const __m512d inv_ln2n = _mm512_set1_pd(from_bits(0x40471547652b82feULL));  // 32 / ln 2
    const __m512d shift = _mm512_set1_pd(from_bits(0x4338000000000000ULL));     // 1.5 * 2^52
    const __m512d kds = _mm512_fmadd_pd(xd, inv_ln2n, shift);
    const __m512i ki = _mm512_castpd_si512(kds);
    const __m512d r = _mm512_fmsub_pd(inv_ln2n, xd, _mm512_sub_pd(kds, shift));
    const __m512i t = _mm512_i64gather_epi64(_mm512_and_si512(ki, _mm512_set1_epi64(31)), kExp2fTable, 8);
    const __m512d s = _mm512_castsi512_pd(_mm512_add_epi64(t, _mm512_slli_epi64(ki, 47)));
    const __m512d z = _mm512_fmadd_pd(_mm512_set1_pd(from_bits(0x3ebc6af84b912394ULL)), r,
                                      _mm512_set1_pd(from_bits(0x3f2ebfce50fac4f3ULL)));
    __m512d y = _mm512_fmadd_pd(_mm512_set1_pd(from_bits(0x3f962e42ff0c52d6ULL)), r, _mm512_set1_pd(1.0));
    y = _mm512_fmadd_pd(z, _mm512_mul_pd(r, r), y);
    return _mm512_cvtpd_ps(_mm512_mul_pd(y, s));
}

// Lanes expf8 does not cover: |x| >= 88 (glibc's special-case bound, 0x42b00000) or NaN.
inline __mmask8 needs_libm(__m256 x) {
    const __m256 ax = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), x);
    return static_cast<__mmask8>(_mm256_movemask_ps(_mm256_cmp_ps(ax, _mm256_set1_ps(88.0f), _CMP_NLT_UQ)));
}

// Whether expf8 gives the running libm's expf bit for bit: ~2^20 arguments spread over (-88, 88) by their bits,
// and the ends. Computed once per process.
inline bool libm_expf_matches() {
    static const bool ok = [] {
        alignas(32) float x[8], y[8];
        int n = 0;
        auto check = [&]() {
            _mm256_store_ps(y, expf8(_mm256_load_ps(x)));
            for (int i = 0; i < 8; ++i) {
                const float ref = std::exp(x[i]);
                if (std::memcmp(&ref, &y[i], 4) != 0) return false;
            }
            return true;
        };
        for (uint32_t bits = 0; bits < 0x42b00000u; bits += 0x42b00000u / (1u << 19) | 1u) {
            for (const uint32_t sign : {0u, 0x80000000u}) {
                const uint32_t u = bits | sign;
                std::memcpy(&x[n++], &u, 4);
                if (n == 8) {
                    if (!check()) return false;
                    n = 0;
                }
            }
        }
        const float ends[8] = {0.f, -0.f, 87.99999f, -87.99999f, 1e-30f, -1e-30f, -10.f, -0.5f};
        std::memcpy(x, ends, sizeof(ends));
        return check();
    }();
    return ok;
}
#endif

}  // namespace sluice_libm
