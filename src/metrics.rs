//! Prometheus naming shared by the admission and policy counters (each renders its own text:
//! `hints::Counters`, `policy::Orchestrator`). Depends on nothing else in the crate.

/// Whether `p` is a valid Prometheus metric name (`[a-zA-Z_:][a-zA-Z0-9_:]*`).
pub fn valid_metric_prefix(p: &str) -> bool {
    let mut it = p.bytes();
    matches!(it.next(), Some(b'a'..=b'z' | b'A'..=b'Z' | b'_' | b':'))
        && it.all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b':')
}
