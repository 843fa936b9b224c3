// kvrelay_llama_kv.cpp: llama.cpp's sequence state as kvrelay blocks, and the block store
// (see kvrelay_llama_kv.hpp). The blob format is llama.cpp's (src/llama-kv-cache.cpp,
// state_write_meta / state_write_data of the pinned tree): magic, seq id, n_stream, then per
// stream a cell count and, when non-zero, the cells ({pos, n_seq_id, seq ids}) and the data
// (v_trans, n_layer, every layer's K {type, row size, rows}, every layer's V {type, row size,
// rows} or, transposed, {type, element size, n_embd_v, n_embd_v runs of one element per cell}).
#include "kvrelay_llama_kv.hpp"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <new>
#include <stdexcept>

namespace kvrelay_llama {
namespace {

constexpr uint32_t STATE_MAGIC = 0xaf143cd8;
constexpr uint32_t MAX_LAYERS  = 4096;

struct reader {
    const uint8_t * p;
    size_t          left;
    bool            ok = true;

    const uint8_t * take(size_t n) {
        if (!ok || left < n) {
            ok = false;
            return nullptr;
        }
        const uint8_t * r = p;
        p += n;
        left -= n;
        return r;
    }
    template <typename T> T get() {
        T v{};
        if (const uint8_t * b = take(sizeof(T))) {
            std::memcpy(&v, b, sizeof(T));
        }
        return v;
    }
};

template <typename T> void put(std::vector<uint8_t> & out, T v) {
    const size_t at = out.size();
    out.resize(at + sizeof(T));
    std::memcpy(out.data() + at, &v, sizeof(T));
}

bool mul_ok(size_t a, size_t b, size_t & r) {
    if (a != 0 && b > std::numeric_limits<size_t>::max() / a) {
        return false;
    }
    r = a * b;
    return true;
}

}  // namespace

size_t kv_schema::token_bytes() const {
    size_t n = 0;
    for (const kv_layer & l : layers) {
        n += size_t(l.k_row) + v_token_bytes(l);
    }
    return n;
}

bool parse_state(const uint8_t * blob, size_t len, kv_parsed & out, std::string & err) {
    reader r{ blob, len };
    out = kv_parsed{};
    if (r.get<uint32_t>() != STATE_MAGIC || !r.ok) {
        err = "the KV state blob has an unknown magic number (another llama.cpp build?)";
        return false;
    }
    (void) r.get<int32_t>();  // the sequence it came from
    const uint32_t n_stream = r.get<uint32_t>();
    if (!r.ok || n_stream == 0 || n_stream > 4096) {
        err = "the KV state blob names no stream";
        return false;
    }
    out.schema.n_stream = n_stream;
    bool seen           = false;
    for (uint32_t s = 0; s < n_stream; s++) {
        const uint32_t cells = r.get<uint32_t>();
        if (!r.ok) {
            err = "the KV state blob ends early";
            return false;
        }
        if (cells == 0) {
            continue;
        }
        if (seen) {
            err = "the KV state holds cells in more than one stream";
            return false;
        }
        seen      = true;
        out.cells = cells;
        // 12 bytes a cell follow: check before allocating for a count the blob cannot hold
        if (r.left / 12 < cells) {
            err = "the KV state blob ends early";
            return false;
        }
        std::vector<int32_t> pos(cells);
        for (uint32_t c = 0; c < cells; c++) {
            pos[c]                  = r.get<int32_t>();
            const uint32_t n_seq_id = r.get<uint32_t>();
            if (!r.ok || n_seq_id != 1) {
                err = "a KV cell of the state is not one sequence's (or carries an extension this integration does not read)";
                return false;
            }
            (void) r.get<int32_t>();
        }
        // position -> cell, for the leading run of positions 0, 1, ...
        std::vector<uint32_t> cell_of(cells, UINT32_MAX);
        for (uint32_t c = 0; c < cells; c++) {
            if (pos[c] >= 0 && uint32_t(pos[c]) < cells) {
                if (cell_of[pos[c]] != UINT32_MAX) {
                    err = "two KV cells of the state hold the same position";
                    return false;
                }
                cell_of[pos[c]] = c;
            }
        }
        size_t lead = 0;
        while (lead < cells && cell_of[lead] != UINT32_MAX) {
            lead++;
        }
        cell_of.resize(lead);
        out.cell_of = std::move(cell_of);

        const uint32_t v_trans = r.get<uint32_t>();
        const uint32_t n_layer = r.get<uint32_t>();
        if (!r.ok || v_trans > 1 || n_layer == 0 || n_layer > MAX_LAYERS) {
            err = "the KV state's layer header is not one this integration reads";
            return false;
        }
        out.schema.v_trans = v_trans == 1;
        out.schema.layers.resize(n_layer);
        for (kv_layer & l : out.schema.layers) {
            l.k_type = r.get<int32_t>();
            l.k_row  = r.get<uint64_t>();
            size_t n = 0;
            if (!r.ok || l.k_row == 0 || !mul_ok(cells, l.k_row, n)) {
                err = "a K row size of the state overflows";
                return false;
            }
            out.k.push_back(r.take(n));
        }
        for (kv_layer & l : out.schema.layers) {
            l.v_type = r.get<int32_t>();
            size_t n = 0;
            bool   fits;
            if (out.schema.v_trans) {
                l.v_el     = r.get<uint32_t>();
                l.n_embd_v = r.get<uint32_t>();
                size_t row = 0;
                fits       = l.v_el != 0 && l.n_embd_v != 0 && mul_ok(l.v_el, l.n_embd_v, row) && mul_ok(cells, row, n);
            } else {
                l.v_row = r.get<uint64_t>();
                fits    = l.v_row != 0 && mul_ok(cells, l.v_row, n);
            }
            if (!r.ok || !fits) {
                err = "a V size of the state overflows";
                return false;
            }
            out.v.push_back(r.take(n));
        }
        if (!r.ok) {
            err = "the KV state blob ends early";
            return false;
        }
    }
    if (!seen) {
        err = "the KV state holds no cell";
        return false;
    }
    if (r.left != 0) {
        err = "bytes follow the KV state's last layer (a memory this integration does not read: SWA, recurrent, hybrid)";
        return false;
    }
    return true;
}

void cut_blocks(const kv_schema & s, const kv_parsed & p, size_t from, size_t to, uint8_t * const * dst) {
    const size_t bt = s.block_tokens;
    for (size_t b = from; b < to; b++) {
        uint8_t *       o    = dst[b - from];
        const uint32_t  c0   = p.cell_of[b * bt];
        // the block's cells lie one after another in the blob (the usual case): runs, not cells
        bool            runs = true;
        for (size_t t = 1; t < bt && runs; t++) {
            runs = p.cell_of[b * bt + t] == c0 + t;
        }
        for (size_t l = 0; l < s.layers.size(); l++) {
            const size_t row = s.layers[l].k_row;
            if (runs) {
                std::memcpy(o, p.k[l] + size_t(c0) * row, bt * row);
            } else {
                for (size_t t = 0; t < bt; t++) {
                    std::memcpy(o + t * row, p.k[l] + size_t(p.cell_of[b * bt + t]) * row, row);
                }
            }
            o += bt * row;
        }
        for (size_t l = 0; l < s.layers.size(); l++) {
            const kv_layer & L = s.layers[l];
            if (!s.v_trans) {
                const size_t row = L.v_row;
                if (runs) {
                    std::memcpy(o, p.v[l] + size_t(c0) * row, bt * row);
                } else {
                    for (size_t t = 0; t < bt; t++) {
                        std::memcpy(o + t * row, p.v[l] + size_t(p.cell_of[b * bt + t]) * row, row);
                    }
                }
                o += bt * row;
                continue;
            }
            // transposed: element j of every cell lies in row j of p.cells elements
            const size_t el = L.v_el;
            for (size_t j = 0; j < L.n_embd_v; j++) {
                const uint8_t * rowp = p.v[l] + j * size_t(p.cells) * el;
                if (runs) {
                    std::memcpy(o, rowp + size_t(c0) * el, bt * el);
                } else {
                    for (size_t t = 0; t < bt; t++) {
                        std::memcpy(o + t * el, rowp + size_t(p.cell_of[b * bt + t]) * el, el);
                    }
                }
                o += bt * el;
            }
        }
    }
}

void build_import(const kv_schema & s, const uint8_t * const * src, size_t n, int32_t seq_id, std::vector<uint8_t> & out) {
    const size_t   bt    = s.block_tokens;
    const uint32_t cells = uint32_t(n * bt);
    out.clear();
    out.reserve(16 + size_t(cells) * 12 + 8 + s.layers.size() * 24 + n * s.block_bytes() + 4 * s.n_stream);
    put<uint32_t>(out, STATE_MAGIC);
    put<int32_t>(out, seq_id);
    put<uint32_t>(out, s.n_stream);
    // the cells in stream 0 (llama.cpp puts a sequence's cells into that sequence's stream)
    put<uint32_t>(out, cells);
    for (uint32_t c = 0; c < cells; c++) {
        put<int32_t>(out, int32_t(c));
        put<uint32_t>(out, 1);
        put<int32_t>(out, seq_id);
    }
    put<uint32_t>(out, s.v_trans ? 1 : 0);
    put<uint32_t>(out, uint32_t(s.layers.size()));
    size_t off = 0;  // of the layer's part within a block
    for (const kv_layer & l : s.layers) {
        put<int32_t>(out, l.k_type);
        put<uint64_t>(out, l.k_row);
        const size_t run = bt * l.k_row;
        for (size_t b = 0; b < n; b++) {
            out.insert(out.end(), src[b] + off, src[b] + off + run);
        }
        off += run;
    }
    for (const kv_layer & l : s.layers) {
        put<int32_t>(out, l.v_type);
        if (!s.v_trans) {
            put<uint64_t>(out, l.v_row);
            const size_t run = bt * l.v_row;
            for (size_t b = 0; b < n; b++) {
                out.insert(out.end(), src[b] + off, src[b] + off + run);
            }
            off += run;
            continue;
        }
        put<uint32_t>(out, l.v_el);
        put<uint32_t>(out, l.n_embd_v);
        const size_t run = bt * l.v_el;
        for (size_t j = 0; j < l.n_embd_v; j++) {
            for (size_t b = 0; b < n; b++) {
                out.insert(out.end(), src[b] + off + j * run, src[b] + off + (j + 1) * run);
            }
        }
        off += size_t(l.n_embd_v) * run;
    }
    for (uint32_t st = 1; st < s.n_stream; st++) {
        put<uint32_t>(out, 0);  // the other streams: no cell
    }
}

block_store::block_store(size_t capacity, size_t block_bytes) : capacity_(capacity), block_bytes_(block_bytes) {
    if (capacity == 0 || block_bytes == 0 || capacity > UINT32_MAX || block_bytes > SIZE_MAX / capacity) {
        throw std::invalid_argument("kvrelay: the KV block pool's size is out of range");
    }
    // 4 KiB aligned: the agent copies whole blocks, and a page-aligned pool suits every transport
    pool_ = static_cast<uint8_t *>(std::aligned_alloc(4096, ((capacity * block_bytes + 4095) / 4096) * 4096));
    if (pool_ == nullptr) {
        throw std::bad_alloc();
    }
    blocks_.resize(capacity);
    free_.reserve(capacity);
    for (size_t i = capacity; i-- > 0;) {
        free_.push_back(uint32_t(i));  // block 0 is handed out first
    }
    by_name_.reserve(capacity);
}

block_store::~block_store() {
    std::free(pool_);
}

size_t block_store::held(const uint64_t * names, const digest * digests, size_t n) const {
    std::lock_guard<std::mutex> g(mu_);
    size_t                      k = 0;
    for (; k < n; k++) {
        const auto it = by_name_.find(names[k]);
        if (it == by_name_.end() || blocks_[it->second].dig != digests[k]) {
            break;
        }
    }
    return k;
}

size_t block_store::pin_checked(const uint64_t * names, const digest * digests, size_t n, uint32_t * ids_out) {
    std::lock_guard<std::mutex> g(mu_);
    size_t                      k = 0;
    for (; k < n; k++) {
        const auto it = by_name_.find(names[k]);
        if (it == by_name_.end()) {
            break;
        }
        entry & e = blocks_[it->second];
        if (e.dig != digests[k]) {
            // the name is held, for other tokens: never this slot's KV
            name_collisions_++;
            break;
        }
        e.pins++;
        e.used     = ++tick_;
        ids_out[k] = it->second;
    }
    return k;
}

size_t block_store::pin(const uint64_t * names, size_t n, uint32_t * ids_out) {
    std::lock_guard<std::mutex> g(mu_);
    size_t                      k = 0;
    for (; k < n; k++) {
        const auto it = by_name_.find(names[k]);
        if (it == by_name_.end()) {
            break;
        }
        entry & e = blocks_[it->second];
        e.pins++;
        e.used     = ++tick_;
        ids_out[k] = it->second;
    }
    return k;
}

void block_store::unpin(const uint32_t * ids, size_t n) {
    std::lock_guard<std::mutex> g(mu_);
    for (size_t i = 0; i < n; i++) {
        if (ids[i] < blocks_.size() && blocks_[ids[i]].pins > 0) {
            blocks_[ids[i]].pins--;
        } else {
            unpin_unheld_++;
        }
    }
}

std::vector<uint32_t> block_store::reserve(size_t n, std::vector<uint64_t> * evicted,
                                          const std::function<void(uint64_t)> & on_evict) {
    std::lock_guard<std::mutex> g(mu_);
    std::vector<uint32_t>       out;
    out.reserve(std::min(n, capacity_));
    while (out.size() < n && !free_.empty()) {
        out.push_back(free_.back());
        free_.pop_back();
    }
    if (out.size() < n) {
        // evict the least recently used committed blocks no pin holds
        std::vector<std::pair<uint64_t, uint32_t>> lru;
        for (uint32_t i = 0; i < blocks_.size(); i++) {
            if (blocks_[i].st == state::COMMITTED && blocks_[i].pins == 0) {
                lru.emplace_back(blocks_[i].used, i);
            }
        }
        const size_t want = std::min(n - out.size(), lru.size());
        std::partial_sort(lru.begin(), lru.begin() + want, lru.end());
        for (size_t i = 0; i < want; i++) {
            entry & e = blocks_[lru[i].second];
            by_name_.erase(e.name);
            evicted_++;
            if (evicted != nullptr) {
                evicted->push_back(e.name);
            }
            if (on_evict) {
                on_evict(e.name);
            }
            out.push_back(lru[i].second);
        }
    }
    for (uint32_t id : out) {
        blocks_[id]    = entry{};
        blocks_[id].st = state::RESERVED;
    }
    return out;
}

std::vector<size_t> block_store::commit(const uint32_t * ids, const uint64_t * names, const digest * digests,
                                        size_t n, const std::function<void(size_t)> & on_stored) {
    std::lock_guard<std::mutex> g(mu_);
    std::vector<size_t>         fresh;
    fresh.reserve(n);
    for (size_t i = 0; i < n; i++) {
        if (ids[i] >= blocks_.size() || blocks_[ids[i]].st != state::RESERVED) {
            commit_not_reserved_++;
            continue;
        }
        entry & e = blocks_[ids[i]];
        if (by_name_.emplace(names[i], ids[i]).second) {
            e = entry{ names[i], ++tick_, 0, state::COMMITTED, digests[i] };
            fresh.push_back(i);
            if (on_stored) {
                on_stored(i);
            }
        } else {
            e = entry{};
            free_.push_back(ids[i]);
        }
    }
    return fresh;
}

void block_store::release(const uint32_t * ids, size_t n) {
    std::lock_guard<std::mutex> g(mu_);
    for (size_t i = 0; i < n; i++) {
        if (ids[i] < blocks_.size() && blocks_[ids[i]].st == state::RESERVED) {
            blocks_[ids[i]] = entry{};
            free_.push_back(ids[i]);
        } else {
            release_not_reserved_++;
        }
    }
}

block_store::counts block_store::read_counts() const {
    std::lock_guard<std::mutex> g(mu_);
    counts                      c;
    c.committed = by_name_.size();
    for (const entry & e : blocks_) {
        c.pinned += e.pins > 0 ? 1 : 0;
    }
    c.evicted              = evicted_;
    c.unpin_unheld         = unpin_unheld_;
    c.commit_not_reserved  = commit_not_reserved_;
    c.release_not_reserved = release_not_reserved_;
    c.name_collisions      = name_collisions_;
    return c;
}

}  // namespace kvrelay_llama
