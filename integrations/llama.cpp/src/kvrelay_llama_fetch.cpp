// kvrelay_llama_fetch.cpp: a request's hints admitted, and the fetch path (HTTP threads).
// Uses kvrelay only through its public C++ header (kvrelay_llama_state.hpp lists the files).
#include "kvrelay_llama_state.hpp"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <exception>
#include <functional>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

namespace kvrelay_llama {
using namespace detail;
namespace {

// Whether a fetch that failed with `failure` (`late`: cancelled by the request once waiting could
// no longer pay) says its source is sick or slow, so that it is skipped for a while (backoff):
// it could not be reached, ran past a deadline, cut its stream, refused (busy, say), sent bytes
// that failed their checksum, or failed inside. Not: a source that lacks the blocks
// (source_miss: a stale hint), a name collision (digest_mismatch), a fingerprint or key
// mismatch: each costs one round trip and is about this request or this pair of servers.
bool source_is_sick(int32_t failure, bool late) {
    if (late && failure == KVRELAY_FETCH_CANCELLED) {
        return true;
    }
    switch (failure) {
        case KVRELAY_FETCH_CONNECT:
        case KVRELAY_FETCH_TIMEOUT:
        case KVRELAY_FETCH_REFUSED:
        case KVRELAY_FETCH_CORRUPT:
        case KVRELAY_FETCH_TRUNCATED:
        case KVRELAY_FETCH_INTERNAL:
            return true;
        default:
            return false;
    }
}

// The fetch a request started, for the requests that join it: finished (its waiters woken, its
// entry gone) when the fetch's blocks were committed, or whenever its request ends otherwise.
struct flight_owner {
    kv_runtime *            kv = nullptr;
    std::string             key;
    std::shared_ptr<flight> f;

    void finish() {
        if (!f) {
            return;
        }
        {
            std::lock_guard<std::mutex> g(kv->flights_mu);
            const auto                  it = kv->flights.find(key);
            if (it != kv->flights.end() && it->second == f) {
                kv->flights.erase(it);
            }
        }
        {
            std::lock_guard<std::mutex> g(f->mu);
            f->done = true;
        }
        f->cv.notify_all();
        f.reset();
    }
    flight_owner()                                 = default;
    flight_owner(const flight_owner &)             = delete;
    flight_owner & operator=(const flight_owner &) = delete;
    ~flight_owner() { finish(); }
};

// What the provider leaves for the request thread that asked (kvrelay_fetch_request::call_context).
struct fetch_call {
    flight_owner                  owner;                 // destroyed last: after the fetch settled
    std::shared_ptr<flight>       joined;                // another request's fetch of these blocks
    const block_keys *            keys       = nullptr;  // the prompt's blocks, up to the last fetchable
    std::string                   endpoint;
    size_t                        held       = 0;        // leading blocks the store holds
    size_t                        run        = 0;        // blocks after them the hint names, to fetch
    std::unique_ptr<pin_guard>    held_pins;             // ... pinned until the fetch is committed
    reservation                   dst;                   // reserved store blocks the fetch writes
    kvrelay::Fetch                fetch;                 // destroyed first: settles the fetch
    bool                          submitted  = false;
    bool                          settled    = false;    // its result was taken (dst.handed set)
    double                        estimate_s = 0;
    double                        local_s    = 0;
    double                        budget_s   = 0;        // the wait worth it (0: the transfer deadline only)
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
            // the verified blocks are not committed on this path: back to the free list (they
            // would stay reserved for ever); withheld ones return through the holder
            const size_t ok = std::min(dst.ids.size(), r->blocks);
            if (dst.store != nullptr) {
                dst.store->release(dst.ids.data(), ok);
            }
            dst.handed = std::min(dst.ids.size(), r->blocks + r->withheld);
        } catch (...) {
            dst.handed = dst.ids.size();  // unknown: keep them all out of the free list
        }
    }
};

// The provider: validates a kv.fetch 1.0 payload on its own terms, then submits the fetch of the
// run the store lacks into reserved store blocks (see fetch_prefix).
class provider final : public kvrelay::Provider {
  public:
    // provider codes (kvrelay_decision::provider_code)
    // (a choice not to fetch, nothing being wrong, carries KVRELAY_PROVIDER_DECLINED: the policy
    // counts it as provider_declined, not fetch_failed)
    enum : int { BAD_VERSION = 1, BAD_PAYLOAD = 2, BAD_HASHES = 3, BAD_ENDPOINT = 4, NO_CONTEXT = 5,
                 NOTHING = 10 | KVRELAY_PROVIDER_DECLINED, NOT_WORTH_IT = 11 | KVRELAY_PROVIDER_DECLINED, NO_ROOM = 12,
                 BUSY = 13, BACKOFF = 14 | KVRELAY_PROVIDER_DECLINED, JOINED = 15 | KVRELAY_PROVIDER_DECLINED };

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
    const std::vector<uint64_t> & names = call->keys->names;
    call->endpoint                      = std::string(r.endpoint.ptr, r.endpoint.len);
    // the blocks held stay pinned until the fetched ones are committed after them
    call->held_pins = std::make_unique<pin_guard>(*kv.store, names.data(), call->keys->digests.data(), names.size());
    call->held                          = call->held_pins->n;
    size_t run                          = 0;
    kvrelay::check(kvrelay_fetch_run_length(names.data(), names.size(), call->held, hashes.data(), hashes.size(), &run));
    if (run == 0) {
        call->outcome = "nothing_to_fetch";
        return NOTHING;
    }
    call->run = run;
    if (!S().fetch_always && kv.backoff.skipping(call->endpoint)) {
        // its last fetch failed, and the period since is not over
        call->outcome = "backoff";
        return BACKOFF;
    }
    call->estimate_s  = kv.agent->estimate(call->endpoint, run);
    const double spt  = kv.sec_per_token.load(std::memory_order_relaxed);
    call->local_s     = spt > 0 ? spt * double(run * S().block_tokens) : -1;
    if (!S().fetch_always && spt > 0 && call->local_s < call->estimate_s) {
        call->outcome = "not_worth_it";
        return NOT_WORTH_IT;
    }
    // --kv-fetch faster waits only as long as the fetch can still pay: twice its estimate, or the
    // local prefill of the same tokens where that is longer; past it, prefilling is quicker
    if (!S().fetch_always && spt > 0) {
        call->budget_s = std::max(2 * call->estimate_s, call->local_s);
    }
    // one fetch per source and first missing block: a request that finds one in flight waits for it
    {
        const std::string           key = call->endpoint + "/" + hex64(names[call->held]);
        std::lock_guard<std::mutex> g(kv.flights_mu);
        if (const auto it = kv.flights.find(key); it != kv.flights.end()) {
            call->joined  = it->second;
            call->outcome = "joined";
            return JOINED;
        }
        call->owner.kv  = &kv;
        call->owner.key = key;
        call->owner.f   = std::make_shared<flight>();
        kv.flights.emplace(key, call->owner.f);
    }
    // a fetch's destination: free blocks first, then at most a quarter of the store claimed
    // (a longer run is fetched in part, counted partial); the claimed blocks stay held and are
    // evicted only once the source's offer said how many blocks come (make_ready below), so a
    // stale or wrong hint to a source that lacks the blocks evicts nothing
    call->dst = reservation(*kv.store, run, publish_removed(kv), std::max<size_t>(1, kv.store->capacity() / 4), true);
    if (call->dst.ids.empty()) {
        call->outcome = "no_room";
        return NO_ROOM;
    }
    try {
        const uint32_t deadline = kvrelay_fetch_deadline_ms(uint64_t(call->dst.ids.size()) * kv.store->block_bytes());
        // checked by content: a block the source holds under the name for other tokens is
        // never written (KVRELAY_FETCH_DIGEST_MISMATCH)
        block_store * const                     store   = kv.store.get();
        const uint32_t * const                  ids     = call->dst.ids.data();
        const std::function<void(uint64_t)>     removed = publish_removed(kv);
        // runs on the agent's fetch threads while the fetch runs; the call (and its ids) outlives
        // the fetch (its destructor settles it first)
        auto ready = [store, ids, removed](size_t from, size_t n) { return store->make_ready(ids + from, n, removed); };
        call->fetch = kv.agent->fetch(call->endpoint, names, call->keys->digests, call->held, call->dst.ids, deadline, ready);
        call->submitted = true;
    } catch (const kvrelay::Error &) {
        call->outcome = "busy";  // nothing was submitted: the reservation goes back with the call
        return BUSY;
    }
    return 0;
}

}  // namespace

namespace detail {
std::shared_ptr<kvrelay::Provider> make_provider() {
    return std::make_shared<provider>();
}
}  // namespace detail

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
        if (S().n_ctx_slot > 0 && tokens.size() >= S().n_ctx_slot) {
            // llama-server refuses it at the slot (exceeds the context): nothing to fetch for
            kv.counts.count("prompt_too_long");
            return nullptr;
        }
        const size_t         bt     = S().block_tokens;
        // the blocks that may be fetched: full ones, at least one prompt token left to evaluate
        const size_t         n_max  = tokens.empty() ? 0 : (tokens.size() - 1) / bt;
        const block_keys              keys  = keys_of(kv, tokens.data(), n_max * bt);
        const std::vector<uint64_t> & names = keys.names;

        // counted while this request waits for its KV (llamacpp_kv_fetch_waiting)
        struct waiting_guard {
            std::atomic<int64_t> & n;
            bool                   on = false;
            void                   begin() { n.fetch_add(1); on = true; }
            ~waiting_guard() { if (on) { n.fetch_sub(1); } }
        } waiting{ kv.counts.waiting };
        fetch_call         call;
        call.keys = &keys;
        kvrelay_request_info info{};
        info.size = sizeof info;
        info.generation_only = true;
        info.lora_adapter    = lora;
        const kvrelay::Decision d = kv.orch->decide(info, *hint, &call);
        if (call.joined) {
            // another request is fetching these blocks: wait for it (as long as this request's own
            // fetch would have waited), then pin what it committed
            kv.counts.count("joined");
            waiting.begin();
            const auto since = std::chrono::steady_clock::now();
            std::unique_lock<std::mutex> lk(call.joined->mu);
            while (!call.joined->done) {
                call.joined->cv.wait_for(lk, std::chrono::milliseconds(WAIT_SLICE_MS));
                const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - since).count();
                if ((should_stop && should_stop()) || (call.budget_s > 0 && waited > call.budget_s)) {
                    return nullptr;  // the client went away, or waiting longer cannot pay: prefill
                }
            }
            lk.unlock();
            auto pins = std::make_shared<pin_guard>(*kv.store, names.data(), keys.digests.data(), names.size());
            SRV_DBG("kvrelay: joined a fetch in flight: %zu blocks held after it (%zu before)\n", pins->n, call.held);
            return pins->n > call.held ? pins : nullptr;
        }
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
        // wait on this request's thread, cancelling when the client goes away or, under --kv-fetch
        // faster, once waiting longer cannot beat prefilling (late)
        waiting.begin();
        std::optional<kvrelay_fetch_result> r;
        bool                                gone  = false;
        bool                                late  = false;
        const auto                          since = std::chrono::steady_clock::now();
        for (;;) {
            uint32_t slice = WAIT_SLICE_MS;
            if (call.budget_s > 0 && !late && !gone) {
                const double left = call.budget_s - std::chrono::duration<double>(std::chrono::steady_clock::now() - since).count();
                if (left <= 0) {
                    late = true;
                    call.fetch.cancel();
                } else {
                    slice = uint32_t(std::clamp(left * 1000.0 + 1, 1.0, double(WAIT_SLICE_MS)));
                }
            }
            if ((r = call.fetch.wait(slice))) {
                break;
            }
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
        kv.store->commit(call.dst.ids.data(), names.data() + call.held, keys.digests.data() + call.held, ok,
                         publish_stored(kv, names, tokens, call.held));
        call.owner.finish();  // the requests that joined this fetch find its blocks committed
        kv.counts.fetched_blocks += ok;
        kv.counts.fetched_bytes += r->bytes;
        const std::string outcome = gone ? "client_gone"
                                    // cancelled by this thread once waiting longer could not pay
                                    : late && r->failure == KVRELAY_FETCH_CANCELLED ? "late"
                                    // the source holds another content under a name: a collision
                                    : r->failure == KVRELAY_FETCH_DIGEST_MISMATCH ? "name_collision"
                                    : r->failure != KVRELAY_FETCH_OK ? std::string(kvrelay_fetch_failure_name(r->failure))
                                    // fewer than the hint's run: the source's or the store's room ran out
                                    : ok < call.run                 ? "partial"
                                                                    : "fetched";
        kv.counts.count(outcome);
        const std::string why = r->failure != KVRELAY_FETCH_OK ? call.fetch.detail() : std::string();
        // what the decision weighed: before this server timed a prompt, --kv-fetch faster has no
        // local prefill to compare with and fetches (its prior: a fetch beats an unmeasured prefill)
        const std::string weighed =
            S().fetch_always ? string_format("estimate %.4f s, --kv-fetch always", call.estimate_s)
            : call.local_s < 0
                ? string_format("estimate %.4f s, local prefill not measured yet: fetched by the prior that a fetch beats it, "
                                "waiting up to the transfer deadline", call.estimate_s)
                : string_format("estimate %.4f s, local prefill %.4f s, waited at most %.4f s", call.estimate_s,
                                call.local_s, call.budget_s);
        SRV_INF("kvrelay: fetch %s: %zu of %zu blocks after the %zu held, %.4f s (%s)%s%s\n", outcome.c_str(), ok, n_dst,
                call.held, r->seconds, weighed.c_str(), why.empty() ? "" : ": ", why.c_str());
        // the source's record: a failure that says the source is sick or slow (it cannot be reached,
        // ran past a deadline, was cancelled as late, cut a stream, refused or sent bad bytes) skips
        // it for a while, a success ends that; a failure about this request's names or this pair's
        // settings (a stale hint: source_miss, routine under eviction; a name collision, which a
        // tenant can plant; a fingerprint or key mismatch) costs a round trip and says nothing of
        // the source's health, nor does a client gone
        if (!gone) {
            if (r->failure != KVRELAY_FETCH_OK && source_is_sick(r->failure, late)) {
                kv.backoff.failed(call.endpoint);
            } else if (ok > 0) {
                kv.backoff.succeeded(call.endpoint);
            }
        }
        if (S().fail_on_load && !gone && outcome != "late" && r->failure != KVRELAY_FETCH_OK) {
            load_failure = outcome;  // thrown below, past this function's own catch
        } else if (ok > 0) {
            // the prefix the slot imports stays pinned until it does: taken while call's pins
            // still hold the leading blocks; the fetched ones were committed just now, as the most
            // recently used, so a reservation in between would evict every other unpinned block first
            return std::make_shared<pin_guard>(*kv.store, names.data(), keys.digests.data(), call.held + ok);
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

std::vector<held_ptr> fetch_prefixes(const std::vector<fetch_input> & in, const std::function<bool()> & should_stop) {
    std::vector<held_ptr> out(in.size());
    size_t                hinted = 0;
    for (const fetch_input & f : in) {
        hinted += f.hint != nullptr ? 1 : 0;
    }
    if (hinted <= 1) {
        for (size_t i = 0; i < in.size(); i++) {
            if (in[i].hint) {
                out[i] = fetch_prefix(*in[i].prompt, in[i].lora, in[i].cache_prompt, in[i].hint, should_stop);
            }
        }
        return out;
    }
    // several hinted prompts: at most MAX_FETCH_THREADS fetch at once (this thread and helpers
    // that each take the next hinted prompt until none is left), so a request of many prompts
    // cannot start a thread per prompt; `should_stop` (the request's connection) asked by one at a time
    std::mutex                   ask;
    const std::function<bool()>  stop = [&]() {
        std::lock_guard<std::mutex> g(ask);
        return should_stop && should_stop();
    };
    std::atomic<size_t>             next{ 0 };
    std::vector<std::exception_ptr> errors(in.size());
    const auto                      work = [&]() {
        for (size_t i; (i = next.fetch_add(1)) < in.size();) {
            if (!in[i].hint) {
                continue;
            }
            try {
                out[i] = fetch_prefix(*in[i].prompt, in[i].lora, in[i].cache_prompt, in[i].hint, stop);
            } catch (...) {
                errors[i] = std::current_exception();  // kv_load_failed: rethrown once every fetch ended
            }
        }
    };
    std::vector<std::thread> helpers;
    for (size_t k = 1; k < std::min(hinted, MAX_FETCH_THREADS); k++) {
        try {
            helpers.emplace_back(work);
        } catch (const std::system_error &) {
            break;  // no more threads to be had: those running (and this one) take the rest
        }
    }
    work();
    for (std::thread & t : helpers) {
        t.join();
    }
    std::exception_ptr failed;
    for (const std::exception_ptr & e : errors) {
        if (e && !failed) {
            failed = e;
        }
    }
    if (failed) {
        std::rethrow_exception(failed);
    }
    return out;
}

}  // namespace kvrelay_llama
