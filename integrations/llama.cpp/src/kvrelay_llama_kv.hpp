// kvrelay_llama_kv.hpp: the KV side of kvrelay inside llama-server (see kvrelay_llama.hpp).
//
// Two pieces with no llama.cpp types in them, so that they build and test on their own:
// - kv_schema: the layout of a block, read off libllama's KV range descriptor
//   (llama_kv_range_desc, llama-kv-range.patch), which every range copy hands back;
// - block_store: the server's reuse cache of named blocks in one host pool, which the KV agent
//   serves from (kvrelay::BlockHolder) and fetches into.
#pragma once

#include "kvrelay.hpp"

#include <cstddef>
#include <cstdint>
#include <memory>
#include <functional>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

namespace kvrelay_llama {

/// One layer's rows in a block.
struct kv_layer {
    int32_t  k_type   = 0;
    uint64_t k_row    = 0;  // bytes of one cell's K
    int32_t  v_type   = 0;
    uint64_t v_row    = 0;  // V not transposed: bytes of one cell's V
    uint32_t v_el     = 0;  // V transposed: bytes of one element
    uint32_t n_embd_v = 0;  // V transposed: elements of one cell's V
    bool operator==(const kv_layer & o) const {
        return k_type == o.k_type && k_row == o.k_row && v_type == o.v_type && v_row == o.v_row && v_el == o.v_el &&
               n_embd_v == o.n_embd_v;
    }
};

/// The KV layout of one context (llama_kv_range_desc, read at start). A block is
/// `block_tokens` positions, stored as llama_kv_range_get writes one: every layer's K
/// (block_tokens rows each), then every layer's V (its block_tokens rows, or, transposed,
/// n_embd_v runs of block_tokens elements).
struct kv_schema {
    bool                  v_trans      = false;
    std::vector<kv_layer> layers;
    size_t                block_tokens = 0;
    std::vector<uint8_t>  desc;  // the descriptor itself, handed to every range call

    bool   empty() const { return layers.empty(); }
    size_t v_token_bytes(const kv_layer & l) const { return v_trans ? size_t(l.n_embd_v) * l.v_el : size_t(l.v_row); }
    size_t token_bytes() const;
    size_t block_bytes() const { return token_bytes() * block_tokens; }
};

/// Parse a descriptor llama_kv_range_desc wrote (version 1). Returns false with `err` for a
/// descriptor of another version, one that ends early or has bytes after it, and impossible
/// layer counts or row sizes. `out.block_tokens` is left 0. O(layers).
bool parse_desc(const uint8_t * desc, size_t len, kv_schema & out, std::string & err);

/// The server's reuse cache: `capacity` blocks of `block_bytes` in one host pool, each free,
/// reserved (being written: a fetch or an export), or committed under its name (readable,
/// servable). Committed blocks no pin holds are evicted least recently used first when a
/// reservation needs room. Thread-safe: the agent's connection threads pin and unpin, request
/// threads reserve and commit fetched blocks, the main loop commits exports and pins imports.
class block_store : public kvrelay::BlockHolder {
  public:
    /// A block's content digest (kvrelay::Naming::digests over the tokens whose KV it holds).
    using digest = kvrelay::BlockDigest;

    /// `pool`: capacity * block_bytes bytes the caller allocated (pinned host memory where the
    /// KV lives on a GPU) and keeps alive for the store's life; null: the store allocates its own
    /// (4 KiB aligned host memory, freed with it).
    block_store(size_t capacity, size_t block_bytes, uint8_t * pool = nullptr);
    ~block_store() override;
    block_store(const block_store &)             = delete;
    block_store & operator=(const block_store &) = delete;

    size_t    capacity() const { return capacity_; }
    size_t    block_bytes() const { return block_bytes_; }
    uint8_t * pool() const { return pool_; }
    uint8_t * block(uint32_t id) const { return pool_ + size_t(id) * block_bytes_; }

    /// How many leading `names` are committed with the content `digests` (one per name). O(n).
    size_t held(const uint64_t * names, const digest * digests, size_t n) const;
    /// Pin the leading committed run of `names` (kvrelay::BlockHolder: the agent's serving side,
    /// which sends each block's recorded digest for the reader to check).
    size_t pin(const uint64_t * names, size_t n, uint32_t * ids_out) override;
    /// Pin the leading committed run of `names` whose blocks hold the content `digests[i]` (what
    /// a slot imports and an export keeps): a name committed for other tokens ends the run and
    /// is counted (name_collisions), never pinned. O(n).
    size_t pin_checked(const uint64_t * names, const digest * digests, size_t n, uint32_t * ids_out);
    void   unpin(const uint32_t * ids, size_t n) override;
    /// Blocks a NIXL fetch withheld are free again.
    void   returned(const uint32_t * ids, size_t n) override { release(ids, n); }
    /// Up to `n` blocks to write (free ones first, then the least recently used unpinned
    /// committed ones, whose names are dropped and, when `evicted` is given, appended to it).
    /// Fewer when everything else is pinned or reserved. `on_evict`, when given, is called
    /// with each evicted name under the store's lock: in the store's own order with every
    /// other commit and eviction (KV events published there never invert). At most `max_evict`
    /// committed blocks are evicted (a fetch's bounded share of the store).
    /// `lazy` (a fetch's destination): the committed blocks are only claimed, not evicted: they
    /// stay readable and servable (a claimed block is never chosen by another reservation)
    /// until `make_ready` evicts them once the source's offer said how many blocks come, so
    /// that a source lacking the blocks costs nothing; `release` gives the rest back unharmed.
    std::vector<uint32_t> reserve(size_t n, std::vector<uint64_t> * evicted = nullptr,
                                  const std::function<void(uint64_t)> & on_evict = nullptr,
                                  size_t max_evict = SIZE_MAX, bool lazy = false);
    /// Make the reserved `ids[0..n]` ready to be written: a claimed block (`reserve(..., lazy)`)
    /// is evicted now (its name dropped, `on_evict` called under the store's lock), unless a pin
    /// holds it. Returns how many leading blocks are ready; stops at the first that cannot be.
    size_t make_ready(const uint32_t * ids, size_t n, const std::function<void(uint64_t)> & on_evict = nullptr);
    /// Commit reserved `ids[i]` under `names[i]` with content digest `digests[i]`; a name already
    /// committed keeps its block (and its digest) and the new one is freed. Every block is checked reserved; one that is not is left alone
    /// and counted (misuse). Returns the positions `i` committed under a new name, in order;
    /// `on_stored`, when given, is called with each of them under the store's lock (as
    /// `on_evict` above).
    std::vector<size_t> commit(const uint32_t * ids, const uint64_t * names, const digest * digests, size_t n,
                               const std::function<void(size_t)> & on_stored = nullptr);
    /// Reserved blocks not committed go back to the free list, and claimed ones (never made
    /// ready) stay committed as they were; a block that is neither is left alone and counted
    /// (misuse).
    void   release(const uint32_t * ids, size_t n);

    struct counts {
        uint64_t committed = 0;  // gauge
        uint64_t pinned    = 0;  // gauge: blocks with a pin
        uint64_t evicted   = 0;
        // misuse, each left without effect: an unpin of a block no pin holds (a second unpin
        // of the same pin), a commit or a release of a block that is not reserved
        uint64_t unpin_unheld        = 0;
        uint64_t commit_not_reserved  = 0;
        uint64_t release_not_reserved = 0;
        // a name held for other tokens than a slot's (a collision, crafted or not): not imported
        uint64_t name_collisions      = 0;
    };
    counts read_counts() const;

  private:
    enum class state : uint8_t { FREE, RESERVED, COMMITTED };
    struct entry {
        uint64_t name = 0;
        uint64_t used = 0;  // LRU tick
        uint32_t pins = 0;
        state    st   = state::FREE;
        digest   dig{};
        bool     claimed = false;  // committed, claimed by a lazy reservation (see reserve)
    };
    size_t                                 capacity_;
    size_t                                 block_bytes_;
    uint8_t *                              pool_ = nullptr;
    bool                                   owned_ = true;  // pool_ is the store's own allocation
    mutable std::mutex                     mu_;
    std::vector<entry>                     blocks_;
    std::vector<uint32_t>                  free_;
    std::unordered_map<uint64_t, uint32_t> by_name_;
    uint64_t                               tick_    = 0;
    uint64_t                               evicted_ = 0;
    uint64_t                               unpin_unheld_ = 0, commit_not_reserved_ = 0, release_not_reserved_ = 0;
    uint64_t                               name_collisions_ = 0;
};

}  // namespace kvrelay_llama
