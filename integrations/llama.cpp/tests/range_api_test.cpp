// The position-range KV API of llama-kv-range.patch (llama_kv_range_desc / _get / _set), on a real
// model, on the CPU: run by range_api_test.sh (under AddressSanitizer + UBSan, with libllama's two
// patched files instrumented). With flash attention off (V transposed) and on:
// - positions exported from one context and imported into a fresh one, in several calls, give the
//   very logits (max difference 0) of the source for the tokens decoded after them;
// - a payload of several blocks equals the blocks exported one by one (the block layout holds);
// - an import into one sequence leaves the other sequence's KV byte for byte as it was;
// - every refusal (descriptor of another layout or version, bad range, block size or payload size,
//   positions the sequence lacks, a gap before p0, no room) returns its status and changes nothing.
//
//   range_api_test MODEL.gguf [N_GPU_LAYERS]   (default 0: the CPU; 99 on a GPU build: the KV
//                                              cache on the device, the copies the backend's)
#include "llama.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

static int failures = 0;
#define CHECK(cond)                                                               \
    do {                                                                          \
        if (!(cond)) {                                                            \
            std::fprintf(stderr, "FAIL %s:%d: %s\n", __FILE__, __LINE__, #cond); \
            failures++;                                                           \
        }                                                                         \
    } while (0)

namespace {

constexpr uint32_t BT = 16;  // positions per block

void quiet(ggml_log_level level, const char * text, void *) {
    if (level >= GGML_LOG_LEVEL_WARN) {
        std::fputs(text, stderr);
    }
}

struct ctx_ptr {
    llama_context * c = nullptr;
    ~ctx_ptr() { llama_free(c); }
};

llama_context * make_ctx(llama_model * model, bool fa, uint32_t n_ctx, ggml_type type_k = GGML_TYPE_F16) {
    llama_context_params p = llama_context_default_params();
    p.n_ctx                = n_ctx;
    p.n_batch              = 256;
    p.n_ubatch             = 256;
    p.n_seq_max            = 2;
    p.n_threads            = 2;
    p.n_threads_batch      = 2;
    p.kv_unified           = true;
    p.flash_attn_type      = fa ? LLAMA_FLASH_ATTN_TYPE_ENABLED : LLAMA_FLASH_ATTN_TYPE_DISABLED;
    p.type_k               = type_k;
    p.type_v               = GGML_TYPE_F16;
    p.no_perf              = true;
    return llama_init_from_model(model, p);
}

// decode tokens[from, to) into seq at positions from..to-1; the last token's logits into `logits`
bool decode(llama_context * ctx, const std::vector<llama_token> & tokens, size_t from, size_t to, llama_seq_id seq,
            std::vector<float> * logits = nullptr) {
    llama_batch b = llama_batch_init(int32_t(to - from), 0, 1);
    for (size_t i = from; i < to; i++) {
        const int32_t j = int32_t(i - from);
        b.token[j]      = tokens[i];
        b.pos[j]        = llama_pos(i);
        b.n_seq_id[j]   = 1;
        b.seq_id[j][0]  = seq;
        b.logits[j]     = i + 1 == to;
    }
    b.n_tokens   = int32_t(to - from);
    const bool ok = llama_decode(ctx, b) == 0;
    if (ok && logits != nullptr) {
        const int     n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(llama_get_model(ctx)));
        const float * l       = llama_get_logits_ith(ctx, -1);
        logits->assign(l, l + n_vocab);
    }
    llama_batch_free(b);
    return ok;
}

std::vector<uint8_t> desc_of(llama_context * ctx) {
    std::vector<uint8_t> d(llama_kv_range_desc(ctx, nullptr, 0));
    if (!d.empty()) {
        CHECK(llama_kv_range_desc(ctx, d.data(), d.size()) == d.size());
    }
    return d;
}

// positions [p0, p1) of seq, exported (empty when refused)
std::vector<uint8_t> get(llama_context * ctx, const std::vector<uint8_t> & d, llama_seq_id seq, llama_pos p0, llama_pos p1,
                         uint32_t n_block = BT) {
    std::vector<uint8_t> out(size_t(p1 - p0) * llama_kv_range_token_size(ctx));
    const int32_t st = llama_kv_range_get(ctx, seq, p0, p1, n_block, d.data(), d.size(), out.data(), out.size());
    CHECK(st == LLAMA_KV_RANGE_OK);
    return st == LLAMA_KV_RANGE_OK ? out : std::vector<uint8_t>();
}

// the caller's copy of llama_kv_range_*_with over host memory: each piece row by row, counted;
// `fail_at`: the piece (0-based) it refuses, -1 for none
struct copies {
    size_t calls   = 0;
    size_t bytes   = 0;
    long   fail_at = -1;
};

bool host_copy(void * user_data, void * dst, size_t dst_pitch, const void * src, size_t src_pitch, size_t width,
               size_t height) {
    auto * c = static_cast<copies *>(user_data);
    if (c->fail_at >= 0 && c->calls == size_t(c->fail_at)) {
        return false;
    }
    c->calls++;
    for (size_t r = 0; r < height; r++) {
        std::memcpy(static_cast<uint8_t *>(dst) + r * dst_pitch, static_cast<const uint8_t *>(src) + r * src_pitch, width);
    }
    c->bytes += width * height;
    return true;
}

float max_diff(const std::vector<float> & a, const std::vector<float> & b) {
    if (a.size() != b.size() || a.empty()) {
        return INFINITY;
    }
    float m = 0;
    for (size_t i = 0; i < a.size(); i++) {
        m = std::fmax(m, std::fabs(a[i] - b[i]));
    }
    return m;
}

void run(llama_model * model, const std::vector<llama_token> & tokens, bool fa) {
    std::printf("range_api_test: flash attention %s\n", fa ? "on (V rows)" : "off (V transposed)");
    const size_t n = tokens.size();  // 80: 4 blocks imported, 16 tokens decoded after them
    ctx_ptr      a{ make_ctx(model, fa, 512) };
    ctx_ptr      b{ make_ctx(model, fa, 512) };
    CHECK(a.c != nullptr && b.c != nullptr);
    if (a.c == nullptr || b.c == nullptr) {
        return;
    }
    const std::vector<uint8_t> d = desc_of(a.c);
    CHECK(!d.empty() && d == desc_of(b.c));
    const size_t tb = llama_kv_range_token_size(a.c);
    CHECK(tb > 0);
    uint32_t trans = 0;
    std::memcpy(&trans, d.data() + 12, 4);
    CHECK(trans == (fa ? 0u : 1u));

    // the source: the first 4 blocks, then the rest (the logits compared are the rest's)
    const size_t       p = 4 * BT;
    std::vector<float> want, got;
    CHECK(decode(a.c, tokens, 0, p, 0) && decode(a.c, tokens, p, n, 0, &want));

    // a payload of several blocks is those blocks one after another
    const std::vector<uint8_t> all = get(a.c, d, 0, 0, llama_pos(p));
    CHECK(all.size() == p * tb);
    for (uint32_t k = 0; k < 4; k++) {
        const std::vector<uint8_t> one = get(a.c, d, 0, llama_pos(k * BT), llama_pos((k + 1) * BT));
        CHECK(one.size() == BT * tb && std::memcmp(one.data(), all.data() + k * BT * tb, one.size()) == 0);
    }
    // one block of 32 positions is not two blocks of 16 (the layout is per block), unless there is one layer
    const std::vector<uint8_t> wide = get(a.c, d, 0, 0, 2 * BT, 2 * BT);
    CHECK(wide.size() == 2 * BT * tb && std::memcmp(wide.data(), all.data(), wide.size()) != 0);

    // imported in two calls (blocks 0-1, then 2-3), then the rest decoded: the source's logits
    CHECK(llama_kv_range_set(b.c, 0, 0, 2 * BT, BT, d.data(), d.size(), all.data(), 2 * BT * tb) == LLAMA_KV_RANGE_OK);
    CHECK(llama_kv_range_set(b.c, 0, 2 * BT, llama_pos(p), BT, d.data(), d.size(), all.data() + 2 * BT * tb, 2 * BT * tb) ==
          LLAMA_KV_RANGE_OK);
    CHECK(llama_memory_seq_pos_max(llama_get_memory(b.c), 0) == llama_pos(p) - 1);
    CHECK(get(b.c, d, 0, 0, llama_pos(p)) == all);
    CHECK(decode(b.c, tokens, p, n, 0, &got));
    const float diff = max_diff(want, got);
    std::printf("range_api_test: logits after an imported prefix of %zu positions: max diff %g\n", p, double(diff));
    CHECK(diff == 0.0f);

    // the caller's copy (llama_kv_range_get_with / _set_with): the same pieces, each handed to it,
    // exactly the payload's bytes; on a GPU they are device addresses (device_store_test covers them)
    char         dev[64] = {};
    const size_t dev_len = llama_kv_range_device(a.c, dev, sizeof dev);
    std::printf("range_api_test: the KV cache's device: %s\n", dev_len > 0 ? dev : "none (host memory)");
    CHECK(dev_len == std::strlen(dev));
    if (dev_len == 0) {
        copies               cg;
        std::vector<uint8_t> via(all.size(), 0xA5);
        CHECK(llama_kv_range_get_with(a.c, 0, 0, llama_pos(p), BT, d.data(), d.size(), via.data(), via.size(), host_copy,
                                      &cg) == LLAMA_KV_RANGE_OK);
        CHECK(via == all && cg.calls > 0 && cg.bytes == all.size());
        ctx_ptr e{ make_ctx(model, fa, 512) };
        CHECK(e.c != nullptr);
        if (e.c != nullptr) {
            // a copy that fails mid-range: FAILED, and the range is gone again
            copies cf;
            cf.fail_at = 3;
            CHECK(llama_kv_range_set_with(e.c, 0, 0, llama_pos(p), BT, d.data(), d.size(), all.data(), all.size(),
                                          host_copy, &cf) == LLAMA_KV_RANGE_FAILED);
            CHECK(cf.calls == 3 && llama_memory_seq_pos_max(llama_get_memory(e.c), 0) == -1);
            // no copy function, or the checks of llama_kv_range_set: nothing changes
            CHECK(llama_kv_range_set_with(e.c, 0, 0, llama_pos(p), BT, d.data(), d.size(), all.data(), all.size(), nullptr,
                                          nullptr) == LLAMA_KV_RANGE_INVALID);
            CHECK(llama_kv_range_get_with(a.c, 0, 0, llama_pos(p), BT, d.data(), d.size(), via.data(), via.size(), nullptr,
                                          nullptr) == LLAMA_KV_RANGE_INVALID);
            copies cs;
            CHECK(llama_kv_range_set_with(e.c, 0, 0, llama_pos(p), BT, d.data(), d.size() - 1, all.data(), all.size(),
                                          host_copy, &cs) == LLAMA_KV_RANGE_MISMATCH && cs.calls == 0);
            // imported through the caller's copy, then the rest decoded: the source's logits
            CHECK(llama_kv_range_set_with(e.c, 0, 0, llama_pos(p), BT, d.data(), d.size(), all.data(), all.size(),
                                          host_copy, &cs) == LLAMA_KV_RANGE_OK);
            CHECK(cs.bytes == all.size() && cs.calls == cg.calls);
            CHECK(get(e.c, d, 0, 0, llama_pos(p)) == all);
            std::vector<float> got_with;
            CHECK(decode(e.c, tokens, p, n, 0, &got_with));
            CHECK(max_diff(want, got_with) == 0.0f);
        }
    }

    // another context whose other sequence holds other tokens first: an import into sequence 0
    // leaves sequence 1's KV byte for byte as it was
    ctx_ptr c{ make_ctx(model, fa, 512) };
    CHECK(c.c != nullptr);
    if (c.c == nullptr) {
        return;
    }
    std::vector<llama_token> other(tokens.rbegin(), tokens.rend());
    CHECK(decode(c.c, other, 0, 2 * BT, 1));
    const std::vector<uint8_t> other_before = get(c.c, d, 1, 0, 2 * BT);
    CHECK(llama_kv_range_set(c.c, 0, 0, llama_pos(p), BT, d.data(), d.size(), all.data(), all.size()) == LLAMA_KV_RANGE_OK);
    CHECK(get(c.c, d, 0, 0, llama_pos(p)) == all);
    CHECK(get(c.c, d, 1, 0, 2 * BT) == other_before);

    // an import at p0 replaces the sequence's positions from p0 on, and only those
    CHECK(llama_kv_range_set(b.c, 0, 3 * BT, 4 * BT, BT, d.data(), d.size(), all.data() + 3 * BT * tb, BT * tb) ==
          LLAMA_KV_RANGE_OK);
    CHECK(llama_memory_seq_pos_max(llama_get_memory(b.c), 0) == 4 * BT - 1);
    CHECK(get(b.c, d, 0, 0, llama_pos(p)) == all);

    // refusals: each returns its status and changes nothing
    const std::vector<uint8_t> before = get(b.c, d, 0, 0, llama_pos(p));
    auto                       set    = [&](llama_seq_id s, llama_pos p0, llama_pos p1, uint32_t nb, const std::vector<uint8_t> & dd,
                      size_t size) {
        return llama_kv_range_set(b.c, s, p0, p1, nb, dd.data(), dd.size(), all.data(), size);
    };
    std::vector<uint8_t> wrong = d;
    wrong[16] ^= 1;  // layer 0's K type
    CHECK(set(0, 4 * BT, 5 * BT, BT, wrong, BT * tb) == LLAMA_KV_RANGE_MISMATCH);
    std::vector<uint8_t> version = d;
    version[4] ^= 2;
    CHECK(set(0, 4 * BT, 5 * BT, BT, version, BT * tb) == LLAMA_KV_RANGE_MISMATCH);
    CHECK(set(0, 4 * BT, 5 * BT, BT, std::vector<uint8_t>(d.begin(), d.end() - 1), BT * tb) == LLAMA_KV_RANGE_MISMATCH);
    CHECK(set(0, 4 * BT, 5 * BT, BT, d, BT * tb - 1) == LLAMA_KV_RANGE_INVALID);  // payload size
    CHECK(set(0, 4 * BT, 5 * BT, 3, d, BT * tb) == LLAMA_KV_RANGE_INVALID);       // block size
    CHECK(set(0, 5 * BT, 4 * BT, BT, d, BT * tb) == LLAMA_KV_RANGE_INVALID);      // p1 < p0
    CHECK(set(-1, 4 * BT, 5 * BT, BT, d, BT * tb) == LLAMA_KV_RANGE_INVALID);     // sequence id
    CHECK(set(7, 4 * BT, 5 * BT, BT, d, BT * tb) == LLAMA_KV_RANGE_INVALID);
    CHECK(set(0, 6 * BT, 7 * BT, BT, d, BT * tb) == LLAMA_KV_RANGE_MISSING);      // a gap before p0
    CHECK(llama_kv_range_set(b.c, 0, 4 * BT, 5 * BT, BT, d.data(), d.size(), nullptr, BT * tb) == LLAMA_KV_RANGE_INVALID);
    CHECK(get(b.c, d, 0, 0, llama_pos(p)) == before);
    CHECK(llama_memory_seq_pos_max(llama_get_memory(b.c), 0) == 4 * BT - 1);
    // export refusals
    std::vector<uint8_t> buf(BT * tb);
    CHECK(llama_kv_range_get(b.c, 0, 4 * BT, 5 * BT, BT, d.data(), d.size(), buf.data(), buf.size()) ==
          LLAMA_KV_RANGE_MISSING);  // positions the sequence does not hold
    CHECK(llama_kv_range_get(b.c, 1, 0, BT, BT, d.data(), d.size(), buf.data(), buf.size()) ==
          LLAMA_KV_RANGE_MISSING);  // a sequence that holds nothing
    CHECK(llama_kv_range_get(b.c, 0, 0, BT, BT, wrong.data(), wrong.size(), buf.data(), buf.size()) == LLAMA_KV_RANGE_MISMATCH);
    CHECK(llama_kv_range_get(b.c, 0, 0, BT, BT, d.data(), d.size(), buf.data(), buf.size() + 1) == LLAMA_KV_RANGE_INVALID);
    CHECK(llama_kv_range_get(b.c, 0, 0, BT, BT, d.data(), d.size(), nullptr, buf.size()) == LLAMA_KV_RANGE_INVALID);
    CHECK(llama_kv_range_get(b.c, 0, 0, 100000, 0, d.data(), d.size(), buf.data(), buf.size()) == LLAMA_KV_RANGE_INVALID);

    // a context whose K type differs has another descriptor: the payload is refused there
    ctx_ptr f32{ make_ctx(model, fa, 512, GGML_TYPE_F32) };
    CHECK(f32.c != nullptr);
    if (f32.c != nullptr) {
        const std::vector<uint8_t> d32 = desc_of(f32.c);
        CHECK(!d32.empty() && d32 != d);
        CHECK(llama_kv_range_set(f32.c, 0, 0, BT, BT, d.data(), d.size(), all.data(), BT * tb) == LLAMA_KV_RANGE_MISMATCH);
        CHECK(llama_memory_seq_pos_max(llama_get_memory(f32.c), 0) == -1);
    }

    // no room: a small cache whose other sequence holds most cells refuses, and changes nothing
    ctx_ptr small{ make_ctx(model, fa, 64) };
    CHECK(small.c != nullptr);
    if (small.c != nullptr) {
        const uint32_t cells = llama_n_ctx(small.c);  // llama.cpp may round the size up
        CHECK(cells >= BT && cells <= 256);
        std::vector<llama_token> fill;
        for (uint32_t i = 0; i + BT / 2 < cells && i < 256; i++) {
            fill.push_back(tokens[i % tokens.size()]);
        }
        for (size_t i = 0; i < fill.size(); i += llama_n_batch(small.c)) {  // n_batch is clamped to n_ctx
            CHECK(decode(small.c, fill, i, std::min(fill.size(), i + llama_n_batch(small.c)), 1));
        }
        CHECK(llama_kv_range_set(small.c, 0, 0, BT, BT, d.data(), d.size(), all.data(), BT * tb) == LLAMA_KV_RANGE_NO_ROOM);
        CHECK(llama_memory_seq_pos_max(llama_get_memory(small.c), 0) == -1);
        CHECK(llama_memory_seq_pos_max(llama_get_memory(small.c), 1) == llama_pos(fill.size()) - 1);
    }
}

}  // namespace

int main(int argc, char ** argv) {
    if (argc != 2 && argc != 3) {
        std::fprintf(stderr, "usage: %s MODEL.gguf [N_GPU_LAYERS]\n", argv[0]);
        return 2;
    }
    llama_log_set(quiet, nullptr);
    llama_backend_init();
    llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers       = argc == 3 ? std::atoi(argv[2]) : 0;
    mp.progress_callback  = [](float, void *) { return true; };  // no progress dots
    llama_model * model   = llama_model_load_from_file(argv[1], mp);
    if (model == nullptr) {
        std::fprintf(stderr, "range_api_test: cannot load %s\n", argv[1]);
        return 2;
    }
    // 80 tokens of text (any text: the check is that imported KV equals computed KV)
    std::string text;
    for (int i = 0; text.size() < 2000; i++) {
        text += "The quick brown fox " + std::to_string(i * 7919 % 1000) + " jumps over the lazy dog. ";
    }
    std::vector<llama_token> tokens(text.size() + 8);
    const llama_vocab *      vocab = llama_model_get_vocab(model);
    int32_t nt = llama_tokenize(vocab, text.c_str(), int32_t(text.size()), tokens.data(), int32_t(tokens.size()), true, false);
    if (nt < 0) {  // more tokens than bytes (a byte-level vocabulary): -nt is how many
        tokens.resize(size_t(-nt));
        nt = llama_tokenize(vocab, text.c_str(), int32_t(text.size()), tokens.data(), int32_t(tokens.size()), true, false);
    }
    CHECK(nt >= int32_t(5 * BT));
    tokens.resize(size_t(std::max(0, std::min(nt, int32_t(5 * BT)))));
    if (tokens.size() == 5 * BT) {
        run(model, tokens, false);
        run(model, tokens, true);
    }
    llama_model_free(model);
    llama_backend_free();
    if (failures != 0) {
        std::fprintf(stderr, "range_api_test: %d check(s) failed\n", failures);
        return 1;
    }
    std::printf("range_api_test: all checks passed\n");
    return 0;
}
