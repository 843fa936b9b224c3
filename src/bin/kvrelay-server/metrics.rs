//! The server's own Prometheus series (prometheus-client), served after the library's
//! admission and policy counters, which appear exactly as the library renders them.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::cache::CacheStats;

/// `endpoint`, `status`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RequestLabels {
    /// Route, e.g. `/v1/completions`.
    pub endpoint: String,
    /// HTTP status code.
    pub status: u16,
}

/// `endpoint`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct EndpointLabel {
    /// Route.
    pub endpoint: String,
}

/// `direction`: `received` or `sent`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DirectionLabel {
    /// Which way.
    pub direction: String,
}

/// `outcome`, `reason`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TransferLabels {
    /// `ok`, `failed` or `skipped`.
    pub outcome: String,
    /// The failure or skip reason (`none` when ok).
    pub reason: String,
}

/// `state`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StateLabel {
    /// `held`, `cached` or `free`.
    pub state: String,
}

fn latency() -> Histogram {
    Histogram::new(exponential_buckets(0.0005, 2.0, 16))
}

/// Every series the server adds.
pub struct Metrics {
    registry: Registry,
    /// Requests by endpoint and status.
    pub requests: Family<RequestLabels, Counter>,
    /// Time to first token, by endpoint.
    pub ttft: Family<EndpointLabel, Histogram, fn() -> Histogram>,
    /// Total request time, by endpoint.
    pub duration: Family<EndpointLabel, Histogram, fn() -> Histogram>,
    /// Prompt tokens served.
    pub prompt_tokens: Counter,
    /// Prompt tokens whose KV was reused.
    pub cached_tokens: Counter,
    /// Prompt tokens prefilled locally.
    pub prefilled_tokens: Counter,
    /// Generated tokens.
    pub generated_tokens: Counter,
    /// KV blocks by state.
    pub blocks: Family<StateLabel, Gauge>,
    /// Requests waiting for a running slot (a gauge, set at scrape time).
    pub waiting: Gauge,
    /// Evictions.
    pub evicted: Counter,
    /// Destination blocks taken out of the pool because a NIXL READ into them could not be
    /// proven stopped.
    pub quarantined: Counter,
    #[cfg_attr(not(feature = "nixl"), allow(dead_code))]
    published_quarantined: AtomicU64,
    /// Fetches by outcome and reason.
    pub transfers: Family<TransferLabels, Counter>,
    /// KV blocks moved between instances.
    pub transfer_blocks: Family<DirectionLabel, Counter>,
    /// KV bytes moved between instances.
    pub transfer_bytes: Family<DirectionLabel, Counter>,
    /// Duration of successful fetches.
    pub transfer_seconds: Histogram,
    /// Prompt tokens whose KV was fetched from another instance.
    pub fetched_tokens: Counter,
    /// Seconds spent in hint admission and orchestration (compare with the request duration sum).
    pub hint_seconds: Counter<f64, AtomicU64>,
    /// The external totals already added to `transfer_blocks{sent}` and `evicted`.
    published_sent: AtomicU64,
    published_evicted: AtomicU64,
}

/// The part of a monotonic external total `now` not yet published, claimed once even when
/// scrapes run concurrently (`fetch_max` hands each increase to exactly one caller).
fn advance(published: &AtomicU64, now: u64) -> u64 {
    now.saturating_sub(published.fetch_max(now, Ordering::Relaxed))
}

impl Metrics {
    /// Register everything under `kvrelay_server_`.
    pub fn new() -> Metrics {
        let mut registry = Registry::with_prefix("kvrelay_server");
        let m = Metrics {
            requests: Family::default(),
            ttft: Family::new_with_constructor(latency),
            duration: Family::new_with_constructor(latency),
            prompt_tokens: Counter::default(),
            cached_tokens: Counter::default(),
            prefilled_tokens: Counter::default(),
            generated_tokens: Counter::default(),
            blocks: Family::default(),
            waiting: Gauge::default(),
            evicted: Counter::default(),
            quarantined: Counter::default(),
            published_quarantined: AtomicU64::new(0),
            transfers: Family::default(),
            transfer_blocks: Family::default(),
            transfer_bytes: Family::default(),
            transfer_seconds: latency(),
            fetched_tokens: Counter::default(),
            hint_seconds: Counter::default(),
            published_sent: AtomicU64::new(0),
            published_evicted: AtomicU64::new(0),
            registry: Registry::default(),
        };
        registry.register("requests", "HTTP requests by endpoint and status", m.requests.clone());
        registry.register("time_to_first_token_seconds", "Time to first token", m.ttft.clone());
        registry.register("request_duration_seconds", "Total request time", m.duration.clone());
        registry.register("prompt_tokens", "Prompt tokens served", m.prompt_tokens.clone());
        registry.register("cached_tokens", "Prompt tokens whose KV was reused", m.cached_tokens.clone());
        registry.register("prefilled_tokens", "Prompt tokens prefilled locally", m.prefilled_tokens.clone());
        registry.register("generated_tokens", "Output tokens generated", m.generated_tokens.clone());
        registry.register("kv_blocks", "KV pool blocks by state (held, cached, free)", m.blocks.clone());
        registry.register("requests_waiting", "Requests waiting for a running slot", m.waiting.clone());
        registry.register("kv_blocks_evicted", "KV blocks evicted from the reuse cache", m.evicted.clone());
        registry.register(
            "kv_blocks_quarantined",
            "KV blocks the KV agent withheld (a NIXL READ into them not proven stopped); they return when it is",
            m.quarantined.clone(),
        );
        registry.register("kv_transfers", "KV fetches from other instances by outcome and reason", m.transfers.clone());
        registry.register("kv_transfer_blocks", "KV blocks moved between instances", m.transfer_blocks.clone());
        registry.register("kv_transfer_bytes", "KV bytes moved between instances", m.transfer_bytes.clone());
        registry.register("kv_transfer_seconds", "Duration of successful KV fetches", m.transfer_seconds.clone());
        registry.register(
            "fetched_tokens",
            "Prompt tokens whose KV was fetched from another instance",
            m.fetched_tokens.clone(),
        );
        registry.register(
            "hint_processing_seconds",
            "Time spent in hint admission and orchestration",
            m.hint_seconds.clone(),
        );
        Metrics { registry, ..m }
    }

    /// Record the pool's state and the KV service's sent blocks (called at scrape time).
    pub fn set_blocks(&self, s: CacheStats, sent_blocks: u64, withheld_blocks: u64, block_bytes: u64) {
        let sent = DirectionLabel { direction: "sent".into() };
        let d = advance(&self.published_sent, sent_blocks);
        if d > 0 {
            self.transfer_blocks.get_or_create(&sent).inc_by(d);
            self.transfer_bytes.get_or_create(&sent).inc_by(d * block_bytes);
        }
        for (state, v) in [("held", s.held), ("cached", s.cached), ("free", s.free)] {
            self.blocks.get_or_create(&StateLabel { state: state.into() }).set(v as i64);
        }
        let d = advance(&self.published_evicted, s.evicted);
        if d > 0 {
            self.evicted.inc_by(d);
        }
        let d = advance(&self.published_quarantined, withheld_blocks);
        if d > 0 {
            self.quarantined.inc_by(d);
        }
    }

    /// The server's series as Prometheus text.
    pub fn encode(&self, out: &mut String) {
        let _ = prometheus_client::encoding::text::encode_registry(out, &self.registry);
    }
}
