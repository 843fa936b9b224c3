// kvrelay_llama_state.hpp: the integration's private state, shared by its sources (never
// included by llama-server's own files; kvrelay_llama.hpp is the only header the patch includes).
//
// The sources, one concern each:
//   kvrelay_llama_flags.cpp   --kv-* flags and LLAMA_ARG_KV_* variables (consume_args)
//   kvrelay_llama_start.cpp   the process-wide state, the naming identity, the start-up probe,
//                             the block store, the agent and the policy (on_model_loaded)
//   kvrelay_llama_fetch.cpp   admission of a request's hints and the fetch path (HTTP threads)
//   kvrelay_llama_slots.cpp   the slot hooks: import, prompt done, export (main loop)
//   kvrelay_llama_routes.cpp  /metrics, /v1/kv/info, /v1/kv/lookup
//   kvrelay_llama_kv.cpp      the block layout (libllama's KV range descriptor), and the block store
#pragma once

#include "kvrelay.hpp"
#include "kvrelay_llama.hpp"
#include "kvrelay_llama_kv.hpp"

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

namespace kvrelay_llama::detail {

inline constexpr size_t       DEFAULT_BLOCK_TOKENS = 32;
inline constexpr size_t       MAX_BLOCK_TOKENS     = 65536;
inline constexpr const char * METRIC_PREFIX        = "llamacpp_kv_hints";
inline constexpr size_t       MAX_HINT_HASHES      = 65536;
inline constexpr uint32_t     WAIT_SLICE_MS        = 20;
// Hinted prompts of one request that fetch at once (the request's own thread and helpers).
inline constexpr size_t       MAX_FETCH_THREADS    = 8;
// A source whose fetch failed is skipped (outcome `backoff`) for BACKOFF_FIRST_S, twice as long
// after each further failure in a row, at most BACKOFF_MAX_S; its first success ends that.
inline constexpr double       BACKOFF_FIRST_S      = 1.0;
inline constexpr double       BACKOFF_MAX_S        = 60.0;

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
    std::string              key_file;  // the KV port's pre-shared key ("" : none)
    std::string              events_key_file;  // the KV events sockets' pre-shared key ("" : none)
    std::string              model_id;  // --kv-model-id: the operator vouches for the model ("" : its SHA-256)
    size_t                   n_ctx_slot = 0;  // a slot's context (0: unknown); longer prompts are refused
    bool                     store_host = false;  // --kv-store host: the store in host memory even with the KV on a GPU
    std::string              transport;  // --kv-transport ("" : cuda-ipc for a device store, tcp otherwise)
    bool                     import_check = true;  // --kv-import-check: blocks checked where they lie before a slot takes them

    bool kv_on() const { return !listen.empty() || !trusted_endpoints.empty(); }
};

/// The process-wide settings (kvrelay_llama_start.cpp).
settings & S();

/// The one admission edge of the process (kvrelay::Admission is thread-safe). Built on first use,
/// after consume_args fixed the trust switch.
const kvrelay::Admission & admission();

/// `v` as 16 lower-case hex digits.
std::string hex64(uint64_t v);

// This integration's counters (the library's agent and policy count their own).
struct kv_counters {
    std::mutex                      mu;
    std::map<std::string, uint64_t> fetch;  // by outcome
    std::atomic<uint64_t>           fetched_blocks{ 0 };
    std::atomic<uint64_t>           fetched_bytes{ 0 };  // their bytes (labelled by kv_runtime::transport)
    std::atomic<uint64_t>           exported_blocks{ 0 };
    std::atomic<uint64_t>           export_failed{ 0 };
    std::atomic<uint64_t>           imported_tokens{ 0 };
    std::atomic<uint64_t>           recomputed_tokens{ 0 };
    std::atomic<uint64_t>           import_refused{ 0 };
    std::atomic<uint64_t>           import_tampered{ 0 };  // imports cut at a block that no longer held what was recorded
    std::atomic<uint64_t>           export_bytes{ 0 };  // KV cache -> store (llama_kv_range_get)
    std::atomic<uint64_t>           import_bytes{ 0 };  // store -> KV cache (llama_kv_range_set)
    std::atomic<uint64_t>           device_copy_ns{ 0 };  // a device store: time of those moves, copies complete
    std::atomic<uint64_t>           cells_changed{ 0 };  // on_cells_changed / on_cells_copied calls
    std::atomic<int64_t>            waiting{ 0 };        // gauge: requests waiting for their KV now

    // every outcome's series is there from the start, at zero: this integration's own, then the
    // agent's failure names (KVRELAY_FETCH_CONNECT and on, up to the first it does not name)
    kv_counters() {
        for (const char * o : { "fetched", "partial", "joined", "late", "backoff", "not_worth_it", "no_room", "nothing_to_fetch",
                                "busy", "client_gone", "cache_prompt_off", "multimodal", "prompt_too_long",
                                "name_collision", "internal" }) {
            fetch[o] = 0;
        }
        for (int32_t f = KVRELAY_FETCH_CONNECT; f < 64; f++) {
            const std::string name = kvrelay_fetch_failure_name(f);
            if (name == "unknown") {
                break;
            }
            if (f != KVRELAY_FETCH_DIGEST_MISMATCH) {  // counted as name_collision
                fetch[name] = 0;
            }
        }
    }

    void count(const std::string & outcome) {
        std::lock_guard<std::mutex> g(mu);
        fetch[outcome]++;
    }
};

// Sources whose last fetches failed, by endpoint (the trusted registry's spelling; at most one
// entry per trusted endpoint, so the map is bounded by the operator's list).
struct source_backoff {
    using clock = std::chrono::steady_clock;
    struct entry {
        uint32_t          failures = 0;
        clock::time_point until;
    };
    std::mutex                   mu;
    std::map<std::string, entry> by_endpoint;

    // whether `endpoint` is being skipped now
    bool skipping(const std::string & endpoint) {
        std::lock_guard<std::mutex> g(mu);
        const auto                  it = by_endpoint.find(endpoint);
        return it != by_endpoint.end() && clock::now() < it->second.until;
    }
    // a fetch from `endpoint` failed: skip it for the next period
    void failed(const std::string & endpoint) {
        std::lock_guard<std::mutex> g(mu);
        entry &                     e = by_endpoint[endpoint];
        e.failures                    = std::min<uint32_t>(e.failures + 1, 32);
        const double period           = std::min(BACKOFF_MAX_S, BACKOFF_FIRST_S * double(1ull << std::min<uint32_t>(e.failures - 1, 20)));
        e.until = clock::now() + std::chrono::duration_cast<clock::duration>(std::chrono::duration<double>(period));
    }
    // a fetch from `endpoint` succeeded: no more skipping
    void succeeded(const std::string & endpoint) {
        std::lock_guard<std::mutex> g(mu);
        by_endpoint.erase(endpoint);
    }
};

// A fetch in flight: a later request whose first missing block, from the same source, is the
// one this fetch starts at waits for it (outcome `joined`) instead of fetching the blocks again.
struct flight {
    std::mutex              mu;
    std::condition_variable cv;
    bool                    done = false;
};

// Pins held through a scope: unpinned when it ends, however it ends. Only blocks whose content
// digest is the one asked for are pinned (block_store::pin_checked).
struct pin_guard {
    block_store *         store = nullptr;
    std::vector<uint32_t> ids;
    size_t                n = 0;
    pin_guard(block_store & st, const uint64_t * names, const block_store::digest * digests, size_t count) :
        store(&st),
        ids(count) {
        n = st.pin_checked(names, digests, count, ids.data());
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
    reservation(block_store & st, size_t n, const std::function<void(uint64_t)> & on_evict,
                size_t max_evict = SIZE_MAX, bool lazy = false) :
        store(&st),
        ids(st.reserve(n, nullptr, on_evict, max_evict, lazy)) {}
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

// What the integration knows of one slot's sequence (main loop only).
struct slot_kv {
    size_t       exact_upto = 0;      // leading cells known to equal a cold prefill (a block multiple)
    bool         aligned    = false;  // this prompt's prefill started at a block edge (import_prefix ran)
    bool         kept       = false;  // import_prefix kept llama-server's own reuse past exact_upto (nothing exported)
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
    source_backoff                         backoff;         // --kv-fetch faster only
    std::mutex                             flights_mu;
    std::map<std::string, std::shared_ptr<flight>> flights;  // by source and first block fetched
    std::string                            store_memory;     // what the store's pool is ("host", "pinned host", "device (CUDA0)")
    std::string                            transport;        // how the agent moves blocks ("tcp", "cuda-ipc", ...)
    bool                                   import_check = false;  // a slot takes only blocks verified in the store
    int32_t                                device = -1;      // the CUDA device of a device store, -1: host store
    // a device store: the copies between llama.cpp's KV tensors and the store's blocks (libllama's
    // llama_kv_range_*_with); counts.device_copy_ns is the time they take
    std::mutex                             copier_mu;
    std::unique_ptr<kvrelay::CudaCopier>   copier;
    kvrelay::Naming                        naming{ 0, DEFAULT_BLOCK_TOKENS };
    std::vector<slot_kv>                   slots;            // by sequence id, main loop only

    slot_kv & slot(int seq_id) {
        if (size_t(seq_id) >= slots.size()) {
            slots.resize(size_t(seq_id) + 1);
        }
        return slots[size_t(seq_id)];
    }
};

/// A prompt's full blocks as the store knows them: their names (what routers index) and their
/// content digests (what a block must hold to enter a slot), from block 0.
struct block_keys {
    std::vector<uint64_t>            names;
    std::vector<block_store::digest> digests;
};

/// The keys of the full blocks of tokens[0, n) (n a block multiple). With the test build's
/// forced collisions on (kvrelay_llama_start.cpp), names are computed as if every token were 0,
/// so that two prompts of one length share every name; digests always come from the tokens.
block_keys keys_of(const kv_runtime & kv, const llama_token * tokens, size_t n);

/// Token ids as names see them: `tokens` itself, or, with the test build's forced collisions
/// on, zeros (in `scratch`).
const llama_token * name_tokens(const llama_token * tokens, size_t n, std::vector<llama_token> & scratch);

/// Set once by on_model_loaded, never freed (agent threads may run until exit); null while the
/// KV path is off.
extern kv_runtime * KV;

/// The provider the orchestrator hands a kv.fetch decision to (kvrelay_llama_fetch.cpp).
std::shared_ptr<kvrelay::Provider> make_provider();

/// The store's `on_stored` for a commit of blocks `first + i` of a prompt named `names` with
/// `tokens` (both outlive the commit): publishes each block committed under a new name (KV
/// events), with the name of the block before it and its tokens, under the store's lock, so
/// that a router's index follows the store's own order. Null without a publisher.
std::function<void(size_t)> publish_stored(const kv_runtime & kv, const std::vector<uint64_t> & names,
                                           const llama_tokens & tokens, size_t first);

/// The store's `on_evict`: publishes each eviction in the store's order. Null without a publisher.
std::function<void(uint64_t)> publish_removed(const kv_runtime & kv);

}  // namespace kvrelay_llama::detail
