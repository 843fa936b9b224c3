// kvrelay_llama_routes.cpp: /metrics (kvrelay's part), /v1/kv/info and /v1/kv/lookup.
// Uses kvrelay only through its public C++ header (kvrelay_llama_state.hpp lists the files).
#include "kvrelay_llama_state.hpp"

#include <cstdio>
#include <filesystem>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace kvrelay_llama {
using namespace detail;

std::string prometheus() noexcept {
    try {
        std::string text = admission().prometheus();
        if (!text.empty() && text.back() != '\n') {
            text += '\n';
        }
        if (KV == nullptr) {
            return text;
        }
        kv_runtime & kv = *KV;
        for (std::string part : { kv.orch->prometheus(), kv.agent->prometheus(),
                                  kv.events ? kv.events->prometheus("llamacpp") : std::string() }) {
            if (!part.empty() && part.back() != '\n') {
                part += '\n';
            }
            text += part;
        }
        text += "# HELP llamacpp_kv_fetch_total KV fetches a hint asked for, by outcome.\n# TYPE llamacpp_kv_fetch_total counter\n";
        {
            std::lock_guard<std::mutex> g(kv.counts.mu);
            for (const auto & [outcome, n] : kv.counts.fetch) {
                text += "llamacpp_kv_fetch_total{outcome=\"" + outcome + "\"} " + std::to_string(n) + "\n";
            }
        }
        // the bytes of verified fetched blocks, by the transport this server's agent fetches with
        // (a fetch that fell back to TCP counts under it too, and in
        // kvrelay_agent_transport_fallbacks_total)
        text += "# TYPE llamacpp_kv_fetch_bytes_total counter\n";
        text += "llamacpp_kv_fetch_bytes_total{transport=\"" + kv.transport + "\"} " +
                std::to_string(kv.counts.fetched_bytes.load()) + "\n";
        const block_store::counts c = kv.store->read_counts();
        const std::pair<const char *, uint64_t> plain[] = {
            { "fetched_blocks_total", kv.counts.fetched_blocks.load() },
            { "exported_blocks_total", kv.counts.exported_blocks.load() },
            { "export_failed_total", kv.counts.export_failed.load() },
            { "imported_tokens_total", kv.counts.imported_tokens.load() },
            { "recomputed_tokens_total", kv.counts.recomputed_tokens.load() },
            { "import_refused_total", kv.counts.import_refused.load() },
            // imports cut where a store block no longer held what was recorded for it (its
            // checksum, its keyed tag): checked where the block lies before a slot takes it,
            // whenever the agent grants the store's memory to peers (--kv-transport other than tcp)
            { "import_tampered_total", kv.counts.import_tampered.load() },
            // bytes moved between llama.cpp's KV cache and the store, counted where they move
            // (llama_kv_range_get / llama_kv_range_set): exactly the new blocks, the missing blocks
            { "export_bytes_total", kv.counts.export_bytes.load() },
            { "import_bytes_total", kv.counts.import_bytes.load() },
            { "slot_cells_changed_total", kv.counts.cells_changed.load() },
            // a device store: nanoseconds of those moves, their device copies complete
            { "device_copy_nanoseconds_total", kv.counts.device_copy_ns.load() },
            { "store_evicted_total", c.evicted },
            { "store_misuse_unpin_unheld_total", c.unpin_unheld },
            { "store_misuse_commit_not_reserved_total", c.commit_not_reserved },
            { "store_misuse_release_not_reserved_total", c.release_not_reserved },
            // a slot's block name held here for other tokens: not imported (fetches that met one
            // count in llamacpp_kv_fetch_total{outcome="name_collision"})
            { "store_name_collisions_total", c.name_collisions },
        };
        for (const auto & [name, v] : plain) {
            text += std::string("# TYPE llamacpp_kv_") + name + " counter\nllamacpp_kv_" + name + " " + std::to_string(v) + "\n";
        }
        text += "# TYPE llamacpp_kv_store_blocks gauge\nllamacpp_kv_store_blocks " + std::to_string(c.committed) + "\n";
        text += "# TYPE llamacpp_kv_store_pinned_blocks gauge\nllamacpp_kv_store_pinned_blocks " + std::to_string(c.pinned) + "\n";
        // requests waiting for their KV now (a fetch of their own, or one they joined): each on an
        // HTTP thread of its own, which llama-server's pool adds on demand
        text += "# TYPE llamacpp_kv_fetch_waiting gauge\nllamacpp_kv_fetch_waiting " +
                std::to_string(kv.counts.waiting.load(std::memory_order_relaxed)) + "\n";
        // what --kv-fetch faster weighs: the measured prefill against the transfer plus llama.cpp's
        // own import of the blocks (a fixed part and a part per block, as the agent fitted them)
        const double imp0 = kv.agent->import_estimate(0), imp1 = kv.agent->import_estimate(1);
        const std::pair<const char *, double> gauges[] = {
            { "prefill_seconds_per_token", kv.sec_per_token.load(std::memory_order_relaxed) },
            { "import_fixed_seconds", imp0 },
            { "import_seconds_per_block", imp1 - imp0 },
        };
        for (const auto & [name, v] : gauges) {
            char num[64];
            snprintf(num, sizeof num, "%.9g", v);
            text += std::string("# TYPE llamacpp_kv_") + name + " gauge\nllamacpp_kv_" + name + " " + num + "\n";
        }
        return text;
    } catch (...) {
        return std::string();
    }
}

json kv_info(const std::string & model_name) {
    const settings & s = S();
    // llama-server names a model without --alias by its path: report the file name then
    std::string model = model_name;
    if (!s.model_path.empty() && model == s.model_path) {
        model = std::filesystem::path(model).filename().string();
    }
    json info = json{
        { "block_tokens",     s.block_tokens       },
        { "naming_seed",      hex64(s.seed)        },
        { "naming_identity",  s.identity           },
        { "model",            model                },
        { "kv_hints_trusted", s.trusted            },
        { "kvrelay_version",  std::string(kvrelay_version()) },
        { "source_control_endpoint", KV != nullptr ? KV->endpoint : std::string() },
        { "block_bytes",      KV != nullptr ? KV->store->block_bytes() : 0 },
        { "store_blocks",     KV != nullptr ? KV->store->capacity() : 0 },
        // a peer of the KV port always proves it holds a key: --kv-key-file's (the deployment's),
        // else the per-user key (its user's alone, made on first use: kvrelay's agent default)
        { "kv_key_required",  KV != nullptr },
        { "kv_key",           KV == nullptr ? "" : s.key_file.empty() ? "per-user" : "file" },
        // how blocks move between llama.cpp's KV cache and the store: only the positions asked
        // for (libllama's position-range KV API), into the store's memory (store_memory)
        { "kv_path",          KV != nullptr ? "position_range" : "off" },
        { "store_memory",     KV != nullptr ? KV->store_memory : std::string() },
        // the CUDA device of a device store (-1: host memory), and how blocks move between servers
        { "store_device",     KV != nullptr ? KV->device : -1 },
        { "kv_transport",     KV != nullptr ? KV->transport : std::string() },
    };
    if (KV != nullptr && KV->events) {
        const kvrelay::KvEvents &     ev = *KV->events;
        const kvrelay_kv_events_stats st = ev.stats();
        const std::string             pub = ev.endpoint(), replay = ev.endpoint(true);
        info["kv_events"] = json{
            { "endpoint",        pub            },
            { "replay_endpoint", replay         },
            { "topic",           ""             },
            { "block_size",      s.block_tokens },
            { "medium",          "CPU"          },
            { "key_required",    !s.events_key_file.empty() },
            { "published",       st.published   },
            { "dropped",         st.dropped     },
        };
        // what a Dynamo worker registration needs (SelectionService.upsert_worker, or a runtime
        // worker's settings): this server is data-parallel rank 0, its hint source is its agent
        info["dynamo"] = json{
            { "model_name",                           model                                 },
            { "block_size",                           s.block_tokens                        },
            { "kv_events_endpoint",                   pub                                   },
            { "replay_endpoint",                      replay                                },
            { "router_hint_worker_type",              "kvrelay"                             },
            { "router_hint_source_control_endpoints", json{ { "0", KV->endpoint } }         },
        };
    }
    return info;
}

json kv_lookup(const json & body, const server_chat_params & chat_params, const llama_vocab * vocab,
               mtmd_context * mctx, const mtmd_helper_init_opt & init_opt) {
    const settings & s = S();
    if (!body.is_object()) {
        throw std::invalid_argument("/v1/kv/lookup: the body must be a JSON object");
    }
    if (mctx != nullptr) {
        throw std::invalid_argument("/v1/kv/lookup: not supported while a multimodal projector is loaded");
    }
    const bool has_prompt   = body.contains("prompt") && !body.at("prompt").is_null();
    const bool has_messages = body.contains("messages") && !body.at("messages").is_null();
    if (has_prompt == has_messages) {
        throw std::invalid_argument("/v1/kv/lookup: give exactly one of \"prompt\" or \"messages\"");
    }
    std::string salt;
    if (body.contains("cache_salt") && !body.at("cache_salt").is_null()) {
        if (!body.at("cache_salt").is_string()) {
            throw std::invalid_argument("/v1/kv/lookup: \"cache_salt\" must be a string");
        }
        salt = body.at("cache_salt").get<std::string>();
    }

    // Tokenize as the completion routes do: a prompt as /completion and /v1/completions
    // (tokenize_input_prompts with special tokens added and parsed), messages through the
    // chat template first, as /v1/chat/completions does.
    json prompt;
    if (has_messages) {
        json                    chat = body;  // oaicompat_chat_params_parse edits its input
        std::vector<raw_buffer> files;
        prompt = oaicompat_chat_params_parse(chat, chat_params, files).at("prompt");
    } else {
        prompt = body.at("prompt");
    }
    std::vector<server_tokens> inputs = tokenize_input_prompts(vocab, nullptr, prompt, true, true, init_opt);
    if (inputs.size() != 1) {
        throw std::invalid_argument("/v1/kv/lookup: give one prompt, not a batch");
    }
    const llama_tokens & tokens = inputs[0].get_tokens();

    // llama.cpp's token ids (i32, never negative) are named as they are, without a copy
    const kvrelay::Naming    naming(s.seed, s.block_tokens, 0, salt);
    std::vector<llama_token> scratch;
    const std::vector<uint64_t> names = naming.names(name_tokens(tokens.data(), tokens.size(), scratch), tokens.size());

    json out = json{
        { "block_tokens",  s.block_tokens },
        { "blocks_total",  names.size()   },
        { "block_hashes",  names          },
        { "n_tokens",      tokens.size()  },
        { "token_ids",     tokens         },
    };
    // Which prefixes this server holds is an answer only for the trusted edge (hints trusted:
    // everything that reaches the server is the operator's own traffic, a router among it).
    // Otherwise any client could learn whether another tenant's prompt was seen here.
    if (s.trusted) {
        // held: under these names, for these tokens (a name held for other tokens is not)
        const std::vector<kvrelay::BlockDigest> digests = naming.digests(s.identity, tokens);
        out["blocks_held"] = KV != nullptr ? KV->store->held(names.data(), digests.data(), names.size()) : 0;
    }
    return out;
}

}  // namespace kvrelay_llama
