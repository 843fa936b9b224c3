// Unit tests of kvrelay_llama_kv (no llama.cpp, no model): the sequence-state blob read and
// written as blocks, and the block store.
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

// A blob as llama.cpp writes it for cells in `order` (order[c] = the position of blob cell c),
// each cell's bytes taken from the blocks `blocks` (position p lies in block p / bt).
static std::vector<uint8_t> blob_in_order(const kv_schema & s, const std::vector<uint8_t> & blocks,
                                          const std::vector<uint32_t> & order, uint32_t n_stream = 1) {
    const size_t bt = s.block_tokens, bb = s.block_bytes();
    std::vector<uint8_t> o;
    put<uint32_t>(o, 0xaf143cd8);
    put<int32_t>(o, 0);
    put<uint32_t>(o, n_stream);
    put<uint32_t>(o, uint32_t(order.size()));
    for (uint32_t p : order) {
        put<int32_t>(o, int32_t(p));
        put<uint32_t>(o, 1);
        put<int32_t>(o, 0);
    }
    put<uint32_t>(o, s.v_trans ? 1 : 0);
    put<uint32_t>(o, uint32_t(s.layers.size()));
    size_t off = 0;
    for (const kv_layer & l : s.layers) {
        put<int32_t>(o, l.k_type);
        put<uint64_t>(o, l.k_row);
        for (uint32_t p : order) {
            const uint8_t * b = blocks.data() + (p / bt) * bb + off + (p % bt) * l.k_row;
            o.insert(o.end(), b, b + l.k_row);
        }
        off += bt * l.k_row;
    }
    for (const kv_layer & l : s.layers) {
        put<int32_t>(o, l.v_type);
        if (!s.v_trans) {
            put<uint64_t>(o, l.v_row);
            for (uint32_t p : order) {
                const uint8_t * b = blocks.data() + (p / bt) * bb + off + (p % bt) * l.v_row;
                o.insert(o.end(), b, b + l.v_row);
            }
            off += bt * l.v_row;
            continue;
        }
        put<uint32_t>(o, l.v_el);
        put<uint32_t>(o, l.n_embd_v);
        for (size_t j = 0; j < l.n_embd_v; j++) {
            for (uint32_t p : order) {
                const uint8_t * b = blocks.data() + (p / bt) * bb + off + j * bt * l.v_el + (p % bt) * l.v_el;
                o.insert(o.end(), b, b + l.v_el);
            }
        }
        off += size_t(l.n_embd_v) * bt * l.v_el;
    }
    for (uint32_t st = 1; st < n_stream; st++) {
        put<uint32_t>(o, 0);
    }
    return o;
}

static std::vector<uint8_t> cut(const kv_schema & s, const kv_parsed & p, size_t from, size_t to) {
    std::vector<uint8_t>   out((to - from) * s.block_bytes());
    std::vector<uint8_t *> dst;
    for (size_t i = 0; i < to - from; i++) {
        dst.push_back(out.data() + i * s.block_bytes());
    }
    cut_blocks(s, p, from, to, dst.data());
    return out;
}

static void state_round_trips(bool v_trans) {
    const kv_schema s  = schema(v_trans);
    const size_t    n  = 3, bb = s.block_bytes();
    CHECK(bb == 2 * 3 * (8 + 8));
    std::vector<uint8_t> blocks(n * bb);
    for (size_t i = 0; i < blocks.size(); i++) {
        blocks[i] = uint8_t(i * 7 + 3);
    }
    std::vector<const uint8_t *> src;
    for (size_t b = 0; b < n; b++) {
        src.push_back(blocks.data() + b * bb);
    }
    // build_import writes what llama.cpp writes for cells in position order
    std::vector<uint8_t> blob;
    build_import(s, src.data(), n, 5, blob);
    std::vector<uint32_t> in_order(n * s.block_tokens);
    std::iota(in_order.begin(), in_order.end(), 0);
    std::vector<uint8_t> want = blob_in_order(s, blocks, in_order);
    std::memcpy(want.data() + 4, blob.data() + 4, 4);  // the seq id
    for (size_t c = 0; c < in_order.size(); c++) {
        std::memcpy(want.data() + 16 + c * 12 + 8, blob.data() + 16 + c * 12 + 8, 4);
    }
    CHECK(blob == want);

    kv_parsed   p;
    std::string err;
    CHECK(parse_state(blob.data(), blob.size(), p, err));
    CHECK(p.cells == n * s.block_tokens && p.cell_of.size() == n * s.block_tokens);
    kv_schema got = p.schema;
    got.block_tokens = s.block_tokens;
    CHECK(got.same_layout(s));
    CHECK(cut(s, p, 0, n) == blocks);
    CHECK(cut(s, p, 1, n) == std::vector<uint8_t>(blocks.begin() + bb, blocks.end()));

    // cells out of order (llama.cpp places them wherever cells are free): cut by position
    std::vector<uint32_t> shuffled = { 3, 0, 5, 1, 4, 2 };
    std::vector<uint8_t>  blob2    = blob_in_order(s, blocks, shuffled);
    CHECK(parse_state(blob2.data(), blob2.size(), p, err));
    CHECK(cut(s, p, 0, n) == blocks);

    // several streams, one of them holding the cells
    std::vector<uint8_t> blob3 = blob_in_order(s, blocks, in_order, 4);
    CHECK(parse_state(blob3.data(), blob3.size(), p, err) && p.schema.n_stream == 4);
    CHECK(cut(s, p, 0, n) == blocks);

    // a gap in the positions: cell_of stops before it
    std::vector<uint32_t> gap = { 0, 1, 2, 4, 5, 6 };
    std::vector<uint8_t>  b4  = blob_in_order(s, std::vector<uint8_t>(4 * bb), gap);
    CHECK(parse_state(b4.data(), b4.size(), p, err) && p.cell_of.size() == 3);

    // refused: truncated, trailing bytes, another magic, two positions alike, nothing
    CHECK(!parse_state(blob.data(), blob.size() - 1, p, err));
    std::vector<uint8_t> longer = blob;
    longer.push_back(0);
    CHECK(!parse_state(longer.data(), longer.size(), p, err) && err.find("follow") != std::string::npos);
    std::vector<uint8_t> magic = blob;
    magic[0] ^= 1;
    CHECK(!parse_state(magic.data(), magic.size(), p, err));
    std::vector<uint32_t> twice = { 0, 1, 1, 3, 4, 5 };
    std::vector<uint8_t>  b5    = blob_in_order(s, blocks, twice);
    CHECK(!parse_state(b5.data(), b5.size(), p, err));
    CHECK(!parse_state(nullptr, 0, p, err));
    // a cell count the blob cannot hold is refused before anything is allocated for it
    std::vector<uint8_t> huge;
    put<uint32_t>(huge, 0xaf143cd8);
    put<int32_t>(huge, 0);
    put<uint32_t>(huge, 1);
    put<uint32_t>(huge, 0xffffffffu);
    CHECK(!parse_state(huge.data(), huge.size(), p, err) && err.find("early") != std::string::npos);
}

// A stand-in content digest: one per name (a block's tokens), another for a collision.
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
    state_round_trips(true);
    state_round_trips(false);
    store_works();
    store_events_follow_the_store();
    if (failures != 0) {
        std::fprintf(stderr, "%d check(s) failed\n", failures);
        return 1;
    }
    std::printf("kv_unit_test: all checks passed\n");
    return 0;
}
