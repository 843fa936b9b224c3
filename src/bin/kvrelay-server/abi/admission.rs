//! Admission and snapshots: the edge every request is admitted at, and the snapshots that
//! travel with it.

use super::*;

/// An admission edge (`kvrelay_admission`): thread-safe, shared by every request.
pub struct Admission(NonNull<kvrelay_admission>);

// SAFETY: the header documents `kvrelay_admission` as thread-safe: any number of threads may
// admit on one edge at once, and it is freed only by `Drop`, which has exclusive access.
unsafe impl Send for Admission {}
// SAFETY: as above.
unsafe impl Sync for Admission {}

/// What admission did with one hint value.
#[derive(Clone, Debug)]
pub enum HintOutcome {
    /// No hint (absent or `null`); not counted.
    Absent,
    /// Admitted and frozen.
    Admitted(Snapshot),
    /// Dropped whole, with the reason's metric label and a detail that never holds hint bytes.
    Ignored {
        /// `untrusted`, `unknown_version`, `oversized` or `malformed`.
        reason: &'static str,
        /// What failed and where (malformed only).
        detail: String,
    },
}

impl HintOutcome {
    /// The label for logs: `absent`, `admitted`, or the ignore reason.
    pub fn label(&self) -> &'static str {
        match self {
            HintOutcome::Absent => "absent",
            HintOutcome::Admitted(_) => "admitted",
            HintOutcome::Ignored { reason, .. } => reason,
        }
    }

    /// The snapshot when admitted.
    pub fn snapshot(&self) -> Option<&Snapshot> {
        match self {
            HintOutcome::Admitted(s) => Some(s),
            _ => None,
        }
    }
}

/// The batch's aligned hint list has another length than its prompt count.
#[derive(Debug)]
pub struct BatchLengthMismatch;

impl Admission {
    /// An edge with trust taken from the environment variable `trust_env` (e.g.
    /// `KVRELAY_TRUST_KV_HINTS`) unless `trust` forces it.
    pub fn new(trust_env: &str, trust: Option<bool>, max_bytes: Option<usize>) -> Result<Admission, AbiError> {
        let mut cfg: *mut kvrelay_admission_config = ptr::null_mut();
        // SAFETY: `cfg` is a writable out-pointer.
        check("kvrelay_admission_config_new", unsafe { kvrelay_admission_config_new(&mut cfg) })?;
        // Free the config on every path: the edge copies it.
        struct Cfg(*mut kvrelay_admission_config);
        impl Drop for Cfg {
            fn drop(&mut self) {
                // SAFETY: from `kvrelay_admission_config_new`, freed once here.
                unsafe { kvrelay_admission_config_free(self.0) };
            }
        }
        let cfg = Cfg(cfg);
        // SAFETY: `cfg.0` is live; the name is readable for its length.
        check("kvrelay_admission_config_trust_from_env", unsafe {
            kvrelay_admission_config_trust_from_env(cfg.0, trust_env.as_ptr().cast(), trust_env.len())
        })?;
        if let Some(t) = trust {
            // SAFETY: `cfg.0` is live.
            check("kvrelay_admission_config_set_trusted", unsafe { kvrelay_admission_config_set_trusted(cfg.0, t) })?;
        }
        if let Some(n) = max_bytes {
            // SAFETY: `cfg.0` is live.
            check("kvrelay_admission_config_set_max_bytes", unsafe {
                kvrelay_admission_config_set_max_bytes(cfg.0, n)
            })?;
        }
        let mut out: *mut kvrelay_admission = ptr::null_mut();
        // SAFETY: `cfg.0` live, `out` writable.
        check("kvrelay_admission_new", unsafe { kvrelay_admission_new(cfg.0, &mut out) })?;
        Ok(Admission(NonNull::new(out).expect("kvrelay_admission_new returned OK with NULL")))
    }

    fn outcome(o: &kvrelay_outcome, snap: *mut kvrelay_snapshot) -> HintOutcome {
        match o.kind {
            k if k == kvrelay_outcome_kind::KVRELAY_OUTCOME_ADMITTED as i32 => match NonNull::new(snap) {
                Some(p) => HintOutcome::Admitted(Snapshot(p)),
                None => HintOutcome::Absent,
            },
            k if k == kvrelay_outcome_kind::KVRELAY_OUTCOME_IGNORED as i32 => {
                // SAFETY: `detail` is NUL-terminated within its fixed capacity (header contract).
                let d = unsafe { CStr::from_ptr(o.detail.as_ptr()) };
                HintOutcome::Ignored {
                    reason: static_text(kvrelay_reason_name(o.reason)),
                    detail: d.to_string_lossy().into_owned(),
                }
            }
            _ => HintOutcome::Absent,
        }
    }

    /// Admit one raw hint value (`None`: the request carries none). Counted once by the edge.
    pub fn admit(&self, raw: Option<&[u8]>) -> HintOutcome {
        let (p, n) = raw.map_or((ptr::null(), 0), |r| (r.as_ptr(), r.len()));
        let mut o = empty_outcome();
        let mut snap: *mut kvrelay_snapshot = ptr::null_mut();
        // SAFETY: the edge is live; `(p, n)` is readable (or NULL, 0); outputs are writable.
        let st = unsafe { kvrelay_admit(self.0.as_ptr(), p, n, &mut o, &mut snap) };
        if st != kvrelay_status::KVRELAY_OK {
            // Only argument errors can get here; inference continues without a hint.
            return HintOutcome::Absent;
        }
        Self::outcome(&o, snap)
    }

    /// Admit the hint value of a batched request of `prompts` prompts: one envelope shared by
    /// all, or an aligned list admitted entry by entry.
    pub fn admit_batch(&self, raw: Option<&[u8]>, prompts: usize) -> Result<Vec<HintOutcome>, BatchLengthMismatch> {
        let (p, n) = raw.map_or((ptr::null(), 0), |r| (r.as_ptr(), r.len()));
        let mut outs = vec![empty_outcome(); prompts];
        let mut snaps: Vec<*mut kvrelay_snapshot> = vec![ptr::null_mut(); prompts];
        // SAFETY: both arrays hold `prompts` writable elements; the edge is live.
        let st = unsafe {
            kvrelay_admit_batch(self.0.as_ptr(), p, n, prompts, outs.as_mut_ptr(), snaps.as_mut_ptr(), ptr::null_mut())
        };
        if st == kvrelay_status::KVRELAY_ERR_BATCH_LENGTH_MISMATCH {
            return Err(BatchLengthMismatch);
        }
        if st != kvrelay_status::KVRELAY_OK {
            return Ok(vec![HintOutcome::Absent; prompts]);
        }
        Ok(outs.iter().zip(snaps).map(|(o, s)| Self::outcome(o, s)).collect())
    }

    /// The edge's counters as Prometheus text.
    pub fn prometheus(&self) -> String {
        // SAFETY: the edge is live; `fill_text` passes a buffer writable for `cap` bytes.
        fill_text("kvrelay_admission_prometheus", |b, c, l| unsafe {
            kvrelay_admission_prometheus(self.0.as_ptr(), b, c, l)
        })
        .unwrap_or_default()
    }

    /// A copy of the edge's counters.
    pub fn counters(&self) -> kvrelay_counters {
        let mut c = kvrelay_counters::default();
        // SAFETY: the edge is live; `c` is writable.
        let _ = unsafe { kvrelay_admission_counters(self.0.as_ptr(), &mut c) };
        c
    }
}

impl Drop for Admission {
    fn drop(&mut self) {
        // SAFETY: from `kvrelay_admission_new`; `&mut self` means no other thread uses it.
        unsafe { kvrelay_admission_free(self.0.as_ptr()) };
    }
}

fn empty_outcome() -> kvrelay_outcome {
    kvrelay_outcome::default()
}

/// A reference to an admitted snapshot: `Clone` retains, `Drop` releases. Its `Debug` never
/// prints hint contents.
pub struct Snapshot(pub(super) NonNull<kvrelay_snapshot>);

// SAFETY: snapshots are immutable and reference counted with atomic counts (header: shared by
// ranks and child requests); retain and release may run on any thread.
unsafe impl Send for Snapshot {}
// SAFETY: as above: every accessor only reads.
unsafe impl Sync for Snapshot {}

impl Clone for Snapshot {
    fn clone(&self) -> Snapshot {
        // SAFETY: `self` holds a reference, so the handle is live.
        let p = unsafe { kvrelay_snapshot_retain(self.0.as_ptr()) };
        Snapshot(NonNull::new(p).expect("retain of a live snapshot"))
    }
}

impl Drop for Snapshot {
    fn drop(&mut self) {
        // SAFETY: this wrapper owns exactly one reference, given up here.
        unsafe { kvrelay_snapshot_release(self.0.as_ptr()) };
    }
}

impl fmt::Debug for Snapshot {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Snapshot(..)")
    }
}

/// One action of a snapshot, borrowed from it.
#[derive(Clone, Copy)]
pub struct ActionView<'a> {
    /// `action_type`.
    pub action_type: &'a str,
    /// `action_version`.
    pub version: &'a str,
    /// Canonical payload bytes.
    pub payload: &'a [u8],
}

/// # Safety
/// `s` must come from kvrelay for a live snapshot that outlives `'a` (valid UTF-8 per header).
pub(super) unsafe fn view_str<'a>(s: kvrelay_str) -> &'a str {
    // SAFETY: per the header, `ptr` is never NULL and readable for `len` bytes of UTF-8 while
    // the snapshot is held; the caller ties `'a` to that.
    unsafe { std::str::from_utf8_unchecked(std::slice::from_raw_parts(s.ptr.cast(), s.len)) }
}

impl Snapshot {
    /// The message id.
    pub fn message_id(&self) -> &str {
        let mut s = kvrelay_str { ptr: ptr::null(), len: 0 };
        // SAFETY: live handle; `s` writable.
        if unsafe { kvrelay_snapshot_message_id(self.0.as_ptr(), &mut s) } != kvrelay_status::KVRELAY_OK {
            return "";
        }
        // SAFETY: the view borrows from `self`, which outlives the returned reference.
        unsafe { view_str(s) }
    }

    /// Number of actions.
    pub fn action_count(&self) -> usize {
        let mut n = 0usize;
        // SAFETY: live handle; `n` writable.
        let _ = unsafe { kvrelay_snapshot_action_count(self.0.as_ptr(), &mut n) };
        n
    }

    /// Action `i`, or `None` past the end.
    pub fn action(&self, i: usize) -> Option<ActionView<'_>> {
        let mut a = kvrelay_action::default();
        // SAFETY: live handle; `a` writable.
        if unsafe { kvrelay_snapshot_action(self.0.as_ptr(), i, &mut a) } != kvrelay_status::KVRELAY_OK {
            return None;
        }
        // SAFETY: every view borrows from `self` (header), which outlives the result.
        Some(unsafe {
            ActionView {
                action_type: view_str(a.action_type),
                version: view_str(a.version),
                payload: std::slice::from_raw_parts(a.payload.ptr, a.payload.len),
            }
        })
    }

    /// The canonical bytes of the one-action envelope of action `i` (copied).
    pub fn action_envelope(&self, i: usize) -> Result<Vec<u8>, AbiError> {
        // SAFETY: live handle; `fill_bytes` passes a buffer writable for `cap` bytes.
        fill_bytes("kvrelay_snapshot_action_envelope", |b, c, l| unsafe {
            kvrelay_snapshot_action_envelope(self.0.as_ptr(), i, b, c, l)
        })
    }
}
