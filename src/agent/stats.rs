//! The agent's counters: the live atomics, the copy handed to callers ([`AgentStats`], the C
//! ABI's `kvrelay_agent_stats`) and their Prometheus text.

use std::sync::atomic::{AtomicU64, Ordering};

use super::{FailReason, Refusal};

/// A copy of the agent's counters (monotonic, except the `*_now` gauges). `kvrelay_agent_stats`
/// in C.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[repr(C)]
pub struct AgentStats {
    /// Connections accepted from allowed peers.
    pub accepted: u64,
    /// Connections that completed their handshake and were served.
    pub served: u64,
    /// Blocks sent.
    pub blocks_sent: u64,
    /// Bytes of blocks sent.
    pub bytes_sent: u64,
    /// Connections refused: peer not on the allowlist.
    pub refused_peer_not_allowed: u64,
    /// Refused: no serving slot, or no slot for a connection in its handshake.
    pub refused_busy: u64,
    /// Refused: the peer address holds its limit.
    pub refused_per_peer_limit: u64,
    /// Refused: a frame that does not decode or is not the one expected.
    pub refused_bad_request: u64,
    /// Refused: the layouts differ.
    pub refused_fingerprint_mismatch: u64,
    /// Refused: authentication failed.
    pub refused_auth_failed: u64,
    /// Refused: more names than `max_names`.
    pub refused_too_many_names: u64,
    /// Refused: the pin callback answered something impossible.
    pub refused_internal: u64,
    /// Connections closed because the handshake ran past its deadline (or the peer left).
    pub handshake_timeouts: u64,
    /// Served transfers that stopped early (the peer left, a write deadline, the transfer deadline).
    pub serve_aborted: u64,
    /// Connections in their handshake now (a gauge).
    pub pending_now: u64,
    /// Connections serving now (a gauge).
    pub serving_now: u64,
    /// Fetches submitted.
    pub fetches_submitted: u64,
    /// Fetches completed without failure.
    pub fetches_ok: u64,
    /// Fetches that failed: connect.
    pub fetch_failed_connect: u64,
    /// ... timeout.
    pub fetch_failed_timeout: u64,
    /// ... refused.
    pub fetch_failed_refused: u64,
    /// ... fingerprint mismatch.
    pub fetch_failed_fingerprint_mismatch: u64,
    /// ... corrupt.
    pub fetch_failed_corrupt: u64,
    /// ... truncated.
    pub fetch_failed_truncated: u64,
    /// ... source miss.
    pub fetch_failed_source_miss: u64,
    /// ... authentication failed.
    pub fetch_failed_auth_failed: u64,
    /// ... cancelled.
    pub fetch_failed_cancelled: u64,
    /// ... shut down.
    pub fetch_failed_shutdown: u64,
    /// Blocks fetched, written and verified.
    pub blocks_fetched: u64,
    /// Their bytes.
    pub bytes_fetched: u64,
    /// Refused: the destination asked for a transport this service lacks (NIXL).
    pub refused_unsupported: u64,
    /// Destination blocks a fetch withheld: writes into them (NIXL READs) were not proven over
    /// when the transfer ended, early or unwound by a panic.
    pub blocks_withheld: u64,
    /// Withheld blocks handed back to the runtime (`BlockHolder::returned`).
    pub blocks_returned: u64,
    /// Served: transfers that came on a kept-alive connection (no new connect or handshake).
    pub reused: u64,
    /// Fetched: streams that went over a kept-alive connection.
    pub streams_reused: u64,
    /// Connections closed, before their first valid message, to make room for a newer one
    /// (the handshake slots or their address's `max_per_peer` were all taken); each is
    /// answered `busy` before it closes.
    pub handshake_evicted: u64,
    /// Fetches that failed: internal (a panic inside the agent).
    pub fetch_failed_internal: u64,
    /// CUDA IPC: allocations of other processes mapped here now (a gauge).
    pub ipc_mapped_now: u64,
    /// CUDA IPC: mappings let go because their source process no longer runs, or to keep the
    /// table within its bounds (per source and in all).
    pub ipc_unmapped: u64,
    /// Fetches made again over TCP because the agent's own transport could not reach their
    /// source (`tcp_fallback`); that source is then fetched from over TCP for a while.
    pub transport_fallbacks: u64,
    /// NIXL: fetches of device memory into device memory (at least 32 MiB, 1 MiB per
    /// descriptor on average) whose READs ran under 2 GB/s: UCX most likely emulated them in
    /// software (README, "The NIXL transport"). Since 0.3.1.
    pub nixl_slow_reads: u64,
    /// Fetches that failed: a block's content digest was not the one asked for. Since 0.3.3.
    pub fetch_failed_digest_mismatch: u64,
    /// CUDA IPC: offers in this process's name refused before any copy (memory no agent of
    /// this process on the offer's device exported, or a block its agent does not serve under
    /// the name asked); each fetch fails `corrupt`.
    pub ipc_offers_refused: u64,
    /// Hellos of a transport that grants memory (CUDA IPC, NIXL) refused because this agent has
    /// no key ([`AgentConfig::per_user_key`](super::AgentConfig::per_user_key) off, no key
    /// given): no handle leaves an agent that cannot tell who asks; also counted in
    /// `refused_unsupported`. Since 0.4.1.
    pub grants_refused_unkeyed: u64,
}

macro_rules! stats {
    ($($name:ident),* $(,)?) => {
        /// The live counters behind [`AgentStats`] (the compiler checks the two list the same
        /// fields).
        #[derive(Default)]
        pub(super) struct Stats { $(pub(super) $name: AtomicU64,)* }
        impl Stats {
            pub(super) fn snapshot(&self) -> AgentStats {
                AgentStats { $($name: self.$name.load(Ordering::Relaxed),)* }
            }
        }
    };
}

stats! {
    accepted, served, blocks_sent, bytes_sent, refused_peer_not_allowed, refused_busy,
    refused_per_peer_limit, refused_bad_request, refused_fingerprint_mismatch, refused_auth_failed,
    refused_too_many_names, refused_internal, handshake_timeouts, serve_aborted, pending_now,
    serving_now, fetches_submitted, fetches_ok, fetch_failed_connect, fetch_failed_timeout,
    fetch_failed_refused, fetch_failed_fingerprint_mismatch, fetch_failed_corrupt,
    fetch_failed_truncated, fetch_failed_source_miss, fetch_failed_auth_failed,
    fetch_failed_cancelled, fetch_failed_shutdown, blocks_fetched, bytes_fetched, refused_unsupported,
    blocks_withheld, blocks_returned, reused, streams_reused, handshake_evicted,
    fetch_failed_internal, ipc_mapped_now, ipc_unmapped,
    transport_fallbacks, nixl_slow_reads, fetch_failed_digest_mismatch, ipc_offers_refused,
    grants_refused_unkeyed,
}

impl Stats {
    pub(super) fn add(c: &AtomicU64, n: u64) {
        c.fetch_add(n, Ordering::Relaxed);
    }
    /// The counter of refusal `r`.
    fn refused_slot(&self, r: Refusal) -> &AtomicU64 {
        match r {
            Refusal::PeerNotAllowed => &self.refused_peer_not_allowed,
            Refusal::Busy => &self.refused_busy,
            Refusal::PerPeerLimit => &self.refused_per_peer_limit,
            Refusal::BadRequest => &self.refused_bad_request,
            Refusal::FingerprintMismatch => &self.refused_fingerprint_mismatch,
            Refusal::AuthFailed => &self.refused_auth_failed,
            Refusal::TooManyNames => &self.refused_too_many_names,
            Refusal::Internal => &self.refused_internal,
            Refusal::Unsupported => &self.refused_unsupported,
        }
    }
    /// The counter of fetch failure `r`.
    fn failed_slot(&self, r: FailReason) -> &AtomicU64 {
        match r {
            FailReason::Connect => &self.fetch_failed_connect,
            FailReason::Timeout => &self.fetch_failed_timeout,
            FailReason::Refused => &self.fetch_failed_refused,
            FailReason::FingerprintMismatch => &self.fetch_failed_fingerprint_mismatch,
            FailReason::Corrupt => &self.fetch_failed_corrupt,
            FailReason::Truncated => &self.fetch_failed_truncated,
            FailReason::SourceMiss => &self.fetch_failed_source_miss,
            FailReason::AuthFailed => &self.fetch_failed_auth_failed,
            FailReason::Cancelled => &self.fetch_failed_cancelled,
            FailReason::Shutdown => &self.fetch_failed_shutdown,
            FailReason::Internal => &self.fetch_failed_internal,
            FailReason::DigestMismatch => &self.fetch_failed_digest_mismatch,
        }
    }
    pub(super) fn refused(&self, r: Refusal) {
        Stats::add(self.refused_slot(r), 1);
    }
    pub(super) fn failed(&self, r: FailReason) {
        Stats::add(self.failed_slot(r), 1);
    }
}

impl Stats {
    /// The counters as Prometheus text.
    pub(super) fn prometheus(&self) -> String {
        use std::fmt::Write;
        let s = self.snapshot();
        let p = "kvrelay_kv_agent";
        let mut t = String::with_capacity(4096);
        let _ = writeln!(t, "# HELP {p}_refused_total Connections the KV service refused, by reason.");
        let _ = writeln!(t, "# TYPE {p}_refused_total counter");
        for r in Refusal::ALL {
            let _ = writeln!(
                t,
                "{p}_refused_total{{reason=\"{}\"}} {}",
                r.as_str(),
                self.refused_slot(r).load(Ordering::Relaxed)
            );
        }
        for (name, help, v) in [
            ("accepted", "Connections accepted from allowed peers.", s.accepted),
            ("served", "Connections that completed their handshake and were served.", s.served),
            ("handshake_timeouts", "Connections closed before a valid first message.", s.handshake_timeouts),
            ("serve_aborted", "Served transfers that stopped early.", s.serve_aborted),
            ("fetches_submitted", "Fetches submitted.", s.fetches_submitted),
            (
                "blocks_withheld",
                "Destination blocks withheld while a NIXL READ could not be proven stopped.",
                s.blocks_withheld,
            ),
            ("blocks_returned", "Withheld blocks handed back to the runtime.", s.blocks_returned),
            (
                "ipc_unmapped",
                "CUDA IPC mappings let go: their source process ended, or the table's bounds.",
                s.ipc_unmapped,
            ),
            (
                "transport_fallbacks",
                "Fetches made again over TCP because the agent's own transport could not reach the source.",
                s.transport_fallbacks,
            ),
            (
                "ipc_offers_refused",
                "CUDA IPC offers in this process's name refused before any copy.",
                s.ipc_offers_refused,
            ),
            (
                "grants_refused_unkeyed",
                "Hellos of CUDA IPC or NIXL refused: this agent has no key, so it grants no memory.",
                s.grants_refused_unkeyed,
            ),
            (
                "nixl_slow_reads",
                "NIXL fetches of device memory into device memory under 2 GB/s (a READ UCX most likely emulated).",
                s.nixl_slow_reads,
            ),
            ("reused", "Served transfers that came on a kept-alive connection.", s.reused),
            ("streams_reused", "Fetch streams that went over a kept-alive connection.", s.streams_reused),
            (
                "handshake_evicted",
                "Connections closed before their first valid message to make room for a newer one.",
                s.handshake_evicted,
            ),
        ] {
            let _ =
                writeln!(t, "# HELP {p}_{name}_total {help}\n# TYPE {p}_{name}_total counter\n{p}_{name}_total {v}");
        }
        let _ = writeln!(t, "# HELP {p}_fetches_total Completed fetches by outcome and reason.");
        let _ = writeln!(t, "# TYPE {p}_fetches_total counter");
        let _ = writeln!(t, "{p}_fetches_total{{outcome=\"ok\",reason=\"none\"}} {}", s.fetches_ok);
        for r in FailReason::ALL {
            let n = self.failed_slot(r).load(Ordering::Relaxed);
            let _ = writeln!(t, "{p}_fetches_total{{outcome=\"failed\",reason=\"{}\"}} {n}", r.as_str());
        }
        for (name, help, sent, fetched) in [
            ("blocks", "KV blocks moved, by direction.", s.blocks_sent, s.blocks_fetched),
            ("bytes", "KV bytes moved, by direction.", s.bytes_sent, s.bytes_fetched),
        ] {
            let _ = writeln!(t, "# HELP {p}_{name}_total {help}\n# TYPE {p}_{name}_total counter");
            let _ = writeln!(
                t,
                "{p}_{name}_total{{direction=\"sent\"}} {sent}\n{p}_{name}_total{{direction=\"fetched\"}} {fetched}"
            );
        }
        let _ = writeln!(
            t,
            "# HELP {p}_connections Connections of the KV service now, by state.\n# TYPE {p}_connections gauge"
        );
        let _ = writeln!(
            t,
            "{p}_connections{{state=\"handshake\"}} {}\n{p}_connections{{state=\"serving\"}} {}",
            s.pending_now, s.serving_now
        );
        let _ = writeln!(
            t,
            "# HELP {p}_ipc_mapped Allocations of other processes mapped here through CUDA IPC now.\n\
             # TYPE {p}_ipc_mapped gauge\n{p}_ipc_mapped {}",
            s.ipc_mapped_now
        );
        t
    }
}
