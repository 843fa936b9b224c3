// kvrelay_llama_start.cpp: the process-wide state, the naming identity, the start-up probe, and the
// block store, agent, policy and events the KV path runs on (on_model_loaded).
// Uses kvrelay only through its public C++ header (kvrelay_llama_state.hpp lists the files).
#include "kvrelay_llama_state.hpp"

#include "build-info.h"
#include <algorithm>
#include <cinttypes>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

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

// Read the context's state layout off a one-token probe in sequence 0, then clear the memory.
bool probe_schema(llama_context * ctx, kv_schema & out, std::string & err) {
    const llama_vocab * vocab = llama_model_get_vocab(llama_get_model(ctx));
    llama_token         tok   = llama_vocab_bos(vocab);
    if (tok < 0) {
        tok = 0;
    }
    llama_memory_t mem = llama_get_memory(ctx);
    if (mem == nullptr) {
        err = "the context has no KV memory";
        return false;
    }
    llama_memory_clear(mem, true);
    llama_batch batch = llama_batch_get_one(&tok, 1);
    if (llama_decode(ctx, batch) != 0) {
        llama_memory_clear(mem, true);
        err = "the probe decode failed";
        return false;
    }
    const size_t         size = llama_state_seq_get_size_ext(ctx, 0, 0);
    std::vector<uint8_t> blob(size);
    const size_t         got = size == 0 ? 0 : llama_state_seq_get_data_ext(ctx, blob.data(), size, 0, 0);
    llama_memory_clear(mem, true);
    if (got != size || size == 0) {
        err = "llama.cpp exported no KV state";
        return false;
    }
    kv_parsed p;
    if (!parse_state(blob.data(), blob.size(), p, err)) {
        return false;
    }
    if (p.cells != 1 || p.cell_of.size() != 1) {
        err = "the probe's KV state does not hold its one token";
        return false;
    }
    out              = p.schema;
    out.block_tokens = S().block_tokens;
    return true;
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
    kv->store           = std::make_unique<block_store>(blocks, bb);
    kv->naming          = kvrelay::Naming(s.seed, s.block_tokens, 0, {});

    const llama_model *       model = llama_get_model(ctx);
    kvrelay_agent_fingerprint fp{};
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
            kv->events = std::make_unique<kvrelay::KvEvents>(s.events, s.block_tokens, "CPU", allow);
            SRV_INF("kvrelay: KV events at %s (replay %s)\n", kv->events->endpoint().c_str(),
                    kv->events->endpoint(true).c_str());
        }
    }

    SRV_INF("kvrelay: KV path on: %zu blocks of %zu bytes (%zu MiB), %s; %zu trusted endpoint(s); fetch %s\n",
            blocks, bb, (blocks * bb) >> 20,
            kv->endpoint.empty() ? "serving nothing" : ("serving at " + kv->endpoint).c_str(),
            s.trusted_endpoints.size(), s.fetch_always ? "always" : "when faster than prefill");
    KV = kv.release();
}

}  // namespace

void on_model_loaded(const common_params & params, llama_context * ctx) {
    settings & s = S();

    // The identity names what makes two servers' KV for the same tokens equal: the model file
    // (name and size), the llama.cpp build, and the context's KV settings. Equal identities give
    // equal block names (SPEC section 8).
    const std::filesystem::path path(params.model.path);
    std::error_code             ec;
    const uintmax_t             model_bytes = std::filesystem::file_size(path, ec);

    std::string id = "llama-server/kvrelay-naming-1";
    id += ";model=" + path.filename().string();
    id += ";model_bytes=" + std::to_string(ec ? 0 : (unsigned long long) model_bytes);
    for (const auto & lora : params.lora_adapters) {
        id += ";lora=" + std::filesystem::path(lora.path).filename().string();
    }
    id += ";build=" + std::string(llama_commit());
    id += ";n_ubatch=" + std::to_string(ctx != nullptr ? llama_n_ubatch(ctx) : (uint32_t) params.n_ubatch);
    id += ";type_k=" + std::string(ggml_type_name(params.cache_type_k));
    id += ";type_v=" + std::string(ggml_type_name(params.cache_type_v));
    id += ";flash_attn=" + std::string(llama_flash_attn_type_name(params.flash_attn_type));
    // With the KV path on, the context's state layout is read off a probe, and whether V is
    // stored transposed (flash attention resolved off) joins the identity: "auto" resolves per
    // device, and blocks computed with and without flash attention differ.
    kv_schema schema;
    bool      probed = false;
    if (s.kv_on() && ctx != nullptr) {
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
