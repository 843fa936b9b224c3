//! Admission at the trusted edge (SPEC.md section 2).

use std::cell::RefCell;
use std::fmt;
use std::sync::Arc;

use super::counters::{Counters, DEFAULT_METRIC_PREFIX};
use super::detail::{Detail, Where};
use super::msgpack;
use super::scan::{scan, Kind, Mode, Scratch};
use super::snapshot::{Parts, Snapshot};
use crate::metrics::valid_metric_prefix;

/// Default name of the environment variable read by [`AdmissionConfig::trust_from_env`].
pub const DEFAULT_TRUST_ENV: &str = "KVRELAY_TRUST_KV_HINTS";
/// Default `max_bytes`: limit on the canonical compact encoding.
pub const DEFAULT_MAX_BYTES: usize = 65_536;
/// Default `max_depth` (the root container is depth 1).
pub const DEFAULT_MAX_DEPTH: usize = 128;
/// Default `max_raw_bytes`: raw input longer than this is refused without parsing.
pub const DEFAULT_MAX_RAW_BYTES: usize = 1 << 20;
/// Largest accepted `max_bytes` and `max_raw_bytes` (snapshot offsets are 32-bit).
pub const LIMIT_BYTES_CEILING: usize = 1 << 28;
/// Largest accepted `max_depth` (decode() and the server walk snapshots recursively through
/// serde_json; this keeps them well inside a 2 MiB thread stack).
pub const LIMIT_DEPTH_CEILING: usize = 1024;

/// Process-wide admission settings.
///
/// `trusted` is off by default: every hint is then dropped as `untrusted` before any parsing.
/// Turning it on trusts **all** traffic that reaches the process; kvrelay authenticates nobody.
/// Enable it only where a trusted router is the only way in.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AdmissionConfig {
    /// Accept hints at all (default false).
    pub trusted: bool,
    /// Limit on the canonical compact encoding, in bytes (default 65,536).
    pub max_bytes: usize,
    /// Deepest nesting allowed; the root container is depth 1 (default 128).
    pub max_depth: usize,
    /// Raw inputs longer than this are `oversized` without parsing (default 1 MiB).
    pub max_raw_bytes: usize,
    /// Prefix of the Prometheus metric names (default `kvrelay_kv_hints`).
    pub metric_prefix: String,
}

impl Default for AdmissionConfig {
    fn default() -> Self {
        AdmissionConfig {
            trusted: false,
            max_bytes: DEFAULT_MAX_BYTES,
            max_depth: DEFAULT_MAX_DEPTH,
            max_raw_bytes: DEFAULT_MAX_RAW_BYTES,
            metric_prefix: DEFAULT_METRIC_PREFIX.to_string(),
        }
    }
}

/// Why an [`AdmissionConfig`] was refused.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ConfigError {
    /// `max_bytes`, `max_raw_bytes` or `max_depth` is zero or above its ceiling.
    Limit(&'static str),
    /// The metric prefix is not a Prometheus metric name.
    MetricPrefix,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ConfigError::Limit(which) => write!(f, "{which} is zero or above its ceiling"),
            ConfigError::MetricPrefix => f.write_str("metric prefix must match [a-zA-Z_:][a-zA-Z0-9_:]*"),
        }
    }
}
impl std::error::Error for ConfigError {}

/// Whether an environment variable's value turns trust on: `1`, `true`, `yes` or `on`,
/// case-insensitive, surrounding whitespace ignored. Anything else, or no variable, is off.
pub fn env_value_trusts(v: &str) -> bool {
    let v = v.trim();
    ["1", "true", "yes", "on"].iter().any(|t| v.eq_ignore_ascii_case(t))
}

impl AdmissionConfig {
    /// Set `trusted` from the environment variable `var` (see [`env_value_trusts`]); use
    /// [`DEFAULT_TRUST_ENV`] unless the embedder has its own name.
    pub fn trust_from_env(mut self, var: &str) -> Self {
        self.trusted = std::env::var(var).map(|v| env_value_trusts(&v)).unwrap_or(false);
        self
    }

    /// Check the limits and the metric prefix.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.max_bytes == 0 || self.max_bytes > LIMIT_BYTES_CEILING {
            return Err(ConfigError::Limit("max_bytes"));
        }
        if self.max_raw_bytes == 0 || self.max_raw_bytes > LIMIT_BYTES_CEILING {
            return Err(ConfigError::Limit("max_raw_bytes"));
        }
        if self.max_depth == 0 || self.max_depth > LIMIT_DEPTH_CEILING {
            return Err(ConfigError::Limit("max_depth"));
        }
        if !valid_metric_prefix(&self.metric_prefix) {
            return Err(ConfigError::MetricPrefix);
        }
        Ok(())
    }
}

crate::labels::labelled_enum! {
    /// Why a hint was dropped. The discriminants are stable (the C ABI uses them, plus one).
    pub enum Reason: u8 {
        /// Trust is off.
        Untrusted = 0 => "untrusted",
        /// `protocol_version` is a string other than `"0.1"`.
        UnknownVersion = 1 => "unknown_version",
        /// Raw input or canonical encoding over its limit.
        Oversized = 2 => "oversized",
        /// Anything else wrong; see the [`Detail`].
        Malformed = 3 => "malformed",
    }
}

/// A dropped hint: the reason, and for `malformed` what failed and where.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Ignored {
    /// Why it was dropped.
    pub reason: Reason,
    /// Set for every `malformed` outcome, `None` otherwise.
    pub detail: Option<Detail>,
}

impl Ignored {
    fn plain(reason: Reason) -> Ignored {
        Ignored { reason, detail: None }
    }
    fn malformed(d: Detail) -> Ignored {
        Ignored { reason: Reason::Malformed, detail: Some(d) }
    }
}

impl fmt::Display for Ignored {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.detail {
            Some(d) => write!(f, "{}: {}", self.reason, d),
            None => write!(f, "{}", self.reason),
        }
    }
}

/// The outcome of admitting one hint value. Inference continues in every case.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// No value, or JSON `null`. Not counted.
    Absent,
    /// Admitted; the snapshot travels with the request.
    Admitted(Snapshot),
    /// Dropped whole.
    Ignored(Ignored),
}

impl Outcome {
    /// The snapshot, when admitted.
    pub fn snapshot(&self) -> Option<&Snapshot> {
        match self {
            Outcome::Admitted(s) => Some(s),
            _ => None,
        }
    }
}

/// Limits applied by [`evaluate`].
#[derive(Clone, Copy, Debug)]
pub(crate) struct Limits {
    pub max_bytes: usize,
    pub max_depth: usize,
    pub max_raw_bytes: usize,
}

/// True when `raw` holds no value: empty, only JSON whitespace, or `null`.
pub(crate) fn is_absent(raw: &[u8]) -> bool {
    let t = trim_ws(raw);
    t.is_empty() || t == b"null"
}

fn trim_ws(raw: &[u8]) -> &[u8] {
    let ws = |b: &u8| matches!(b, b' ' | b'\t' | b'\n' | b'\r');
    let s = raw.iter().position(|b| !ws(b)).unwrap_or(raw.len());
    let e = raw.iter().rposition(|b| !ws(b)).map_or(s, |e| e + 1);
    &raw[s..e]
}

/// SPEC.md steps 3-9 on a value known to be present and trusted. Counts nothing.
pub(crate) fn evaluate(sc: &mut Scratch, raw: &[u8], lim: Limits) -> Result<Snapshot, Ignored> {
    if raw.len() > lim.max_raw_bytes {
        return Err(Ignored::plain(Reason::Oversized));
    }
    let s = scan(sc, raw, lim.max_bytes, lim.max_depth, Mode::Envelope).map_err(Ignored::malformed)?;
    let bad = |what| Err(Ignored::malformed(Detail::new(what, Where::Root)));
    if s.root != Kind::Object {
        return bad("root is not an object");
    }
    if s.pv.kind != Kind::String {
        return bad("protocol_version is missing or not a string");
    }
    if !s.pv_is_01 {
        return Err(Ignored::plain(Reason::UnknownVersion));
    }
    if s.canonical_len > lim.max_bytes {
        return Err(Ignored::plain(Reason::Oversized));
    }
    if let Some(d) = s.number_error {
        return Err(Ignored::malformed(d));
    }
    if s.msgid.kind != Kind::String {
        return bad("message_id is missing or not a string");
    }
    if s.actions.kind != Kind::Array {
        return bad("actions is missing or not an array");
    }
    if let Some(i) = s.action_not_object {
        return Err(Ignored::malformed(Detail::new("action is not an object", Where::Action(i))));
    }
    for (i, a) in sc.actions.iter().enumerate() {
        let w = Where::Action(i as u32);
        let check =
            |k: Kind, want: Kind, what| if k == want { Ok(()) } else { Err(Ignored::malformed(Detail::new(what, w))) };
        check(a.id.kind, Kind::String, "action_id is missing or not a string")?;
        check(a.ty.kind, Kind::String, "action_type is missing or not a string")?;
        check(a.ver.kind, Kind::String, "action_version is missing or not a string")?;
        check(a.payload.kind, Kind::Object, "payload is missing or not an object")?;
    }
    let Scratch { out, keybuf, actions, .. } = sc;
    let canon: &[u8] = match s.verbatim {
        Some((a, b)) => &raw[a..b],
        None => out,
    };
    Ok(Snapshot::build(Parts { canon, pv: s.pv, msgid: s.msgid, actions: s.actions, recs: actions }, keybuf))
}

thread_local! {
    static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch::default());
}

/// Run `f` with this thread's scratch area (or a fresh one if it is already in use).
fn with_scratch<R>(f: impl FnOnce(&mut Scratch) -> R) -> R {
    SCRATCH.with(|c| match c.try_borrow_mut() {
        Ok(mut sc) => f(&mut sc),
        Err(_) => f(&mut Scratch::default()),
    })
}

/// The outcome for a batched request (SPEC.md section 2).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum BatchOutcome {
    /// One outcome shared by every prompt (a single envelope, absent, or a hint dropped whole).
    Shared(Outcome),
    /// One outcome per prompt, in prompt order (an aligned list).
    PerPrompt(Vec<Outcome>),
}

/// An aligned list whose length differs from the prompt count: a request error, not a hint
/// outcome (nothing is counted).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BatchLengthMismatch {
    /// Entries in the list.
    pub entries: usize,
    /// Prompts in the request.
    pub prompts: usize,
}

impl fmt::Display for BatchLengthMismatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "kv_hints has {} entries for {} prompts", self.entries, self.prompts)
    }
}
impl std::error::Error for BatchLengthMismatch {}

/// The admission edge: config plus counters. Cheap to share (`Send + Sync`); `admit` takes
/// `&self` and works from a per-thread scratch area, so any number of threads may admit at once
/// with no lock.
#[derive(Debug)]
pub struct Admission {
    config: AdmissionConfig,
    counters: Arc<Counters>,
}

impl Admission {
    /// An admission edge with fresh counters.
    pub fn new(config: AdmissionConfig) -> Result<Admission, ConfigError> {
        config.validate()?;
        Ok(Admission { config, counters: Arc::new(Counters::default()) })
    }

    /// The config this edge was built with.
    pub fn config(&self) -> &AdmissionConfig {
        &self.config
    }

    /// The counters (shareable with a metrics exporter).
    pub fn counters(&self) -> &Arc<Counters> {
        &self.counters
    }

    pub(crate) fn limits(&self) -> Limits {
        Limits {
            max_bytes: self.config.max_bytes,
            max_depth: self.config.max_depth,
            max_raw_bytes: self.config.max_raw_bytes,
        }
    }

    /// Admit one hint value: the raw JSON text found under `kv_hints`, or `None` when the
    /// request has none. Applies SPEC.md section 2 in its order and counts the outcome once.
    ///
    /// Cost: one pass over the input (no heap allocation once this thread's scratch has grown
    /// to the largest input seen) plus exactly one allocation for an admitted snapshot. Nothing
    /// is parsed when trust is off or the input is over `max_raw_bytes`.
    pub fn admit(&self, raw: Option<&[u8]>) -> Outcome {
        with_scratch(|sc| self.admit_with(sc, raw))
    }

    /// [`Admission::admit`] with a caller-owned scratch area instead of the per-thread one.
    pub fn admit_with(&self, sc: &mut Scratch, raw: Option<&[u8]>) -> Outcome {
        let raw = match raw {
            Some(r) if !is_absent(r) => r,
            _ => return Outcome::Absent,
        };
        if !self.config.trusted {
            self.counters.ignored(Reason::Untrusted);
            return Outcome::Ignored(Ignored::plain(Reason::Untrusted));
        }
        self.count(evaluate(sc, raw, self.limits()))
    }

    fn count(&self, r: Result<Snapshot, Ignored>) -> Outcome {
        match r {
            Ok(s) => {
                self.counters.admitted();
                Outcome::Admitted(s)
            }
            Err(i) => {
                self.counters.ignored(i.reason);
                Outcome::Ignored(i)
            }
        }
    }

    /// Admit the `kv_hints` value of a batched request of `prompts` prompts.
    ///
    /// - absent or `null`: `Shared(Absent)`;
    /// - trust off: `Shared(Ignored(untrusted))`, counted once, nothing parsed;
    /// - a JSON array: an aligned list, one entry per prompt (`null` entries are `Absent`), each
    ///   admitted and counted on its own; a list of another length is `Err` (a request error,
    ///   nothing counted); a list that is not well-formed JSON, or deeper than `max_depth + 1`,
    ///   is one malformed hint shared by all prompts, counted once; a list longer than
    ///   `max_raw_bytes` per prompt is one oversized hint;
    /// - anything else: one envelope admitted once and shared by every prompt.
    pub fn admit_batch(&self, raw: Option<&[u8]>, prompts: usize) -> Result<BatchOutcome, BatchLengthMismatch> {
        let raw = match raw {
            Some(r) if !is_absent(r) => r,
            _ => return Ok(BatchOutcome::Shared(Outcome::Absent)),
        };
        if !self.config.trusted || trim_ws(raw).first() != Some(&b'[') {
            return Ok(BatchOutcome::Shared(self.admit(Some(raw))));
        }
        if raw.len() > self.config.max_raw_bytes.saturating_mul(prompts.max(1)) {
            return Ok(BatchOutcome::Shared(self.count(Err(Ignored::plain(Reason::Oversized)))));
        }
        let spans = with_scratch(|sc| {
            scan(sc, raw, usize::MAX, self.config.max_depth + 1, Mode::BatchList).map(|_| sc.elems.clone())
        });
        let spans = match spans {
            Ok(s) => s,
            Err(d) => return Ok(BatchOutcome::Shared(self.count(Err(Ignored::malformed(d))))),
        };
        if spans.len() != prompts {
            return Err(BatchLengthMismatch { entries: spans.len(), prompts });
        }
        Ok(BatchOutcome::PerPrompt(spans.into_iter().map(|(a, b)| self.admit(Some(&raw[a..b]))).collect()))
    }

    /// Decode a MessagePack-encoded envelope (rank broadcast, proxy forwarding) and re-validate
    /// it with this edge's limits and the 0.1 rules. The trust switch does not apply (the
    /// transport is internal) and nothing is counted: the hint was counted where it entered.
    pub fn decode_msgpack(&self, bytes: &[u8]) -> Result<Snapshot, Ignored> {
        decode_msgpack_with(bytes, self.limits())
    }

    /// Append the Prometheus text (format 0.0.4) of this edge's counters to `out`.
    pub fn write_prometheus(&self, out: &mut String) {
        self.counters.write_prometheus(&self.config.metric_prefix, out);
    }

    /// The Prometheus text of this edge's counters.
    pub fn prometheus(&self) -> String {
        let mut s = String::new();
        self.write_prometheus(&mut s);
        s
    }
}

pub(crate) fn default_limits() -> Limits {
    Limits { max_bytes: DEFAULT_MAX_BYTES, max_depth: DEFAULT_MAX_DEPTH, max_raw_bytes: DEFAULT_MAX_RAW_BYTES }
}

pub(crate) fn decode_msgpack_with(bytes: &[u8], lim: Limits) -> Result<Snapshot, Ignored> {
    if bytes.len() > lim.max_raw_bytes {
        return Err(Ignored::plain(Reason::Oversized));
    }
    let mut json = Vec::with_capacity(bytes.len() * 2);
    msgpack::to_json(bytes, lim.max_depth, &mut json).map_err(Ignored::malformed)?;
    // The text is produced by us; its length is bounded by the input's, so the raw limit was
    // already applied above.
    with_scratch(|sc| evaluate(sc, &json, Limits { max_raw_bytes: usize::MAX, ..lim }))
}

impl Snapshot {
    /// The envelope as MessagePack (SPEC.md section 4), appended to `out`. Allocates only to
    /// grow `out` and for a small table of container sizes.
    pub fn write_msgpack(&self, out: &mut Vec<u8>) {
        msgpack::encode(self.canonical(), out);
    }

    /// The envelope as a new MessagePack buffer.
    pub fn to_msgpack(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(self.canonical_len());
        self.write_msgpack(&mut v);
        v
    }

    /// Decode MessagePack with the default limits and re-validate; see
    /// [`Admission::decode_msgpack`] to use an edge's own limits.
    pub fn from_msgpack(bytes: &[u8]) -> Result<Snapshot, Ignored> {
        decode_msgpack_with(bytes, default_limits())
    }
}
