// kvrelay_llama_flags.cpp: the --kv-* flags and their LLAMA_ARG_KV_* variables (consume_args).
// Uses kvrelay only through its public C++ header (kvrelay_llama_state.hpp lists the files).
#include "kvrelay_llama_state.hpp"

#include "arg.h"
#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

namespace kvrelay_llama {
using namespace detail;
namespace {

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
    printf("--kv-listen HOST:PORT                   serve this server's KV blocks to peers there (port 0: any free port);\n"
           "                                        turns the KV path on (env: LLAMA_ARG_KV_LISTEN)\n");
    printf("--kv-trusted-endpoint tcp://HOST:PORT   an endpoint a hint may fetch KV from (repeatable; the trusted registry);\n"
           "                                        turns the KV path on (env: LLAMA_ARG_KV_TRUSTED_ENDPOINTS, comma-separated)\n");
    printf("--kv-allow-peer SPEC                    a peer that may fetch from this server: loopback, an address or ADDR/PREFIX\n"
           "                                        (repeatable; default: loopback) (env: LLAMA_ARG_KV_ALLOW_PEERS, comma-separated)\n");
    printf("--kv-pool-mib N                         host memory of the KV block store (default: 1024)\n"
           "                                        (env: LLAMA_ARG_KV_POOL_MIB)\n");
    printf("--kv-store device|host                  where the block store lives when llama.cpp's KV cache is on a CUDA device:\n"
           "                                        a pool on that device, blocks moved device to device (default), or\n"
           "                                        pinned host memory (env: LLAMA_ARG_KV_STORE)\n");
    printf("--kv-transport NAME                     how blocks move between servers: tcp, cuda-ipc, nixl, cuda-ipc,nixl\n"
           "                                        (default: cuda-ipc for a device store, then TCP; tcp for a host store)\n"
           "                                        (env: LLAMA_ARG_KV_TRANSPORT)\n");
    printf("--kv-import-check on|off                with a transport that registers the store itself with keyed peers (nixl),\n"
           "                                        check each block's checksum and keyed tag where it lies before a slot\n"
           "                                        takes it (default: on; one kernel over the blocks on a device store;\n"
           "                                        tcp and cuda-ipc never let another process write the store: no check)\n"
           "                                        (env: LLAMA_ARG_KV_IMPORT_CHECK)\n");
    printf("--kv-fetch faster|always                fetch a hinted prefix only when the estimate beats this server's measured\n"
           "                                        prefill (default), or always (env: LLAMA_ARG_KV_FETCH)\n");
    printf("--kv-load-failure-policy recompute|fail when a hinted fetch fails: prefill as a cold request (default), or answer\n"
           "                                        502 kv_load_failed (env: LLAMA_ARG_KV_LOAD_FAILURE_POLICY)\n");
    printf("--kv-key-file PATH                      a pre-shared key (the file's bytes, mode 600: a file others may read is\n"
           "                                        refused) that peers fetching from this server and the peers it fetches\n"
           "                                        from must prove they hold; give every server of a deployment the same\n"
           "                                        one (default: the per-user key, made on first use at $KVRELAY_KEY_FILE,\n"
           "                                        else $XDG_CACHE_HOME/kvrelay/agent.key, else ~/.cache/kvrelay/agent.key:\n"
           "                                        servers of one user on one host reach each other, nobody else does)\n"
           "                                        (env: LLAMA_ARG_KV_KEY_FILE)\n");
    printf("--kv-model-id ID                        name the model by ID, which the operator vouches for (equal only for\n"
           "                                        equal weights), instead of the SHA-256 of its file, computed at start and\n"
           "                                        cached (env: LLAMA_ARG_KV_MODEL_ID)\n");
    printf("--kv-events tcp://HOST:PORT             publish KV events (the blocks served, and evicted) there for a router such as\n"
           "                                        Dynamo's (port 0: a free one; needs --kv-listen) (env: LLAMA_ARG_KV_EVENTS)\n");
    printf("--kv-events-key-file PATH               a pre-shared key for the events' sockets: subscribers log in with ZMQ PLAIN\n"
           "                                        as kvrelay with the key's token, HMAC-SHA-256(key, 'kvrelay-kv-events/v1\n"
           "                                        subscriber') in hex; the token and the events cross the network in clear\n"
           "                                        (default: none) (env: LLAMA_ARG_KV_EVENTS_KEY_FILE)\n\n");
}

void split_list(const std::string & text, std::vector<std::string> & out) {
    size_t at = 0;
    while (at <= text.size()) {
        const size_t end  = std::min(text.find(',', at), text.size());
        std::string  item = text.substr(at, end - at);
        if (!item.empty()) {
            out.push_back(item);
        }
        at = end + 1;
    }
}

bool parse_pool_mib(const std::string & text, const char * from, size_t & out) {
    char * end = nullptr;
    errno      = 0;
    const unsigned long long v = std::strtoull(text.c_str(), &end, 10);
    if (text.empty() || text[0] == '-' || *end != '\0' || errno != 0 || v == 0 || v > (1ull << 20)) {
        fprintf(stderr, "error: %s: expected MiB in 1..1048576, got '%s'\n", from, text.c_str());
        return false;
    }
    out = (size_t) v;
    return true;
}

// A setting of two words: `out` is true for `yes`, false for `no`; anything else is refused.
bool parse_either(const std::string & text, const char * from, const char * no, const char * yes, bool & out) {
    if (text == no || text == yes) {
        out = text == yes;
        return true;
    }
    fprintf(stderr, "error: %s: expected %s or %s, got '%s'\n", from, no, yes, text.c_str());
    return false;
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
    if (const char * env = std::getenv("LLAMA_ARG_KV_LISTEN"); env != nullptr) {
        s.listen = env;
    }
    if (const char * env = std::getenv("LLAMA_ARG_KV_EVENTS"); env != nullptr) {
        s.events = env;
    }
    if (const char * env = std::getenv("LLAMA_ARG_KV_KEY_FILE"); env != nullptr) {
        s.key_file = env;
    }
    if (const char * env = std::getenv("LLAMA_ARG_KV_EVENTS_KEY_FILE"); env != nullptr) {
        s.events_key_file = env;
    }
    if (const char * env = std::getenv("LLAMA_ARG_KV_MODEL_ID"); env != nullptr) {
        s.model_id = env;
    }
    if (const char * env = std::getenv("LLAMA_ARG_KV_TRUSTED_ENDPOINTS"); env != nullptr) {
        split_list(env, s.trusted_endpoints);
    }
    if (const char * env = std::getenv("LLAMA_ARG_KV_ALLOW_PEERS"); env != nullptr) {
        split_list(env, s.allow_peers);
    }
    if (const char * env = std::getenv("LLAMA_ARG_KV_POOL_MIB"); env != nullptr && *env != '\0') {
        if (!parse_pool_mib(env, "LLAMA_ARG_KV_POOL_MIB", s.pool_mib)) {
            return false;
        }
    }
    if (const char * env = std::getenv("LLAMA_ARG_KV_IMPORT_CHECK"); env != nullptr && *env != '\0') {
        if (!parse_either(env, "LLAMA_ARG_KV_IMPORT_CHECK", "off", "on", s.import_check)) {
            return false;
        }
    }
    if (const char * env = std::getenv("LLAMA_ARG_KV_STORE"); env != nullptr && *env != '\0') {
        if (!parse_either(env, "LLAMA_ARG_KV_STORE", "device", "host", s.store_host)) {
            return false;
        }
    }
    if (const char * env = std::getenv("LLAMA_ARG_KV_TRANSPORT"); env != nullptr) {
        s.transport = env;
    }
    if (const char * env = std::getenv("LLAMA_ARG_KV_FETCH"); env != nullptr && *env != '\0') {
        if (!parse_either(env, "LLAMA_ARG_KV_FETCH", "faster", "always", s.fetch_always)) {
            return false;
        }
    }
    if (const char * env = std::getenv("LLAMA_ARG_KV_LOAD_FAILURE_POLICY"); env != nullptr && *env != '\0') {
        if (!parse_either(env, "LLAMA_ARG_KV_LOAD_FAILURE_POLICY", "recompute", "fail", s.fail_on_load)) {
            return false;
        }
    }
    if (argv == nullptr) {
        return true;
    }

    int  kept               = 1;
    bool flag_seen_endpoint = false;
    bool flag_seen_peer     = false;
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
        // the flags with a value: a flag given names its value, replacing the variable's
        static const char * const valued[] = { "--kv-listen", "--kv-trusted-endpoint", "--kv-allow-peer",
                                               "--kv-pool-mib", "--kv-fetch", "--kv-events",
                                               "--kv-load-failure-policy", "--kv-key-file", "--kv-model-id",
                                               "--kv-events-key-file", "--kv-store", "--kv-transport",
                                               "--kv-import-check" };
        bool                      is_valued = false;
        for (const char * v : valued) {
            is_valued = is_valued || arg == v;
        }
        if (is_valued) {
            if (i + 1 >= argc) {
                fprintf(stderr, "error: %s needs a value\n", arg.c_str());
                return false;
            }
            const std::string value = argv[++i];
            if (arg == "--kv-listen") {
                s.listen = value;
            } else if (arg == "--kv-key-file") {
                s.key_file = value;
            } else if (arg == "--kv-events-key-file") {
                s.events_key_file = value;
            } else if (arg == "--kv-model-id") {
                s.model_id = value;
            } else if (arg == "--kv-events") {
                s.events = value;
            } else if (arg == "--kv-trusted-endpoint") {
                if (!flag_seen_endpoint) {
                    s.trusted_endpoints.clear();
                    flag_seen_endpoint = true;
                }
                s.trusted_endpoints.push_back(value);
            } else if (arg == "--kv-allow-peer") {
                if (!flag_seen_peer) {
                    s.allow_peers.clear();
                    flag_seen_peer = true;
                }
                s.allow_peers.push_back(value);
            } else if (arg == "--kv-pool-mib") {
                if (!parse_pool_mib(value, "--kv-pool-mib", s.pool_mib)) {
                    return false;
                }
            } else if (arg == "--kv-store") {
                if (!parse_either(value, "--kv-store", "device", "host", s.store_host)) {
                    return false;
                }
            } else if (arg == "--kv-transport") {
                s.transport = value;
            } else if (arg == "--kv-import-check") {
                if (!parse_either(value, "--kv-import-check", "off", "on", s.import_check)) {
                    return false;
                }
            } else if (arg == "--kv-load-failure-policy") {
                if (!parse_either(value, "--kv-load-failure-policy", "recompute", "fail", s.fail_on_load)) {
                    return false;
                }
            } else if (!parse_either(value, "--kv-fetch", "faster", "always", s.fetch_always)) {
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

}  // namespace kvrelay_llama
