// kvrelay_llama.cpp: kvrelay inside llama-server, phase 1 (see kvrelay_llama.hpp and
// integrations/llama.cpp/README.md). Uses kvrelay only through its public C++ header.
#include "kvrelay_llama.hpp"

#include "arg.h"
#include "build-info.h"
#include "kvrelay.hpp"

#include <cerrno>
#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <stdexcept>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

namespace kvrelay_llama {
namespace {

constexpr size_t DEFAULT_BLOCK_TOKENS = 32;
constexpr size_t MAX_BLOCK_TOKENS     = 65536;
constexpr const char * METRIC_PREFIX  = "llamacpp_kv_hints";

// Process-wide settings: written by consume_args and on_model_loaded on the main thread before
// the HTTP server is marked ready, read by request threads afterwards.
struct settings {
    bool        trusted      = false;
    size_t      block_tokens = DEFAULT_BLOCK_TOKENS;
    std::string identity;
    uint64_t    seed         = 0;
    std::string model_path;
};

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

bool parse_block_tokens(const std::string & text, const char * from, size_t & out) {
    char * end = nullptr;
    errno      = 0;
    const unsigned long long v = std::strtoull(text.c_str(), &end, 10);
    if (text.empty() || text[0] == '-' || *end != '\0' || errno != 0 || v == 0 || v > MAX_BLOCK_TOKENS) {
        fprintf(stderr, "error: %s: expected a number of tokens per block in 1..%zu, got '%s'\n", from,
                MAX_BLOCK_TOKENS, text.c_str());
        return false;
    }
    out = (size_t) v;
    return true;
}

void print_usage() {
    printf("----- kvrelay (integrations/llama.cpp) -----\n\n");
    printf("--kv-hints-trusted                      admit KV hints (kv_hints, kv_hint, router_hint) from requests;\n"
           "                                        trusts all traffic that reaches the server (default: off)\n"
           "                                        (env: LLAMA_ARG_KV_HINTS_TRUSTED)\n");
    printf("--kv-block-tokens N                     tokens per named KV block for /v1/kv/lookup (default: %zu)\n"
           "                                        (env: LLAMA_ARG_KV_BLOCK_TOKENS)\n\n",
           DEFAULT_BLOCK_TOKENS);
}

std::string hex64(uint64_t v) {
    char buf[17];
    snprintf(buf, sizeof buf, "%016" PRIx64, v);
    return buf;
}

}  // namespace

bool consume_args(int & argc, char ** argv) {
    settings & s = S();

    if (const char * env = std::getenv("LLAMA_ARG_KV_HINTS_TRUSTED"); env != nullptr && *env != '\0') {
        if (common_arg_utils::is_truthy(env)) {
            s.trusted = true;
        } else if (common_arg_utils::is_falsey(env)) {
            s.trusted = false;
        } else {
            fprintf(stderr, "error: LLAMA_ARG_KV_HINTS_TRUSTED: expected 1|true|on|enabled or 0|false|off|disabled, got '%s'\n", env);
            return false;
        }
    }
    if (const char * env = std::getenv("LLAMA_ARG_KV_BLOCK_TOKENS"); env != nullptr && *env != '\0') {
        if (!parse_block_tokens(env, "LLAMA_ARG_KV_BLOCK_TOKENS", s.block_tokens)) {
            return false;
        }
    }
    if (argv == nullptr) {
        return true;
    }

    int kept = 1;
    for (int i = 1; i < argc; i++) {
        const std::string arg = argv[i];
        if (arg == "--kv-hints-trusted") {
            s.trusted = true;
            continue;
        }
        if (arg == "--kv-block-tokens") {
            if (i + 1 >= argc) {
                fprintf(stderr, "error: --kv-block-tokens needs a value\n");
                return false;
            }
            if (!parse_block_tokens(argv[++i], "--kv-block-tokens", s.block_tokens)) {
                return false;
            }
            continue;
        }
        if (arg == "-h" || arg == "--help" || arg == "--usage") {
            print_usage();
        }
        argv[kept++] = argv[i];
    }
    argv[kept] = nullptr;
    argc       = kept;
    return true;
}

void on_model_loaded(const common_params & params, const llama_context * ctx) {
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

    s.model_path = params.model.path;
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
}

std::vector<hint_ptr> admit_request_hints(const std::string & body, size_t n_prompts) {
    std::vector<hint_ptr> out(n_prompts);

    // One hint per request, found by kvrelay in the body's own bytes (kv_hints, kv_hint,
    // router_hint, kv_transfer_params.{kv_hint,router_hint}; null is absent), so that
    // admission sees the client's text: its duplicate members and its size, which a parse
    // and a dump() would not keep.
    kvrelay::FoundHint found;
    try {
        found = kvrelay::find_hint(body);
    } catch (const kvrelay::Error & e) {
        // two hints (or a body that is not one JSON object, which the server parsed already)
        throw std::invalid_argument(e.what());
    }
    if (!found || n_prompts == 0) {
        return out;
    }
    const std::string where = found.batched() ? "kv_hints" : "a router hint";
    const std::string_view raw = found.value;

    std::vector<kvrelay::Outcome> outcomes;
    try {
        if (found.batched()) {
            // a single envelope is shared by every prompt, an aligned list is admitted entry by entry
            outcomes = admission().admit_batch(raw, n_prompts);
        } else {
            // Dynamo's router hint: one envelope for the request
            outcomes.push_back(admission().admit(raw));
        }
    } catch (const kvrelay::Error & e) {
        if (e.status() == KVRELAY_ERR_BATCH_LENGTH_MISMATCH) {
            throw std::invalid_argument(string_format(
                "kv_hints: an aligned list needs exactly one entry (or null) per prompt; this request has %zu prompts",
                n_prompts));
        }
        SRV_WRN("kvrelay: admission failed (%s); the request runs without a hint\n", e.what());
        return out;
    }

    size_t n_admitted = 0;
    for (size_t i = 0; i < n_prompts; i++) {
        kvrelay::Outcome & o = outcomes.size() == 1 ? outcomes[0] : outcomes[i];
        if (o.admitted()) {
            if (outcomes.size() == 1 && i > 0) {
                out[i] = out[0];  // one snapshot shared by every prompt
            } else {
                out[i] = std::make_shared<kvrelay::Snapshot>(std::move(o.snapshot));
            }
            n_admitted++;
        } else if (o.ignored()) {
            // the detail names a rule and a place, never the hint's contents
            SRV_DBG("kvrelay: %s ignored for prompt %zu: %s%s%s\n", where.c_str(), i, o.reason_name(),
                    o.detail.empty() ? "" : ": ", o.detail.c_str());
        }
    }
    if (n_admitted > 0) {
        SRV_DBG("kvrelay: %s admitted for %zu of %zu prompt(s)\n", where.c_str(), n_admitted, n_prompts);
    }
    return out;
}

void on_task_launched(int id_slot, int id_task, const hint_ptr & hint) noexcept {
    if (!hint) {
        return;
    }
    try {
        LOG_DBG("kvrelay: slot %d, task %d carries an admitted KV hint with %zu action(s) (phase 1: not acted on)\n",
                id_slot, id_task, hint->action_count());
    } catch (...) {
    }
}

std::string prometheus() noexcept {
    try {
        std::string text = admission().prometheus();
        if (!text.empty() && text.back() != '\n') {
            text += '\n';
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
    return json{
        { "block_tokens",     s.block_tokens       },
        { "naming_seed",      hex64(s.seed)        },
        { "naming_identity",  s.identity           },
        { "model",            model                },
        { "kv_hints_trusted", s.trusted            },
        { "kvrelay_version",  std::string(kvrelay_version()) },
    };
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
    const kvrelay::Naming naming(s.seed, s.block_tokens, 0, salt);
    const std::vector<uint64_t> names = naming.names(tokens);

    return json{
        { "block_tokens",  s.block_tokens },
        { "blocks_total",  names.size()   },
        { "blocks_held",   0              },  // phase 1: slots' cached prefixes are not read
        { "block_hashes",  names          },
        { "n_tokens",      tokens.size()  },
        { "token_ids",     tokens         },
    };
}

}  // namespace kvrelay_llama
