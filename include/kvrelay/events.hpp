// kvrelay/events.hpp: KV events for routers: KvEvents.
// Part of kvrelay.hpp (C++17 RAII wrappers over kvrelay.h); include <kvrelay.hpp> for all of them.
#ifndef KVRELAY_KVRELAY_EVENTS_HPP
#define KVRELAY_KVRELAY_EVENTS_HPP

#include "core.hpp"

namespace kvrelay {

/// A KV events publisher (kvrelay_kv_events): what a runtime's reuse cache holds, in the format
/// Dynamo's KV router indexes. Every call is thread-safe and never blocks on a subscriber.
/// Destroying it sends what was queued and joins its threads. Movable, not copyable.
class KvEvents {
 public:
  /// Publish at `endpoint` (`tcp://HOST:PORT`, port 0: a free one) with `block_size` tokens per
  /// block; `medium` "CPU" or "GPU"; `allow` peers ("" : loopback only); `key_file` a file
  /// holding a pre-shared key that peers must log in with (ZMQ PLAIN, its subscriber token:
  /// KVRELAY_KV_EVENTS_KEY_FILE says what that protects; "" : no key).
  KvEvents(std::string_view endpoint, std::size_t block_size, std::string_view medium = "CPU",
           std::string_view allow = {}, std::string_view replay_endpoint = {}, std::string_view key_file = {}) {
    detail::Handle<kvrelay_kv_events_config, kvrelay_kv_events_config_free> c;
    check(kvrelay_kv_events_config_new(endpoint.data(), endpoint.size(), block_size, c.out()));
    check(kvrelay_kv_events_config_set(c.get(), KVRELAY_KV_EVENTS_MEDIUM, medium.data(), medium.size()));
    if (!allow.empty())
      check(kvrelay_kv_events_config_set(c.get(), KVRELAY_KV_EVENTS_ALLOW_PEER, allow.data(), allow.size()));
    if (!replay_endpoint.empty())
      check(kvrelay_kv_events_config_set(c.get(), KVRELAY_KV_EVENTS_REPLAY_ENDPOINT, replay_endpoint.data(),
                                         replay_endpoint.size()));
    if (!key_file.empty())
      check(kvrelay_kv_events_config_set(c.get(), KVRELAY_KV_EVENTS_KEY_FILE, key_file.data(), key_file.size()));
    check(kvrelay_kv_events_start(c.get(), h_.out()));
  }
  /// A block was committed under `name`; `parent` names the block before it (none: first).
  void stored(uint64_t name, const uint64_t *parent, const uint32_t *tokens, std::size_t n) const {
    check(kvrelay_kv_events_stored(h_.get(), name, parent != nullptr, parent ? *parent : 0, tokens, n));
  }
  /// The block named `name` was evicted.
  void removed(uint64_t name) const { check(kvrelay_kv_events_removed(h_.get(), name)); }
  /// Every block published before is gone.
  void cleared() const { check(kvrelay_kv_events_cleared(h_.get())); }
  /// The bound PUB endpoint, or the replay endpoint.
  std::string endpoint(bool replay = false) const {
    return detail::fill<std::string>([&](uint8_t *b, std::size_t c, std::size_t *n) {
      return kvrelay_kv_events_endpoint(h_.get(), replay, reinterpret_cast<char *>(b), c, n);
    });
  }
  kvrelay_kv_events_stats stats() const {
    kvrelay_kv_events_stats s;
    check(kvrelay_kv_events_read_stats(h_.get(), &s, sizeof s));
    return s;
  }
  /// The counters as Prometheus text, `{prefix}_kv_events_*` ("" : kvrelay).
  std::string prometheus(std::string_view prefix = {}) const {
    return detail::fill<std::string>([&](uint8_t *b, std::size_t c, std::size_t *n) {
      return kvrelay_kv_events_prometheus(h_.get(), prefix.data(), prefix.size(), reinterpret_cast<char *>(b), c, n);
    });
  }
  const kvrelay_kv_events *get() const noexcept { return h_.get(); }

 private:
  detail::Handle<kvrelay_kv_events, kvrelay_kv_events_free> h_;
};

}  // namespace kvrelay

#endif  // KVRELAY_KVRELAY_EVENTS_HPP
