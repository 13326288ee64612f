// A stack of Llama decoder layers of a GGUF served in its own blocks on CPU, in one call: the same kernels and the
// same order of operations as models/llama.py's DecoderLayer makes through GgmlLayerOps, GgmlCpuAttention and
// GgufBlockLinear one op at a time, so the result is identical bit for bit (tests/engine/test_ggml_decoder.py).
//
// Why: at decode a layer of a small model is ~10 kernel calls of a few microseconds of arithmetic each, and
// reaching each from Python (module dispatch, tensor views and allocations, ctypes) costs more than the kernel:
// ~3 ms of a ~11 ms batch-1 step of the bundled model (30 layers). llama.cpp runs its whole graph from C; so does
// this. Only the layer loop moves here; the embedding, the final norm and the output layer stay in Python.
//
// Per layer, for T tokens (hidden H, q = heads * d, kv = kv_heads * d, intermediate I):
//   h, residual = add_norm(x, residual)            (the first layer: h = norm(x), residual = x)
//   qkv = h . Wqkv^T                      [T, q + 2 kv]
//   rotary over qkv's Q and K heads, in place; K and V written to the layer's fp16 cache at the tokens' slots
//   attn = attention(Q, cache)            [T, q]
//   h, residual = add_norm(attn . Wo^T, residual)
//   x = down(swiglu(h . Wgate_up^T))      [T, H], the layer's output, not yet added to residual

#include <cstdint>
#include <cstring>
#include <vector>

extern "C" {
void sluice_quant_gemm_f32(int fmt, const float* x, int64_t ldx, const uint8_t* w, int M, int K, int N, float* y,
                           int64_t ldy, int num_threads);
void sluice_ggml_rms_norm_f32(const float* x, int64_t ldx, const float* w, float* out, int64_t ldo, int rows, int n,
                              float eps, int threads);
void sluice_ggml_add_rms_norm_f32(const float* x, int64_t ldx, const float* res, int64_t ldr, const float* w,
                                  float* out, int64_t ldo, float* sum, int64_t lds, int rows, int n, float eps,
                                  int threads);
void sluice_ggml_rotary_f32(float* x, int64_t ldt, int64_t ldh, int tokens, int heads, int dim, const float* cos,
                            const float* sin, int64_t ldc, int threads);
void sluice_ggml_swiglu_f32(const float* gate_up, int64_t ldg, float* out, int64_t ldo, int rows, int inter,
                            int threads);
void sluice_ggml_write_kv(const float* k, int64_t ldk, const float* v, int64_t ldv, uint16_t* k_cache,
                          uint16_t* v_cache, const int64_t* slots, int tokens, int kv_heads, int d, int threads);
void sluice_ggml_attention(float* out, int64_t ldo, const float* q, int64_t ldq, const uint16_t* k_cache,
                           const uint16_t* v_cache, const int32_t* block_tables, int64_t ldt, const int32_t* seq_lens,
                           const int32_t* query_start, int num_seqs, int heads, int kv_heads, int d, int block_size,
                           float scale, int threads);
}

namespace {

// Per-thread scratch, grown to the largest step seen and kept, for callers that pass none big enough: a prefill
// chunk's activations are tens of MB, and allocating them per call would fault their pages in again every time.
float* scratch(size_t floats) {
    thread_local std::vector<float> buf;
    if (buf.size() < floats) buf.resize(floats);
    return buf.data();
}

}  // namespace

extern "C" {

// One decoder layer's weights and caches (ctypes mirrors this: models/ggml_decoder.py).
struct SluiceGgmlLayer {
    const float* input_norm;
    const float* post_attention_norm;
    const uint8_t* qkv;  // packed (sluice_quant_repack) [q + 2 kv, H]
    const uint8_t* o;  // [H, q]
    const uint8_t* gate_up;  // [2 I, H]: gate rows, then up rows
    const uint8_t* down;  // [H, I]
    int32_t qkv_fmt, o_fmt, gate_up_fmt, down_fmt;
    uint16_t* k_cache;  // the layer's fp16 paged cache (attention/ggml_cpu.py)
    uint16_t* v_cache;
};

struct SluiceGgmlShape {
    int32_t hidden, heads, kv_heads, head_dim, intermediate, block_size;
    float eps, scale;
};

// The scratch a step needs per token: h, qkv, attention, gate_up and the SwiGLU activations.
int64_t sluice_ggml_decoder_work_floats(const SluiceGgmlShape* shape) {
    const int64_t q = static_cast<int64_t>(shape->heads) * shape->head_dim, kv = static_cast<int64_t>(shape->kv_heads) * shape->head_dim;
    return shape->hidden + (q + 2 * kv) + q + 3 * static_cast<int64_t>(shape->intermediate);
}

// x [T, H] (rows H apart): in, the stream (the embedding); out, the last layer's output. residual [T, H]: out, the
// stream before the returned x.
// cos/sin: the tokens' rotary rows [T, d / 2] (ggml's table). slots [T]; block_tables [num_seqs, ldt];
// seq_lens [num_seqs]; query_start [num_seqs + 1]: the step's attention metadata. work: the caller's scratch of
// work_floats floats (the stack's, sized for the token budget and touched at start, so no step faults its pages
// in: sluice_ggml_decoder_work_floats per token), or null / too small: a per-thread one, grown as needed.
void sluice_ggml_decoder_layers(const SluiceGgmlLayer* layers, int num_layers, const SluiceGgmlShape* shape,
                                float* x, float* residual, int tokens, const float* cos,
                                const float* sin, const int64_t* slots, const int32_t* block_tables, int64_t ldt,
                                const int32_t* seq_lens, const int32_t* query_start, int num_seqs, int threads,
                                float* work, int64_t work_floats) {
    if (tokens <= 0 || num_layers <= 0) return;
    const int H = shape->hidden, d = shape->head_dim, heads = shape->heads, kv_heads = shape->kv_heads;
    const int q = heads * d, kv = kv_heads * d, qkv_n = q + 2 * kv, I = shape->intermediate;
    const int64_t T = tokens;
    const int64_t need = T * sluice_ggml_decoder_work_floats(shape);
    float* h = work != nullptr && work_floats >= need ? work : scratch(static_cast<size_t>(need));
    float* qkv = h + T * H;
    float* attn = qkv + T * qkv_n;
    float* gate_up = attn + T * q;
    float* act = gate_up + T * 2 * I;
    for (int l = 0; l < num_layers; ++l) {
        const SluiceGgmlLayer& L = layers[l];
        if (l == 0) {
            sluice_ggml_rms_norm_f32(x, H, L.input_norm, h, H, tokens, H, shape->eps, threads);
            std::memcpy(residual, x, sizeof(float) * T * H);
        } else {
            sluice_ggml_add_rms_norm_f32(x, H, residual, H, L.input_norm, h, H, residual, H, tokens, H, shape->eps,
                                         threads);
        }
        sluice_quant_gemm_f32(L.qkv_fmt, h, H, L.qkv, tokens, H, qkv_n, qkv, qkv_n, threads);
        sluice_ggml_rotary_f32(qkv, qkv_n, d, tokens, heads + kv_heads, d, cos, sin, d / 2, threads);
        sluice_ggml_write_kv(qkv + q, qkv_n, qkv + q + kv, qkv_n, L.k_cache, L.v_cache, slots, tokens, kv_heads, d,
                             threads);
        sluice_ggml_attention(attn, q, qkv, qkv_n, L.k_cache, L.v_cache, block_tables, ldt, seq_lens, query_start,
                              num_seqs, heads, kv_heads, d, shape->block_size, shape->scale, threads);
        sluice_quant_gemm_f32(L.o_fmt, attn, q, L.o, tokens, q, H, x, H, threads);
        sluice_ggml_add_rms_norm_f32(x, H, residual, H, L.post_attention_norm, h, H, residual, H, tokens, H,
                                     shape->eps, threads);
        sluice_quant_gemm_f32(L.gate_up_fmt, h, H, L.gate_up, tokens, H, 2 * I, gate_up, 2 * I, threads);
        sluice_ggml_swiglu_f32(gate_up, 2 * I, act, I, tokens, I, threads);
        sluice_quant_gemm_f32(L.down_fmt, act, I, L.down, tokens, I, H, x, H, threads);
    }
}

}  // extern "C"
