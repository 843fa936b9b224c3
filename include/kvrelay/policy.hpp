// kvrelay/policy.hpp: Capabilities, bindings and the orchestrator: Support, Capabilities, Binding, PolicyConfig, Provider, Decision, Orchestrator.
// Part of kvrelay.hpp (C++17 RAII wrappers over kvrelay.h); include <kvrelay.hpp> for all of them.
#ifndef KVRELAY_KVRELAY_POLICY_HPP
#define KVRELAY_KVRELAY_POLICY_HPP

#include "admission.hpp"

namespace kvrelay {

/// One (family, action_type, action_version) a backend family supports.
struct Support {
  std::string family, action_type, action_version;
};

/// An immutable capability snapshot. Movable, not copyable.
class Capabilities {
 public:
  explicit Capabilities(const std::vector<Support> &supports) {
    kvrelay_capabilities_builder *b = nullptr;
    check(kvrelay_capabilities_builder_new(&b));
    for (const Support &s : supports) {
      int32_t st = kvrelay_capabilities_builder_add(b, s.family.data(), s.family.size(), s.action_type.data(), s.action_type.size(),
                                                    s.action_version.data(), s.action_version.size());
      if (st != KVRELAY_OK) {
        kvrelay_capabilities_builder_free(b);
        throw Error(st);
      }
    }
    check(kvrelay_capabilities_build(b, h_.out()));  // consumes the builder
  }
  kvrelay_capabilities *get() const noexcept { return h_.get(); }

  /// The candidates of a snapshot, in producer order.
  std::vector<kvrelay_candidate> candidates(const Snapshot &s, kvrelay_candidate_counts *counts = nullptr) const {
    std::size_t n = 0;
    int32_t st = kvrelay_collect_candidates(s.get(), h_.get(), nullptr, 0, &n, counts);
    if (st != KVRELAY_OK && st != KVRELAY_ERR_BUFFER_TOO_SMALL) throw Error(st);
    std::vector<kvrelay_candidate> v(n);
    check(kvrelay_collect_candidates(s.get(), h_.get(), v.data(), v.size(), &n, counts));
    return v;
  }

 private:
  detail::Handle<kvrelay_capabilities, kvrelay_capabilities_free> h_;
};

/// A configured binding.
struct Binding {
  std::string id, family;
  bool request_paired = false;
  bool authorized = true;
  std::vector<std::pair<std::string, std::string>> supports;  ///< (action_type, action_version)
};

/// The server's policy configuration.
struct PolicyConfig {
  std::vector<Binding> bindings;
  std::vector<std::string> endpoints;  ///< the trusted endpoint registry
  std::optional<std::string> metric_prefix;  ///< empty: the library's default (`kvrelay_kv_policy`)
};

/// A consumer's provider: return 0 to accept, anything else to refuse. A `fetch` that declines
/// by choice (nothing to fetch, not worth it) sets KVRELAY_PROVIDER_DECLINED in its code: the
/// decision is then a decline (KVRELAY_DISCARD_PROVIDER_DECLINED), counted apart from failed
/// fetches. Called from any thread that calls Orchestrator::decide. An exception thrown here
/// counts as a refusal (-1); it never crosses into kvrelay.
class Provider {
 public:
  virtual ~Provider() = default;
  virtual int validate(const kvrelay_fetch_request &request) = 0;
  virtual int fetch(const kvrelay_fetch_request &request) = 0;
};

/// The decision for one request.
struct Decision {
  int32_t kind = KVRELAY_DECISION_KEEP_PAIRED_PATH;
  int32_t discard = 0;  ///< reason code; see discard_name()
  std::string binding_id;
  std::size_t action_index = 0;
  int32_t provider_code = 0;  ///< the provider's answer when it refused (provider_rejected, fetch_failed)
  bool named_fetch() const noexcept { return kind == KVRELAY_DECISION_NAMED_FETCH; }
  const char *discard_name() const noexcept { return kvrelay_discard_name(discard); }
};

/// Capabilities + bindings + endpoint registry + provider + counters. Movable, not copyable;
/// decide() is thread-safe.
class Orchestrator {
 public:
  Orchestrator(const Capabilities &caps, const PolicyConfig &config, std::shared_ptr<Provider> provider) {
    kvrelay_policy_config *c = nullptr;
    check(kvrelay_policy_config_new(&c));
    int32_t st = KVRELAY_OK;
    if (config.metric_prefix) st = kvrelay_policy_config_set_metric_prefix(c, config.metric_prefix->data(), config.metric_prefix->size());
    for (const Binding &b : config.bindings) {
      if (st == KVRELAY_OK)
        st = kvrelay_policy_config_add_binding(c, b.id.data(), b.id.size(), b.family.data(), b.family.size(),
                                               b.request_paired ? KVRELAY_ADDRESSING_REQUEST_PAIRED : KVRELAY_ADDRESSING_NAMED,
                                               b.authorized);
      for (const auto &tv : b.supports)
        if (st == KVRELAY_OK)
          st = kvrelay_policy_config_binding_support(c, b.id.data(), b.id.size(), tv.first.data(), tv.first.size(), tv.second.data(),
                                                     tv.second.size());
    }
    for (const std::string &e : config.endpoints)
      if (st == KVRELAY_OK) st = kvrelay_policy_config_add_endpoint(c, e.data(), e.size());
    if (st == KVRELAY_OK) {
      kvrelay_provider p {sizeof(kvrelay_provider), new std::shared_ptr<Provider>(std::move(provider)), &call_validate, &call_fetch, &destroy};
      st = kvrelay_orchestrator_new(caps.get(), c, &p, h_.out());  // owns p.user_data from here on
    }
    kvrelay_policy_config_free(c);
    check(st);
  }

  /// Decide for a request; `snapshot` may be empty (no admitted hint).
  Decision decide(const kvrelay_request_info &request, const Snapshot &snapshot) const { return decide(request, snapshot, nullptr); }
  /// The same, with `call_context` handed to the provider (`kvrelay_fetch_request::call_context`,
  /// kvrelay_orchestrate_with_context): where the provider leaves what it submitted for the
  /// caller (a fetch handle, the blocks it fetches into) without globals or thread-locals.
  Decision decide(const kvrelay_request_info &request, const Snapshot &snapshot, void *call_context) const {
    kvrelay_decision d{};
    d.size = sizeof d;
    check(kvrelay_orchestrate_with_context(h_.get(), &request, snapshot.get(), call_context, &d));
    return Decision{d.kind, d.discard, std::string(view(d.binding_id)), d.action_index, d.provider_code};
  }

  std::string prometheus() const {
    std::string s = detail::fill<std::string>(
        [&](uint8_t *b, std::size_t c, std::size_t *n) { return kvrelay_orchestrator_prometheus(h_.get(), reinterpret_cast<char *>(b), c, n); });
    if (!s.empty() && s.back() == '\0') s.pop_back();
    return s;
  }

 private:
  static int32_t call_validate(void *u, const kvrelay_fetch_request *r) noexcept {
    try {
      return (*static_cast<std::shared_ptr<Provider> *>(u))->validate(*r);
    } catch (...) {
      return -1;
    }
  }
  static int32_t call_fetch(void *u, const kvrelay_fetch_request *r) noexcept {
    try {
      return (*static_cast<std::shared_ptr<Provider> *>(u))->fetch(*r);
    } catch (...) {
      return -1;
    }
  }
  static void destroy(void *u) noexcept { delete static_cast<std::shared_ptr<Provider> *>(u); }

  detail::Handle<kvrelay_orchestrator, kvrelay_orchestrator_free> h_;
};

}  // namespace kvrelay

#endif  // KVRELAY_KVRELAY_POLICY_HPP
