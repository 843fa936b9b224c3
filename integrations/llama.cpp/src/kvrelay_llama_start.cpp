// kvrelay_llama_start.cpp: the process-wide state, the naming identity, the start-up probe, and the
// block store, agent, policy and events the KV path runs on (on_model_loaded).
// Uses kvrelay only through its public C++ header (kvrelay_llama_state.hpp lists the files).
#include "kvrelay_llama_state.hpp"

#include "build-info.h"
#include <algorithm>
#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

#include <sys/stat.h>
#include <unistd.h>

namespace kvrelay_llama {
namespace detail {

kv_runtime * KV = nullptr;

settings & S() {
    static settings s;
    return s;
}

// The one admission edge of the process (kvrelay::Admission is thread-safe). Built on first use,
// after consume_args fixed the trust switch.
const kvrelay::Admission & admission() {
    static const kvrelay::Admission a = [] {
        kvrelay::AdmissionConfig c;
        c.trusted       = S().trusted;
        c.metric_prefix = std::string(METRIC_PREFIX);
        return kvrelay::Admission(c);
    }();
    return a;
}

std::string hex64(uint64_t v) {
    char buf[17];
    snprintf(buf, sizeof buf, "%016" PRIx64, v);
    return buf;
}

std::function<void(size_t)> publish_stored(const kv_runtime & kv, const std::vector<uint64_t> & names,
                                           const llama_tokens & tokens, size_t first) {
    if (!kv.events) {
        return nullptr;
    }
    const kvrelay::KvEvents & ev = *kv.events;
    const size_t              bt = S().block_tokens;
    return [&ev, &names, &tokens, first, bt](size_t i) {
        const size_t b = first + i;
        try {
            // llama_token ids are never negative: read as their unsigned values
            ev.stored(names[b], b > 0 ? &names[b - 1] : nullptr,
                      reinterpret_cast<const uint32_t *>(tokens.data() + b * bt), bt);
        } catch (...) {
            // the publisher refused (stopped): the commit stands, the event is lost
        }
    };
}

std::function<void(uint64_t)> publish_removed(const kv_runtime & kv) {
    if (!kv.events) {
        return nullptr;
    }
    const kvrelay::KvEvents & ev = *kv.events;
    return [&ev](uint64_t name) {
        try {
            ev.removed(name);
        } catch (...) {
        }
    };
}

}  // namespace detail

using namespace detail;

namespace {

// Read the context's KV layout (libllama's range descriptor). Memory the range API does not
// serve (recurrent, hybrid, sliding-window, M-RoPE cells) has none: the KV path stays off.
bool probe_schema(llama_context * ctx, kv_schema & out, std::string & err) {
    const size_t len = llama_kv_range_desc(ctx, nullptr, 0);
    if (len == 0) {
        err = "the context's memory is not a plain KV cache (recurrent, hybrid, sliding-window or M-RoPE "
              "memory has no position-range KV)";
        return false;
    }
    std::vector<uint8_t> desc(len);
    if (llama_kv_range_desc(ctx, desc.data(), desc.size()) != len || !parse_desc(desc.data(), desc.size(), out, err)) {
        if (err.empty()) {
            err = "libllama's KV range descriptor changed while it was read";
        }
        return false;
    }
    if (out.token_bytes() != llama_kv_range_token_size(ctx)) {
        err = "libllama's KV range descriptor does not add up to its bytes per position";
        return false;
    }
    out.block_tokens = S().block_tokens;
    return true;
}

// Where file digests are kept between runs: KVRELAY_CACHE_DIR, else $XDG_CACHE_HOME/kvrelay, else
// $HOME/.cache/kvrelay ("" : nowhere; each start digests the files again).
std::filesystem::path cache_dir() {
    if (const char * d = std::getenv("KVRELAY_CACHE_DIR"); d != nullptr && *d != '\0') {
        return d;
    }
    if (const char * d = std::getenv("XDG_CACHE_HOME"); d != nullptr && *d != '\0') {
        return std::filesystem::path(d) / "kvrelay";
    }
    if (const char * d = std::getenv("HOME"); d != nullptr && *d != '\0') {
        return std::filesystem::path(d) / ".cache" / "kvrelay";
    }
    return {};
}

// The SHA-256 of a file (model, adapter, control vector) as hex: what the identity binds it by.
// Read once per file version: kept in the cache directory under the file's device, inode, size
// and status-change time (ctime), which every write, truncation, rename over it or copy in place
// moves and which no user can set back (a modification time can be: touch -d), so a file
// changed in any way gets a new entry; an entry is used only when the key it records is this
// file's. Throws when the file cannot be read.
std::string file_sha256(const std::string & file) {
    namespace fs = std::filesystem;
    std::error_code ec;
    struct stat     st {};
    const bool      known = ::stat(file.c_str(), &st) == 0;
    const std::string key = "dev=" + std::to_string((unsigned long long) st.st_dev) +
                            "\nino=" + std::to_string((unsigned long long) st.st_ino) +
                            "\nsize=" + std::to_string((long long) st.st_size) +
                            "\nctime=" + std::to_string((long long) st.st_ctim.tv_sec) + "." +
                            std::to_string((long long) st.st_ctim.tv_nsec);
    const fs::path dir    = cache_dir();
    const fs::path entry  = dir.empty() || !known ? fs::path() : dir / "file-sha256" / hex64(kvrelay::Naming::seed_of(key));
    if (!entry.empty()) {
        std::ifstream in(entry);
        std::string   hex;
        if (in && std::getline(in, hex)) {
            const std::string rest((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
            if (hex.size() == 64 && rest == key) {
                return hex;
            }
        }
    }
    const kvrelay::BlockDigest d = kvrelay::file_digest(file);
    std::string                hex;
    for (uint8_t b : d) {
        char two[3];
        snprintf(two, sizeof two, "%02x", b);
        hex += two;
    }
    if (!entry.empty()) {
        // best effort, written whole then renamed: a reader never sees half an entry
        fs::create_directories(entry.parent_path(), ec);
        const fs::path tmp = entry.string() + ".tmp" + std::to_string((long long) getpid());
        {
            std::ofstream out(tmp, std::ios::trunc);
            out << hex << '\n' << key;
        }
        fs::rename(tmp, entry, ec);
        if (ec) {
            fs::remove(tmp, ec);
        }
    }
    return hex;
}

// A float setting as text that tells every value apart (hexadecimal floating point).
std::string exact(double v) {
    char buf[64];
    snprintf(buf, sizeof buf, "%a", v);
    return buf;
}

// Everything the KV of a prompt depends on besides its tokens, as text (the identity's settings
// part): the model by content, every setting that reaches the graph, the KV cache's types, the
// build and where the model runs. Two servers whose identities are equal compute equal KV for
// equal tokens; everything else never exchanges a block (their names and digests differ, and
// their agents refuse each other's fingerprint). Throws when a file cannot be read.
std::string identity_of(const common_params & params, const llama_context * ctx) {
    const settings & s  = S();
    std::string      id = "llama-server/kvrelay-naming-2";
    // the model by content, or by the operator's word
    id += s.model_id.empty() ? ";model_sha256=" + file_sha256(params.model.path) : ";model_id=" + s.model_id;
    for (const auto & lora : params.lora_adapters) {
        id += ";lora_sha256=" + file_sha256(lora.path) + "*" + exact(lora.scale);
    }
    id += std::string(";lora_applied=") + (params.lora_init_without_apply ? "0" : "1");
    for (const auto & cv : params.control_vectors) {
        id += ";cvec_sha256=" + file_sha256(cv.fname) + "*" + exact(cv.strength);
    }
    if (!params.control_vectors.empty()) {
        id += ";cvec_layers=" + std::to_string(params.control_vector_layer_start) + ".." +
              std::to_string(params.control_vector_layer_end);
    }
    for (const llama_model_kv_override & o : params.kv_overrides) {
        if (o.key[0] == '\0') {
            continue;  // the list's terminator
        }
        id += ";override_kv=" + std::string(o.key) + ":";
        switch (o.tag) {
            case LLAMA_KV_OVERRIDE_TYPE_INT:   id += "int:" + std::to_string((long long) o.val_i64); break;
            case LLAMA_KV_OVERRIDE_TYPE_FLOAT: id += "float:" + exact(o.val_f64); break;
            case LLAMA_KV_OVERRIDE_TYPE_BOOL:  id += std::string("bool:") + (o.val_bool ? "1" : "0"); break;
            case LLAMA_KV_OVERRIDE_TYPE_STR:   id += "str:" + std::string(o.val_str); break;
            default:                           id += "tag:" + std::to_string(int(o.tag)); break;
        }
    }
    // RoPE and YaRN as given (0 and -1: the model's own, which its digest binds); K is stored
    // after RoPE
    id += ";rope_freq_base=" + exact(params.rope_freq_base) + ";rope_freq_scale=" + exact(params.rope_freq_scale);
    id += ";rope_scaling=" + std::to_string(int(params.rope_scaling_type));
    id += ";yarn=" + exact(params.yarn_ext_factor) + "," + exact(params.yarn_attn_factor) + "," +
          exact(params.yarn_beta_fast) + "," + exact(params.yarn_beta_slow) + "," + std::to_string(params.yarn_orig_ctx);
    id += std::string(";swa_full=") + (params.swa_full ? "1" : "0");
    // the context per sequence: LongRoPE models (Phi-3/3.5, Phi-4-mini) rotate K with their long
    // or short factors by whether it exceeds the model's original context (which the model's
    // bytes and yarn_orig_ctx above fix), so -c, -np and --kv-unified change K; bound for every
    // model (simplest, and the cost is only that servers of other -c never exchange)
    id += ";n_ctx_seq=" + std::to_string(ctx != nullptr ? llama_n_ctx_seq(ctx) : 0u);
    if (ctx == nullptr) {
        id += ";n_ctx=" + std::to_string(params.n_ctx) + ";n_parallel=" + std::to_string(params.n_parallel) +
              ";kv_unified=" + (params.kv_unified ? "1" : "0");
    }
    // where the KV and the weights live (the CPU's kernels and a GPU's differ in low bits)
    id += std::string(";kv_offload=") + (params.no_kv_offload ? "0" : "1");
    for (const llama_model_tensor_buft_override & o : params.tensor_buft_overrides) {
        if (o.pattern == nullptr) {
            continue;  // padding and the list's terminator
        }
        id += ";tensor_override=" + std::string(o.pattern) + "=" +
              (o.buft != nullptr ? ggml_backend_buft_name(o.buft) : "(none)");
    }
    id += ";build=" + std::string(llama_commit());
    id += ";n_ubatch=" + std::to_string(ctx != nullptr ? llama_n_ubatch(ctx) : (uint32_t) params.n_ubatch);
    id += ";type_k=" + std::string(ggml_type_name(params.cache_type_k));
    id += ";type_v=" + std::string(ggml_type_name(params.cache_type_v));
    id += ";flash_attn=" + std::string(llama_flash_attn_type_name(params.flash_attn_type));
    // where the layers run: the CPU backend, or the GPUs' kind (their kernels' numerics differ)
    id += ";ngl=" + std::to_string(params.n_gpu_layers) + ";split=" + std::to_string(int(params.split_mode));
    std::vector<ggml_backend_dev_t> devs = params.devices;
    if (devs.empty()) {
        for (size_t i = 0; i < ggml_backend_dev_count(); i++) {
            ggml_backend_dev_t d = ggml_backend_dev_get(i);
            const auto         t = ggml_backend_dev_type(d);
            if (t == GGML_BACKEND_DEVICE_TYPE_GPU || t == GGML_BACKEND_DEVICE_TYPE_IGPU) {
                devs.push_back(d);
            }
        }
    }
    for (ggml_backend_dev_t d : devs) {
        if (d != nullptr && params.n_gpu_layers != 0) {
            id += ";device=" + std::string(ggml_backend_dev_name(d)) + ":" + ggml_backend_dev_description(d);
        }
    }
    return id;
}

// The test build's forced name collisions (a build with KVRELAY_LLAMA_TEST_HOOKS defined, which
// build.sh makes with KVRELAY_TEST_HOOKS=1, run with KVRELAY_LLAMA_TEST_NAME_COLLISIONS=1): block
// names ignore the tokens, so any two prompts of one length share every name, as a crafted
// collision would. Digests are untouched: the content check is what the test exercises.
bool forced_collisions() {
#ifdef KVRELAY_LLAMA_TEST_HOOKS
    static const bool on = [] {
        const char * v = std::getenv("KVRELAY_LLAMA_TEST_NAME_COLLISIONS");
        return v != nullptr && std::string(v) == "1";
    }();
    return on;
#else
    return false;
#endif
}

void start_kv(const common_params & params, llama_context * ctx, const kv_schema & schema) {
    const settings & s = S();
    auto             kv = std::make_unique<kv_runtime>();
    kv->schema          = schema;
    const size_t bb     = kv->schema.block_bytes();
    if (bb == 0 || bb % 2 != 0) {
        SRV_ERR("kvrelay: the KV path is off: a block of %zu bytes is not a whole number of K/V halves\n", bb);
        return;
    }
    const size_t blocks = std::max<size_t>(1, (s.pool_mib << 20) / bb);
    // Where the KV lives on a GPU, the store is pinned host memory (the host buffer type of the
    // first GPU device, as llama.cpp pins its own host buffers): every copy between it and the
    // KV cache is a direct DMA, not a pass through the driver's bounce buffers. Without a GPU,
    // or with no layer offloaded (the KV then stays in host memory), plain host memory.
    uint8_t * pool = nullptr;
    kv->store_memory = "host";
    // Where llama.cpp's whole KV cache is on one CUDA device, the store is a pool on that device
    // (memory of its own, exactly the pool: what CUDA IPC exports is nothing else), and blocks
    // move device to device: between the KV tensors and the pool by checked strided copies
    // (libllama's llama_kv_range_*_with, kvrelay's copier), between servers by the agent's
    // device transports.
    char dev_name[64] = {};
    if (!s.store_host && llama_kv_range_device(ctx, dev_name, sizeof dev_name) > 0 &&
        std::strncmp(dev_name, "CUDA", 4) == 0 && dev_name[4] != '\0') {
        char *     end     = nullptr;
        const long ordinal = std::strtol(dev_name + 4, &end, 10);
        ggml_backend_dev_t dev = ggml_backend_dev_by_name(dev_name);
        ggml_backend_buffer_t buf = nullptr;
        if (end != nullptr && *end == '\0' && ordinal >= 0 && dev != nullptr) {
            buf = ggml_backend_buft_alloc_buffer(ggml_backend_dev_buffer_type(dev), blocks * bb);
        }
        if (buf != nullptr) {
            try {
                kv->copier = std::make_unique<kvrelay::CudaCopier>(int(ordinal));
                // never freed: the store, like the runtime, lives until exit (agent threads read it)
                pool             = static_cast<uint8_t *>(ggml_backend_buffer_get_base(buf));
                kv->device       = int32_t(ordinal);
                kv->store_memory = std::string("device (") + dev_name + ")";
            } catch (const std::exception & e) {
                SRV_WRN("kvrelay: the KV block store stays in host memory: kvrelay cannot copy on %s: %s\n", dev_name,
                        e.what());
                ggml_backend_buffer_free(buf);
            }
        } else {
            SRV_WRN("kvrelay: no room on %s for the KV block store (%zu MiB): it uses host memory\n", dev_name,
                    (blocks * bb) >> 20);
        }
    }
    if (ggml_backend_dev_t gpu = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_GPU);
        pool == nullptr && gpu != nullptr && params.n_gpu_layers != 0) {
        if (ggml_backend_buffer_type_t buft = ggml_backend_dev_host_buffer_type(gpu)) {
            // never freed: the store, like the runtime, lives until exit (agent threads read it)
            if (ggml_backend_buffer_t buf = ggml_backend_buft_alloc_buffer(buft, blocks * bb)) {
                pool             = static_cast<uint8_t *>(ggml_backend_buffer_get_base(buf));
                kv->store_memory = std::string("pinned host (") + ggml_backend_buft_name(buft) + ")";
            } else {
                SRV_WRN("kvrelay: no pinned host memory for the KV block store (%zu MiB): it uses plain host memory\n",
                        (blocks * bb) >> 20);
            }
        }
    }
    kv->store = std::make_unique<block_store>(blocks, bb, pool);
    kv->naming          = kvrelay::Naming(s.seed, s.block_tokens, 0, {});

    const llama_model *       model = llama_get_model(ctx);
    kvrelay_agent_fingerprint fp{};
    fp.size = sizeof fp;
    fp.block_tokens = uint32_t(s.block_tokens);
    fp.layers       = uint32_t(kv->schema.layers.size());
    fp.kv_heads     = uint32_t(std::max<int32_t>(1, llama_model_n_head_kv(model)));
    fp.head_dim     = uint32_t(llama_model_n_embd(model) / std::max<int32_t>(1, llama_model_n_head(model)));
    fp.dtype_bytes  = uint32_t(ggml_type_size(params.cache_type_k));
    fp.naming       = s.seed;

    kvrelay::AgentConfig cfg(fp);
    cfg.listen(s.listen);
    if (!s.key_file.empty()) {
        cfg.key_from_file(s.key_file);  // both ways: peers fetching from here, fetches from peers
    }
    for (const std::string & p : s.allow_peers) {
        cfg.allow_peer(p);
    }
    kv->transport = !s.transport.empty() ? s.transport : kv->device >= 0 ? std::string("cuda-ipc") : std::string("tcp");
    // over TCP and CUDA IPC no other process can write the store (a CUDA IPC grant maps an
    // export area the source copies the asked blocks into, never the store): only a NIXL
    // registration of the store lets a keyed peer write into it, so only then is a block
    // checked where it lies before a slot takes it
    kv->import_check = s.import_check && kv->transport.find("nixl") != std::string::npos;
    if (kv->device >= 0) {
        cfg.device(kv->device);
    }
    if (kv->transport != "tcp") {
        cfg.transport(kv->transport);
    }
    // the pool as one [blocks, 1 layer, 2, block/2] region: kvrelay moves whole blocks
    const kvrelay::KvLayout layout =
        kvrelay::KvLayout::all_layers_per_block((uint64_t) (uintptr_t) kv->store->pool(), 1, uint32_t(blocks), bb / 2);
    kv->agent    = std::make_unique<kvrelay::Agent>(cfg, layout, *kv->store);
    kv->endpoint = kv->agent->endpoint();

    kvrelay::Capabilities caps({ { "kvrelay", "kv.fetch", "1.0" } });
    kvrelay::PolicyConfig pc;
    pc.bindings.push_back(kvrelay::Binding{ "kv-tcp", "kvrelay", false, true, { { "kv.fetch", "1.0" } } });
    pc.endpoints     = s.trusted_endpoints;
    pc.metric_prefix = std::string("llamacpp_kv_policy");
    kv->orch         = std::make_unique<kvrelay::Orchestrator>(caps, pc, make_provider());

    if (!s.events.empty()) {
        if (kv->endpoint.empty()) {
            SRV_ERR("%s", "kvrelay: --kv-events needs --kv-listen (a router's hint names this server's KV endpoint); no events\n");
        } else {
            std::string allow;
            for (const std::string & p : s.allow_peers) {
                allow += (allow.empty() ? "" : ",") + p;
            }
            kv->events = std::make_unique<kvrelay::KvEvents>(s.events, s.block_tokens, kv->device >= 0 ? "GPU" : "CPU", allow, "",
                                                             s.events_key_file);
            SRV_INF("kvrelay: KV events at %s (replay %s)\n", kv->events->endpoint().c_str(),
                    kv->events->endpoint(true).c_str());
        }
    }

    SRV_INF("kvrelay: KV path on: %zu blocks of %zu bytes (%zu MiB) in %s memory, moved by %s; %s; %zu trusted "
            "endpoint(s); fetch %s\n",
            blocks, bb, (blocks * bb) >> 20, kv->store_memory.c_str(), kv->transport.c_str(),
            kv->endpoint.empty() ? "serving nothing" : ("serving at " + kv->endpoint).c_str(),
            s.trusted_endpoints.size(), s.fetch_always ? "always" : "when faster than prefill");
    KV = kv.release();
}

}  // namespace

namespace detail {

const llama_token * name_tokens(const llama_token * tokens, size_t n, std::vector<llama_token> & scratch) {
    if (!forced_collisions()) {
        return tokens;
    }
    scratch.assign(n, 0);
    return scratch.data();
}

block_keys keys_of(const kv_runtime & kv, const llama_token * tokens, size_t n) {
    block_keys               k;
    std::vector<llama_token> scratch;
    k.names   = kv.naming.names(name_tokens(tokens, n, scratch), n);
    k.digests = kv.naming.digests(S().identity, tokens, n);
    return k;
}

}  // namespace detail

void on_model_loaded(const common_params & params, llama_context * ctx) {
    settings & s = S();

    // The identity names what makes two servers' KV for the same tokens equal (identity_of):
    // equal identities give equal block names and digests (SPEC section 8), and nothing else
    // does. A file that cannot be read leaves the identity empty: the KV path stays off.
    std::string id;
    try {
        id = identity_of(params, ctx);
    } catch (const std::exception & e) {
        SRV_ERR("kvrelay: the KV path is off: the engine's identity: %s\n", e.what());
    }
    // With the KV path on, the context's KV layout is read (libllama's range descriptor), and whether V is
    // stored transposed (flash attention resolved off) joins the identity: "auto" resolves per
    // device, and blocks computed with and without flash attention differ.
    kv_schema schema;
    bool      probed = false;
    if (s.kv_on() && ctx != nullptr && !id.empty()) {
        std::string err;
        if (probe_schema(ctx, schema, err)) {
            probed = true;
            id += std::string(";v_trans=") + (schema.v_trans ? "1" : "0");
        } else {
            SRV_ERR("kvrelay: the KV path is off: %s\n", err.c_str());
        }
    }

    s.model_path = params.model.path;
    if (ctx != nullptr) {
        // as llama-server's n_ctx_slot(): a longer prompt is refused at the slot, so never fetched for
        size_t n = llama_n_ctx_seq(ctx);
        if (params.kv_unified_per_slot > 0) {
            n = std::min(n, size_t(params.kv_unified_per_slot));
        }
        s.n_ctx_slot = std::min(n, size_t(std::max(0, llama_model_n_ctx_train(llama_get_model(ctx)))));
    }
    try {
        s.seed     = kvrelay::Naming::seed_of(id);
        s.identity = std::move(id);
        (void) admission();  // build the edge now: a failure shows at startup
    } catch (const std::exception & e) {
        SRV_ERR("kvrelay: %s\n", e.what());
    }
    SRV_INF("kvrelay %s: KV hints %s; %zu-token blocks named under seed %s (%s)\n", kvrelay_version(),
            s.trusted ? "TRUSTED (all traffic that reaches this server is trusted)" : "ignored (untrusted)",
            s.block_tokens, hex64(s.seed).c_str(), s.identity.c_str());
    if (probed && !s.identity.empty() && KV == nullptr) {
        try {
            start_kv(params, ctx, schema);
        } catch (const std::exception & e) {
            SRV_ERR("kvrelay: the KV path is off: %s\n", e.what());
        }
    }
}

}  // namespace kvrelay_llama
