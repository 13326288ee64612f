// Paged attention for short queries (decode, speculative verification) on CPU.
//
// The torch reference path gathers every sequence's blocks into a padded copy and then runs SDPA
// over it: the K/V bytes cross memory three times. Here each (sequence, KV head) reads its keys and
// values once, straight from the block-table slots, for all the query heads that share them (GQA) and
// all its query rows (causal within the sequence). Plain C++ with OpenMP, no torch headers, so it
// compiles in a second or two at first use; loaded with ctypes (cpu_kernels/__init__.py).
//
// Layouts (the engine's):
//   q, out       [T, Hq, D] rows with row stride q_row_stride / out_row_stride (elements); heads and
//                head dims contiguous
//   k/v cache    [num_blocks, block_size, Hkv, D] contiguous
//   block_tables [B, table_stride] int32;  seq_lens [B] int32;  query_start [B+1] int32
// Query j of sequence b sits at absolute position seq_len - q_len + j and sees keys 0..that position.
// Sequences whose q_len exceeds max_query_len are skipped (the caller handles them).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

// exp for x <= 0 that the compiler can vectorize (std::exp blocks it without -ffast-math): range
// reduction to r in [-ln2/2, ln2/2] and a degree-6 minimax polynomial (the Cephes expf
// coefficients), ~1 ulp. Inputs are score - row max, so never positive.
inline float exp_nonpositive(float x) {
    x = std::max(x, -87.0f);
    const float n = std::nearbyint(x * 1.44269504088896341f);
    float r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
    float scale;
    std::memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

inline float to_float(float x) { return x; }
inline float to_float(uint16_t bf16) {
    const uint32_t bits = static_cast<uint32_t>(bf16) << 16;
    float f;
    std::memcpy(&f, &bits, sizeof f);
    return f;
}
// One K or V row as floats: in place for fp32, converted into `buf` for bf16.
template <typename T, int D>
inline const float* load_row(const T* src, float* buf) {
    if constexpr (sizeof(T) == sizeof(float)) {
        return reinterpret_cast<const float*>(src);
    } else {
        for (int d = 0; d < D; ++d) buf[d] = to_float(src[d]);
        return buf;
    }
}

// Ask for the next block's rows of this KV head while the current block is computed.
template <typename T, int D>
inline void prefetch_rows(const T* first, int rows, int64_t row_stride) {
    constexpr int kLine = 64 / sizeof(T);  // elements per cache line
    for (int o = 0; o < rows; ++o)
        for (int d = 0; d < D; d += kLine) __builtin_prefetch(first + o * row_stride + d);
}

// body(p, row) for positions 0..seq_len-1 of one KV head, block by block through the block table,
// the row as floats; the next block is prefetched while this one is used.
template <typename T, int D, typename Body>
inline void for_each_row(const T* cache, const int32_t* table, int seq_len, int block_size, int64_t slot_stride,
                         int kv_head, float* buf, Body&& body) {
    const int64_t block_stride = static_cast<int64_t>(block_size) * slot_stride;
    for (int p0 = 0, blk = 0; p0 < seq_len; p0 += block_size, ++blk) {
        const T* rows = cache + table[blk] * block_stride + kv_head * D;
        if (p0 + block_size < seq_len)
            prefetch_rows<T, D>(cache + table[blk + 1] * block_stride + kv_head * D,
                                std::min(block_size, seq_len - p0 - block_size), slot_stride);
        const int n = std::min(block_size, seq_len - p0);
        for (int o = 0; o < n; ++o) body(p0 + o, load_row<T, D>(rows + o * slot_stride, buf));
    }
}

inline void store(float* dst, float x) { *dst = x; }
inline void store(uint16_t* dst, float x) {  // bf16, round to nearest even (no NaNs arise here)
    uint32_t bits;
    std::memcpy(&bits, &x, sizeof bits);
    bits += 0x7FFFu + ((bits >> 16) & 1u);
    *dst = static_cast<uint16_t>(bits >> 16);
}

template <typename T, int D>
void paged_attention(T* out, int64_t out_row_stride, const T* q, int64_t q_row_stride, const T* k_cache,
                     const T* v_cache, const int32_t* block_tables, int64_t table_stride, const int32_t* seq_lens,
                     const int32_t* query_start, int num_seqs, int num_heads, int num_kv_heads,
                     int block_size, int max_query_len, float scale, int num_threads) {
    const int group = num_heads / num_kv_heads;
    const int64_t slot_stride = static_cast<int64_t>(num_kv_heads) * D;  // one token's K (or V) row
    const int items = num_seqs * num_kv_heads;
#pragma omp parallel num_threads(num_threads)
    {
        std::vector<float> qf, scores, acc, inv_sum, kv_row(D);
#pragma omp for schedule(dynamic, 1)
        for (int item = 0; item < items; ++item) {
            const int b = item / num_kv_heads, kvh = item % num_kv_heads;
            const int q0 = query_start[b], q_len = query_start[b + 1] - q0;
            if (q_len == 0 || q_len > max_query_len) continue;
            const int seq_len = seq_lens[b];
            const int rows = q_len * group;  // row r: query j = r / group, head kvh * group + r % group
            const int32_t* table = block_tables + static_cast<int64_t>(b) * table_stride;
            qf.resize(static_cast<size_t>(rows) * D);
            scores.resize(static_cast<size_t>(rows) * seq_len);
            acc.assign(static_cast<size_t>(rows) * D, 0.0f);
            for (int r = 0; r < rows; ++r) {
                const T* src = q + (q0 + r / group) * q_row_stride + (kvh * group + r % group) * D;
                for (int d = 0; d < D; ++d) qf[r * D + d] = to_float(src[d]) * scale;
            }
            // Keys: position p is visible to query j when p <= seq_len - q_len + j.
            const int first_limit = seq_len - q_len;  // last position query 0 sees
            for_each_row<T, D>(k_cache, table, seq_len, block_size, slot_stride, kvh, kv_row.data(),
                               [&](int p, const float* k) {
                const int first_row = p <= first_limit ? 0 : (p - first_limit) * group;
                for (int r = first_row; r < rows; ++r) {
                    const float* qr = &qf[r * D];
                    float s = 0.0f;
#pragma omp simd reduction(+ : s)
                    for (int d = 0; d < D; ++d) s += qr[d] * k[d];
                    scores[static_cast<size_t>(r) * seq_len + p] = s;
                }
            });
            inv_sum.resize(rows);
            for (int r = 0; r < rows; ++r) {
                const int visible = first_limit + r / group + 1;
                float* sr = &scores[static_cast<size_t>(r) * seq_len];
                float m = sr[0];
                for (int p = 1; p < visible; ++p) m = std::max(m, sr[p]);
                float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
                for (int p = 0; p < visible; ++p) {
                    const float e = exp_nonpositive(sr[p] - m);
                    sr[p] = e;
                    sum += e;
                }
                inv_sum[r] = 1.0f / sum;
            }
            for_each_row<T, D>(v_cache, table, seq_len, block_size, slot_stride, kvh, kv_row.data(),
                               [&](int p, const float* v) {
                const int first_row = p <= first_limit ? 0 : (p - first_limit) * group;
                for (int r = first_row; r < rows; ++r) {
                    const float w = scores[static_cast<size_t>(r) * seq_len + p];
                    float* ar = &acc[r * D];
#pragma omp simd
                    for (int d = 0; d < D; ++d) ar[d] += w * v[d];
                }
            });
            for (int r = 0; r < rows; ++r) {
                T* dst = out + (q0 + r / group) * out_row_stride + (kvh * group + r % group) * D;
                for (int d = 0; d < D; ++d) store(&dst[d], acc[r * D + d] * inv_sum[r]);
            }
        }
    }
}

}  // namespace

#ifndef SLUICE_CPU_ISA_NAME  // the level this library is built for (cpu_kernels/__init__.py passes it)
#define SLUICE_CPU_ISA_NAME "unknown"
#endif

extern "C" {

// The level's name in the library's bytes, which cpu_kernels/__init__.py reads before it loads the file: a
// library for instructions this CPU lacks is never loaded.
__attribute__((used)) const char sluice_kernels_isa_tag[] = "sluice-kernels-isa:" SLUICE_CPU_ISA_NAME;
const char* sluice_kernels_isa() { return sluice_kernels_isa_tag + sizeof("sluice-kernels-isa:") - 1; }

int sluice_paged_attention_abi_version() { return 2; }

// Head dims are compile-time constants, so the per-row loops unroll into whole vector registers.
int sluice_paged_attention_supports_head_dim(int head_dim) {
    return head_dim == 64 || head_dim == 128 || head_dim == 32 || head_dim == 96 || head_dim == 256;
}

#define SLUICE_DISPATCH_HEAD_DIM(T)                                                                       \
    switch (head_dim) {                                                                                   \
        case 32: return paged_attention<T, 32>(SLUICE_ARGS);                                              \
        case 64: return paged_attention<T, 64>(SLUICE_ARGS);                                              \
        case 96: return paged_attention<T, 96>(SLUICE_ARGS);                                              \
        case 128: return paged_attention<T, 128>(SLUICE_ARGS);                                            \
        case 256: return paged_attention<T, 256>(SLUICE_ARGS);                                            \
        default: return;                                                                                  \
    }

#define SLUICE_ARGS                                                                                       \
    out, out_row_stride, q, q_row_stride, k_cache, v_cache, block_tables, table_stride, seq_lens,         \
        query_start, num_seqs, num_heads, num_kv_heads, block_size, max_query_len, scale, num_threads

#define SLUICE_PAGED_ATTENTION(NAME, T)                                                                   \
    void NAME(T* out, int64_t out_row_stride, const T* q, int64_t q_row_stride, const T* k_cache,         \
              const T* v_cache, const int32_t* block_tables, int64_t table_stride, const int32_t* seq_lens, \
              const int32_t* query_start, int num_seqs, int num_heads, int num_kv_heads, int head_dim,    \
              int block_size, int max_query_len, float scale, int num_threads) {                          \
        SLUICE_DISPATCH_HEAD_DIM(T)                                                                       \
    }

SLUICE_PAGED_ATTENTION(sluice_paged_attention_f32, float)
SLUICE_PAGED_ATTENTION(sluice_paged_attention_bf16, uint16_t)

}  // extern "C"
