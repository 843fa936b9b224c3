//! The runtime's reuse cache as the agent's service sees it: the C callbacks behind
//! [`crate::agent::BlockHolder`].

use std::ffi::c_void;

use crate::agent::BlockHolder;

/// The runtime's reuse cache, as the agent's service sees it. `pin` and `unpin` run on the
/// agent's connection threads, several at once: they must be thread-safe, must not unwind or
/// `longjmp` out (catch C++ exceptions inside) and must not call back into this agent.
/// - `pin(user_data, names, n, ids_out)`: of the `n` consecutive block names, find the leading
///   run this instance holds, pin those blocks (no eviction, no write, no reuse until `unpin`),
///   write their block ids into `ids_out[0..k]` (room for `n`) and return `k` (0: the first
///   name is not held). The agent serves only blocks whose checksum was recorded
///   (`kvrelay_agent_record_checksums`).
/// - `unpin(user_data, ids, k)`: release blocks pinned by `pin` (each exactly once).
/// - `destroy(user_data)` (may be NULL): called once when the agent is freed, after its last use
///   of the holder, or when `kvrelay_agent_new` fails.
/// - `returned(user_data, ids, k)` (may be NULL over TCP; needed with NIXL): destination blocks
///   a fetch withheld (`kvrelay_fetch_result.withheld`) are free again, no transfer can write
///   them any more. Runs on a fetch worker, or in `kvrelay_agent_free`. Without it withheld
///   blocks stay out of the runtime's pool for good (counted in `blocks_withheld`).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct kvrelay_block_holder {
    /// `sizeof(kvrelay_block_holder)` as the caller's header declares it (callbacks of a newer
    /// header are refused while set, absent ones of an older header are NULL).
    pub size: usize,
    /// Passed back to every callback.
    pub user_data: *mut c_void,
    /// Pin the leading held run of `names`.
    pub pin:
        Option<unsafe extern "C" fn(user_data: *mut c_void, names: *const u64, n: usize, ids_out: *mut u32) -> usize>,
    /// Release pinned blocks.
    pub unpin: Option<unsafe extern "C" fn(user_data: *mut c_void, ids: *const u32, n: usize)>,
    /// Release `user_data`.
    pub destroy: Option<unsafe extern "C" fn(user_data: *mut c_void)>,
    /// Withheld destination blocks are free again.
    pub returned: Option<unsafe extern "C" fn(user_data: *mut c_void, ids: *const u32, n: usize)>,
}

crate::ffi::boundary::sized_since_epoch!(kvrelay_block_holder);

pub(super) struct CHolder(pub(super) kvrelay_block_holder);

// SAFETY: the holder contract (documented on kvrelay_block_holder) requires its callbacks and
// user_data to be usable from any thread, concurrently.
unsafe impl Send for CHolder {}
// SAFETY: as above.
unsafe impl Sync for CHolder {}

impl Drop for CHolder {
    fn drop(&mut self) {
        if let Some(d) = self.0.destroy {
            // SAFETY: called exactly once, with the user_data the consumer supplied for it.
            unsafe { d(self.0.user_data) };
        }
    }
}

impl BlockHolder for CHolder {
    fn pin(&self, names: &[u64], ids: &mut [u32]) -> usize {
        match self.0.pin {
            // SAFETY: the consumer's callback; `names` and `ids` are live slices of `names.len()`
            // elements for the duration of the call (the agent checks what it answers).
            Some(f) => unsafe { f(self.0.user_data, names.as_ptr(), names.len(), ids.as_mut_ptr()) },
            None => 0,
        }
    }
    fn unpin(&self, ids: &[u32]) {
        if let Some(f) = self.0.unpin {
            // SAFETY: the consumer's callback; `ids` is a live slice for the call's duration.
            unsafe { f(self.0.user_data, ids.as_ptr(), ids.len()) }
        }
    }
    fn returned(&self, ids: &[u32]) {
        if let Some(f) = self.0.returned {
            // SAFETY: the consumer's callback; `ids` is a live slice for the call's duration.
            unsafe { f(self.0.user_data, ids.as_ptr(), ids.len()) }
        }
    }
}
