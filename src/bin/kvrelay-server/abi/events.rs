//! The KV events publisher through `kvrelay_kv_events_*` (the functions a C++ runtime calls).

use super::*;
use kvrelay::ffi::events::*;

/// A running publisher (freed on drop: what was queued is sent, its threads joined).
pub struct KvEvents {
    ptr: NonNull<kvrelay_kv_events>,
    /// The PUB endpoint as bound.
    pub endpoint: String,
    /// The replay endpoint as bound.
    pub replay_endpoint: String,
    /// Tokens per block.
    pub block_size: usize,
    /// `"GPU"` or `"CPU"`.
    pub medium: &'static str,
    /// Whether peers must present the key's subscriber token (`--kv-events-key-file`).
    pub key_required: bool,
}

// SAFETY: the header documents every function on a publisher as thread-safe.
unsafe impl Send for KvEvents {}
// SAFETY: as above.
unsafe impl Sync for KvEvents {}

/// What `KvEvents::start` publishes.
pub struct EventsSettings<'a> {
    /// `tcp://HOST:PORT` of the PUB socket.
    pub endpoint: &'a str,
    /// `tcp://HOST:PORT` of the replay socket (`None`: a free port of the endpoint's host).
    pub replay_endpoint: Option<&'a str>,
    /// Tokens per block.
    pub block_size: usize,
    /// `"GPU"` or `"CPU"`.
    pub medium: &'static str,
    /// The peers allowed (`--kv-peer-allow`; empty: loopback).
    pub allow: &'a [String],
    /// A file holding the events' pre-shared key (`--kv-events-key-file`; `None`: no key).
    pub key_file: Option<&'a str>,
}

/// A failing call's status with this thread's last error (the detail that says why).
fn why(call: &'static str, st: kvrelay_status) -> String {
    match super::agent::check_detail(call, st) {
        Err(e) => e,
        Ok(()) => format!("{call} failed"),
    }
}

impl KvEvents {
    /// Bind and start the publisher.
    pub fn start(s: &EventsSettings<'_>) -> Result<KvEvents, String> {
        struct Config(*mut kvrelay_kv_events_config);
        impl Drop for Config {
            fn drop(&mut self) {
                // SAFETY: made by kvrelay_kv_events_config_new, freed once here.
                unsafe { kvrelay_kv_events_config_free(self.0) }
            }
        }
        let mut c = ptr::null_mut();
        // SAFETY: a live string and a local out-parameter.
        let st =
            unsafe { kvrelay_kv_events_config_new(s.endpoint.as_ptr().cast(), s.endpoint.len(), s.block_size, &mut c) };
        if st != kvrelay_status::KVRELAY_OK {
            return Err(why("kvrelay_kv_events_config_new", st));
        }
        let c = Config(c);
        let mut settings = vec![(kvrelay_kv_events_setting::KVRELAY_KV_EVENTS_MEDIUM, s.medium)];
        settings.extend(s.replay_endpoint.map(|r| (kvrelay_kv_events_setting::KVRELAY_KV_EVENTS_REPLAY_ENDPOINT, r)));
        settings.extend(s.allow.iter().map(|a| (kvrelay_kv_events_setting::KVRELAY_KV_EVENTS_ALLOW_PEER, a.as_str())));
        settings.extend(s.key_file.map(|k| (kvrelay_kv_events_setting::KVRELAY_KV_EVENTS_KEY_FILE, k)));
        for (k, v) in settings {
            // SAFETY: the live config and a live string.
            let st = unsafe { kvrelay_kv_events_config_set(c.0, k as i32, v.as_ptr().cast(), v.len()) };
            if st != kvrelay_status::KVRELAY_OK {
                return Err(why("kvrelay_kv_events_config_set", st));
            }
        }
        let mut p = ptr::null_mut();
        // SAFETY: the live config and a local out-parameter.
        let st = unsafe { kvrelay_kv_events_start(c.0, &mut p) };
        if st != kvrelay_status::KVRELAY_OK {
            return Err(why("kvrelay_kv_events_start", st));
        }
        let ptr = NonNull::new(p).ok_or("kvrelay_kv_events_start returned NULL")?;
        let mut ev = KvEvents {
            ptr,
            endpoint: String::new(),
            replay_endpoint: String::new(),
            block_size: s.block_size,
            medium: s.medium,
            key_required: s.key_file.is_some(),
        };
        ev.endpoint = ev.endpoint_of(false);
        ev.replay_endpoint = ev.endpoint_of(true);
        Ok(ev)
    }

    fn endpoint_of(&self, replay: bool) -> String {
        // SAFETY: the live publisher; the closure's buffer is writable for `cap` bytes.
        fill_text("kvrelay_kv_events_endpoint", |b, c, l| unsafe {
            kvrelay_kv_events_endpoint(self.ptr.as_ptr(), replay, b, c, l)
        })
        .expect("a live publisher has its endpoints")
    }

    /// A block was committed under `name`.
    pub fn stored(&self, name: u64, parent: Option<u64>, tokens: &[u32]) {
        // SAFETY: the live publisher; a live slice of its length.
        let st = unsafe {
            kvrelay_kv_events_stored(
                self.ptr.as_ptr(),
                name,
                parent.is_some(),
                parent.unwrap_or(0),
                tokens.as_ptr(),
                tokens.len(),
            )
        };
        debug_assert_eq!(st, kvrelay_status::KVRELAY_OK);
    }

    /// The block named `name` was evicted.
    pub fn removed(&self, name: u64) {
        // SAFETY: the live publisher.
        let st = unsafe { kvrelay_kv_events_removed(self.ptr.as_ptr(), name) };
        debug_assert_eq!(st, kvrelay_status::KVRELAY_OK);
    }

    /// The counters.
    pub fn stats(&self) -> kvrelay::events::EventStats {
        let mut s = kvrelay::events::EventStats::default();
        // SAFETY: the live publisher and a local of the stated size.
        let st = unsafe { kvrelay_kv_events_read_stats(self.ptr.as_ptr(), &mut s, std::mem::size_of_val(&s)) };
        debug_assert_eq!(st, kvrelay_status::KVRELAY_OK);
        s
    }

    /// Append the counters as Prometheus text (`kvrelay_server_kv_events_*`).
    pub fn prometheus(&self, out: &mut String) {
        let prefix = "kvrelay_server";
        // SAFETY: the live publisher, a live prefix; the closure's buffer is writable for `cap`.
        let text = fill_text("kvrelay_kv_events_prometheus", |b, c, l| unsafe {
            kvrelay_kv_events_prometheus(self.ptr.as_ptr(), prefix.as_ptr().cast(), prefix.len(), b, c, l)
        });
        out.push_str(&text.expect("a live publisher renders its counters"));
    }

    /// What `/v1/kv/info` shows of the publisher.
    pub fn info(&self) -> serde_json::Value {
        let s = self.stats();
        serde_json::json!({
            "endpoint": self.endpoint,
            "replay_endpoint": self.replay_endpoint,
            "topic": "",
            "block_size": self.block_size,
            "medium": self.medium,
            "key_required": self.key_required,
            "published": s.published,
            "dropped": s.dropped,
        })
    }
}

impl Drop for KvEvents {
    fn drop(&mut self) {
        // SAFETY: made by kvrelay_kv_events_start, freed once here; no other user remains.
        unsafe { kvrelay_kv_events_free(self.ptr.as_ptr()) }
    }
}
