// kvrelay_llama.cpp: kvrelay inside llama-server (see kvrelay_llama.hpp and
// integrations/llama.cpp/README.md). Uses kvrelay only through its public C++ header.
#include "kvrelay_llama.hpp"

#include "arg.h"
#include "build-info.h"
#include "kvrelay.hpp"
#include "kvrelay_llama_kv.hpp"

#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <map>
#include <mutex>
#include <optional>
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
    // the KV path
    std::string              listen;
    std::vector<std::string> trusted_endpoints;
    std::vector<std::string> allow_peers;
    size_t                   pool_mib     = 1024;
    bool                     fetch_always = false;
    bool                     fail_on_load = false;  // --kv-load-failure-policy fail
    std::string              events;  // KV events publisher endpoint ("" : none)

    bool kv_on() const { return !listen.empty() || !trusted_endpoints.empty(); }
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
    printf("--kv-listen HOST:PORT                   serve this server's KV blocks to peers there (port 0: any free port);\n"
           "                                        turns the KV path on (env: LLAMA_ARG_KV_LISTEN)\n");
    printf("--kv-trusted-endpoint tcp://HOST:PORT   an endpoint a hint may fetch KV from (repeatable; the trusted registry);\n"
           "                                        turns the KV path on (env: LLAMA_ARG_KV_TRUSTED_ENDPOINTS, comma-separated)\n");
    printf("--kv-allow-peer SPEC                    a peer that may fetch from this server: loopback, an address or ADDR/PREFIX\n"
           "                                        (repeatable; default: loopback) (env: LLAMA_ARG_KV_ALLOW_PEERS, comma-separated)\n");
    printf("--kv-pool-mib N                         host memory of the KV block store (default: 1024)\n"
           "                                        (env: LLAMA_ARG_KV_POOL_MIB)\n");
    printf("--kv-fetch faster|always                fetch a hinted prefix only when the estimate beats this server's measured\n"
           "                                        prefill (default), or always (env: LLAMA_ARG_KV_FETCH)\n");
    printf("--kv-load-failure-policy recompute|fail when a hinted fetch fails: prefill as a cold request (default), or answer\n"
           "                                        502 kv_load_failed (env: LLAMA_ARG_KV_LOAD_FAILURE_POLICY)\n");
    printf("--kv-events tcp://HOST:PORT             publish KV events (the blocks served, and evicted) there for a router such as\n"
           "                                        Dynamo's (port 0: a free one; needs --kv-listen) (env: LLAMA_ARG_KV_EVENTS)\n\n");
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

std::string hex64(uint64_t v) {
    char buf[17];
    snprintf(buf, sizeof buf, "%016" PRIx64, v);
    return buf;
}

// ---- the KV path -------------------------------------------------------------------------

constexpr size_t   MAX_HINT_HASHES = 65536;
constexpr uint32_t WAIT_SLICE_MS   = 20;

// This integration's counters (the library's agent and policy count their own).
struct kv_counters {
    std::mutex                      mu;
    std::map<std::string, uint64_t> fetch;  // by outcome
    std::atomic<uint64_t>           fetched_blocks{ 0 };
    std::atomic<uint64_t>           exported_blocks{ 0 };
    std::atomic<uint64_t>           export_failed{ 0 };
    std::atomic<uint64_t>           imported_tokens{ 0 };
    std::atomic<uint64_t>           recomputed_tokens{ 0 };
    std::atomic<uint64_t>           import_refused{ 0 };

    void count(const std::string & outcome) {
        std::lock_guard<std::mutex> g(mu);
        fetch[outcome]++;
    }
};

// Pins held through a scope: unpinned when it ends, however it ends.
struct pin_guard {
    block_store *         store = nullptr;
    std::vector<uint32_t> ids;
    size_t                n = 0;
    pin_guard(block_store & st, const uint64_t * names, size_t count) : store(&st), ids(count) {
        n = st.pin(names, count, ids.data());
    }
    pin_guard(const pin_guard &)             = delete;
    pin_guard & operator=(const pin_guard &) = delete;
    ~pin_guard() { store->unpin(ids.data(), n); }
};

// Reserved blocks owned by a scope: `ids[handed..]` go back to the free list when it ends (the
// ones before were committed, or are withheld by a transfer, and are no longer this scope's).
struct reservation {
    block_store *         store = nullptr;
    std::vector<uint32_t> ids;
    size_t                handed = 0;
    reservation() = default;
    reservation(block_store & st, size_t n, std::vector<uint64_t> * evicted) : store(&st), ids(st.reserve(n, evicted)) {}
    reservation(reservation && o) noexcept : store(o.store), ids(std::move(o.ids)), handed(o.handed) { o.store = nullptr; }
    reservation & operator=(reservation && o) noexcept {
        std::swap(store, o.store);
        std::swap(ids, o.ids);
        std::swap(handed, o.handed);
        return *this;
    }
    ~reservation() {
        if (store != nullptr && handed < ids.size()) {
            store->release(ids.data() + handed, ids.size() - handed);
        }
    }
};

// What the provider leaves for the request thread that asked (kvrelay_fetch_request::call_context).
struct fetch_call {
    const std::vector<uint64_t> * names      = nullptr;  // the prompt's block names, up to the last fetchable
    std::string                   endpoint;
    size_t                        held       = 0;        // leading blocks the store holds
    std::unique_ptr<pin_guard>    held_pins;             // ... pinned until the fetch is committed
    reservation                   dst;                   // reserved store blocks the fetch writes
    kvrelay::Fetch                fetch;                 // destroyed first: settles the fetch
    bool                          submitted  = false;
    bool                          settled    = false;    // its result was taken (dst.handed set)
    double                        estimate_s = 0;
    double                        local_s    = 0;
    std::string                   outcome;               // why the provider refused

    fetch_call() = default;
    fetch_call(const fetch_call &)             = delete;
    fetch_call & operator=(const fetch_call &) = delete;
    ~fetch_call() {
        // an early end (an exception) with the fetch still running: wait for it, and keep the
        // blocks a transfer may still write (withheld) out of the free list
        if (!submitted || settled) {
            return;
        }
        try {
            std::optional<kvrelay_fetch_result> r = fetch.poll();
            if (!r) {
                fetch.cancel();
                while (!(r = fetch.wait(1000))) {
                }
            }
            dst.handed = std::min(dst.ids.size(), r->blocks + r->withheld);
        } catch (...) {
            dst.handed = dst.ids.size();  // unknown: keep them all out of the free list
        }
    }
};

struct kv_runtime;
kv_runtime * KV = nullptr;  // set once by on_model_loaded, never freed (agent threads may run until exit)

// The provider: validates a kv.fetch 1.0 payload on its own terms, then submits the fetch of the
// run the store lacks into reserved store blocks (see fetch_prefix).
class provider final : public kvrelay::Provider {
  public:
    // provider codes (kvrelay_decision::provider_code)
    enum : int { BAD_VERSION = 1, BAD_PAYLOAD = 2, BAD_HASHES = 3, BAD_ENDPOINT = 4, NO_CONTEXT = 5,
                 NOTHING = 10, NOT_WORTH_IT = 11, NO_ROOM = 12, BUSY = 13 };

    int validate(const kvrelay_fetch_request & r) override {
        std::vector<uint64_t> hashes;
        return parse(r, hashes);
    }
    int fetch(const kvrelay_fetch_request & r) override;

    static int parse(const kvrelay_fetch_request & r, std::vector<uint64_t> & hashes) {
        if (std::string_view(r.action_version.ptr, r.action_version.len) != "1.0") {
            return BAD_VERSION;
        }
        const json p = json::parse_no_throw(std::string(reinterpret_cast<const char *>(r.payload.ptr), r.payload.len));
        if (p.is_discarded() || !p.is_object() || !p.contains("block_hashes") || !p.at("block_hashes").is_array()) {
            return BAD_PAYLOAD;
        }
        const json & h = p.at("block_hashes");
        if (h.empty() || h.size() > MAX_HINT_HASHES) {
            return BAD_HASHES;
        }
        hashes.reserve(h.size());
        for (const json & v : h) {
            // admission kept integers within -2^63 ..= 2^64-1; a name is never negative
            if (!v.is_number_integer() || v.dump().front() == '-') {
                return BAD_HASHES;
            }
            hashes.push_back(v.get<uint64_t>());
        }
        // the orchestrator checked the registry; the provider checks that its transport speaks it
        const std::string_view ep(r.endpoint.ptr, r.endpoint.len);
        const size_t           colon = ep.rfind(':');
        if (ep.substr(0, 6) != "tcp://" || colon == std::string_view::npos || colon <= 6 || colon + 1 >= ep.size()) {
            return BAD_ENDPOINT;
        }
        return 0;
    }
};

// What the integration knows of one slot's sequence (main loop only).
struct slot_kv {
    size_t       exact_upto = 0;      // leading cells known to equal a cold prefill (a block multiple)
    bool         aligned    = false;  // this prompt's prefill started at a block edge (import_prefix ran)
    llama_tokens pending;             // a prompt whose blocks export_pending exports (empty: none)
};

// kvrelay's own work on the main loop (imports, exports): llama-server's prompt time of every
// slot whose prompt was in flight meanwhile includes it, and on_prompt_done takes it out. The
// last 64 pieces, main loop only; one a slot's window lost from the ring is left in (a prefill
// then looks slower than it is, and a fetch is chosen a little more often).
struct loop_work {
    using clock = std::chrono::steady_clock;
    struct piece {
        clock::time_point start;
        double            seconds = 0;
    };
    std::array<piece, 64> ring{};
    size_t                next = 0;

    // a piece that started at `start` ends now; its seconds
    double add(clock::time_point start) {
        const double s              = std::chrono::duration<double>(clock::now() - start).count();
        ring[next++ % ring.size()] = { start, s };
        return s;
    }
    double since(clock::time_point from) const {
        double t = 0;
        for (const piece & p : ring) {
            if (p.seconds > 0 && p.start >= from) {
                t += p.seconds;
            }
        }
        return t;
    }
};

struct kv_runtime {
    kv_schema                              schema;
    std::unique_ptr<block_store>           store;
    std::unique_ptr<kvrelay::Agent>        agent;
    std::unique_ptr<kvrelay::Orchestrator> orch;
    std::unique_ptr<kvrelay::KvEvents>     events;          // null: no events
    std::string                            endpoint;        // this server's KV service, "" for none
    std::atomic<double>                    sec_per_token{ 0 };  // prefill, a moving average (0: not measured)
    bool                                   warmed = false;      // a prompt was timed (the first is not folded)
    loop_work                              work;                // main loop only
    kv_counters                            counts;
    std::vector<uint8_t>                   blob;             // main loop only
    kvrelay::Naming                        naming{ 0, DEFAULT_BLOCK_TOKENS };
    std::vector<slot_kv>                   slots;            // by sequence id, main loop only

    slot_kv & slot(int seq_id) {
        if (size_t(seq_id) >= slots.size()) {
            slots.resize(size_t(seq_id) + 1);
        }
        return slots[size_t(seq_id)];
    }
};

// Blocks `first + fresh[i]` of a prompt just committed: publish them (KV events), each with the
// name of the block before it and its tokens. No-op without a publisher.
void publish_stored(const kv_runtime & kv, const std::vector<uint64_t> & names, const llama_tokens & tokens,
                    size_t first, const std::vector<size_t> & fresh) {
    if (!kv.events) {
        return;
    }
    const size_t bt = S().block_tokens;
    for (size_t i : fresh) {
        const size_t b = first + i;
        // llama_token ids are never negative: read as their unsigned values
        kv.events->stored(names[b], b > 0 ? &names[b - 1] : nullptr,
                          reinterpret_cast<const uint32_t *>(tokens.data() + b * bt), bt);
    }
}

void publish_removed(const kv_runtime & kv, const std::vector<uint64_t> & evicted) {
    if (kv.events) {
        for (uint64_t name : evicted) {
            kv.events->removed(name);
        }
    }
}

int provider::fetch(const kvrelay_fetch_request & r) {
    auto * call = static_cast<fetch_call *>(r.call_context);
    if (call == nullptr || KV == nullptr) {
        return NO_CONTEXT;
    }
    std::vector<uint64_t> hashes;
    if (const int bad = parse(r, hashes); bad != 0) {
        return bad;
    }
    kv_runtime &                  kv    = *KV;
    const std::vector<uint64_t> & names = *call->names;
    call->endpoint                      = std::string(r.endpoint.ptr, r.endpoint.len);
    // the blocks held stay pinned until the fetched ones are committed after them
    call->held_pins                     = std::make_unique<pin_guard>(*kv.store, names.data(), names.size());
    call->held                          = call->held_pins->n;
    size_t run                          = 0;
    kvrelay::check(kvrelay_fetch_run_length(names.data(), names.size(), call->held, hashes.data(), hashes.size(), &run));
    if (run == 0) {
        call->outcome = "nothing_to_fetch";
        return NOTHING;
    }
    call->estimate_s  = kv.agent->estimate(call->endpoint, run);
    const double spt  = kv.sec_per_token.load(std::memory_order_relaxed);
    call->local_s     = spt > 0 ? spt * double(run * S().block_tokens) : -1;
    if (!S().fetch_always && spt > 0 && call->local_s < call->estimate_s) {
        call->outcome = "not_worth_it";
        return NOT_WORTH_IT;
    }
    std::vector<uint64_t> evicted;
    call->dst = reservation(*kv.store, run, &evicted);
    publish_removed(kv, evicted);
    if (call->dst.ids.empty()) {
        call->outcome = "no_room";
        return NO_ROOM;
    }
    try {
        const uint32_t deadline = kvrelay_fetch_deadline_ms(uint64_t(call->dst.ids.size()) * kv.store->block_bytes());
        call->fetch     = kv.agent->fetch(call->endpoint, names, call->held, call->dst.ids, deadline);
        call->submitted = true;
    } catch (const kvrelay::Error &) {
        call->outcome = "busy";  // nothing was submitted: the reservation goes back with the call
        return BUSY;
    }
    return 0;
}

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
    kv->orch         = std::make_unique<kvrelay::Orchestrator>(caps, pc, std::make_shared<provider>());

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
                                               "--kv-load-failure-policy" };
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

held_ptr fetch_prefix(const server_tokens & prompt, bool lora, bool cache_prompt, const hint_ptr & hint,
                      const std::function<bool()> & should_stop) {
    if (!hint || KV == nullptr) {
        return nullptr;
    }
    kv_runtime & kv = *KV;
    std::string  load_failure;  // the agent's failure name, under --kv-load-failure-policy fail
    try {
        if (!cache_prompt) {
            kv.counts.count("cache_prompt_off");  // the slot would not import it
            return nullptr;
        }
        if (prompt.has_mtmd) {
            kv.counts.count("multimodal");
            return nullptr;
        }
        const llama_tokens & tokens = prompt.get_tokens();
        const size_t         bt     = S().block_tokens;
        // the blocks that may be fetched: full ones, at least one prompt token left to evaluate
        const size_t         n_max  = tokens.empty() ? 0 : (tokens.size() - 1) / bt;
        std::vector<uint64_t> names = kv.naming.names(tokens.data(), n_max * bt);

        fetch_call         call;
        call.names = &names;
        kvrelay_request_info info{};
        info.generation_only = true;
        info.lora_adapter    = lora;
        const kvrelay::Decision d = kv.orch->decide(info, *hint, &call);
        if (!call.submitted) {
            if (!call.outcome.empty()) {
                kv.counts.count(call.outcome);
                SRV_DBG("kvrelay: no fetch: %s (estimate %.4f s, local prefill %.4f s)\n", call.outcome.c_str(),
                        call.estimate_s, call.local_s);
            } else if (!d.named_fetch()) {
                // the policy's own discard (untrusted endpoint, ...), counted by the policy
                SRV_DBG("kvrelay: no fetch: %s (provider code %d)\n", d.discard_name(), d.provider_code);
            }
            return nullptr;
        }
        // wait on this request's thread, cancelling when the client goes away
        std::optional<kvrelay_fetch_result> r;
        bool                                gone = false;
        while (!(r = call.fetch.wait(WAIT_SLICE_MS))) {
            if (!gone && should_stop && should_stop()) {
                gone = true;
                call.fetch.cancel();
            }
        }
        const size_t n_dst    = call.dst.ids.size();
        const size_t ok       = std::min(r->blocks, n_dst);
        const size_t withheld = std::min(r->withheld, n_dst - ok);
        // the verified blocks are committed, withheld ones come back through the holder's
        // returned(), the rest goes back to the free list with the reservation
        call.dst.handed                = ok + withheld;
        call.settled                   = true;
        const std::vector<size_t> fresh = kv.store->commit(call.dst.ids.data(), names.data() + call.held, ok);
        kv.counts.fetched_blocks += ok;
        publish_stored(kv, names, tokens, call.held, fresh);
        const std::string outcome = gone ? "client_gone"
                                    : r->failure != KVRELAY_FETCH_OK ? std::string(kvrelay_fetch_failure_name(r->failure))
                                    : ok < n_dst                    ? "partial"
                                                                    : "fetched";
        kv.counts.count(outcome);
        const std::string why = r->failure != KVRELAY_FETCH_OK ? call.fetch.detail() : std::string();
        SRV_INF("kvrelay: fetch %s: %zu of %zu blocks after the %zu held, %.4f s (estimate %.4f s, local prefill %.4f s)%s%s\n",
                outcome.c_str(), ok, n_dst, call.held, r->seconds, call.estimate_s, call.local_s,
                why.empty() ? "" : ": ", why.c_str());
        if (S().fail_on_load && !gone && r->failure != KVRELAY_FETCH_OK) {
            load_failure = outcome;  // thrown below, past this function's own catch
        } else if (ok > 0) {
            // the prefix the slot imports stays pinned until it does: taken while call's pins
            // still hold the leading blocks; the fetched ones were committed just now, as the most
            // recently used, so a reservation in between would evict every other unpinned block first
            return std::make_shared<pin_guard>(*kv.store, names.data(), call.held + ok);
        }
    } catch (const std::exception & e) {
        kv.counts.count("internal");
        SRV_WRN("kvrelay: the fetch path failed (%s); the request prefills as a cold one\n", e.what());
    } catch (...) {
        kv.counts.count("internal");
    }
    if (!load_failure.empty()) {
        throw kv_load_failed("fetching the hinted KV failed (" + load_failure +
                             ") and --kv-load-failure-policy is fail");
    }
    return nullptr;
}

int import_prefix(llama_context * ctx, int seq_id, const server_tokens & prompt, int n_past) noexcept {
    if (KV == nullptr || prompt.has_mtmd || n_past < 0 || seq_id < 0) {
        return n_past;
    }
    kv_runtime & kv = *KV;
    try {
        slot_kv &            slot   = kv.slot(seq_id);
        const llama_tokens & tokens = prompt.get_tokens();
        const size_t         bt     = S().block_tokens;
        slot.pending.clear();  // a new prompt: an export not made after the last one's first token is dropped
        // full blocks that may be reused: at least one prompt token is evaluated
        const size_t         n_max  = tokens.empty() ? 0 : (tokens.size() - 1) / bt;
        // what the slot keeps of its own cells: the leading ones known to equal a cold prefill
        // (imported, or prefilled from a block edge; never generated ones), whole blocks only
        const size_t n_exact = std::min({ size_t(n_past), slot.exact_upto, n_max * bt }) / bt * bt;
        size_t       n_new   = n_exact;
        size_t       k       = 0;
        std::chrono::steady_clock::time_point t0;
        if (n_max * bt > n_exact) {
            const std::vector<uint64_t> names = kv.naming.names(tokens.data(), n_max * bt);
            pin_guard                   pins(*kv.store, names.data(), names.size());
            k = pins.n;
            if (k * bt > n_exact) {
                t0 = std::chrono::steady_clock::now();
                std::vector<const uint8_t *> src(k);
                for (size_t i = 0; i < k; i++) {
                    src[i] = kv.store->block(pins.ids[i]);
                }
                build_import(kv.schema, src.data(), k, seq_id, kv.blob);
                n_new = k * bt;
            }
        }
        if (n_new > n_exact) {
            const size_t got = llama_state_seq_set_data_ext(ctx, kv.blob.data(), kv.blob.size(), seq_id, 0);
            if (got != kv.blob.size()) {
                llama_memory_seq_rm(llama_get_memory(ctx), seq_id, -1, -1);
                kv.counts.import_refused++;
                slot.exact_upto = 0;
                slot.aligned    = true;  // the prompt is prefilled from token 0
                SRV_WRN("kvrelay: llama.cpp refused the imported KV of %zu blocks; slot %d prefills its whole prompt\n", k,
                        seq_id);
                return 0;
            }
            kv.counts.imported_tokens += n_new - std::min(n_new, size_t(n_past));
            // what a fetch costs past its transfer: the agent's estimate counts it from now on
            // (llama.cpp imports a whole sequence: flash attention off, V transposed row by row)
            const double took = kv.work.add(t0);
            try {
                kv.agent->record_import(k, took);
            } catch (...) {
                // the import stands whatever the estimate makes of it
            }
            SRV_DBG("kvrelay: slot %d: imported %zu blocks (the slot kept %zu tokens, had %d)\n", seq_id, k, n_exact, n_past);
        } else if (n_new < size_t(n_past)) {
            kv.counts.recomputed_tokens += size_t(n_past) - n_new;
        }
        // the prompt's prefill starts at a block edge: its blocks are exact, and exported
        slot.exact_upto = n_new;
        slot.aligned    = true;
        return int(n_new);
    } catch (...) {
        kv.counts.import_refused++;
        return n_past;
    }
}

void on_prompt_done(llama_context * ctx, int seq_id, const server_tokens & prompt, bool exportable,
                    double t_prompt_ms, uint64_t n_processed) noexcept {
    (void) ctx;
    if (KV == nullptr || prompt.has_mtmd || seq_id < 0) {
        return;
    }
    kv_runtime & kv = *KV;
    try {
        const size_t bt   = S().block_tokens;
        slot_kv &    slot = kv.slot(seq_id);
        // llama-server's prompt time includes kvrelay's main-loop work meanwhile (this prompt's
        // import, other slots' imports and exports): the prefill alone is the rest
        const auto   now       = loop_work::clock::now();
        const auto   window    = std::chrono::duration_cast<loop_work::clock::duration>(
            std::chrono::duration<double, std::milli>(std::max(0.0, t_prompt_ms)));
        const double prefill_s = t_prompt_ms / 1e3 - kv.work.since(now - window);
        // a prompt of a few blocks or more (a short one's time is mostly per-decode overhead, which
        // the tokens a fetch would save do not pay twice)
        // and not the first one after start, which pays one-time costs (with --no-warmup, or on a
        // GPU: kernels loaded, graphs and buffers made) that would hold the average up for long
        if (n_processed >= 4 * bt && prefill_s > 0 && std::exchange(kv.warmed, true)) {
            const double now  = prefill_s / double(n_processed);
            const double prev = kv.sec_per_token.load(std::memory_order_relaxed);
            kv.sec_per_token.store(prev > 0 ? 0.8 * prev + 0.2 * now : now, std::memory_order_relaxed);
        }
        // a prompt prefilled from a block edge (import_prefix ran for it) without a LoRA adapter:
        // its full blocks equal a cold prefill's; anything else is not served, and not kept
        const bool exact = exportable && slot.aligned;
        slot.aligned     = false;
        slot.exact_upto  = exact ? prompt.size() / bt * bt : 0;
        slot.pending.clear();
        if (exact && slot.exact_upto > 0) {
            // exported by export_pending, once the first token is on its way (the copy of the
            // tokens keeps the buffer's capacity from prompt to prompt)
            const llama_tokens & tokens = prompt.get_tokens();
            slot.pending.assign(tokens.begin(), tokens.begin() + slot.exact_upto);
        }
    } catch (...) {
        kv.counts.export_failed++;
    }
}

void export_pending(llama_context * ctx, int seq_id) noexcept {
    if (KV == nullptr || seq_id < 0 || size_t(seq_id) >= KV->slots.size() || KV->slots[size_t(seq_id)].pending.empty()) {
        return;
    }
    kv_runtime & kv   = *KV;
    slot_kv &    slot = kv.slots[size_t(seq_id)];
    try {
        // exported once, whatever happens below (the buffer keeps its capacity); its time is
        // kvrelay's main-loop work, which other slots' prompt times then include
        struct on_exit {
            llama_tokens &                t;
            loop_work &                   work;
            loop_work::clock::time_point start;
            ~on_exit() {
                t.clear();
                work.add(start);
            }
        } const done{ slot.pending, kv.work, loop_work::clock::now() };
        const size_t                bt     = S().block_tokens;
        const llama_tokens &        tokens = slot.pending;
        const std::vector<uint64_t> names  = kv.naming.names(tokens.data(), tokens.size());
        // the blocks held stay pinned while the new ones are reserved and committed after them
        pin_guard    held(*kv.store, names.data(), names.size());
        const size_t from = held.n;
        if (from == names.size()) {
            return;
        }
        const size_t size = llama_state_seq_get_size_ext(ctx, seq_id, 0);
        kv.blob.resize(size);
        const size_t got = size == 0 ? 0 : llama_state_seq_get_data_ext(ctx, kv.blob.data(), size, seq_id, 0);
        kv_parsed    p;
        std::string  err;
        if (got != size || size == 0) {
            err = "llama.cpp exported no KV state";
        } else if (parse_state(kv.blob.data(), kv.blob.size(), p, err) && !p.schema.same_layout(kv.schema)) {
            err = "the exported KV state does not have the layout probed at load";
        } else if (err.empty() && p.cell_of.size() < names.size() * bt) {
            err = "the exported KV state lacks some of the prompt's positions";
        }
        if (!err.empty()) {
            kv.counts.export_failed++;
            SRV_WRN("kvrelay: slot %d: its blocks are not served: %s\n", seq_id, err.c_str());
            return;
        }
        std::vector<uint64_t> evicted;
        reservation           res(*kv.store, names.size() - from, &evicted);
        publish_removed(kv, evicted);
        const std::vector<uint32_t> & ids = res.ids;
        std::vector<uint8_t *>        dst(ids.size());
        for (size_t i = 0; i < ids.size(); i++) {
            dst[i] = kv.store->block(ids[i]);
        }
        cut_blocks(kv.schema, p, from, from + ids.size(), dst.data());
        kv.agent->record_checksums(ids);  // before the blocks can be pinned by name
        res.handed                      = ids.size();
        const std::vector<size_t> fresh = kv.store->commit(ids.data(), names.data() + from, ids.size());
        kv.counts.exported_blocks += fresh.size();
        publish_stored(kv, names, tokens, from, fresh);
    } catch (const std::exception & e) {
        kv.counts.export_failed++;
        SRV_WRN("kvrelay: slot %d: its blocks are not served: %s\n", seq_id, e.what());
    } catch (...) {
        kv.counts.export_failed++;
    }
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
        LOG_DBG("kvrelay: slot %d, task %d carries an admitted KV hint with %zu action(s)\n",
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
        const block_store::counts c = kv.store->read_counts();
        const std::pair<const char *, uint64_t> plain[] = {
            { "fetched_blocks_total", kv.counts.fetched_blocks.load() },
            { "exported_blocks_total", kv.counts.exported_blocks.load() },
            { "export_failed_total", kv.counts.export_failed.load() },
            { "imported_tokens_total", kv.counts.imported_tokens.load() },
            { "recomputed_tokens_total", kv.counts.recomputed_tokens.load() },
            { "import_refused_total", kv.counts.import_refused.load() },
            { "store_evicted_total", c.evicted },
        };
        for (const auto & [name, v] : plain) {
            text += std::string("# TYPE llamacpp_kv_") + name + " counter\nllamacpp_kv_" + name + " " + std::to_string(v) + "\n";
        }
        text += "# TYPE llamacpp_kv_store_blocks gauge\nllamacpp_kv_store_blocks " + std::to_string(c.committed) + "\n";
        text += "# TYPE llamacpp_kv_store_pinned_blocks gauge\nllamacpp_kv_store_pinned_blocks " + std::to_string(c.pinned) + "\n";
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
    const kvrelay::Naming naming(s.seed, s.block_tokens, 0, salt);
    const std::vector<uint64_t> names = naming.names(tokens);

    return json{
        { "block_tokens",  s.block_tokens },
        { "blocks_total",  names.size()   },
        { "blocks_held",   KV != nullptr ? KV->store->held(names.data(), names.size()) : 0 },
        { "block_hashes",  names          },
        { "n_tokens",      tokens.size()  },
        { "token_ids",     tokens         },
    };
}

}  // namespace kvrelay_llama
