// kvrelay_llama_kv.cpp: the layout of llama.cpp's KV blocks, and the block store (see
// kvrelay_llama_kv.hpp). The descriptor format is llama_kv_range_desc's (llama-kv-range.patch,
// include/llama.h): magic "KVRG", version, layer count, V transposed, then per layer K and V
// types, K and V bytes of one position, and (transposed V) element bytes and elements.
#include "kvrelay_llama_kv.hpp"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <new>
#include <stdexcept>

namespace kvrelay_llama {
namespace {

constexpr uint32_t DESC_MAGIC   = 0x4752564b;  // "KVRG"
constexpr uint32_t DESC_VERSION = 1;           // LLAMA_KV_RANGE_VERSION of llama-kv-range.patch
constexpr uint32_t MAX_LAYERS   = 4096;

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

}  // namespace

size_t kv_schema::token_bytes() const {
    size_t n = 0;
    for (const kv_layer & l : layers) {
        n += size_t(l.k_row) + v_token_bytes(l);
    }
    return n;
}

bool parse_desc(const uint8_t * desc, size_t len, kv_schema & out, std::string & err) {
    reader r{ desc, len };
    const uint32_t magic   = r.get<uint32_t>();
    const uint32_t version = r.get<uint32_t>();
    const uint32_t n_layer = r.get<uint32_t>();
    const uint32_t trans   = r.get<uint32_t>();
    if (!r.ok || magic != DESC_MAGIC) {
        err = "the KV range descriptor is not one (bad magic or too short)";
        return false;
    }
    if (version != DESC_VERSION) {
        err = "the KV range descriptor has version " + std::to_string(version) + ", this build reads " +
              std::to_string(DESC_VERSION);
        return false;
    }
    if (n_layer == 0 || n_layer > MAX_LAYERS || trans > 1) {
        err = "the KV range descriptor names " + std::to_string(n_layer) + " layers (transposed " + std::to_string(trans) +
              ")";
        return false;
    }
    kv_schema s;
    s.v_trans = trans == 1;
    s.layers.resize(n_layer);
    for (kv_layer & l : s.layers) {
        l.k_type             = r.get<int32_t>();
        l.v_type             = r.get<int32_t>();
        l.k_row              = r.get<uint64_t>();
        const uint64_t v_row = r.get<uint64_t>();
        l.v_el               = r.get<uint32_t>();
        l.n_embd_v           = r.get<uint32_t>();
        l.v_row              = s.v_trans ? 0 : v_row;
        const bool sane      = l.k_row > 0 && l.k_row < (1u << 24) && v_row > 0 && v_row < (1u << 24) &&
                          (s.v_trans ? uint64_t(l.v_el) * l.n_embd_v == v_row && l.v_el > 0
                                     : l.v_el == 0 && l.n_embd_v == 0);
        if (!r.ok || !sane) {
            err = r.ok ? "the KV range descriptor has a layer with impossible row sizes"
                       : "the KV range descriptor ends early";
            return false;
        }
    }
    if (r.left != 0) {
        err = "bytes follow the KV range descriptor";
        return false;
    }
    s.desc.assign(desc, desc + len);
    out = std::move(s);
    return true;
}


block_store::block_store(size_t capacity, size_t block_bytes, uint8_t * pool) :
    capacity_(capacity),
    block_bytes_(block_bytes) {
    if (capacity == 0 || block_bytes == 0 || capacity > UINT32_MAX || block_bytes > SIZE_MAX / capacity) {
        throw std::invalid_argument("kvrelay: the KV block pool's size is out of range");
    }
    // 4 KiB aligned: the agent copies whole blocks, and a page-aligned pool suits every transport
    owned_ = pool == nullptr;
    pool_  = pool != nullptr ? pool
                             : static_cast<uint8_t *>(std::aligned_alloc(4096, ((capacity * block_bytes + 4095) / 4096) * 4096));
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
    if (owned_) {
        std::free(pool_);
    }
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
                                          const std::function<void(uint64_t)> & on_evict, size_t max_evict,
                                          bool lazy) {
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
            if (blocks_[i].st == state::COMMITTED && blocks_[i].pins == 0 && !blocks_[i].claimed) {
                lru.emplace_back(blocks_[i].used, i);
            }
        }
        const size_t want = std::min({ n - out.size(), lru.size(), max_evict });
        std::partial_sort(lru.begin(), lru.begin() + want, lru.end());
        if (lazy) {
            // claimed only: evicted by make_ready once the source said what comes
            const size_t free_ones = out.size();
            for (size_t i = 0; i < want; i++) {
                blocks_[lru[i].second].claimed = true;
                out.push_back(lru[i].second);
            }
            for (size_t i = 0; i < free_ones; i++) {
                blocks_[out[i]]    = entry{};
                blocks_[out[i]].st = state::RESERVED;
            }
            return out;
        }
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
            e = entry{ names[i], ++tick_, 0, state::COMMITTED, digests[i], false };
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

size_t block_store::make_ready(const uint32_t * ids, size_t n, const std::function<void(uint64_t)> & on_evict) {
    std::lock_guard<std::mutex> g(mu_);
    for (size_t i = 0; i < n; i++) {
        if (ids[i] >= blocks_.size()) {
            return i;
        }
        entry & e = blocks_[ids[i]];
        if (e.st == state::RESERVED) {
            continue;
        }
        if (e.st != state::COMMITTED || !e.claimed || e.pins > 0) {
            return i;  // a pin holds it (a peer reads it, a slot imports it): not now
        }
        by_name_.erase(e.name);
        evicted_++;
        if (on_evict) {
            on_evict(e.name);
        }
        e    = entry{};
        e.st = state::RESERVED;
    }
    return n;
}

void block_store::release(const uint32_t * ids, size_t n) {
    std::lock_guard<std::mutex> g(mu_);
    for (size_t i = 0; i < n; i++) {
        if (ids[i] < blocks_.size() && blocks_[ids[i]].st == state::RESERVED) {
            blocks_[ids[i]] = entry{};
            free_.push_back(ids[i]);
        } else if (ids[i] < blocks_.size() && blocks_[ids[i]].st == state::COMMITTED && blocks_[ids[i]].claimed) {
            blocks_[ids[i]].claimed = false;  // never made ready: still held as it was
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
