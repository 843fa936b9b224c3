//! Lock-free admission counters and their Prometheus text exposition (format 0.0.4).

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};

use super::Reason;

/// Counters of one admission edge. Every update is one relaxed atomic add; reads are a
/// consistent-enough view for monitoring (each counter is exact, the set is not a transaction).
#[derive(Debug, Default)]
pub struct Counters {
    admitted: AtomicU64,
    ignored: [AtomicU64; Reason::ALL.len()],
}

/// A point-in-time copy of [`Counters`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CounterValues {
    /// `admitted_total`
    pub admitted: u64,
    /// `ignored_total{reason="untrusted"}`
    pub untrusted: u64,
    /// `ignored_total{reason="unknown_version"}`
    pub unknown_version: u64,
    /// `ignored_total{reason="oversized"}`
    pub oversized: u64,
    /// `ignored_total{reason="malformed"}`
    pub malformed: u64,
}

impl CounterValues {
    /// The `ignored_total` value for one reason.
    pub fn ignored(&self, r: Reason) -> u64 {
        match r {
            Reason::Untrusted => self.untrusted,
            Reason::UnknownVersion => self.unknown_version,
            Reason::Oversized => self.oversized,
            Reason::Malformed => self.malformed,
        }
    }
}

/// The default metric prefix: metrics are `kvrelay_kv_hints_admitted_total` and
/// `kvrelay_kv_hints_ignored_total{reason="..."}`.
pub const DEFAULT_METRIC_PREFIX: &str = "kvrelay_kv_hints";

impl Counters {
    pub(crate) fn admitted(&self) {
        self.admitted.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn ignored(&self, r: Reason) {
        self.ignored[r as usize].fetch_add(1, Ordering::Relaxed);
    }

    /// Read all counters.
    pub fn values(&self) -> CounterValues {
        let g = |r: Reason| self.ignored[r as usize].load(Ordering::Relaxed);
        CounterValues {
            admitted: self.admitted.load(Ordering::Relaxed),
            untrusted: g(Reason::Untrusted),
            unknown_version: g(Reason::UnknownVersion),
            oversized: g(Reason::Oversized),
            malformed: g(Reason::Malformed),
        }
    }

    /// Append the Prometheus text exposition (format 0.0.4) of these counters, with HELP and
    /// TYPE lines, under `prefix` (see [`DEFAULT_METRIC_PREFIX`]). Every reason is always
    /// listed, zero or not, so dashboards see the series from the start.
    pub fn write_prometheus(&self, prefix: &str, out: &mut String) {
        let v = self.values();
        // Writing to a String cannot fail.
        let _ = write!(
            out,
            "# HELP {prefix}_admitted_total KV hint envelopes admitted.\n\
             # TYPE {prefix}_admitted_total counter\n\
             {prefix}_admitted_total {}\n\
             # HELP {prefix}_ignored_total KV hint envelopes dropped whole at admission, by reason.\n\
             # TYPE {prefix}_ignored_total counter\n",
            v.admitted
        );
        for r in Reason::ALL {
            let _ = writeln!(out, "{prefix}_ignored_total{{reason=\"{}\"}} {}", r.as_str(), v.ignored(r));
        }
    }
}
