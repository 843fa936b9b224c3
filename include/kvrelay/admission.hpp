// kvrelay/admission.hpp: Hint admission and snapshots: Snapshot, Outcome, AdmissionConfig, FoundHint, find_hint, Admission.
// Part of kvrelay.hpp (C++17 RAII wrappers over kvrelay.h); include <kvrelay.hpp> for all of them.
#ifndef KVRELAY_KVRELAY_ADMISSION_HPP
#define KVRELAY_KVRELAY_ADMISSION_HPP

#include "core.hpp"

namespace kvrelay {

/// A shared, immutable admitted envelope.
class Snapshot {
 public:
  Snapshot() noexcept = default;
  /// Take over one reference (e.g. from kvrelay_admit).
  explicit Snapshot(kvrelay_snapshot *adopt) noexcept : p_(adopt) {}
  Snapshot(const Snapshot &o) noexcept : p_(kvrelay_snapshot_retain(o.p_)) {}
  Snapshot(Snapshot &&o) noexcept : p_(std::exchange(o.p_, nullptr)) {}
  Snapshot &operator=(Snapshot o) noexcept {
    std::swap(p_, o.p_);
    return *this;
  }
  ~Snapshot() { kvrelay_snapshot_release(p_); }

  explicit operator bool() const noexcept { return p_ != nullptr; }
  /// The handle, still owned by this object.
  kvrelay_snapshot *get() const noexcept { return p_; }
  /// Give up ownership of the handle (the caller must release it).
  kvrelay_snapshot *release() noexcept { return std::exchange(p_, nullptr); }

  std::string_view canonical() const {
    kvrelay_bytes b;
    check(kvrelay_snapshot_canonical(p_, &b));
    return view(b);
  }
  std::string_view protocol_version() const {
    kvrelay_str s;
    check(kvrelay_snapshot_protocol_version(p_, &s));
    return view(s);
  }
  std::string_view message_id() const {
    kvrelay_str s;
    check(kvrelay_snapshot_message_id(p_, &s));
    return view(s);
  }
  std::size_t action_count() const {
    std::size_t n = 0;
    check(kvrelay_snapshot_action_count(p_, &n));
    return n;
  }
  /// Throws kvrelay::Error(KVRELAY_ERR_OUT_OF_RANGE) past the end.
  Action action(std::size_t i) const {
    kvrelay_action a{};
    a.size = sizeof a;
    check(kvrelay_snapshot_action(p_, i, &a));
    return {a.index, view(a.id), view(a.action_type), view(a.version), view(a.payload), view(a.canonical)};
  }
  /// An independent copy of the canonical JSON.
  std::string decode() const {
    return detail::fill<std::string>([&](uint8_t *b, std::size_t c, std::size_t *n) { return kvrelay_snapshot_decode(p_, b, c, n); });
  }
  /// MessagePack encoding (SPEC.md section 4).
  std::vector<uint8_t> to_msgpack() const {
    return detail::fill<std::vector<uint8_t>>([&](uint8_t *b, std::size_t c, std::size_t *n) { return kvrelay_snapshot_msgpack(p_, b, c, n); });
  }
  /// Canonical JSON of the one-action envelope of action `i`.
  std::string action_envelope(std::size_t i) const {
    return detail::fill<std::string>([&](uint8_t *b, std::size_t c, std::size_t *n) { return kvrelay_snapshot_action_envelope(p_, i, b, c, n); });
  }

 private:
  kvrelay_snapshot *p_ = nullptr;
};

/// The outcome of admitting one hint.
struct Outcome {
  int32_t kind = KVRELAY_OUTCOME_ABSENT;  ///< a kvrelay_outcome_kind value
  int32_t reason = KVRELAY_REASON_NONE;   ///< a kvrelay_reason value
  std::string detail;                     ///< what and where, for malformed hints
  Snapshot snapshot;                      ///< set when admitted

  bool admitted() const noexcept { return kind == KVRELAY_OUTCOME_ADMITTED; }
  bool absent() const noexcept { return kind == KVRELAY_OUTCOME_ABSENT; }
  bool ignored() const noexcept { return kind == KVRELAY_OUTCOME_IGNORED; }
  /// "untrusted", "unknown_version", "oversized", "malformed", or "none".
  const char *reason_name() const noexcept { return kvrelay_reason_name(reason); }

  static Outcome from(const kvrelay_outcome &o, kvrelay_snapshot *s) {
    Outcome r;
    r.kind = o.kind;
    r.reason = o.reason;
    r.detail = o.detail;
    r.snapshot = Snapshot(s);
    return r;
  }
};

/// Admission settings. A limit or prefix left empty keeps the library's own default
/// (kvrelay_admission_config_new: 65,536 canonical bytes, depth 128, 1 MiB raw,
/// `kvrelay_kv_hints`); nothing is copied here by hand.
struct AdmissionConfig {
  bool trusted = false;
  std::optional<std::size_t> max_bytes;
  std::optional<std::size_t> max_depth;
  std::optional<std::size_t> max_raw_bytes;
  std::optional<std::string> metric_prefix;
  /// When not empty, this environment variable decides trust and `trusted` is not used: `1`,
  /// `true`, `yes` or `on` (any case) trust; unset or anything else is untrusted, even with
  /// `trusted = true`. "KVRELAY_TRUST_KV_HINTS" is the conventional name.
  std::string trust_env;
};

/// The KV hint of a request body (find_hint): its spelling, and its value exactly as the
/// client sent it (a view into the body).
struct FoundHint {
  kvrelay_hint_spelling spelling = KVRELAY_HINT_NONE;
  std::string_view value;
  explicit operator bool() const noexcept { return spelling != KVRELAY_HINT_NONE; }
  /// Admitted per prompt (Admission::admit_batch: `kv_hints`) rather than once for the request
  /// (Admission::admit: Dynamo's spellings).
  bool batched() const noexcept { return spelling == KVRELAY_HINT_KV_HINTS; }
};

/// Find the KV hint of a generation request in the body's original bytes (kvrelay_find_hint):
/// `kv_hints`, `kv_hint`, `router_hint`, or either of the last two under `kv_transfer_params`;
/// `null` is absent. Throws kvrelay::Error(KVRELAY_ERR_INVALID_ARGUMENT) when the body carries
/// two (answer the request 400: what() names both) or is not one JSON object. One pass, no
/// allocation.
inline FoundHint find_hint(std::string_view body) {
  int32_t spelling = 0;
  std::size_t at = 0, len = 0;
  check(kvrelay_find_hint(reinterpret_cast<const uint8_t *>(body.data()), body.size(), &spelling, &at, &len));
  return FoundHint{static_cast<kvrelay_hint_spelling>(spelling), body.substr(at, len)};
}

/// An admission edge. Movable, not copyable; admit() is thread-safe.
class Admission {
 public:
  explicit Admission(const AdmissionConfig &c = {}) {
    kvrelay_admission_config *cfg = nullptr;
    check(kvrelay_admission_config_new(&cfg));
    int32_t s = kvrelay_admission_config_set_trusted(cfg, c.trusted);
    if (s == KVRELAY_OK && !c.trust_env.empty()) s = kvrelay_admission_config_trust_from_env(cfg, c.trust_env.data(), c.trust_env.size());
    if (s == KVRELAY_OK && c.max_bytes) s = kvrelay_admission_config_set_max_bytes(cfg, *c.max_bytes);
    if (s == KVRELAY_OK && c.max_depth) s = kvrelay_admission_config_set_max_depth(cfg, *c.max_depth);
    if (s == KVRELAY_OK && c.max_raw_bytes) s = kvrelay_admission_config_set_max_raw_bytes(cfg, *c.max_raw_bytes);
    if (s == KVRELAY_OK && c.metric_prefix)
      s = kvrelay_admission_config_set_metric_prefix(cfg, c.metric_prefix->data(), c.metric_prefix->size());
    if (s == KVRELAY_OK) s = kvrelay_admission_new(cfg, h_.out());
    kvrelay_admission_config_free(cfg);
    check(s);
  }

  kvrelay_admission *get() const noexcept { return h_.get(); }

  /// Admit the raw text of a hint (find_hint's value; empty: the request has none).
  Outcome admit(std::string_view json) const {
    kvrelay_outcome o{};
    o.size = sizeof o;
    kvrelay_snapshot *s = nullptr;
    check(kvrelay_admit(h_.get(), reinterpret_cast<const uint8_t *>(json.data()), json.size(), &o, &s));
    return Outcome::from(o, s);
  }

  /// Admit the `kv_hints` of a batch of `prompts` prompts: one Outcome per prompt. Throws
  /// kvrelay::Error(KVRELAY_ERR_BATCH_LENGTH_MISMATCH) for an aligned list of another length.
  std::vector<Outcome> admit_batch(std::string_view json, std::size_t prompts, bool *shared = nullptr) const {
    std::vector<kvrelay_outcome> o(prompts, kvrelay_outcome{sizeof(kvrelay_outcome), 0, 0, {}});
    std::vector<kvrelay_snapshot *> s(prompts, nullptr);
    check(kvrelay_admit_batch(h_.get(), reinterpret_cast<const uint8_t *>(json.data()), json.size(), prompts, o.data(), s.data(), shared));
    std::vector<Outcome> r;
    r.reserve(prompts);
    for (std::size_t i = 0; i < prompts; ++i) r.push_back(Outcome::from(o[i], s[i]));
    return r;
  }

  /// Decode and re-validate a MessagePack envelope (rank broadcast); nothing is counted.
  Outcome decode_msgpack(const uint8_t *data, std::size_t len) const {
    kvrelay_outcome o{};
    o.size = sizeof o;
    kvrelay_snapshot *s = nullptr;
    check(kvrelay_admission_decode_msgpack(h_.get(), data, len, &o, &s));
    return Outcome::from(o, s);
  }
  Outcome decode_msgpack(const std::vector<uint8_t> &m) const { return decode_msgpack(m.data(), m.size()); }

  kvrelay_counters counters() const {
    kvrelay_counters c{};
    c.size = sizeof c;
    check(kvrelay_admission_counters(h_.get(), &c));
    return c;
  }

  /// Prometheus text (format 0.0.4) of the counters.
  std::string prometheus() const {
    std::string s = detail::fill<std::string>(
        [&](uint8_t *b, std::size_t c, std::size_t *n) { return kvrelay_admission_prometheus(h_.get(), reinterpret_cast<char *>(b), c, n); });
    if (!s.empty() && s.back() == '\0') s.pop_back();
    return s;
  }

 private:
  detail::Handle<kvrelay_admission, kvrelay_admission_free> h_;
};

}  // namespace kvrelay

#endif  // KVRELAY_KVRELAY_ADMISSION_HPP
