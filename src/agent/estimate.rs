//! What a fetch from a source is expected to cost: setup latency and throughput per source,
//! exponential moving averages (weight 1/4 for each new transfer; a fetch that ended by its
//! deadline or a cancel before any block counts its whole wait as setup, a lower bound of the
//! real one, so a frozen source stops looking fast), and a documented default
//! per transport before the first transfer; and what the runtime reports its own import of
//! fetched blocks costs ([`ImportCost`]), which a fetch must pay for too.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// A source's measured speed.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SourceSpeed {
    /// Seconds from submission to the first verified block (connect, handshake, the source's
    /// first gather).
    pub setup_s: f64,
    /// Bytes per second after it.
    pub bytes_per_s: f64,
}

/// The TCP default before the first transfer: 2 ms of setup and 3 GB/s, what one loopback TCP
/// stream carried in this repository's transfer benchmark (3.2-4.6 GB/s on the 2-core dev VM
/// and the H200 machine, `benches/RESULTS.md`); a datacenter link is slower, so the first
/// transfer corrects it either way.
pub const TCP_DEFAULT: SourceSpeed = SourceSpeed { setup_s: 0.002, bytes_per_s: 3e9 };

/// The NIXL default into a GPU pool: 0.5 ms of setup and 150 GB/s. VRAM READs over CUDA IPC with
/// GET zero-copy on (the transport's default UCX options) carried 90-155 GB/s between two
/// H200s and about 200 GB/s between two processes on one, where a fetch of 1 or 8 blocks took
/// 0.15-0.3 ms (`benches/RESULTS.md`).
pub const NIXL_VRAM_DEFAULT: SourceSpeed = SourceSpeed { setup_s: 0.0005, bytes_per_s: 150e9 };

/// The same-host CUDA IPC default (GPU pool to GPU pool): 0.1 ms of setup (the offer's round
/// trip, the mapping looked up, one copy-and-sum kernel) and 1.1 TB/s: on one H200 a 1- or
/// 8-block fetch took 81-180 us (the thread wake-ups vary by machine) and 1 GiB moved at
/// 1.1 TB/s (`benches/RESULTS.md`).
pub const CUDA_IPC_DEFAULT: SourceSpeed = SourceSpeed { setup_s: 0.0001, bytes_per_s: 1.1e12 };

/// The NIXL default into a host pool: 5 ms and 3 GB/s (UCX's host-memory READs measured
/// 3.2-4.6 GB/s there).
pub const NIXL_HOST_DEFAULT: SourceSpeed = SourceSpeed { setup_s: 0.005, bytes_per_s: 3e9 };

/// Most sources remembered; the oldest entry is dropped beyond (a hostile hint stream cannot
/// grow the table without bound).
pub const MAX_SOURCES: usize = 4096;

/// Per-source moving averages.
pub struct Estimator {
    default: SourceSpeed,
    by_source: Mutex<HashMap<String, Entry>>,
    tick: std::sync::atomic::AtomicU64,
}

/// One source's estimate.
struct Entry {
    speed: SourceSpeed,
    /// When it was last used (the oldest goes first beyond [`MAX_SOURCES`]).
    tick: u64,
    /// Until when `speed` is of a transport the source fell back to ([`Estimator::restart`]):
    /// past it the source is fetched from with the first transport again, and starts again
    /// from the default.
    until: Option<Instant>,
}

impl Entry {
    fn expired(&self, now: Instant) -> bool {
        self.until.is_some_and(|u| now >= u)
    }
}

impl Estimator {
    /// An estimator whose sources start at `default`.
    pub fn new(default: SourceSpeed) -> Estimator {
        Estimator { default, by_source: Mutex::new(HashMap::new()), tick: Default::default() }
    }

    /// The current estimate for `source`.
    pub fn speed(&self, source: &str) -> SourceSpeed {
        let m = self.by_source.lock().unwrap_or_else(|e| e.into_inner());
        match m.get(source) {
            Some(e) if !e.expired(Instant::now()) => e.speed,
            _ => self.default,
        }
    }

    /// Seconds to fetch `bytes` from `source`.
    pub fn seconds(&self, source: &str, bytes: u64) -> f64 {
        let s = self.speed(source);
        s.setup_s + bytes as f64 / s.bytes_per_s
    }

    /// Start `source` again from `default` until `until`, forgetting what was measured (the
    /// agent calls it when a source falls back to another transport for a while: the
    /// measurements were of the old one). From `until` on, the source starts again from the
    /// estimator's own default, as its fetches go back to the first transport.
    pub fn restart(&self, source: &str, default: SourceSpeed, until: Instant) {
        let mut m = self.by_source.lock().unwrap_or_else(|e| e.into_inner());
        let e = self.entry(&mut m, source);
        (e.speed, e.until) = (default, Some(until));
    }

    /// `source`'s entry, made (at the default) when missing or when its fallback ended, the
    /// oldest entry dropped beyond [`MAX_SOURCES`]; marked as the newest.
    fn entry<'m>(&self, m: &'m mut HashMap<String, Entry>, source: &str) -> &'m mut Entry {
        let tick = self.tick.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        if !m.contains_key(source) && m.len() >= MAX_SOURCES {
            if let Some(oldest) = m.iter().min_by_key(|(_, v)| v.tick).map(|(k, _)| k.clone()) {
                m.remove(&oldest);
            }
        }
        let fresh = Entry { speed: self.default, tick, until: None };
        let e = m.entry(source.to_string()).or_insert(fresh);
        if e.expired(Instant::now()) {
            (e.speed, e.until) = (self.default, None);
        }
        e.tick = tick;
        e
    }

    /// Fold in a finished transfer.
    pub fn record(&self, source: &str, setup: Duration, bytes: u64, data_time: Duration) {
        let mut m = self.by_source.lock().unwrap_or_else(|e| e.into_inner());
        let e = &mut self.entry(&mut m, source).speed;
        e.setup_s = 0.75 * e.setup_s + 0.25 * setup.as_secs_f64();
        if bytes > 0 && data_time > Duration::ZERO {
            e.bytes_per_s = 0.75 * e.bytes_per_s + 0.25 * (bytes as f64 / data_time.as_secs_f64());
        }
    }
}

/// The longest import [`ImportCost`] takes a report of (an hour; `Agent::record_import` refuses
/// more).
pub(crate) const MAX_IMPORT_SECONDS: f64 = 3600.0;

/// What the runtime's own import of fetched blocks costs, as it reports it (a runtime whose
/// cache is not the pool itself rebuilds its KV from the fetched blocks: llama.cpp's state
/// import copies them in, transposing V row by row when flash attention is off, about 140 ms on
/// the H200 whatever the length). Modelled as `fixed_s + per_block_s * blocks`, fitted by least
/// squares over the reports with exponential forgetting (each report weighs 1, earlier ones
/// 3/4 as much at every new one), both terms kept non-negative. While the reports' block counts
/// spread too little for a slope (a standard deviation under half a block, or under a quarter
/// of their mean: a slope from counts close together is mostly timing noise, and extrapolated to
/// long prompts) the cost is taken as fixed (their mean) rather than proportional: an estimate
/// that errs high stops the fetches whose imports would correct it, one that errs low is
/// corrected by the next import (at a new block count, which widens the spread). Zero until the
/// first report. One lock, taken once per report and per estimate.
#[derive(Default)]
pub struct ImportCost {
    sums: Mutex<Sums>,
}

/// Exponentially weighted sums of the reports: weight, blocks, seconds, blocks², blocks·seconds.
#[derive(Clone, Copy, Default)]
struct Sums {
    w: f64,
    x: f64,
    y: f64,
    xx: f64,
    xy: f64,
}

impl ImportCost {
    /// Fold in one import of `blocks` blocks that took `seconds` (finite and non-negative: the
    /// caller checks).
    pub fn record(&self, blocks: usize, seconds: f64) {
        let (x, y) = (blocks as f64, seconds);
        let mut s = self.sums.lock().unwrap_or_else(|e| e.into_inner());
        let d = 0.75;
        *s = Sums { w: d * s.w + 1.0, x: d * s.x + x, y: d * s.y + y, xx: d * s.xx + x * x, xy: d * s.xy + x * y };
    }

    /// The model's two terms, `(fixed_s, per_block_s)`; `(0, 0)` before the first report.
    pub fn terms(&self) -> (f64, f64) {
        let s = *self.sums.lock().unwrap_or_else(|e| e.into_inner());
        if s.w <= 0.0 {
            return (0.0, 0.0);
        }
        let (mx, my) = (s.x / s.w, s.y / s.w);
        let var = s.xx / s.w - mx * mx;
        if var < 0.25 || var < (0.25 * mx) * (0.25 * mx) {
            // one block count (or nearly): no slope to fit, the mean as a fixed cost
            return (my, 0.0);
        }
        let slope = (s.xy / s.w - mx * my) / var;
        if slope <= 0.0 {
            return (my, 0.0);
        }
        let fixed = my - slope * mx;
        if fixed < 0.0 {
            // through the origin: the least-squares slope of y = k x
            return (0.0, s.xy / s.xx);
        }
        (fixed, slope)
    }

    /// Seconds the runtime is expected to spend importing `blocks` blocks.
    pub fn seconds(&self, blocks: usize) -> f64 {
        let (fixed, per_block) = self.terms();
        fixed + per_block * blocks as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn moves_toward_measurements() {
        let e = Estimator::new(TCP_DEFAULT);
        assert_eq!(e.speed("a"), TCP_DEFAULT);
        e.record("a", Duration::from_millis(10), 1_000_000_000, Duration::from_secs(1));
        let s = e.speed("a");
        assert!((s.setup_s - (0.75 * 0.002 + 0.25 * 0.010)).abs() < 1e-12);
        assert!((s.bytes_per_s - (0.75 * 3e9 + 0.25 * 1e9)).abs() < 1.0);
        assert_eq!(e.speed("b"), TCP_DEFAULT);
        assert!(e.seconds("a", 0) == s.setup_s);
        // a source that moved to another transport starts from that one's default, measured
        // transfers fold into it while the fallback lasts
        e.restart("a", NIXL_HOST_DEFAULT, Instant::now() + Duration::from_secs(3600));
        assert_eq!(e.speed("a"), NIXL_HOST_DEFAULT);
        assert_eq!(e.speed("b"), TCP_DEFAULT);
        e.record("a", Duration::from_millis(1), 0, Duration::ZERO);
        assert!((e.speed("a").setup_s - (0.75 * 0.005 + 0.25 * 0.001)).abs() < 1e-12);
        // once the fallback ended, the source starts again from the estimator's default
        e.restart("a", NIXL_HOST_DEFAULT, Instant::now());
        assert_eq!(e.speed("a"), TCP_DEFAULT);
        e.record("a", Duration::from_millis(10), 0, Duration::ZERO);
        assert!((e.speed("a").setup_s - (0.75 * 0.002 + 0.25 * 0.010)).abs() < 1e-12, "folded into the default");
    }

    #[test]
    fn import_cost_fits_fixed_and_per_block_terms() {
        let c = ImportCost::default();
        assert_eq!(c.seconds(10), 0.0, "nothing reported: no cost");
        // one block count only: fixed (an estimate erring low is corrected by the next import)
        c.record(4, 0.040);
        c.record(4, 0.050);
        let mean = (0.75 * 0.040 + 0.050) / 1.75;
        assert!((c.seconds(8) - mean).abs() < 1e-12 && (c.seconds(1) - mean).abs() < 1e-12);
        // 0.1 s + 0.01 s a block, at several counts: both terms found
        let c = ImportCost::default();
        for b in [2usize, 8, 4, 16, 1, 32, 4] {
            c.record(b, 0.1 + 0.01 * b as f64);
        }
        let (f, k) = c.terms();
        assert!((f - 0.1).abs() < 1e-9 && (k - 0.01).abs() < 1e-9, "{f} {k}");
        assert!((c.seconds(100) - 1.1).abs() < 1e-9);
        // a fixed cost whatever the length (llama.cpp's transposed V): the slope is not negative
        let c = ImportCost::default();
        for (b, t) in [(2usize, 0.15), (16, 0.14), (64, 0.13)] {
            c.record(b, t);
        }
        let (f, k) = c.terms();
        assert_eq!(k, 0.0);
        assert!(f > 0.13 && f < 0.15, "{f}");
        // a fit whose intercept would be negative goes through the origin
        let c = ImportCost::default();
        for (b, t) in [(1usize, 0.0), (10, 1.0), (20, 2.5)] {
            c.record(b, t);
        }
        let (f, k) = c.terms();
        assert_eq!(f, 0.0);
        assert!(k > 0.09 && k < 0.13, "{k}");
        // counts close together (7 and 9 blocks): no slope from them, their mean as a fixed cost
        let c = ImportCost::default();
        c.record(7, 0.070);
        c.record(9, 0.095);
        assert_eq!(c.terms().1, 0.0);
        assert!((c.seconds(100) - (0.75 * 0.070 + 0.095) / 1.75).abs() < 1e-12);
        // newer reports weigh more: the cost follows a change
        let c = ImportCost::default();
        for _ in 0..3 {
            c.record(8, 0.8);
        }
        for _ in 0..20 {
            c.record(8, 0.08);
        }
        assert!((c.seconds(8) - 0.08).abs() < 0.002, "{}", c.seconds(8));
    }
}
