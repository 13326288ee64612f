// LoRA's low-rank delta on CPU (lora/cpu_ops.py), one call per LoRA layer: for every token on an adapter,
// h = A[slot] x (all of a fused layer's projections at once: q, k and v side by side along the rank), then
// y[offset_j : offset_j + out_j] += B_j[slot] h_j for each projection j, in place over the base layer's output.
// Why: in torch this is an index_select, a bmm, a mask and an index_add per projection and slot group, ~30 ops
// per decoder layer whose dispatch (and, with OMP_WAIT_POLICY=passive, the wake-up of the OpenMP threads for
// each) cost far more than the arithmetic: rank 16 on all seven projections of the bundled model is ~4% of the
// base model's FLOPs, but the torch path ran at half the base model's speed at concurrency 32 (BENCHMARKS.md).
//
// Tokens come sorted by slot (rows[i] is a row of x and y, slots[i] its slot, never 0), so they are cut into
// tiles of up to kTile tokens of one slot, whose rows of A then come from L1; the shrink runs four rows of A
// per pass over a token (four independent sums in flight, not one latency-bound chain). B comes transposed
// ([slot][rank][out]), so the expand sums, per block of kCols output columns held in registers, the rank's
// rows of B scaled by h: vectorized along the columns, y read and written once. A rank whose h is exactly zero
// (zero padding to the largest rank, a projection the adapter leaves alone) is skipped.
// On the bundled model (rank 16 on all seven projections, 32 decode tokens over 4 adapters, Xeon AVX-512, one
// thread) the four calls of a decoder layer take ~185 us (~28 GMAC/s); per-token dot products took ~280.
// Tiles run in parallel when there is enough work for the OpenMP fork to pay.

#include <algorithm>
#include <cstdint>
#include <vector>

namespace {

constexpr int kTile = 8;                  // tokens of one slot whose shrink shares each row of A
constexpr int kCols = 64;                 // output columns an expand sums over the rank at once
constexpr int64_t kParallelMacs = 1 << 18;  // below this many multiply-adds a call stays on the calling thread

inline float dot(const float* a, const float* b, int n) {
    float acc = 0.f;
#pragma omp simd reduction(+ : acc)
    for (int i = 0; i < n; ++i) acc += a[i] * b[i];
    return acc;
}

// y[0:W] += sum_k h[k] b[k * ldb : k * ldb + W], the W sums held in registers across the rank (W is a
// compile-time constant, so they are), a rank whose h is zero skipped.
template <int W>
inline void expand_block(const float* h, int rank, const float* b, int64_t ldb, float* y) {
    float acc[W];
#pragma omp simd
    for (int o = 0; o < W; ++o) acc[o] = y[o];
    for (int k = 0; k < rank; ++k) {
        const float c = h[k];
        if (c == 0.f) continue;
        const float* b_row = b + k * ldb;
#pragma omp simd
        for (int o = 0; o < W; ++o) acc[o] += c * b_row[o];
    }
#pragma omp simd
    for (int o = 0; o < W; ++o) y[o] = acc[o];
}

}  // namespace

extern "C" {

// x: [*, in_features] rows at stride ldx; a: [slots, num_proj * rank, in_features] contiguous;
// bt[j]: [slots, rank, outs[j]] contiguous; y: rows at stride ldy, projection j at column offsets[j].
void sluice_lora_f32(const float* x, int64_t ldx, int in_features, const float* a, int num_proj, int rank,
                     const float* const* bt, const int* outs, const int* offsets, const int64_t* rows,
                     const int64_t* slots, int n, float* y, int64_t ldy, int nthreads) {
    if (n <= 0) return;
    std::vector<int> tiles;  // first token of each tile, then n
    for (int i = 0; i < n; ++i)
        if (i == 0 || slots[i] != slots[i - 1] || i - tiles.back() == kTile) tiles.push_back(i);
    const int num_tiles = static_cast<int>(tiles.size());
    tiles.push_back(n);
    const int pr = num_proj * rank;
    int64_t width = 0;
    for (int j = 0; j < num_proj; ++j) width += outs[j];
    const int64_t macs = static_cast<int64_t>(n) * rank * (static_cast<int64_t>(num_proj) * in_features + width);
    const bool parallel = nthreads > 1 && num_tiles > 1 && macs >= kParallelMacs;
#pragma omp parallel num_threads(nthreads) if (parallel)
    {
        std::vector<float> h(static_cast<size_t>(kTile) * pr);
#pragma omp for schedule(dynamic, 1)
        for (int t = 0; t < num_tiles; ++t) {
            const int first = tiles[t], m = tiles[t + 1] - first;
            const int64_t slot = slots[first];
            const float* a_slot = a + slot * pr * static_cast<int64_t>(in_features);
            int p = 0;
            for (; p + 4 <= pr; p += 4) {  // four rows of A per pass over x: four independent sums in flight
                const float* a0 = a_slot + static_cast<int64_t>(p) * in_features;
                const float *a1 = a0 + in_features, *a2 = a1 + in_features, *a3 = a2 + in_features;
                for (int i = 0; i < m; ++i) {
                    const float* xi = x + rows[first + i] * ldx;
                    float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
                    for (int k = 0; k < in_features; ++k) {
                        const float xv = xi[k];
                        s0 += a0[k] * xv;
                        s1 += a1[k] * xv;
                        s2 += a2[k] * xv;
                        s3 += a3[k] * xv;
                    }
                    float* hi = h.data() + i * pr + p;
                    hi[0] = s0, hi[1] = s1, hi[2] = s2, hi[3] = s3;
                }
            }
            for (; p < pr; ++p) {
                const float* a_row = a_slot + static_cast<int64_t>(p) * in_features;
                for (int i = 0; i < m; ++i) h[i * pr + p] = dot(a_row, x + rows[first + i] * ldx, in_features);
            }
            for (int j = 0; j < num_proj; ++j) {
                const int out = outs[j];
                const float* b_slot = bt[j] + slot * rank * static_cast<int64_t>(out);
                for (int i = 0; i < m; ++i) {
                    float* y_row = y + rows[first + i] * ldy + offsets[j];
                    const float* h_j = h.data() + i * pr + j * rank;
                    int o0 = 0;
                    for (; o0 + kCols <= out; o0 += kCols) expand_block<kCols>(h_j, rank, b_slot + o0, out, y_row + o0);
                    for (; o0 + 16 <= out; o0 += 16) expand_block<16>(h_j, rank, b_slot + o0, out, y_row + o0);
                    for (; o0 < out; ++o0) {  // the last columns when out is not a multiple of 16
                        float acc = y_row[o0];
                        for (int k = 0; k < rank; ++k) acc += h_j[k] * b_slot[static_cast<int64_t>(k) * out + o0];
                        y_row[o0] = acc;
                    }
                }
            }
        }
    }
}

}  // extern "C"
