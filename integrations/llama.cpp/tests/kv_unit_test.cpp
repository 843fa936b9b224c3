// Unit tests of kvrelay_llama_kv (no llama.cpp, no model): libllama's KV range descriptor read
// as a block layout, and the block store. (The range API itself: range_api_test.cpp.)
//
//   g++ -std=c++17 -Wall -Wextra -Werror -Iinclude -Iintegrations/llama.cpp/src
//       integrations/llama.cpp/tests/kv_unit_test.cpp integrations/llama.cpp/src/kvrelay_llama_kv.cpp
//       -o kv_unit_test   (one command; no library to link)
#include "kvrelay_llama_kv.hpp"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <set>
#include <thread>
#include <string>
#include <vector>

using namespace kvrelay_llama;

static int failures = 0;
#define CHECK(cond)                                                        \
    do {                                                                   \
        if (!(cond)) {                                                     \
            std::fprintf(stderr, "FAIL %s:%d: %s\n", __FILE__, __LINE__, #cond); \
            failures++;                                                    \
        }                                                                  \
    } while (0)

static kv_schema schema(bool v_trans) {
    kv_schema s;
    s.v_trans = v_trans;
    s.block_tokens = 2;
    for (int l = 0; l < 3; l++) {
        kv_layer L;
        L.k_type = 1;
        L.k_row  = 8;
        L.v_type = 1;
        if (v_trans) {
            L.v_el     = 2;
            L.n_embd_v = 4;
        } else {
            L.v_row = 8;
        }
        s.layers.push_back(L);
    }
    return s;
}

template <typename T> static void put(std::vector<uint8_t> & o, T v) {
    const size_t at = o.size();
    o.resize(at + sizeof v);
    std::memcpy(o.data() + at, &v, sizeof v);
}

// A descriptor as llama_kv_range_desc writes one (llama-kv-range.patch) for schema `s`.
static std::vector<uint8_t> desc_of(const kv_schema & s, uint32_t version = 1) {
    std::vector<uint8_t> o;
    put<uint32_t>(o, 0x4752564b);
    put<uint32_t>(o, version);
    put<uint32_t>(o, uint32_t(s.layers.size()));
    put<uint32_t>(o, s.v_trans ? 1 : 0);
    for (const kv_layer & l : s.layers) {
        put<int32_t>(o, l.k_type);
        put<int32_t>(o, l.v_type);
        put<uint64_t>(o, l.k_row);
        put<uint64_t>(o, s.v_trans ? uint64_t(l.v_el) * l.n_embd_v : l.v_row);
        put<uint32_t>(o, l.v_el);
        put<uint32_t>(o, l.n_embd_v);
    }
    return o;
}

static void desc_parses(bool v_trans) {
    const kv_schema            s = schema(v_trans);
    const std::vector<uint8_t> d = desc_of(s);
    kv_schema                  got;
    std::string                err;
    CHECK(parse_desc(d.data(), d.size(), got, err));
    CHECK(got.v_trans == v_trans && got.layers == s.layers && got.desc == d && got.block_tokens == 0);
    got.block_tokens = s.block_tokens;
    CHECK(got.block_bytes() == s.block_bytes() && got.token_bytes() == 3 * (8 + 8));
    // each way a descriptor can be wrong is refused, with a reason
    const std::vector<uint8_t> v2 = desc_of(s, 2);
    CHECK(!parse_desc(v2.data(), v2.size(), got, err) && err.find("version 2") != std::string::npos);
    CHECK(!parse_desc(d.data(), d.size() - 1, got, err) && err.find("early") != std::string::npos);
    std::vector<uint8_t> longer = d;
    longer.push_back(0);
    CHECK(!parse_desc(longer.data(), longer.size(), got, err) && err.find("follow") != std::string::npos);
    std::vector<uint8_t> magic = d;
    magic[0] ^= 1;
    CHECK(!parse_desc(magic.data(), magic.size(), got, err) && err.find("magic") != std::string::npos);
    CHECK(!parse_desc(nullptr, 0, got, err));
    kv_schema none = s;
    none.layers.clear();
    const std::vector<uint8_t> zero = desc_of(none);
    CHECK(!parse_desc(zero.data(), zero.size(), got, err) && err.find("0 layers") != std::string::npos);
    // a V row that does not match the element size times the elements (transposed), or element
    // fields set for plain V
    kv_schema odd = s;
    if (v_trans) {
        odd.layers[1].v_el = 0;
    } else {
        odd.layers[1].v_el = 2;
    }
    std::vector<uint8_t> bad = desc_of(odd);
    if (v_trans) {  // the row field still says 8 bytes
        const uint64_t row = 8;
        std::memcpy(bad.data() + 16 + 32 + 16, &row, sizeof row);
    }
    CHECK(!parse_desc(bad.data(), bad.size(), got, err) && err.find("impossible") != std::string::npos);
    // a failed parse leaves `out` as it was
    kv_schema kept = s;
    CHECK(!parse_desc(v2.data(), v2.size(), kept, err) && kept.layers == s.layers && kept.desc.empty());
}

static block_store::digest dig(uint64_t name, uint8_t tenant = 0) {
    block_store::digest d{};
    std::memcpy(d.data(), &name, sizeof name);
    d[31] = tenant;
    return d;
}

static void store_works() {
    block_store st(4, 64);
    CHECK(reinterpret_cast<uintptr_t>(st.pool()) % 4096 == 0);
    const uint64_t names[] = { 11, 22, 33, 44, 55 };
    const block_store::digest digs[] = { dig(11), dig(22), dig(33), dig(44), dig(55) };
    std::vector<uint32_t> ids = st.reserve(3);
    CHECK(ids.size() == 3);
    CHECK(st.held(names, digs, 5) == 0);
    std::vector<size_t> fresh = st.commit(ids.data(), names, digs, 3);
    CHECK(fresh == (std::vector<size_t>{ 0, 1, 2 }));
    CHECK(st.held(names, digs, 5) == 3);
    // the same names for other tokens (a collision): not held, never pinned, counted
    const block_store::digest theirs[] = { dig(11), dig(22, 1), dig(33) };
    uint32_t                  got[3];
    CHECK(st.held(names, theirs, 3) == 1);
    CHECK(st.pin_checked(names, theirs, 3, got) == 1 && st.read_counts().name_collisions == 1);
    st.unpin(got, 1);
    CHECK(st.pin_checked(names, digs, 3, got) == 3);
    st.unpin(got, 3);
    CHECK(st.read_counts().pinned == 0 && st.read_counts().name_collisions == 1);
    // pin the leading run: 11, 22, 33
    uint32_t pinned[5];
    CHECK(st.pin(names, 5, pinned) == 3);
    CHECK(st.read_counts().pinned == 3);
    // all but one free block pinned: a reservation of 2 gets the free one only
    std::vector<uint64_t> evicted;
    std::vector<uint32_t> more = st.reserve(2, &evicted);
    CHECK(more.size() == 1 && evicted.empty());
    st.release(more.data(), more.size());
    st.unpin(pinned, 3);
    CHECK(st.read_counts().pinned == 0);
    // use 11 again, so 22 is the least recently used committed block
    uint32_t one;
    CHECK(st.pin(names, 1, &one) == 1);
    st.unpin(&one, 1);
    more = st.reserve(2, &evicted);
    CHECK(more.size() == 2 && evicted == std::vector<uint64_t>{ 22 });
    CHECK(st.held(names, digs, 5) == 1);  // 22 is gone: the run stops there
    // committing a name already held frees the new block (and keeps the held block's digest)
    const uint64_t            again[]      = { 11, 44 };
    const block_store::digest again_digs[] = { dig(11, 2), dig(44) };
    fresh = st.commit(more.data(), again, again_digs, 2);
    CHECK(fresh == std::vector<size_t>{ 1 });
    CHECK(st.read_counts().committed == 3 && st.read_counts().evicted == 1);
    // commit and release ignore blocks that are not reserved, and count them
    st.release(ids.data(), 1);
    CHECK(st.held(names, digs, 1) == 1 && st.read_counts().release_not_reserved == 1);
    const uint64_t            other     = 99;
    const block_store::digest other_dig = dig(99);
    CHECK(st.commit(ids.data(), &other, &other_dig, 1).empty() && st.held(&other, &other_dig, 1) == 0);
    CHECK(st.read_counts().commit_not_reserved == 1);
    // a second unpin of one pin takes nothing from another holder's pin, and is counted
    uint32_t a, b;
    CHECK(st.pin(names, 1, &a) == 1 && st.pin(names, 1, &b) == 1 && a == b);
    st.unpin(&a, 1);
    st.unpin(&b, 1);
    CHECK(st.read_counts().pinned == 0 && st.read_counts().unpin_unheld == 0);
    st.unpin(&a, 1);  // a double unpin: no pin left to take
    CHECK(st.read_counts().unpin_unheld == 1);
    bool threw = false;
    try {
        block_store bad(0, 64);
    } catch (const std::invalid_argument &) {
        threw = true;
    }
    CHECK(threw);
    // a bounded share: a reservation evicts at most max_evict committed blocks (free ones first)
    block_store                 full(8, 64);
    std::vector<uint32_t>       all = full.reserve(8);
    std::vector<uint64_t>       names8(8);
    std::vector<block_store::digest> digs8(8);
    for (uint64_t i = 0; i < 8; i++) {
        names8[i] = 100 + i;
        digs8[i]  = dig(100 + i);
    }
    CHECK(full.commit(all.data(), names8.data(), digs8.data(), 8).size() == 8);
    std::vector<uint64_t> gone;
    std::vector<uint32_t> two = full.reserve(5, &gone, nullptr, 2);
    CHECK(two.size() == 2 && gone.size() == 2 && full.read_counts().committed == 6);
    full.release(two.data(), two.size());
    std::vector<uint32_t> back = full.reserve(5, &gone, nullptr, 0);  // the 2 free ones, no eviction
    CHECK(back.size() == 2 && gone.size() == 2 && full.read_counts().committed == 6);
    full.release(back.data(), back.size());
}

// Lazy reservations (a fetch's destination): committed blocks are only claimed, still held and
// pinnable; make_ready evicts them in order once the source said what comes, stopping at one a
// pin holds; release gives claimed ones back as they were; another reservation never takes a
// claimed block.
static void lazy_reservations_evict_only_what_comes() {
    block_store                      st(6, 64);
    std::vector<uint32_t>            all = st.reserve(6);
    std::vector<uint64_t>            names(6);
    std::vector<block_store::digest> digs(6);
    for (uint64_t i = 0; i < 6; i++) {
        names[i] = 300 + i;
        digs[i]  = dig(300 + i);
    }
    CHECK(st.commit(all.data(), names.data(), digs.data(), 6).size() == 6);
    std::vector<uint64_t> removed;
    auto on_evict = [&](uint64_t n) { removed.push_back(n); };
    std::vector<uint32_t> claim = st.reserve(4, nullptr, on_evict, 3, true);
    CHECK(claim.size() == 3 && removed.empty() && st.read_counts().committed == 6 && st.read_counts().evicted == 0);
    // another reservation cannot take what is claimed: 3 unclaimed blocks remain
    std::vector<uint32_t> other = st.reserve(6, nullptr, on_evict, 6);
    CHECK(other.size() == 3 && removed.size() == 3);
    st.release(other.data(), other.size());
    removed.clear();
    // a source that sends nothing: released, everything claimed still held, nothing evicted
    st.release(claim.data(), claim.size());
    CHECK(removed.empty() && st.read_counts().committed == 3 && st.read_counts().release_not_reserved == 0);
    const uint64_t n0 = names[claim[0]];
    const block_store::digest d0 = dig(n0);
    CHECK(st.held(&n0, &d0, 1) == 1);
    // a full store again, then a claim of 3: made ready in order, evicted only as they come
    std::vector<uint32_t> refill = st.reserve(3);
    std::vector<uint64_t> rn{ 400, 401, 402 };
    std::vector<block_store::digest> rd{ dig(400), dig(401), dig(402) };
    CHECK(refill.size() == 3 && st.commit(refill.data(), rn.data(), rd.data(), 3).size() == 3);
    claim = st.reserve(3, nullptr, on_evict, 3, true);
    CHECK(claim.size() == 3 && removed.empty() && st.read_counts().committed == 6);
    CHECK(st.make_ready(claim.data(), 1, on_evict) == 1 && removed.size() == 1 && st.read_counts().committed == 5);
    // the third is pinned meanwhile (a peer reads it): ready stops before it, nothing evicted for it
    uint64_t third = 0;
    for (uint64_t n = 300; n < 306; n++) {
        const block_store::digest d = dig(n);
        uint32_t                  id = 0;
        if (st.pin_checked(&n, &d, 1, &id) == 1) {
            third = id == claim[2] ? n : third;
            st.unpin(&id, 1);
        }
    }
    for (uint64_t n = 400; n < 403; n++) {
        const block_store::digest d = dig(n);
        uint32_t                  id = 0;
        if (st.pin_checked(&n, &d, 1, &id) == 1) {
            third = id == claim[2] ? n : third;
            st.unpin(&id, 1);
        }
    }
    CHECK(third != 0);
    uint32_t pinned = 0;
    CHECK(st.pin(&third, 1, &pinned) == 1 && pinned == claim[2]);
    CHECK(st.make_ready(claim.data(), 3, on_evict) == 2 && removed.size() == 2);
    st.unpin(&pinned, 1);
    CHECK(st.make_ready(claim.data(), 3, on_evict) == 3 && removed.size() == 3 && st.read_counts().committed == 3);
    // the fetch took two: committed under new names; the third goes back free
    std::vector<uint64_t>            fn{ 500, 501 };
    std::vector<block_store::digest> fd{ dig(500), dig(501) };
    CHECK(st.commit(claim.data(), fn.data(), fd.data(), 2).size() == 2);
    st.release(claim.data() + 2, 1);
    CHECK(st.read_counts().committed == 5 && st.read_counts().release_not_reserved == 0
          && st.read_counts().commit_not_reserved == 0);
}

// Commits and evictions racing on two threads: the events the store reports (under its own
// lock), replayed in their order into a set, give exactly the names the store holds, as a
// router's index built from KV events must.
static void store_events_follow_the_store() {
    block_store                        st(16, 64);
    std::vector<std::pair<bool, uint64_t>> log;  // (stored?, name), appended under the store's lock only
    auto work = [&](uint64_t base) {
        for (uint64_t k = 0; k < 3000; k++) {
            std::vector<uint32_t> ids = st.reserve(2, nullptr, [&](uint64_t name) { log.emplace_back(false, name); });
            // names repeat across the threads (k % 40): a commit may find its name held already
            std::vector<uint64_t>            names(ids.size());
            std::vector<block_store::digest> digs(ids.size());
            for (size_t i = 0; i < names.size(); i++) {
                names[i] = 1 + (base + k * 2 + i) % 40;
                digs[i]  = dig(names[i]);
            }
            st.commit(ids.data(), names.data(), digs.data(), ids.size(),
                      [&](size_t i) { log.emplace_back(true, names[i]); });
        }
    };
    std::thread t1(work, 0), t2(work, 7);
    t1.join();
    t2.join();
    std::set<uint64_t> index;
    bool               consistent = true;
    for (const auto & [stored, name] : log) {
        if (stored) {
            consistent = index.insert(name).second && consistent;  // never stored twice without a removal
        } else {
            consistent = index.erase(name) == 1 && consistent;  // never removed unless stored
        }
    }
    CHECK(consistent);
    size_t held = 0;
    for (uint64_t name = 1; name <= 40; name++) {
        const block_store::digest d        = dig(name);
        const bool                in_store = st.held(&name, &d, 1) == 1;
        held += in_store ? 1 : 0;
        CHECK(in_store == (index.count(name) == 1));
    }
    CHECK(held == st.read_counts().committed && held == index.size() && st.read_counts().evicted > 1000);
}

int main() {
    desc_parses(true);
    desc_parses(false);
    store_works();
    store_events_follow_the_store();
    lazy_reservations_evict_only_what_comes();
    if (failures != 0) {
        std::fprintf(stderr, "%d check(s) failed\n", failures);
        return 1;
    }
    std::printf("kv_unit_test: all checks passed\n");
    return 0;
}
