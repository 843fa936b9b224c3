// kvrelay.hpp: header-only C++17 RAII wrappers over kvrelay.h.
//
// Error policy: a kvrelay_status other than KVRELAY_OK throws kvrelay::Error (derived from
// std::runtime_error; status() gives the code, what() kvrelay_status_message's text). Hint
// outcomes are not errors: an ignored hint is an ordinary Outcome, so inference continues.
//
// kvrelay::Snapshot: copy = kvrelay_snapshot_retain, move = transfer, destructor = release.
// Views (std::string_view) borrow from the snapshot and are valid while some Snapshot holding
// it lives. Every other handle (Admission, Capabilities, Orchestrator, KvLayout, CpuEngine,
// Pinned, CudaEngine) is one detail::Handle: movable (construction and assignment; a moved-from
// object is empty), not copyable, freed once.
//
// Threads: Snapshot, Admission (admit, counters, prometheus), Capabilities and Orchestrator
// (decide, prometheus) may be used from any number of threads at once. CpuEngine, CudaEngine
// and Pinned belong to one thread (or stream) at a time. Provider::validate and fetch run on
// the thread that calls Orchestrator::decide, inside it, possibly on many threads at once: make
// them thread-safe; an exception they throw is caught and counts as a refusal (-1); a provider
// slot left NULL at the C level refuses as well. kvrelay::Error::what() carries the detail of
// kvrelay_last_error_message when thrown right after the failing call (same thread).
#ifndef KVRELAY_KVRELAY_HPP
#define KVRELAY_KVRELAY_HPP

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "kvrelay.h"

// CUDA driver handle types are the struct tags cuda.h declares (and the runtime API's
// cudaStream_t / cudaEvent_t are the same pointers), so kvrelay.hpp needs no CUDA headers and a
// runtime's CUstream / CUevent pass straight through. Only the two struct tags are declared in
// the global namespace; the typedef names stay cuda.h's (kvrelay::CUstream, kvrelay::CUevent here).
struct CUstream_st;
struct CUevent_st;

namespace kvrelay {

/// cuda.h's `CUstream` (`struct CUstream_st *`), without including it.
using CUstream = ::CUstream_st *;
/// cuda.h's `CUevent` (`struct CUevent_st *`), without including it.
using CUevent = ::CUevent_st *;

/// A kvrelay_status other than KVRELAY_OK.
class Error : public std::runtime_error {
 public:
  /// The status, and what() the thread's last-error detail when it belongs to this status
  /// (thrown right after the failing call, on the same thread), else the status's message.
  explicit Error(int32_t status) : std::runtime_error(describe(status)), status_(status) {}
  /// The kvrelay_status value.
  int32_t status() const noexcept { return status_; }

 private:
  static std::string describe(int32_t status) {
    std::string msg = kvrelay_status_message(status);
    std::size_t need = 0;
    if (status == KVRELAY_ERR_BUFFER_TOO_SMALL ||
        kvrelay_last_error_message(nullptr, 0, &need) != KVRELAY_ERR_BUFFER_TOO_SMALL || need <= 1) {
      return msg;
    }
    std::string last(need, '\0');
    if (kvrelay_last_error_message(last.data(), last.size(), &need) != KVRELAY_OK) return msg;
    last.resize(need - 1);
    // the detail starts with its status's message: use it only when it is this status's
    return last.compare(0, msg.size(), msg) == 0 ? last : msg;
  }

  int32_t status_;
};

/// Throw kvrelay::Error unless `s` is KVRELAY_OK.
inline void check(int32_t s) {
  if (s != KVRELAY_OK) throw Error(s);
}

inline std::string_view view(kvrelay_str s) noexcept { return {s.ptr, s.len}; }
inline std::string_view view(kvrelay_bytes b) noexcept { return {reinterpret_cast<const char *>(b.ptr), b.len}; }

/// One action of a snapshot, as views into it.
struct Action {
  std::size_t index;
  std::string_view id, action_type, version;
  std::string_view payload;    ///< canonical JSON of `payload`
  std::string_view canonical;  ///< canonical JSON of the whole action
};

namespace detail {
/// One owning handle for every kvrelay handle freed by one function: movable (a moved-from
/// handle is empty and frees nothing), not copyable, frees exactly once.
template <typename T, void (*Free)(T *)>
class Handle {
 public:
  Handle() noexcept = default;
  Handle(Handle &&o) noexcept : p_(std::exchange(o.p_, nullptr)) {}
  Handle &operator=(Handle &&o) noexcept {
    if (this != &o) {
      reset();
      p_ = std::exchange(o.p_, nullptr);
    }
    return *this;
  }
  Handle(const Handle &) = delete;
  Handle &operator=(const Handle &) = delete;
  ~Handle() { reset(); }
  T *get() const noexcept { return p_; }
  /// For a `_new(..., &out)` call: frees what it held, then hands out its slot.
  T **out() noexcept {
    reset();
    return &p_;
  }
  void reset() noexcept {
    if (p_) Free(p_);
    p_ = nullptr;
  }

 private:
  T *p_ = nullptr;
};

/// Call a kvrelay "fill the caller's buffer" function: size query, then fill. Text that grows
/// between the two (Prometheus text while other threads admit) is asked for again with the
/// size the failed fill reported, a bounded number of times.
template <typename Out, typename F>
Out fill(F &&f) {
  std::size_t need = 0;
  int32_t s = f(nullptr, 0, &need);
  if (s != KVRELAY_ERR_BUFFER_TOO_SMALL && s != KVRELAY_OK) throw Error(s);
  for (int attempt = 0; attempt < 8; ++attempt) {
    Out out(need, typename Out::value_type{});
    s = f(reinterpret_cast<uint8_t *>(out.data()), out.size(), &need);
    if (s == KVRELAY_ERR_BUFFER_TOO_SMALL) continue;  // grew meanwhile; `need` is the new size
    check(s);
    out.resize(need);
    return out;
  }
  throw Error(KVRELAY_ERR_BUFFER_TOO_SMALL);
}
}  // namespace detail

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
    kvrelay_action a;
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
    kvrelay_outcome o;
    kvrelay_snapshot *s = nullptr;
    check(kvrelay_admit(h_.get(), reinterpret_cast<const uint8_t *>(json.data()), json.size(), &o, &s));
    return Outcome::from(o, s);
  }

  /// Admit the `kv_hints` of a batch of `prompts` prompts: one Outcome per prompt. Throws
  /// kvrelay::Error(KVRELAY_ERR_BATCH_LENGTH_MISMATCH) for an aligned list of another length.
  std::vector<Outcome> admit_batch(std::string_view json, std::size_t prompts, bool *shared = nullptr) const {
    std::vector<kvrelay_outcome> o(prompts);
    std::vector<kvrelay_snapshot *> s(prompts, nullptr);
    check(kvrelay_admit_batch(h_.get(), reinterpret_cast<const uint8_t *>(json.data()), json.size(), prompts, o.data(), s.data(), shared));
    std::vector<Outcome> r;
    r.reserve(prompts);
    for (std::size_t i = 0; i < prompts; ++i) r.push_back(Outcome::from(o[i], s[i]));
    return r;
  }

  /// Decode and re-validate a MessagePack envelope (rank broadcast); nothing is counted.
  Outcome decode_msgpack(const uint8_t *data, std::size_t len) const {
    kvrelay_outcome o;
    kvrelay_snapshot *s = nullptr;
    check(kvrelay_admission_decode_msgpack(h_.get(), data, len, &o, &s));
    return Outcome::from(o, s);
  }
  Outcome decode_msgpack(const std::vector<uint8_t> &m) const { return decode_msgpack(m.data(), m.size()); }

  kvrelay_counters counters() const {
    kvrelay_counters c;
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

/// A consumer's provider: return 0 to accept, anything else to refuse. Called from any thread
/// that calls Orchestrator::decide. An exception thrown here counts as a refusal (-1); it never
/// crosses into kvrelay.
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
      kvrelay_provider p{new std::shared_ptr<Provider>(std::move(provider)), &call_validate, &call_fetch, &destroy};
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
    kvrelay_decision d;
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

/// A validated KV pool layout (see kvrelay_kv_layout_*). Movable, not copyable.
class KvLayout {
 public:
  /// TensorRT-LLM-style `[num_blocks, layers, 2, kv_block_bytes]` pool at `pool`.
  static KvLayout all_layers_per_block(uint64_t pool, uint32_t layers, uint32_t num_blocks, uint64_t kv_block_bytes) {
    KvLayout l;
    check(kvrelay_kv_layout_all_layers_per_block(pool, layers, num_blocks, kv_block_bytes, l.h_.out()));
    return l;
  }
  /// vLLM-style: one `[2, num_blocks, kv_block_bytes]` pool per layer.
  static KvLayout per_layer_kv_first(const std::vector<uint64_t> &layer_pools, uint32_t num_blocks, uint64_t kv_block_bytes) {
    KvLayout l;
    check(kvrelay_kv_layout_per_layer_kv_first(layer_pools.data(), layer_pools.size(), num_blocks, kv_block_bytes, l.h_.out()));
    return l;
  }
  /// FlashInfer-style: one `[num_blocks, 2, kv_block_bytes]` pool per layer.
  static KvLayout per_layer_block_first(const std::vector<uint64_t> &layer_pools, uint32_t num_blocks, uint64_t kv_block_bytes) {
    KvLayout l;
    check(kvrelay_kv_layout_per_layer_block_first(layer_pools.data(), layer_pools.size(), num_blocks, kv_block_bytes, l.h_.out()));
    return l;
  }
  /// Any segment table; `pools` are the extents the segments must stay inside (may be empty).
  static KvLayout from_segments(uint32_t num_blocks, const std::vector<kvrelay_kv_segment> &segments,
                                const std::vector<kvrelay_kv_extent> &pools = {}) {
    KvLayout l;
    check(kvrelay_kv_layout_new(num_blocks, segments.data(), segments.size(), pools.data(), pools.size(), l.h_.out()));
    return l;
  }
  const kvrelay_kv_layout *get() const noexcept { return h_.get(); }
  /// Bytes of one staged block (every segment, block-major).
  uint64_t stage_block_bytes() const noexcept { return kvrelay_kv_layout_stage_block_bytes(h_.get()); }

 private:
  KvLayout() = default;
  detail::Handle<kvrelay_kv_layout, kvrelay_kv_layout_free> h_;
};

/// The CPU reference engine over a host-memory pool (the caller keeps the pool alive).
class CpuEngine {
 public:
  explicit CpuEngine(const KvLayout &layout) { check(kvrelay_cpu_engine_new(layout.get(), h_.out())); }
  /// Copy blocks `ids[0..n]` into `staging[0..len]`, block-major.
  void gather(const uint32_t *ids, std::size_t n, uint8_t *staging, std::size_t len) {
    check(kvrelay_cpu_gather(h_.get(), ids, n, staging, len));
  }
  void gather(const std::vector<uint32_t> &ids, uint8_t *staging, std::size_t len) { gather(ids.data(), ids.size(), staging, len); }
  /// Copy `staging[0..len]` back into blocks `ids[0..n]` (no repeats).
  void scatter(const uint8_t *staging, std::size_t len, const uint32_t *ids, std::size_t n) {
    check(kvrelay_cpu_scatter(h_.get(), staging, len, ids, n));
  }
  void scatter(const uint8_t *staging, std::size_t len, const std::vector<uint32_t> &ids) {
    scatter(staging, len, ids.data(), ids.size());
  }

 private:
  detail::Handle<kvrelay_cpu_engine, kvrelay_cpu_engine_free> h_;
};

/// Pinned, device-mapped host memory: allocated here, or the caller's own memory registered.
class Pinned {
 public:
  Pinned(int device, std::size_t len) { check(kvrelay_pinned_alloc(device, len, h_.out())); }
  /// Pin and map the caller's memory `[ptr, ptr + len)` (unregistered when this is destroyed;
  /// the memory must outlive it and not be registered elsewhere).
  static Pinned register_memory(int device, void *ptr, std::size_t len) {
    Pinned p;
    check(kvrelay_pinned_register(device, ptr, len, p.h_.out()));
    return p;
  }
  uint8_t *data() noexcept { return kvrelay_pinned_host(h_.get()); }
  std::size_t size() const noexcept { return kvrelay_pinned_len(h_.get()); }
  const kvrelay_pinned *get() const noexcept { return h_.get(); }

 private:
  Pinned() = default;
  detail::Handle<kvrelay_pinned, kvrelay_pinned_free> h_;
};

/// The CUDA engine over a device pool; copies are enqueued on the caller's CUstream, after the
/// work already enqueued there, and `done` (may be null) is recorded after them. Not
/// thread-safe: one engine per thread or stream that copies concurrently. Every call leaves the
/// calling thread's current CUDA context as it was.
class CudaEngine {
 public:
  CudaEngine(int device, const KvLayout &layout, const kvrelay_cuda_engine_options *options = nullptr) {
    check(kvrelay_cuda_engine_new(device, layout.get(), options, h_.out()));
  }
  void gather(const uint32_t *ids, std::size_t n, const Pinned &staging, CUstream stream, CUevent done = nullptr) {
    check(kvrelay_cuda_gather(h_.get(), ids, n, staging.get(), static_cast<void *>(stream), static_cast<void *>(done)));
  }
  void gather(const std::vector<uint32_t> &ids, const Pinned &staging, CUstream stream, CUevent done = nullptr) {
    gather(ids.data(), ids.size(), staging, stream, done);
  }
  void scatter(const Pinned &staging, const uint32_t *ids, std::size_t n, CUstream stream, CUevent done = nullptr) {
    check(kvrelay_cuda_scatter(h_.get(), staging.get(), ids, n, static_cast<void *>(stream), static_cast<void *>(done)));
  }
  void scatter(const Pinned &staging, const std::vector<uint32_t> &ids, CUstream stream, CUevent done = nullptr) {
    scatter(staging, ids.data(), ids.size(), stream, done);
  }

 private:
  detail::Handle<kvrelay_cuda_engine, kvrelay_cuda_engine_free> h_;
};

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
  /// A pre-shared key both sides must prove they hold.
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
    kvrelay_fetch_result r;
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
    kvrelay_fetch_result r;
    if (kvrelay_fetch_poll(h_.get(), &r) != KVRELAY_ERR_PENDING) return;
    kvrelay_fetch_cancel(h_.get());
    while (kvrelay_fetch_wait(h_.get(), 1000, &r) == KVRELAY_ERR_PENDING) {
    }
  }
  detail::Handle<kvrelay_fetch, kvrelay_fetch_free> h_;
};

/// A block's content digest (kvrelay_block_digests): SHA-256 over its tokens, chained through
/// its parent and bound to the engine identity.
using BlockDigest = std::array<uint8_t, KVRELAY_BLOCK_DIGEST_BYTES>;
static_assert(sizeof(BlockDigest) == KVRELAY_BLOCK_DIGEST_BYTES, "digests are passed to C as contiguous bytes");

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
    kvrelay_block_holder h{&holder, &Agent::pin_cb, &Agent::unpin_cb, nullptr, &Agent::returned_cb};
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
  /// Blocks' content digests, `digests[i]` for `ids[i]`, recorded after their checksums
  /// (kvrelay_agent_record_digests): each block is served with its digest.
  void record_digests(const std::vector<uint32_t> &ids, const std::vector<BlockDigest> &digests) const {
    if (ids.size() != digests.size()) throw Error(KVRELAY_ERR_INVALID_ARGUMENT);
    check(kvrelay_agent_record_digests(h_.get(), ids.data(), reinterpret_cast<const uint8_t *>(digests.data()),
                                       ids.size()));
  }
  /// Submit a fetch of names[held .. held + dst.size()] into `dst` (see kvrelay_agent_fetch).
  Fetch fetch(std::string_view endpoint, const std::vector<uint64_t> &names, std::size_t held,
              const std::vector<uint32_t> &dst, uint32_t deadline_ms) const {
    kvrelay_fetch_params p{{endpoint.data(), endpoint.size()}, names.data(), names.size(), held,
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
    kvrelay_fetch_params p{{endpoint.data(), endpoint.size()}, names.data(), names.size(), held,
                           dst.data(), dst.size(), deadline_ms};
    Fetch f;
    check(kvrelay_agent_submit_checked(h_.get(), &p, reinterpret_cast<const uint8_t *>(digests.data()),
                                       digests.size(), nullptr, f.h_.out()));
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

/// Block names (SPEC section 8; kvrelay_block_names): how a runtime names the full blocks of a
/// request's tokens, the same way every runtime that links kvrelay does. Holds its own copy of
/// the salt; copyable.
class Naming {
 public:
  /// Names under `seed` (seed_of() the engine's identity), `block_tokens` per block, `lora_id`
  /// (0: none) and the request's cache salt ("" : none; copied).
  Naming(uint64_t seed, std::size_t block_tokens, uint64_t lora_id = 0, std::string_view salt = {})
      : seed_(seed), block_tokens_(block_tokens), lora_id_(lora_id), salt_(salt) {}
  /// The seed of an engine whose identity is `identity` (model digest, build, KV settings).
  static uint64_t seed_of(std::string_view identity) {
    uint64_t seed = 0;
    check(kvrelay_name_seed(reinterpret_cast<const uint8_t *>(identity.data()), identity.size(), &seed));
    return seed;
  }
  /// The names of the full blocks of `tokens`, which begin at block `first_block` of their
  /// request after the block named `parent` (both 0 for a whole prompt).
  std::vector<uint64_t> names(const uint32_t *tokens, std::size_t n, uint64_t parent = 0,
                              std::size_t first_block = 0) const {
    std::vector<uint64_t> out(block_tokens_ ? n / block_tokens_ : 0);
    std::size_t got = 0;
    const kvrelay_naming c = c_naming();
    check(kvrelay_block_names(&c, parent, first_block, tokens, n, out.data(), out.size(), &got));
    out.resize(got);
    return out;
  }
  /// The same for signed token ids (llama.cpp's `llama_token`), read as their unsigned values
  /// without a copy (ids are never negative; the two types share their representation).
  std::vector<uint64_t> names(const int32_t *tokens, std::size_t n, uint64_t parent = 0,
                              std::size_t first_block = 0) const {
    return names(reinterpret_cast<const uint32_t *>(tokens), n, parent, first_block);
  }
  std::vector<uint64_t> names(const std::vector<uint32_t> &tokens) const { return names(tokens.data(), tokens.size()); }
  std::vector<uint64_t> names(const std::vector<int32_t> &tokens) const { return names(tokens.data(), tokens.size()); }
  /// A block's content digest (kvrelay_block_digests): SHA-256, chained like the names.
  using Digest = BlockDigest;
  /// The content digests of the full blocks of `tokens` under the engine identity `identity`
  /// (the string seed_of() takes), cut as names() cuts them: `tokens` begin at block
  /// `first_block` of their request after the block whose digest is `*parent` (nullptr and 0
  /// for a whole prompt; nullptr with `first_block` above 0 throws KVRELAY_ERR_NULL). Names are
  /// what routers index, but they are not collision-resistant: import a block into a slot
  /// only when its recorded digest equals the digest of that slot's own tokens.
  std::vector<Digest> digests(std::string_view identity, const uint32_t *tokens, std::size_t n,
                              const Digest *parent = nullptr, std::size_t first_block = 0) const {
    std::vector<Digest> out(block_tokens_ ? n / block_tokens_ : 0);
    std::size_t got = 0;
    const kvrelay_naming c = c_naming();
    check(kvrelay_block_digests(&c, reinterpret_cast<const uint8_t *>(identity.data()), identity.size(),
                                parent ? parent->data() : nullptr, first_block, tokens, n,
                                reinterpret_cast<uint8_t *>(out.data()), out.size(), &got));
    out.resize(got);
    return out;
  }
  /// The same for signed token ids (llama.cpp's `llama_token`), read as their unsigned values.
  std::vector<Digest> digests(std::string_view identity, const int32_t *tokens, std::size_t n,
                              const Digest *parent = nullptr, std::size_t first_block = 0) const {
    return digests(identity, reinterpret_cast<const uint32_t *>(tokens), n, parent, first_block);
  }
  std::vector<Digest> digests(std::string_view identity, const std::vector<uint32_t> &tokens) const {
    return digests(identity, tokens.data(), tokens.size());
  }
  std::vector<Digest> digests(std::string_view identity, const std::vector<int32_t> &tokens) const {
    return digests(identity, tokens.data(), tokens.size());
  }
  /// The C struct for this naming (valid while this object lives and is not modified).
  kvrelay_naming c_naming() const noexcept {
    return kvrelay_naming{sizeof(kvrelay_naming), seed_,
                          block_tokens_,          lora_id_,
                          reinterpret_cast<const uint8_t *>(salt_.data()), salt_.size()};
  }

 private:
  uint64_t seed_;
  std::size_t block_tokens_;
  uint64_t lora_id_;
  std::string salt_;
};

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

#endif  // KVRELAY_KVRELAY_HPP
