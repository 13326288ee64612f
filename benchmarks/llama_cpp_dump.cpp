// llama-dump: run llama.cpp's CPU backend the way llama-server would (one slot, greedy) and write every
// tensor its graphs compute to disk, so Sluice's numerics can be compared with llama.cpp's op by op.
//
// Build: benchmarks/build_llama_cpp_dump.sh (static llama.cpp libs from scripts/get-llama-server.sh's build).
//
//   llama-dump --model M.gguf --tokens 1,504,3287 --n-gen 4 --out DIR
//              [--threads 2] [--ctx 4096] [--fa on|off|auto] [--dump-steps all|none|0,2,...]
//              [--dump-cache-views] [--verbose]
//
// Step 0 is the prompt: all its tokens in one llama_decode call, logits for the last token only. Steps
// 1..N each decode one token (the argmax of the previous step's logits) at position n_past, as a server
// slot does. Every dumped step S writes, in DIR:
//   stepSSS-IIII-NAME.bin  one file per graph node, in evaluation order (IIII counts within the step; a
//                          prompt longer than n_ubatch runs several graphs and the count runs on)
//   index.tsv              a header, then one line per node: step idx name op type ne0,ne1,ne2,ne3 file
//                          (name: the tensor's name; nodes llama.cpp leaves unnamed, which ggml calls
//                          node_<n>, are labelled op(first source), and FLASH_ATTN_EXT __fattn__-<layer>)
//   logits-stepS.bin       the float32 logits row the argmax was taken over (n_vocab floats)
// and, once: tokens.txt (the generated ids, one a line) and params.txt (what the context was given).
//
// Data layout of a .bin: the tensor's elements in ggml's logical order (ne0 fastest, then ne1, ne2, ne3),
// whatever the strides were (a permuted or otherwise non-contiguous view is gathered as ggml_cont would).
// The type column says how it was written:
//   f32            float32 as computed
//   f16>f32, bf16>f32   converted exactly to float32 (ggml_fp16_to_fp32 / ggml_bf16_to_fp32)
//   i32:raw, i64:raw, ...  integer elements, native width, gathered like the floats
//   q4_1:raw, ...  quantized: the raw blocks (of the byte span ggml_nbytes covers, when not contiguous)
//   ...:skipped    (file "-") a view of the KV cache (the n_kv-cell window attention reads, stale and
//                  empty cells included: 64,3,256,1 and its permutation per layer, 4 a layer, most
//                  of the bytes otherwise); --dump-cache-views writes them (as f16>f32)
// A SET_ROWS node (the KV-cache store) returns the whole cache tensor of its layer (n_ctx rows); only the
// rows it wrote this step are dumped, in the order of its source rows: the type column then ends in
// ":setrows" and the ne column is the source's shape (e.g. 192,9,1,1 for 9 tokens' K of one layer), and
// the values are those stored in the cache (for an f16 cache: the f16 rounding of K/V, as float32).
// With --fa off the V cache is transposed and stored element by element: its SET_ROWS shows as 1,192,1,1.
//
// The graph-eval callback (cb_eval) asks for every node, so ggml computes each node as its own one-node
// graph. That changes no arithmetic: each op's kernel and its split over threads depend on the node and
// n_threads only. It does stop ggml-cpu's one fusion (RMS_NORM+MUL, which computes (x*scale)*w in one
// pass, the same roundings as the two separate ops). --dump-steps none runs without the callback at all:
// compare its logits-step*.bin with a dumping run's to check that the instrumentation is transparent
// (they are bit-identical). Steps left out of --dump-steps run with the callback answering "no", which
// computes each graph in one piece, as without it.
//
// Which attention the CPU backend runs (ggml-cpu/ops.cpp, this revision): the cache window n_kv is padded
// to a multiple of 256 cells; FLASH_ATTN_EXT with an f16 cache rounds Q to f16 for the K dot products and
// accumulates V*softmax in an f16 buffer (online softmax, one query row at a time) while the ubatch has
// fewer than 64 tokens and n_kv < 512; a ubatch of >= 64 tokens takes the tiled path (GGML_FA_TILE_Q = 64),
// and a 1-token decode with n_kv >= 512 the split-KV path, whose per-thread chunks (so its roundings)
// depend on n_threads.
//
// What llama-server (common/common.cpp's common_model_params_to_llama / common_context_params_to_llama,
// tools/server/server.cpp and server-context.cpp) passes for
//   llama-server -m M --no-repack --threads 2 --ctx-size 4096 --parallel 1
// and is mirrored here:
//   model:   use_extra_bufts = false (--no-repack sets common_params.no_extra_bufts), n_gpu_layers = 0 (CPU
//            only; the server's -1 "auto" offloads nothing without a GPU), load_mode AUTO (mmap), no
//            check_tensors, no kv/tensor-buffer overrides, load_mtp false.
//   context: n_ctx 4096, n_seq_max 1 (--parallel 1; an explicit --parallel leaves kv_unified false),
//            n_batch 2048, n_ubatch 512, n_threads = n_threads_batch = 2 (no -tb), n_rs_seq 0 (no
//            speculative decoding), n_outputs_max 1 and n_outputs_max_per_seq 1 (server_output_limits:
//            n_parallel * (1 + n_draft=0)), flash_attn_type AUTO (CPU resolves it to enabled), type_k =
//            type_v = F16, offload_kqv true, op_offload true, swa_full false, kv_unified false, no_perf
//            false, embeddings false, pooling/attention/rope/yarn left "from the model" (0 / -1 / unspecified).
//   runtime: a ggml threadpool of n_threads (default priority, poll 50, no affinity) attached for both
//            generation and batch (common_threadpools::init: the two params match, so one pool); the
//            warmup decode of [BOS, EOS] followed by llama_memory_clear (common_init_from_params), not
//            dumped; greedy sampling = argmax (first index on ties, like llama_sampler_init_greedy).
// The server decodes with llama_process on a llama_batch_ext; this uses llama_decode on a llama_batch with
// the same tokens, positions, sequence 0 and output flags.

#include "ggml-backend.h"
#include "ggml-cpu.h"
#include "ggml.h"
#include "llama.h"

#include <algorithm>
#include <cerrno>
#include <cctype>
#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <set>
#include <string>
#include <sys/stat.h>
#include <vector>

namespace {

struct options {
    std::string model;
    std::vector<llama_token> tokens;
    int n_gen = 4;
    std::string out;
    int threads = 2;
    int ctx = 4096;
    llama_flash_attn_type fa = LLAMA_FLASH_ATTN_TYPE_AUTO;
    bool dump_all = true;
    std::set<int> dump_steps;  // used when !dump_all
    bool use_cb = true;        // false for --dump-steps none: no cb_eval at all
    bool cache_views = false;  // --dump-cache-views: also write the views of the KV cache attention reads
    bool verbose = false;
};

struct dump_state {
    std::string dir;
    FILE * index = nullptr;
    int step = 0;
    int idx = 0;
    bool enabled = false;
    bool saw_flash_attn = false;
    bool saw_soft_max = false;
    size_t n_files = 0;
    size_t n_bytes = 0;
    size_t n_views = 0;
    size_t n_noncontig = 0;
    std::vector<uint8_t> raw;
    std::vector<uint8_t> out;
    bool cache_views = false;
    size_t n_skipped = 0;
    bool failed = false;
};

[[noreturn]] void die(const char * fmt, const char * arg) {
    fprintf(stderr, "llama-dump: ");
    fprintf(stderr, fmt, arg);
    fprintf(stderr, "\n");
    exit(1);
}

void usage() {
    fprintf(stderr,
            "usage: llama-dump --model PATH --tokens 1,2,3 --n-gen N --out DIR\n"
            "                  [--threads 2] [--ctx 4096] [--fa on|off|auto] [--dump-steps all|none|S,S,...]\n"
            "                  [--dump-cache-views] [--verbose]\n");
}

std::vector<int> parse_int_list(const std::string & s) {
    std::vector<int> v;
    size_t pos = 0;
    while (pos <= s.size()) {
        size_t comma = s.find(',', pos);
        if (comma == std::string::npos) {
            comma = s.size();
        }
        std::string item = s.substr(pos, comma - pos);
        if (!item.empty()) {
            char * end = nullptr;
            errno = 0;
            long x = strtol(item.c_str(), &end, 10);
            if (errno != 0 || *end != '\0' || x < 0 || x > INT32_MAX) {
                die("not a non-negative integer: '%s'", item.c_str());
            }
            v.push_back((int) x);
        }
        pos = comma + 1;
    }
    return v;
}

int parse_int(const char * s) {
    std::vector<int> v = parse_int_list(s);
    if (v.size() != 1) {
        die("expected one integer, got '%s'", s);
    }
    return v[0];
}

options parse_args(int argc, char ** argv) {
    options o;
    for (int i = 1; i < argc; i++) {
        std::string a = argv[i];
        auto value = [&]() -> const char * {
            if (i + 1 >= argc) {
                die("%s needs a value", a.c_str());
            }
            return argv[++i];
        };
        if (a == "--model" || a == "-m") {
            o.model = value();
        } else if (a == "--tokens") {
            for (int t : parse_int_list(value())) {
                o.tokens.push_back((llama_token) t);
            }
        } else if (a == "--n-gen") {
            o.n_gen = parse_int(value());
        } else if (a == "--out") {
            o.out = value();
        } else if (a == "--threads" || a == "-t") {
            o.threads = parse_int(value());
        } else if (a == "--ctx" || a == "-c") {
            o.ctx = parse_int(value());
        } else if (a == "--fa") {
            std::string v = value();
            if (v == "on") {
                o.fa = LLAMA_FLASH_ATTN_TYPE_ENABLED;
            } else if (v == "off") {
                o.fa = LLAMA_FLASH_ATTN_TYPE_DISABLED;
            } else if (v == "auto") {
                o.fa = LLAMA_FLASH_ATTN_TYPE_AUTO;
            } else {
                die("--fa takes on, off or auto, not '%s'", v.c_str());
            }
        } else if (a == "--dump-steps") {
            std::string v = value();
            if (v == "all") {
                o.dump_all = true;
            } else if (v == "none") {
                o.dump_all = false;
                o.use_cb = false;
            } else {
                o.dump_all = false;
                for (int s : parse_int_list(v)) {
                    o.dump_steps.insert(s);
                }
            }
        } else if (a == "--dump-cache-views") {
            o.cache_views = true;
        } else if (a == "--verbose" || a == "-v") {
            o.verbose = true;
        } else if (a == "--help" || a == "-h") {
            usage();
            exit(0);
        } else {
            usage();
            die("unknown argument '%s'", a.c_str());
        }
    }
    if (o.model.empty() || o.tokens.empty() || o.out.empty()) {
        usage();
        die("%s", "--model, --tokens and --out are required");
    }
    if (o.threads < 1 || o.ctx < 1) {
        die("%s", "--threads and --ctx must be positive");
    }
    return o;
}

void make_dir(const std::string & dir) {
    std::string partial;
    for (size_t i = 0; i <= dir.size(); i++) {
        if (i == dir.size() || dir[i] == '/') {
            if (!partial.empty() && mkdir(partial.c_str(), 0755) != 0 && errno != EEXIST) {
                die("cannot create directory %s", partial.c_str());
            }
        }
        if (i < dir.size()) {
            partial += dir[i];
        }
    }
}

std::string sanitize(const char * name) {
    std::string s;
    for (const char * p = name; *p; p++) {
        char c = *p;
        bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '-' ||
                  c == '_' || c == '.';
        s += ok ? c : '_';
    }
    if (s.empty()) {
        s = "unnamed";
    }
    return s;
}

// Converts one element at p (of a non-quantized type) and appends it to out.
void append_element(ggml_type type, const uint8_t * p, std::vector<uint8_t> & out) {
    switch (type) {
        case GGML_TYPE_F32: {
            out.insert(out.end(), p, p + 4);
        } break;
        case GGML_TYPE_F16: {
            ggml_fp16_t h;
            memcpy(&h, p, sizeof(h));
            float f = ggml_fp16_to_fp32(h);
            const uint8_t * fb = reinterpret_cast<const uint8_t *>(&f);
            out.insert(out.end(), fb, fb + 4);
        } break;
        case GGML_TYPE_BF16: {
            ggml_bf16_t h;
            memcpy(&h, p, sizeof(h));
            float f = ggml_bf16_to_fp32(h);
            const uint8_t * fb = reinterpret_cast<const uint8_t *>(&f);
            out.insert(out.end(), fb, fb + 4);
        } break;
        default: {  // integer types: native width, unchanged
            size_t sz = ggml_type_size(type);
            out.insert(out.end(), p, p + sz);
        } break;
    }
}

std::string type_label(ggml_type type) {
    std::string name = ggml_type_name(type);
    if (type == GGML_TYPE_F32) {
        return name;
    }
    if (type == GGML_TYPE_F16 || type == GGML_TYPE_BF16) {
        return name + ">f32";
    }
    return name + ":raw";
}

void write_file(dump_state * st, const std::string & file, const std::vector<uint8_t> & data) {
    std::string path = st->dir + "/" + file;
    FILE * f = fopen(path.c_str(), "wb");
    if (!f || (data.size() && fwrite(data.data(), 1, data.size(), f) != data.size()) || fclose(f) != 0) {
        fprintf(stderr, "llama-dump: cannot write %s\n", path.c_str());
        st->failed = true;
        return;
    }
    st->n_bytes += data.size();
}

bool is_view_op(ggml_op op) {
    return op == GGML_OP_VIEW || op == GGML_OP_RESHAPE || op == GGML_OP_PERMUTE || op == GGML_OP_TRANSPOSE;
}

// True for a view (of a view...) of a tensor no graph computes: in practice a layer's KV cache.
bool is_view_of_leaf(const ggml_tensor * t) {
    if (!is_view_op(t->op) || !t->view_src) {
        return false;
    }
    const ggml_tensor * base = t->view_src;
    while (base->view_src) {
        base = base->view_src;
    }
    return base->op == GGML_OP_NONE;
}

// "Qcur-12 (view) (permuted)" -> 12; -1 when the name has no layer number.
int layer_of(const char * name) {
    std::string s = name;
    size_t paren = s.find(" (");
    if (paren != std::string::npos) {
        s = s.substr(0, paren);
    }
    size_t i = s.size();
    while (i > 0 && s[i - 1] >= '0' && s[i - 1] <= '9') {
        i--;
    }
    if (i == s.size() || i == 0 || (s[i - 1] != '-' && !(s[i - 1] == 'l' && i >= 2 && s[i - 2] == '_'))) {
        return -1;
    }
    return atoi(s.c_str() + i);
}

// ggml names the nodes llama.cpp left unnamed "node_<index in graph>" (this revision leaves the flash
// attention output unnamed: older ones called it __fattn__-<layer>). Label those after their op and first
// source so that the index says what they are; named nodes keep their name.
std::string label_of(const ggml_tensor * t) {
    std::string name = t->name;
    bool auto_named = name.empty();
    if (name.rfind("node_", 0) == 0 && name.size() > 5) {
        auto_named = name.find_first_not_of("0123456789", 5) == std::string::npos;
    }
    if (!auto_named) {
        return name;
    }
    const ggml_tensor * src = t->src[0];
    if (t->op == GGML_OP_FLASH_ATTN_EXT) {
        int il = src ? layer_of(src->name) : -1;
        return il >= 0 ? "__fattn__-" + std::to_string(il) : "__fattn__";
    }
    std::string op = ggml_op_desc(t);
    for (char & c : op) {
        c = (char) tolower((unsigned char) c);
    }
    return src && src->name[0] ? op + "(" + src->name + ")" : op;
}

void dump_tensor(dump_state * st, ggml_tensor * t) {
    const int idx = st->idx++;
    if (t->op == GGML_OP_FLASH_ATTN_EXT) {
        st->saw_flash_attn = true;
    }
    if (t->op == GGML_OP_SOFT_MAX) {
        st->saw_soft_max = true;
    }

    const std::string name = label_of(t);
    char prefix[64];
    snprintf(prefix, sizeof(prefix), "step%03d-%04d-", st->step, idx);
    std::string file = std::string(prefix) + sanitize(name.c_str()) + ".bin";

    std::string label = type_label(t->type);
    int64_t ne[4] = { t->ne[0], t->ne[1], t->ne[2], t->ne[3] };
    std::vector<uint8_t> & out = st->out;
    out.clear();

    const bool has_buffer = t->buffer != nullptr || (t->view_src && t->view_src->buffer != nullptr);
    const bool skip = !st->cache_views && is_view_of_leaf(t);
    if (skip) {
        // the KV-cache window attention reads (n_kv cells, stale ones included): what SET_ROWS stored
        // there is dumped already; --dump-cache-views writes these too
        label += ":skipped";
        file = "-";
    } else if (!has_buffer || t->data == nullptr) {
        label += ":nodata";
        for (int d = 0; d < 4; d++) {
            ne[d] = 0;
        }
    } else if (t->op == GGML_OP_SET_ROWS && !ggml_is_quantized(t->type)) {
        // The node is the whole destination (a layer's KV cache): read back only the rows written.
        const ggml_tensor * src = t->src[0];
        const ggml_tensor * ids = t->src[1];
        std::vector<uint8_t> id_bytes(ggml_nbytes(ids));
        ggml_backend_tensor_get(ids, id_bytes.data(), 0, id_bytes.size());
        const size_t esz = ggml_type_size(t->type);
        std::vector<uint8_t> row(t->ne[0] * esz);
        for (int64_t i03 = 0; i03 < src->ne[3]; i03++) {
            for (int64_t i02 = 0; i02 < src->ne[2]; i02++) {
                for (int64_t i = 0; i < src->ne[1]; i++) {
                    const size_t off = i * ids->nb[0] + (i02 % ids->ne[1]) * ids->nb[1] + (i03 % ids->ne[2]) * ids->nb[2];
                    int64_t r;
                    if (ids->type == GGML_TYPE_I64) {
                        memcpy(&r, id_bytes.data() + off, sizeof(int64_t));
                    } else {
                        int32_t r32;
                        memcpy(&r32, id_bytes.data() + off, sizeof(int32_t));
                        r = r32;
                    }
                    for (int64_t i0 = 0; i0 < t->ne[0]; i0++) {
                        // a row may be strided only if nb[0] != esz (not for KV caches); read element-wise
                        ggml_backend_tensor_get(t, row.data() + i0 * esz, r * t->nb[1] + i02 * t->nb[2] + i03 * t->nb[3] + i0 * t->nb[0], esz);
                    }
                    for (int64_t i0 = 0; i0 < t->ne[0]; i0++) {
                        append_element(t->type, row.data() + i0 * esz, out);
                    }
                }
            }
        }
        label += ":setrows";
        for (int d = 0; d < 4; d++) {
            ne[d] = src->ne[d];
        }
        ne[0] = t->ne[0];
    } else {
        const size_t nbytes = ggml_nbytes(t);  // for a strided view: the span from first to last element
        std::vector<uint8_t> & raw = st->raw;
        raw.resize(nbytes);
        ggml_backend_tensor_get(t, raw.data(), 0, nbytes);
        if (ggml_is_quantized(t->type)) {
            out = raw;  // blocks as stored
        } else if (t->type == GGML_TYPE_F32 && ggml_is_contiguous(t)) {
            out = raw;
        } else {
            const size_t esz = ggml_type_size(t->type);
            out.reserve(ggml_nelements(t) * std::max<size_t>(esz, 4));
            for (int64_t i3 = 0; i3 < t->ne[3]; i3++) {
                for (int64_t i2 = 0; i2 < t->ne[2]; i2++) {
                    for (int64_t i1 = 0; i1 < t->ne[1]; i1++) {
                        const uint8_t * rowp = raw.data() + i1 * t->nb[1] + i2 * t->nb[2] + i3 * t->nb[3];
                        for (int64_t i0 = 0; i0 < t->ne[0]; i0++) {
                            append_element(t->type, rowp + i0 * t->nb[0], out);
                        }
                    }
                }
            }
        }
    }

    if (skip) {
        st->n_skipped++;
    } else {
        write_file(st, file, out);
        st->n_files++;
        st->n_views += is_view_op(t->op) ? 1 : 0;
        st->n_noncontig += ggml_is_contiguous(t) ? 0 : 1;
    }
    fprintf(st->index, "%d\t%d\t%s\t%s\t%s\t%" PRId64 ",%" PRId64 ",%" PRId64 ",%" PRId64 "\t%s\n", st->step, idx,
            name.c_str(), ggml_op_desc(t), label.c_str(), ne[0], ne[1], ne[2], ne[3], file.c_str());
}

bool eval_callback(ggml_tensor * t, bool ask, void * user_data) {
    dump_state * st = static_cast<dump_state *>(user_data);
    if (ask) {
        return st->enabled;  // true: compute up to this node and call back with its data
    }
    if (st->enabled) {
        dump_tensor(st, t);
    }
    return true;  // false would abort the graph
}

bool g_verbose = false;

void log_callback(ggml_log_level level, const char * text, void *) {
    if (g_verbose || level == GGML_LOG_LEVEL_WARN || level == GGML_LOG_LEVEL_ERROR) {
        fputs(text, stderr);
    }
}

llama_token argmax(const float * logits, int n) {
    int best = 0;
    for (int i = 1; i < n; i++) {
        if (logits[i] > logits[best]) {
            best = i;
        }
    }
    return best;
}

}  // namespace

int main(int argc, char ** argv) {
    options opt = parse_args(argc, argv);
    g_verbose = opt.verbose;
    make_dir(opt.out);

    llama_log_set(log_callback, nullptr);
    llama_backend_init();

    llama_model_params mparams = llama_model_default_params();
    mparams.n_gpu_layers = 0;
    mparams.use_extra_bufts = false;  // --no-repack
    mparams.check_tensors = false;
    mparams.no_host = false;
    mparams.load_mtp = false;

    llama_model * model = llama_model_load_from_file(opt.model.c_str(), mparams);
    if (!model) {
        die("cannot load model %s", opt.model.c_str());
    }
    const llama_vocab * vocab = llama_model_get_vocab(model);
    const int n_vocab = llama_vocab_n_tokens(vocab);
    for (llama_token t : opt.tokens) {
        if (t < 0 || t >= n_vocab) {
            die("token id out of range: %s", std::to_string(t).c_str());
        }
    }

    dump_state st;
    st.dir = opt.out;
    st.cache_views = opt.cache_views;

    llama_context_params cparams = llama_context_default_params();
    cparams.n_ctx = (uint32_t) opt.ctx;
    cparams.n_batch = 2048;
    cparams.n_ubatch = 512;
    cparams.n_seq_max = 1;
    cparams.n_rs_seq = 0;
    cparams.n_outputs_max = 1;
    cparams.n_outputs_max_per_seq = 1;
    cparams.n_threads = opt.threads;
    cparams.n_threads_batch = opt.threads;
    cparams.flash_attn_type = opt.fa;
    cparams.type_k = GGML_TYPE_F16;
    cparams.type_v = GGML_TYPE_F16;
    cparams.embeddings = false;
    cparams.offload_kqv = true;
    cparams.no_perf = false;
    cparams.op_offload = true;
    cparams.swa_full = false;
    cparams.kv_unified = false;
    if (opt.use_cb) {
        cparams.cb_eval = eval_callback;
        cparams.cb_eval_user_data = &st;
    }

    llama_context * ctx = llama_init_from_model(model, cparams);
    if (!ctx) {
        die("%s", "cannot create the context");
    }

    ggml_threadpool_params tpp;
    ggml_threadpool_params_init(&tpp, opt.threads);
    ggml_threadpool * threadpool = ggml_threadpool_new(&tpp);
    if (!threadpool) {
        die("%s", "cannot create the threadpool");
    }
    llama_attach_threadpool(ctx, threadpool, nullptr);

    // warmup, as common_init_from_params does for the server (not dumped)
    {
        std::vector<llama_token> tmp;
        if (llama_vocab_bos(vocab) != LLAMA_TOKEN_NULL) {
            tmp.push_back(llama_vocab_bos(vocab));
        }
        if (llama_vocab_eos(vocab) != LLAMA_TOKEN_NULL) {
            tmp.push_back(llama_vocab_eos(vocab));
        }
        if (tmp.empty()) {
            tmp.push_back(0);
        }
        if (llama_decode(ctx, llama_batch_get_one(tmp.data(), (int32_t) tmp.size())) != 0) {
            die("%s", "warmup decode failed");
        }
        llama_memory_clear(llama_get_memory(ctx), true);
        llama_synchronize(ctx);
        llama_perf_context_reset(ctx);
    }

    {
        std::string path = opt.out + "/params.txt";
        FILE * f = fopen(path.c_str(), "w");
        if (!f) {
            die("cannot write %s", path.c_str());
        }
        fprintf(f, "model\t%s\n", opt.model.c_str());
        fprintf(f, "prompt_tokens\t");
        for (size_t i = 0; i < opt.tokens.size(); i++) {
            fprintf(f, "%s%d", i ? "," : "", opt.tokens[i]);
        }
        fprintf(f, "\nn_gen\t%d\nthreads\t%d\nn_ctx\t%u\nn_batch\t%u\nn_ubatch\t%u\nflash_attn_type\t%s\n", opt.n_gen,
                opt.threads, llama_n_ctx(ctx), llama_n_batch(ctx), llama_n_ubatch(ctx),
                llama_flash_attn_type_name(opt.fa));
        fprintf(f, "use_extra_bufts\t0\nn_gpu_layers\t0\ntype_k\tf16\ntype_v\tf16\nn_vocab\t%d\n", n_vocab);
        fclose(f);
    }

    std::string index_path = opt.out + "/index.tsv";
    st.index = fopen(index_path.c_str(), "w");
    if (!st.index) {
        die("cannot write %s", index_path.c_str());
    }
    fprintf(st.index, "step\tidx\tname\top\ttype\tne\tfile\n");

    const int n_prompt = (int) opt.tokens.size();
    if (n_prompt + opt.n_gen > (int) llama_n_ctx(ctx)) {
        die("%s", "prompt + n-gen exceeds the context");
    }
    if (n_prompt > (int) llama_n_batch(ctx)) {
        die("%s", "the prompt is longer than n_batch (2048): the server would split it into several decodes");
    }

    llama_batch batch = llama_batch_init(std::max(n_prompt, 1), 0, 1);
    std::vector<llama_token> generated;
    int n_past = 0;
    bool saw_fa = false;
    bool saw_softmax = false;

    for (int step = 0; step <= opt.n_gen; step++) {
        batch.n_tokens = 0;
        if (step == 0) {
            for (int i = 0; i < n_prompt; i++) {
                batch.token[i] = opt.tokens[i];
                batch.pos[i] = i;
                batch.n_seq_id[i] = 1;
                batch.seq_id[i][0] = 0;
                batch.logits[i] = (i == n_prompt - 1);
            }
            batch.n_tokens = n_prompt;
        } else {
            batch.token[0] = generated.back();
            batch.pos[0] = n_past;
            batch.n_seq_id[0] = 1;
            batch.seq_id[0][0] = 0;
            batch.logits[0] = 1;
            batch.n_tokens = 1;
        }

        st.step = step;
        st.idx = 0;
        st.enabled = opt.use_cb && (opt.dump_all || opt.dump_steps.count(step) > 0);
        st.saw_flash_attn = false;
        st.saw_soft_max = false;

        int ret = llama_decode(ctx, batch);
        if (ret != 0) {
            die("llama_decode failed at step %s", std::to_string(step).c_str());
        }
        llama_synchronize(ctx);
        fflush(st.index);
        saw_fa = saw_fa || st.saw_flash_attn;
        saw_softmax = saw_softmax || st.saw_soft_max;
        n_past += batch.n_tokens;

        const float * logits = llama_get_logits_ith(ctx, -1);
        if (!logits) {
            die("no logits at step %s", std::to_string(step).c_str());
        }
        {
            std::string path = opt.out + "/logits-step" + std::to_string(step) + ".bin";
            FILE * f = fopen(path.c_str(), "wb");
            if (!f || fwrite(logits, sizeof(float), n_vocab, f) != (size_t) n_vocab || fclose(f) != 0) {
                die("cannot write %s", path.c_str());
            }
        }
        if (step < opt.n_gen) {
            generated.push_back(argmax(logits, n_vocab));
        }
        if (st.failed) {
            die("%s", "failed writing the dump");
        }
    }
    fclose(st.index);
    llama_batch_free(batch);

    {
        std::string path = opt.out + "/tokens.txt";
        FILE * f = fopen(path.c_str(), "w");
        if (!f) {
            die("cannot write %s", path.c_str());
        }
        for (llama_token t : generated) {
            fprintf(f, "%d\n", t);
        }
        fclose(f);
    }

    fprintf(stderr,
            "llama-dump: %zu tensors, %.1f MiB in %s (%zu of them views, %zu non-contiguous, gathered); "
            "%zu KV-cache views indexed, not written; attention: %s\n",
            st.n_files, st.n_bytes / 1048576.0, opt.out.c_str(), st.n_views, st.n_noncontig, st.n_skipped,
            !opt.use_cb     ? "not observed (--dump-steps none)" :
            saw_fa          ? "FLASH_ATTN_EXT" :
            saw_softmax     ? "MUL_MAT + SOFT_MAX (no flash attention)" :
                              "not observed");
    for (size_t i = 0; i < generated.size(); i++) {
        printf("%s%d", i ? "," : "", generated[i]);
    }
    printf("\n");

    llama_free(ctx);
    ggml_threadpool_free(threadpool);
    llama_model_free(model);
    llama_backend_free();
    return 0;
}
