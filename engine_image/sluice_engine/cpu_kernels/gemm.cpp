// fp32 GEMM for linear layers on CPU: y[M, N] = x[M, K] . W^T, with W packed once at load into
// panels of 32 output columns, [ceil(N / 32), K, 32] (zero-padded), so that a panel is one contiguous
// stream. Why: MKL's sgemm (what F.linear calls) is tuned for big matrices; at the row counts a
// serving engine decodes with (1-64 rows) it reached half of what this machine's memory and FMA units
// allow, and a decode step is mostly these matmuls. Here each thread takes whole panels; a panel
// streams from memory once per chunk of x's rows (prefetched ahead: nothing else would bring the
// weights in early), while 8 rows x 32 columns of y accumulate in 16 vector registers. At prefill's
// thousands of rows it runs ~5-10% behind MKL (measured); decode is where the time goes.
// AVX-512F intrinsics; AVX2 and AArch64 get the same algorithm in vector extensions with a smaller
// tile (16-column panels: the panel width is the library's to say); elsewhere sluice_gemm_available()
// is 0 and the engine keeps F.linear. Sums run in a different order from MKL's: results differ from
// F.linear by float rounding.

#include <algorithm>
#include <cstdint>

#ifdef __AVX512F__
#include <immintrin.h>

namespace {

constexpr int kPanel = 32;     // output columns per panel: two 16-float vectors
constexpr int kMaxRows = 8;    // rows of x per register tile: 2 x 8 accumulators
constexpr int64_t kChunkBytes = 512 << 10;  // rows of x per pass over the weights: this much of x, kept in L2
constexpr int kPrefetch = 32;  // panel rows (128 bytes each) to prefetch ahead

// Few rows leave too few independent FMA chains to cover the FMA latency: those tiles keep
// kSplit partial sums over interleaved k and add them at the end.
template <int MR>
inline void tile(const float* x, int64_t ldx, const float* panel, int K, float* y, int64_t ldy, int ncols) {
    constexpr int kSplit = MR <= 2 ? 4 : 1;
    __m512 lo[kSplit][MR], hi[kSplit][MR];
    for (int s = 0; s < kSplit; ++s)
        for (int m = 0; m < MR; ++m) lo[s][m] = hi[s][m] = _mm512_setzero_ps();
    int k = 0;
    for (; k + kSplit <= K; k += kSplit) {
        for (int s = 0; s < kSplit; ++s) {
            const float* w = panel + static_cast<int64_t>(k + s) * kPanel;
            _mm_prefetch(reinterpret_cast<const char*>(w + kPrefetch * kPanel), _MM_HINT_T0);
            _mm_prefetch(reinterpret_cast<const char*>(w + kPrefetch * kPanel + 16), _MM_HINT_T0);
            const __m512 w0 = _mm512_loadu_ps(w), w1 = _mm512_loadu_ps(w + 16);
            for (int m = 0; m < MR; ++m) {
                const __m512 xv = _mm512_set1_ps(x[m * ldx + k + s]);
                lo[s][m] = _mm512_fmadd_ps(xv, w0, lo[s][m]);
                hi[s][m] = _mm512_fmadd_ps(xv, w1, hi[s][m]);
            }
        }
    }
    for (; k < K; ++k) {  // the last K % kSplit rows
        const float* w = panel + static_cast<int64_t>(k) * kPanel;
        const __m512 w0 = _mm512_loadu_ps(w), w1 = _mm512_loadu_ps(w + 16);
        for (int m = 0; m < MR; ++m) {
            const __m512 xv = _mm512_set1_ps(x[m * ldx + k]);
            lo[0][m] = _mm512_fmadd_ps(xv, w0, lo[0][m]);
            hi[0][m] = _mm512_fmadd_ps(xv, w1, hi[0][m]);
        }
    }
    for (int s = 1; s < kSplit; ++s)
        for (int m = 0; m < MR; ++m) {
            lo[0][m] = _mm512_add_ps(lo[0][m], lo[s][m]);
            hi[0][m] = _mm512_add_ps(hi[0][m], hi[s][m]);
        }
    const __mmask16 mask_lo = ncols >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << ncols) - 1);
    const __mmask16 mask_hi = ncols >= 32 ? 0xFFFF : ncols <= 16 ? 0 : static_cast<__mmask16>((1u << (ncols - 16)) - 1);
    for (int m = 0; m < MR; ++m) {
        _mm512_mask_storeu_ps(y + m * ldy, mask_lo, lo[0][m]);
        _mm512_mask_storeu_ps(y + m * ldy + 16, mask_hi, hi[0][m]);
    }
}

using TileFn = void (*)(const float*, int64_t, const float*, int, float*, int64_t, int);
constexpr TileFn kTiles[kMaxRows + 1] = {nullptr, tile<1>, tile<2>, tile<3>, tile<4>, tile<5>, tile<6>, tile<7>, tile<8>};

}  // namespace

#elif defined(__AVX2__) || defined(__aarch64__)
// The same algorithm in GCC/Clang vector extensions for AVX2 (8-float ymm) and AArch64 (NEON, a
// 32-byte vector is two q registers): 6 rows x 16 columns, 12 accumulators (of 16 ymm registers).
#include <cstring>

namespace {

constexpr int kLanes = 8;
constexpr int kPanel = 2 * kLanes;
constexpr int kMaxRows = 6;
constexpr int64_t kChunkBytes = 512 << 10;
constexpr int kPrefetch = 64;  // panel rows (64 bytes each) to prefetch ahead

typedef float vec __attribute__((vector_size(kLanes * sizeof(float))));

inline vec load(const float* p) {
    vec v;
    std::memcpy(&v, p, sizeof v);
    return v;
}

template <int MR>
void tile(const float* x, int64_t ldx, const float* panel, int K, float* y, int64_t ldy, int ncols) {
    vec lo[MR] = {}, hi[MR] = {};
    for (int k = 0; k < K; ++k) {
        const float* w = panel + static_cast<int64_t>(k) * kPanel;
        __builtin_prefetch(w + kPrefetch * kPanel);
        const vec w0 = load(w), w1 = load(w + kLanes);
        for (int m = 0; m < MR; ++m) {
            const float xs = x[m * ldx + k];
            lo[m] += xs * w0;
            hi[m] += xs * w1;
        }
    }
    for (int m = 0; m < MR; ++m) {
        float row[kPanel];
        std::memcpy(row, &lo[m], sizeof(vec));
        std::memcpy(row + kLanes, &hi[m], sizeof(vec));
        std::memcpy(y + m * ldy, row, static_cast<size_t>(ncols) * sizeof(float));
    }
}

using TileFn = void (*)(const float*, int64_t, const float*, int, float*, int64_t, int);
constexpr TileFn kTiles[kMaxRows + 1] = {nullptr, tile<1>, tile<2>, tile<3>, tile<4>, tile<5>, tile<6>};

}  // namespace

#define SLUICE_GEMM_PORTABLE 1

#else  // neither: the engine keeps F.linear

extern "C" {
int sluice_gemm_available() { return 0; }
int sluice_gemm_panel_width() { return 32; }
void sluice_gemm_f32(const float*, int64_t, const float*, int, int, int, float*, int64_t, int) {}
}

#endif

#if defined(__AVX512F__) || defined(SLUICE_GEMM_PORTABLE)
extern "C" {

int sluice_gemm_available() { return 1; }
int sluice_gemm_panel_width() { return kPanel; }

void sluice_gemm_f32(const float* x, int64_t ldx, const float* packed, int M, int K, int N, float* y, int64_t ldy,
                     int num_threads) {
    const int panels = (N + kPanel - 1) / kPanel;
    const int chunk = std::max(kMaxRows, static_cast<int>(kChunkBytes / (static_cast<int64_t>(K) * sizeof(float))));
    for (int m0 = 0; m0 < M; m0 += chunk) {
        const int rows = std::min(chunk, M - m0);
        const float* xc = x + static_cast<int64_t>(m0) * ldx;
        float* yc = y + static_cast<int64_t>(m0) * ldy;
#pragma omp parallel for schedule(static) num_threads(num_threads)
        for (int p = 0; p < panels; ++p) {
            const float* panel = packed + static_cast<int64_t>(p) * K * kPanel;
            const int n0 = p * kPanel, ncols = std::min(kPanel, N - n0);
            for (int m = 0; m < rows; m += kMaxRows) {
                const int mr = std::min(kMaxRows, rows - m);
                kTiles[mr](xc + m * ldx, ldx, panel, K, yc + m * ldy + n0, ldy, ncols);
            }
        }
    }
}

}  // extern "C"
#endif
