// ggml's AVX-512 vector expf, one lane at a time: shared by the llama.cpp-exact ops (layer_ops.cpp's SwiGLU,
// ggml_attention.cpp's tiled softmax), which must round exactly as llama.cpp does (see ggml_attention.cpp).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

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

}  // namespace sluice_ggml
