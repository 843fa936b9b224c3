//! The KV agent: serving this server's blocks and fetching named blocks from other instances.

use super::*;

/// The library's last error text on this thread (what a failed call said).
fn last_error() -> String {
    // SAFETY: a size query and a fill of a buffer of that size; nothing else is passed.
    fill_text("kvrelay_last_error_message", |b, c, l| unsafe { kvrelay_last_error_message(b, c, l) })
        .unwrap_or_default()
}

pub(super) fn check_detail(call: &'static str, st: kvrelay_status) -> Result<(), String> {
    check(call, st).map_err(|e| {
        let d = last_error();
        if d.is_empty() {
            e.to_string()
        } else {
            format!("{e}: {d}")
        }
    })
}

/// The server's reuse cache as the agent's service sees it (`kvrelay_block_holder`).
pub trait Holder: Send + Sync {
    /// Pin the leading run of `names` held here; their ids into `ids`; how many.
    fn pin(&self, names: &[u64], ids: &mut [u32]) -> usize;
    /// Release pinned blocks.
    fn unpin(&self, ids: &[u32]);
    /// Withheld destination blocks are free again.
    fn returned(&self, ids: &[u32]);
}

type HolderBox = Arc<dyn Holder>;

unsafe extern "C" fn holder_pin(ud: *mut c_void, names: *const u64, n: usize, ids: *mut u32) -> usize {
    // SAFETY: `ud` is the `HolderBox` leaked in `KvAgent::new`, alive until `holder_destroy`;
    // the agent passes `n` names and room for `n` ids.
    let (h, names, ids) = unsafe {
        (&*(ud as *const HolderBox), std::slice::from_raw_parts(names, n), std::slice::from_raw_parts_mut(ids, n))
    };
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| h.pin(names, ids))).unwrap_or(0)
}

unsafe extern "C" fn holder_unpin(ud: *mut c_void, ids: *const u32, n: usize) {
    // SAFETY: as in `holder_pin`; `n` ids.
    let (h, ids) = unsafe { (&*(ud as *const HolderBox), std::slice::from_raw_parts(ids, n)) };
    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| h.unpin(ids)));
}

unsafe extern "C" fn holder_returned(ud: *mut c_void, ids: *const u32, n: usize) {
    // SAFETY: as in `holder_unpin`.
    let (h, ids) = unsafe { (&*(ud as *const HolderBox), std::slice::from_raw_parts(ids, n)) };
    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| h.returned(ids)));
}

unsafe extern "C" fn holder_destroy(ud: *mut c_void) {
    // SAFETY: the box leaked in `KvAgent::new`; the agent calls this once, after its last use.
    drop(unsafe { Box::from_raw(ud as *mut HolderBox) });
}

/// How the server's agent is set up.
pub struct AgentSettings<'a> {
    /// The layout fingerprint.
    pub fingerprint: kvrelay_agent_fingerprint,
    /// `host:port` of the KV service.
    pub listen: &'a str,
    /// Peers allowed (`loopback`, addresses, `ADDR/PREFIX`).
    pub allow: &'a [String],
    /// The pool's CUDA device (`None`: host memory).
    pub device: Option<i32>,
    /// `tcp`, `nixl` or `cuda-ipc`.
    pub transport: &'a str,
    /// Folder of the NIXL libraries.
    pub nixl_lib_dir: Option<&'a std::path::Path>,
    /// Fetch over TCP from a source the transport cannot reach (the library's `tcp_fallback`).
    pub tcp_fallback: bool,
    /// How long the agent's threads poll for the next step before they sleep, microseconds
    /// (the library's `poll_us`).
    pub poll_us: u64,
}

/// A running KV agent (`kvrelay_agent`).
pub struct KvAgent(NonNull<kvrelay_agent>);

// SAFETY: the header says every function on an agent is thread-safe.
unsafe impl Send for KvAgent {}
// SAFETY: as above.
unsafe impl Sync for KvAgent {}

/// A fetch handle (`kvrelay_fetch`), freed when the last holder lets go.
struct FetchHandle(NonNull<kvrelay_fetch>);

// SAFETY: a fetch handle is thread-safe (header): poll, wait, detail and cancel may be called
// from any thread at once; it is freed once, by the drop below.
unsafe impl Send for FetchHandle {}
// SAFETY: as above.
unsafe impl Sync for FetchHandle {}

impl Drop for FetchHandle {
    fn drop(&mut self) {
        // SAFETY: from `kvrelay_agent_submit`, freed once (the last `Arc` goes here).
        unsafe { kvrelay_fetch_free(self.0.as_ptr()) };
    }
}

/// A submitted fetch, with its completion on the way. Whoever owns the fetch's destination
/// blocks must keep them until [`PendingFetch::done`] answers: the agent writes them until
/// then. [`PendingFetch::canceller`] lets another task (a request that goes away) ask it to stop.
pub struct PendingFetch {
    fetch: Arc<FetchHandle>,
    done: tokio::sync::oneshot::Receiver<(kvrelay_fetch_result, String)>,
}

/// Asks a fetch to stop (`kvrelay_fetch_cancel`); its completion still comes through
/// [`PendingFetch::done`], after which nothing writes its destination blocks.
#[derive(Clone)]
pub struct FetchCanceller(Arc<FetchHandle>);

impl FetchCanceller {
    /// Ask the fetch to stop (never blocks; a completed fetch is unaffected).
    pub fn cancel(&self) {
        // SAFETY: a live handle (held by this `Arc`).
        let _ = unsafe { kvrelay_fetch_cancel(self.0 .0.as_ptr()) };
    }
}

type DoneSender = tokio::sync::oneshot::Sender<(kvrelay_fetch_result, String)>;

unsafe extern "C" fn fetch_done(ud: *mut c_void, r: *const kvrelay_fetch_result, detail: kvrelay_str) {
    // SAFETY: `ud` is the sender boxed in `KvAgent::fetch`, alive until `fetch_destroy` (which
    // runs after this); `r` and `detail` are readable for the call.
    let (tx, r, detail) = unsafe {
        (&mut *(ud as *mut Option<DoneSender>), *r, std::slice::from_raw_parts(detail.ptr.cast::<u8>(), detail.len))
    };
    if let Some(tx) = tx.take() {
        let _ = tx.send((r, String::from_utf8_lossy(detail).into_owned()));
    }
}

unsafe extern "C" fn fetch_destroy(ud: *mut c_void) {
    // SAFETY: boxed in `KvAgent::fetch`; the agent runs `destroy` exactly once, last.
    drop(unsafe { Box::from_raw(ud as *mut Option<DoneSender>) });
}

impl PendingFetch {
    /// A handle that cancels this fetch.
    pub fn canceller(&self) -> FetchCanceller {
        FetchCanceller(self.fetch.clone())
    }

    /// Wait for the completion without blocking a runtime thread: the result and its detail,
    /// both delivered by the completion callback (no round trip to the fetch handle).
    pub async fn done(self) -> (kvrelay_fetch_result, String) {
        match self.done.await {
            Ok(r) => r,
            // the callback always runs before destroy drops the sender: a dropped sender
            // means the agent is gone
            Err(_) => (kvrelay_fetch_result { failure: 10, ..Default::default() }, "the agent went away".into()),
        }
    }
}

impl KvAgent {
    /// Start an agent over `layout`, serving `holder`'s blocks.
    ///
    /// # Safety
    /// `layout`'s blocks are host memory (or memory of `settings.device`) valid for the agent's
    /// life; the holder's pins keep blocks unwritten; a fetch's destination blocks are left
    /// alone until it completes.
    pub unsafe fn new(settings: &AgentSettings<'_>, layout: &KvLayout, holder: HolderBox) -> Result<KvAgent, String> {
        struct Cfg(*mut kvrelay_agent_config);
        impl Drop for Cfg {
            fn drop(&mut self) {
                // SAFETY: from `kvrelay_agent_config_new`, freed once.
                unsafe { kvrelay_agent_config_free(self.0) };
            }
        }
        let mut raw = ptr::null_mut();
        // SAFETY: the fingerprint is readable, `raw` writable.
        check_detail("kvrelay_agent_config_new", unsafe { kvrelay_agent_config_new(&settings.fingerprint, &mut raw) })?;
        let cfg = Cfg(raw);
        let listen = settings.listen;
        // SAFETY: live config; text readable for its length.
        check_detail("kvrelay_agent_config_set_listen", unsafe {
            kvrelay_agent_config_set_listen(cfg.0, listen.as_ptr().cast(), listen.len())
        })?;
        for a in settings.allow {
            // SAFETY: as above.
            check_detail("kvrelay_agent_config_allow_peer", unsafe {
                kvrelay_agent_config_allow_peer(cfg.0, a.as_ptr().cast(), a.len())
            })?;
        }
        // SAFETY: live config.
        check_detail("kvrelay_agent_config_set_device", unsafe {
            kvrelay_agent_config_set_device(cfg.0, settings.device.unwrap_or(-1))
        })?;
        let dir = settings.nixl_lib_dir.map(|d| d.to_string_lossy().into_owned()).unwrap_or_default();
        // SAFETY: live config; both texts readable for their lengths.
        check_detail("kvrelay_agent_config_set_transport", unsafe {
            kvrelay_agent_config_set_transport(
                cfg.0,
                settings.transport.as_ptr().cast(),
                settings.transport.len(),
                dir.as_ptr().cast(),
                dir.len(),
            )
        })?;
        // SAFETY: live config.
        check_detail("kvrelay_agent_config_set_limit", unsafe {
            kvrelay_agent_config_set_limit(
                cfg.0,
                kvrelay_agent_limit::KVRELAY_LIMIT_TCP_FALLBACK as i32,
                u64::from(settings.tcp_fallback),
            )
        })?;
        // SAFETY: live config.
        check_detail("kvrelay_agent_config_set_limit", unsafe {
            kvrelay_agent_config_set_limit(cfg.0, kvrelay_agent_limit::KVRELAY_LIMIT_POLL_US as i32, settings.poll_us)
        })?;
        let ud = Box::into_raw(Box::new(holder)) as *mut c_void;
        let h = kvrelay_block_holder {
            size: size_of::<kvrelay_block_holder>(),
            user_data: ud,
            pin: Some(holder_pin),
            unpin: Some(holder_unpin),
            destroy: Some(holder_destroy),
            returned: Some(holder_returned),
        };
        let mut out = ptr::null_mut();
        // SAFETY: live config and layout; the holder's user data is owned by the agent from here
        // (its destroy runs on every path); the memory contract is the caller's.
        check_detail("kvrelay_agent_new", unsafe { kvrelay_agent_new(cfg.0, layout.0.as_ptr(), &h, &mut out) })?;
        Ok(KvAgent(NonNull::new(out).expect("OK with NULL")))
    }

    /// `tcp://ADDR:PORT` of the KV service.
    pub fn endpoint(&self) -> String {
        // SAFETY: live agent; a size query and a fill.
        fill_text("kvrelay_agent_endpoint", |b, c, l| unsafe { kvrelay_agent_endpoint(self.0.as_ptr(), b, c, l) })
            .unwrap_or_default()
    }

    /// Record the checksums of blocks that just became reusable.
    pub fn record_checksums(&self, ids: &[u32]) -> Result<(), String> {
        // SAFETY: live agent; `ids` readable.
        check_detail("kvrelay_agent_record_checksums", unsafe {
            kvrelay_agent_record_checksums(self.0.as_ptr(), ids.as_ptr(), ids.len())
        })
    }

    /// Record the content digests of blocks that just became reusable (`digests[i]` for
    /// `ids[i]`), after their checksums: a checked fetch takes a block only under its digest.
    pub fn record_digests(&self, ids: &[u32], digests: &[[u8; 32]]) -> Result<(), String> {
        if ids.len() != digests.len() {
            return Err(format!("{} blocks and {} digests", ids.len(), digests.len()));
        }
        // SAFETY: live agent; `ids` readable for `n` ids and `digests` for `n` digests of 32 bytes.
        check_detail("kvrelay_agent_record_digests", unsafe {
            kvrelay_agent_record_digests(self.0.as_ptr(), ids.as_ptr(), digests.as_ptr().cast(), ids.len())
        })
    }

    /// Submit a fetch of `names[held .. held + dst.len()]` from `endpoint` into `dst`, checked
    /// by content: `digests[i]` is the digest of `names[i]` (one per name).
    #[allow(clippy::too_many_arguments)] // the fetch's parameters, as the C ABI takes them
    pub fn fetch(
        &self,
        endpoint: &str,
        names: &[u64],
        digests: &[[u8; 32]],
        held: usize,
        dst: &[u32],
        deadline_ms: u32,
    ) -> Result<PendingFetch, String> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        let callbacks = kvrelay_fetch_callbacks {
            size: std::mem::size_of::<kvrelay_fetch_callbacks>(),
            user_data: Box::into_raw(Box::new(Some(tx))) as *mut c_void,
            done: Some(fetch_done),
            destroy: Some(fetch_destroy),
            ready: None,
        };
        let p = kvrelay_fetch_params {
            size: size_of::<kvrelay_fetch_params>(),
            endpoint: kvrelay_str { ptr: endpoint.as_ptr().cast(), len: endpoint.len() },
            names: names.as_ptr(),
            names_len: names.len(),
            held,
            dst_blocks: dst.as_ptr(),
            dst_len: dst.len(),
            deadline_ms,
        };
        let mut out = ptr::null_mut();
        // SAFETY: live agent; the parameters' arrays and the digests are readable for the call
        // (the agent copies them); the callbacks' user data is owned by the agent from here (its destroy
        // runs exactly once, also when the submission is refused).
        let st = unsafe {
            kvrelay_agent_submit_checked(
                self.0.as_ptr(),
                &p,
                digests.as_ptr().cast(),
                digests.len(),
                &callbacks,
                &mut out,
            )
        };
        check_detail("kvrelay_agent_submit_checked", st)?;
        Ok(PendingFetch { fetch: Arc::new(FetchHandle(NonNull::new(out).expect("OK with NULL"))), done: rx })
    }

    /// Expected seconds to fetch `blocks` blocks from `endpoint`.
    pub fn estimate(&self, endpoint: &str, blocks: usize) -> f64 {
        let mut s = 0.0;
        // SAFETY: live agent; text readable; `s` writable.
        let st = unsafe {
            kvrelay_agent_estimate(self.0.as_ptr(), endpoint.as_ptr().cast(), endpoint.len(), blocks, &mut s)
        };
        if st == kvrelay_status::KVRELAY_OK {
            s
        } else {
            f64::INFINITY
        }
    }

    /// The agent's counters.
    pub fn stats(&self) -> kvrelay::agent::AgentStats {
        let mut s = kvrelay::agent::AgentStats::default();
        // SAFETY: live agent; `s` writable for its size.
        let _ = unsafe { kvrelay_agent_read_stats(self.0.as_ptr(), &mut s, std::mem::size_of_val(&s)) };
        s
    }

    /// The agent's Prometheus text (`kvrelay_kv_agent_*`).
    pub fn prometheus(&self) -> String {
        // SAFETY: live agent; a size query and a fill.
        fill_text("kvrelay_agent_prometheus", |b, c, l| unsafe { kvrelay_agent_prometheus(self.0.as_ptr(), b, c, l) })
            .unwrap_or_default()
    }
}

impl Drop for KvAgent {
    fn drop(&mut self) {
        // SAFETY: from `kvrelay_agent_new`, freed once, from no agent callback.
        unsafe { kvrelay_agent_free(self.0.as_ptr()) };
    }
}

/// The label of a `kvrelay_fetch_failure` value.
pub fn fetch_failure_name(f: i32) -> &'static str {
    static_text(kvrelay_fetch_failure_name(f))
}

/// The run to fetch (`kvrelay_fetch_run_length`): from the first block not held here (`held`
/// leading blocks are), the consecutive names that appear among `hashes`.
pub fn run_to_fetch(names: &[u64], held: usize, hashes: &[u64]) -> Vec<u64> {
    let mut n = 0usize;
    // SAFETY: both slices readable for their lengths; `n` writable.
    let st =
        unsafe { kvrelay_fetch_run_length(names.as_ptr(), names.len(), held, hashes.as_ptr(), hashes.len(), &mut n) };
    if st != kvrelay_status::KVRELAY_OK {
        return Vec::new();
    }
    names[held..held + n].to_vec()
}

/// The deadline a source gives a transfer of `bytes`, in milliseconds (`kvrelay_fetch_deadline_ms`).
pub fn fetch_deadline_ms(bytes: u64) -> u32 {
    kvrelay_fetch_deadline_ms(bytes)
}
