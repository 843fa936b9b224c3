// kvrelay/agent.hpp: The KV agent: BlockHolder, AgentConfig, Fetch, file_digest, Agent.
// Part of kvrelay.hpp (C++17 RAII wrappers over kvrelay.h); include <kvrelay.hpp> for all of them.
#ifndef KVRELAY_KVRELAY_AGENT_HPP
#define KVRELAY_KVRELAY_AGENT_HPP

#include <functional>

#include "copy.hpp"

namespace kvrelay {

/// The runtime's reuse cache as the KV agent's service sees it (kvrelay_block_holder). pin and
/// unpin run on the agent's connection threads, several at once: make them thread-safe. An
/// exception thrown by pin counts as "nothing held" (0); one thrown by unpin is swallowed.
class BlockHolder {
 public:
  virtual ~BlockHolder() = default;
  /// Pin the leading run of `names` this instance holds; write its block ids to ids_out[0..k];
  /// return k.
  virtual std::size_t pin(const uint64_t *names, std::size_t n, uint32_t *ids_out) = 0;
  /// Release blocks pinned by pin (each exactly once).
  virtual void unpin(const uint32_t *ids, std::size_t n) = 0;
  /// Destination blocks a NIXL fetch withheld (kvrelay_fetch_result.withheld) are free again.
  /// Override it when the agent uses NIXL; over TCP it is never called.
  virtual void returned(const uint32_t *ids, std::size_t n) {
    (void)ids;
    (void)n;
  }
};

/// The KV agent's configuration (kvrelay_agent_config). Movable, not copyable.
class AgentConfig {
 public:
  explicit AgentConfig(const kvrelay_agent_fingerprint &fp) { check(kvrelay_agent_config_new(&fp, h_.out())); }
  /// `host:port` to serve on (port 0 picks one); "" serves nothing.
  AgentConfig &listen(std::string_view addr) {
    check(kvrelay_agent_config_set_listen(h_.get(), addr.data(), addr.size()));
    return *this;
  }
  /// `loopback`, an address or `ADDR/PREFIX`; the first call replaces the default (loopback).
  AgentConfig &allow_peer(std::string_view spec) {
    check(kvrelay_agent_config_allow_peer(h_.get(), spec.data(), spec.size()));
    return *this;
  }
  /// The pool is memory of CUDA device `device` (-1: host memory, the default).
  AgentConfig &device(int32_t device) {
    check(kvrelay_agent_config_set_device(h_.get(), device));
    return *this;
  }
  /// "tcp" (the default) or "nixl"; `lib_dir` holds libnixl_capi.so ("" : the loader's path).
  AgentConfig &transport(std::string_view name, std::string_view lib_dir = {}) {
    check(kvrelay_agent_config_set_transport(h_.get(), name.data(), name.size(), lib_dir.data(), lib_dir.size()));
    return *this;
  }
  /// Set one limit by name (kvrelay_agent_config_set_limit; times in milliseconds).
  AgentConfig &limit(kvrelay_agent_limit which, uint64_t value) {
    check(kvrelay_agent_config_set_limit(h_.get(), which, value));
    return *this;
  }
  /// The value of one limit (the documented default until set).
  uint64_t limit(kvrelay_agent_limit which) const {
    uint64_t v = 0;
    check(kvrelay_agent_config_get_limit(h_.get(), which, &v));
    return v;
  }
  /// With no key given: the per-user key (true, the default) or no authentication at all
  /// (false: TCP only, no memory grant leaves the agent). `kvrelay_agent_config_set_per_user_key`.
  AgentConfig &per_user_key(bool on) {
    check(kvrelay_agent_config_set_per_user_key(h_.get(), on));
    return *this;
  }
  /// A pre-shared key both sides must prove they hold (the deployment's key).
  AgentConfig &key(std::string_view k) {
    check(kvrelay_agent_config_set_key(h_.get(), reinterpret_cast<const uint8_t *>(k.data()), k.size()));
    return *this;
  }
  AgentConfig &key_from_env(std::string_view name) {
    check(kvrelay_agent_config_key_from_env(h_.get(), name.data(), name.size()));
    return *this;
  }
  AgentConfig &key_from_file(std::string_view path) {
    check(kvrelay_agent_config_key_from_file(h_.get(), path.data(), path.size()));
    return *this;
  }
  const kvrelay_agent_config *get() const noexcept { return h_.get(); }

 private:
  detail::Handle<kvrelay_agent_config, kvrelay_agent_config_free> h_;
};

/// A submitted fetch (kvrelay_fetch): poll, wait, cancel. The fetch owns its destination blocks
/// until it completes, so destroying (or assigning over) a `Fetch` whose fetch still runs
/// cancels it and waits for its completion: when the destructor returns, nothing writes the
/// destination blocks any more and the result says which of them were committed (blocks
/// withheld by NIXL still come back through the holder's `returned`). The wait is bounded by
/// the block in progress and the agent's I/O timeout; never destroy a running `Fetch` on a
/// thread that must not block. `release()` lets a fetch go on without its handle. Movable, not
/// copyable.
class Fetch {
 public:
  Fetch() noexcept = default;
  Fetch(Fetch &&) noexcept = default;
  Fetch &operator=(Fetch &&o) noexcept {
    if (this != &o) {
      settle();
      h_ = std::move(o.h_);
    }
    return *this;
  }
  Fetch(const Fetch &) = delete;
  Fetch &operator=(const Fetch &) = delete;
  ~Fetch() { settle(); }
  /// Give up the handle and let the fetch run on (its completion callback, if any, still runs);
  /// the destination blocks stay the fetch's until it completes.
  void release() noexcept { h_.reset(); }
  /// The result once complete; std::nullopt while it runs. Never blocks.
  std::optional<kvrelay_fetch_result> poll() const { return wait(0); }
  /// Wait up to `timeout_ms` (blocks the calling thread: not for a scheduler's thread).
  std::optional<kvrelay_fetch_result> wait(uint32_t timeout_ms) const {
    kvrelay_fetch_result r{};
    r.size = sizeof r;
    int32_t s = timeout_ms == 0 ? kvrelay_fetch_poll(h_.get(), &r) : kvrelay_fetch_wait(h_.get(), timeout_ms, &r);
    if (s == KVRELAY_ERR_PENDING) return std::nullopt;
    check(s);
    return r;
  }
  void cancel() const { check(kvrelay_fetch_cancel(h_.get())); }
  /// Why it failed, in words ("" when it did not).
  std::string detail() const {
    return detail::fill<std::string>([&](uint8_t *b, std::size_t c, std::size_t *n) {
      return kvrelay_fetch_detail(h_.get(), reinterpret_cast<char *>(b), c, n);
    });
  }

 private:
  friend class Agent;
  /// Cancel a fetch that still runs and wait until it completed.
  void settle() noexcept {
    if (!h_.get()) return;
    kvrelay_fetch_result r{};
    r.size = sizeof r;
    if (kvrelay_fetch_poll(h_.get(), &r) != KVRELAY_ERR_PENDING) return;
    kvrelay_fetch_cancel(h_.get());
    while (kvrelay_fetch_wait(h_.get(), 1000, &r) == KVRELAY_ERR_PENDING) {
    }
  }
  detail::Handle<kvrelay_fetch, kvrelay_fetch_free> h_;
};

/// The SHA-256 of the file at `path` (kvrelay_file_digest): what an engine's identity binds its
/// model, adapters and control vectors by. Reads the whole file: compute it once per file.
inline BlockDigest file_digest(std::string_view path) {
  BlockDigest d{};
  check(kvrelay_file_digest(reinterpret_cast<const uint8_t *>(path.data()), path.size(), d.data()));
  return d;
}

/// The KV agent (kvrelay_agent) over a host-memory pool: serves pinned blocks, fetches named
/// runs into the runtime's blocks. The holder must outlive the agent. Movable, not copyable;
/// the destructor stops the agent and joins its threads (kvrelay_agent_free).
class Agent {
 public:
  Agent(const AgentConfig &cfg, const KvLayout &layout, BlockHolder &holder) {
    kvrelay_block_holder h {sizeof(kvrelay_block_holder), &holder, &Agent::pin_cb, &Agent::unpin_cb, nullptr, &Agent::returned_cb};
    check(kvrelay_agent_new(cfg.get(), layout.get(), &h, h_.out()));
  }
  /// `tcp://ADDR:PORT` of the service ("" for a fetch-only agent).
  std::string endpoint() const {
    return detail::fill<std::string>([&](uint8_t *b, std::size_t c, std::size_t *n) {
      return kvrelay_agent_endpoint(h_.get(), reinterpret_cast<char *>(b), c, n);
    });
  }
  /// Blocks that just became reusable: record their checksums.
  void record_checksums(const std::vector<uint32_t> &ids) const {
    check(kvrelay_agent_record_checksums(h_.get(), ids.data(), ids.size()));
  }
  /// How many leading blocks of `ids[0..n]` still hold what was recorded for them (checksum,
  /// and keyed tag in a keyed agent): check before a slot takes blocks from a pool whose agent
  /// grants its memory to peers (kvrelay_agent_verify_blocks). Since 0.4.2.
  std::size_t verify_blocks(const uint32_t *ids, std::size_t n) const {
    std::size_t k = 0;
    check(kvrelay_agent_verify_blocks(h_.get(), ids, n, &k));
    return k;
  }
  /// Blocks' content digests, `digests[i]` for `ids[i]`, recorded after their checksums
  /// (kvrelay_agent_record_digests): each block is served with its digest.
  void record_digests(const std::vector<uint32_t> &ids, const std::vector<BlockDigest> &digests) const {
    if (ids.size() != digests.size()) throw Error(KVRELAY_ERR_INVALID_ARGUMENT);
    check(kvrelay_agent_record_digests(h_.get(), ids.data(), reinterpret_cast<const uint8_t *>(digests.data()),
                                       ids.size()));
  }
  /// Submit a fetch of names[held .. held + dst.size()] into `dst` by name alone (see
  /// kvrelay_agent_fetch): refused unless the limit KVRELAY_LIMIT_UNCHECKED_FETCH is 1; a
  /// runtime asks by content (the overloads with digests below).
  Fetch fetch(std::string_view endpoint, const std::vector<uint64_t> &names, std::size_t held,
              const std::vector<uint32_t> &dst, uint32_t deadline_ms) const {
    kvrelay_fetch_params p {sizeof(kvrelay_fetch_params), {endpoint.data(), endpoint.size()}, names.data(), names.size(), held,
                           dst.data(), dst.size(), deadline_ms};
    Fetch f;
    check(kvrelay_agent_fetch(h_.get(), &p, nullptr, nullptr, f.h_.out()));
    return f;
  }
  /// The same, checked by content (kvrelay_agent_submit_checked): `digests[i]` is the digest of
  /// the runtime's own tokens of block `names[i]`; a block the source recorded another digest
  /// for (or none) is never written, and the fetch ends before it
  /// (KVRELAY_FETCH_DIGEST_MISMATCH).
  Fetch fetch(std::string_view endpoint, const std::vector<uint64_t> &names, const std::vector<BlockDigest> &digests,
              std::size_t held, const std::vector<uint32_t> &dst, uint32_t deadline_ms) const {
    kvrelay_fetch_params p {sizeof(kvrelay_fetch_params), {endpoint.data(), endpoint.size()}, names.data(), names.size(), held,
                           dst.data(), dst.size(), deadline_ms};
    Fetch f;
    check(kvrelay_agent_submit_checked(h_.get(), &p, reinterpret_cast<const uint8_t *>(digests.data()),
                                       digests.size(), nullptr, f.h_.out()));
    return f;
  }
  /// The same, with lazy eviction (kvrelay_fetch_callbacks.ready): `dst` need only be
  /// reserved; `ready(from, n)` runs on a fetch thread once per stream, after the source's
  /// offer said `n` blocks come and before any is written, and makes dst[from .. from + n]
  /// ready to be written, returning how many of them (from the first) it made ready. It may
  /// run on several threads at once; an exception it throws counts as none ready (0).
  Fetch fetch(std::string_view endpoint, const std::vector<uint64_t> &names, const std::vector<BlockDigest> &digests,
              std::size_t held, const std::vector<uint32_t> &dst, uint32_t deadline_ms,
              std::function<std::size_t(std::size_t from, std::size_t n)> ready) const {
    kvrelay_fetch_params p {sizeof(kvrelay_fetch_params), {endpoint.data(), endpoint.size()}, names.data(), names.size(), held,
                           dst.data(), dst.size(), deadline_ms};
    using Ready = std::function<std::size_t(std::size_t, std::size_t)>;
    kvrelay_fetch_callbacks cb{};
    cb.size = sizeof cb;
    cb.user_data = new Ready(std::move(ready));
    cb.ready = [](void *ud, std::size_t from, std::size_t n) -> std::size_t {
      try {
        return (*static_cast<Ready *>(ud))(from, n);
      } catch (...) {
        return 0;
      }
    };
    cb.destroy = [](void *ud) { delete static_cast<Ready *>(ud); };
    Fetch f;
    // destroy runs on every path, a refused submission included: no leak when check throws
    check(kvrelay_agent_submit_checked(h_.get(), &p, reinterpret_cast<const uint8_t *>(digests.data()),
                                       digests.size(), &cb, f.h_.out()));
    return f;
  }
  /// Expected seconds to fetch `blocks` blocks from `endpoint`, the runtime's import of them
  /// included (as `record_import` reported it).
  double estimate(std::string_view endpoint, std::size_t blocks) const {
    double s = 0;
    check(kvrelay_agent_estimate(h_.get(), endpoint.data(), endpoint.size(), blocks, &s));
    return s;
  }
  /// Report that the runtime's own import of `blocks` fetched blocks took `seconds` (finite,
  /// not negative): `estimate` counts it from now on.
  void record_import(std::size_t blocks, double seconds) const {
    check(kvrelay_agent_record_import(h_.get(), blocks, seconds));
  }
  /// Expected seconds of the runtime's import of `blocks` blocks (0 before a report).
  double import_estimate(std::size_t blocks) const {
    double s = 0;
    check(kvrelay_agent_import_estimate(h_.get(), blocks, &s));
    return s;
  }
  /// The counters as Prometheus text (kvrelay_kv_agent_*).
  std::string prometheus() const {
    return detail::fill<std::string>([&](uint8_t *b, std::size_t c, std::size_t *n) {
      return kvrelay_agent_prometheus(h_.get(), reinterpret_cast<char *>(b), c, n);
    });
  }
  kvrelay_agent_stats stats() const {
    kvrelay_agent_stats s;
    check(kvrelay_agent_read_stats(h_.get(), &s, sizeof s));
    return s;
  }
  const kvrelay_agent *get() const noexcept { return h_.get(); }

 private:
  static std::size_t pin_cb(void *ud, const uint64_t *names, std::size_t n, uint32_t *ids) noexcept {
    try {
      return static_cast<BlockHolder *>(ud)->pin(names, n, ids);
    } catch (...) {
      return 0;
    }
  }
  static void unpin_cb(void *ud, const uint32_t *ids, std::size_t n) noexcept {
    try {
      static_cast<BlockHolder *>(ud)->unpin(ids, n);
    } catch (...) {
    }
  }
  static void returned_cb(void *ud, const uint32_t *ids, std::size_t n) noexcept {
    try {
      static_cast<BlockHolder *>(ud)->returned(ids, n);
    } catch (...) {
    }
  }
  detail::Handle<kvrelay_agent, kvrelay_agent_free> h_;
};

}  // namespace kvrelay

#endif  // KVRELAY_KVRELAY_AGENT_HPP
