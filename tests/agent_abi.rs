//! The agent's C ABI as it grows: limits set by name, counters read at the caller's struct
//! size (an executor built against an earlier header gets the fields it knows and nothing past
//! them is written), and `kvrelay_agent_submit`, whose completion carries the failure detail
//! and whose `destroy` runs exactly once on every path.
#![cfg(feature = "agent")]

use std::ffi::c_void;
use std::ptr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use kvrelay::agent::AgentStats;
use kvrelay::ffi::agent::*;
use kvrelay::ffi::copy::*;
use kvrelay::ffi::kvrelay_status::{self, *};
use kvrelay::ffi::types::kvrelay_str;

unsafe extern "C" fn pin(_: *mut c_void, _: *const u64, _: usize, _: *mut u32) -> usize {
    0
}
unsafe extern "C" fn unpin(_: *mut c_void, _: *const u32, _: usize) {}

/// The fingerprint every agent of these tests has.
fn fingerprint() -> kvrelay_agent_fingerprint {
    kvrelay_agent_fingerprint {
        block_tokens: 16,
        layers: 1,
        kv_heads: 1,
        head_dim: 64,
        dtype_bytes: 2,
        naming: 7,
        ..Default::default()
    }
}

/// A fetch-only agent over a small host pool (the pool is leaked: the agent is freed by the test).
fn agent() -> *mut kvrelay_agent {
    let pool: &'static mut [u64] = Box::leak(vec![0u64; 4 * 1024].into_boxed_slice());
    let fp = fingerprint();
    let (mut cfg, mut layout, mut a) = (ptr::null_mut(), ptr::null_mut(), ptr::null_mut());
    // SAFETY: live out-pointers and inputs; the pool outlives the agent (leaked).
    unsafe {
        assert_eq!(kvrelay_agent_config_new(&fp, &mut cfg), KVRELAY_OK);
        assert_eq!(kvrelay_agent_config_set_listen(cfg, ptr::null(), 0), KVRELAY_OK);
        // its fetches go by name alone (nothing listens where they go)
        let unchecked = kvrelay_agent_limit::KVRELAY_LIMIT_UNCHECKED_FETCH as i32;
        assert_eq!(kvrelay_agent_config_set_limit(cfg, unchecked, 1), KVRELAY_OK);
        assert_eq!(
            kvrelay_kv_layout_all_layers_per_block(pool.as_mut_ptr() as u64, 1, 4, 4096, &mut layout),
            KVRELAY_OK
        );
        let h = kvrelay_block_holder {
            size: size_of::<kvrelay_block_holder>(),
            user_data: ptr::null_mut(),
            pin: Some(pin),
            unpin: Some(unpin),
            destroy: None,
            returned: None,
        };
        assert_eq!(kvrelay_agent_new(cfg, layout, &h, &mut a), KVRELAY_OK);
        kvrelay_kv_layout_free(layout);
        kvrelay_agent_config_free(cfg);
    }
    a
}

#[test]
fn limits_are_set_by_name_and_never_wrap() {
    let fp = fingerprint();
    let mut cfg = ptr::null_mut();
    let mut v = 0u64;
    let streams = kvrelay_agent_limit::KVRELAY_LIMIT_STREAMS as i32;
    // SAFETY: live config and out-pointers.
    unsafe {
        assert_eq!(kvrelay_agent_config_new(&fp, &mut cfg), KVRELAY_OK);
        assert_eq!(kvrelay_agent_config_get_limit(cfg, streams, &mut v), KVRELAY_OK);
        assert_eq!(v, 4, "the documented default");
        // 2^32 + 4 would be 4 if it wrapped into the u32 field
        assert_eq!(kvrelay_agent_config_set_limit(cfg, streams, (1u64 << 32) + 4), KVRELAY_ERR_INVALID_CONFIG);
        assert_eq!(kvrelay_agent_config_set_limit(cfg, streams, 0), KVRELAY_ERR_INVALID_CONFIG);
        assert_eq!(kvrelay_agent_config_set_limit(cfg, 99, 1), KVRELAY_ERR_INVALID_CONFIG);
        assert_eq!(kvrelay_agent_config_get_limit(cfg, 99, &mut v), KVRELAY_ERR_INVALID_ARGUMENT);
        assert_eq!(kvrelay_agent_config_set_limit(cfg, streams, 8), KVRELAY_OK);
        let idle = kvrelay_agent_limit::KVRELAY_LIMIT_IDLE_TIMEOUT_MS as i32;
        assert_eq!(kvrelay_agent_config_set_limit(cfg, idle, 0), KVRELAY_OK, "0 turns reuse off");
        assert_eq!(kvrelay_agent_config_get_limit(cfg, streams, &mut v), KVRELAY_OK);
        assert_eq!(v, 8);
        // a switch: its default, or the other of 0 and 1, nothing else
        let switch = |key: kvrelay_agent_limit, default: u64, why: &str| {
            let mut v = 9u64;
            assert_eq!(kvrelay_agent_config_get_limit(cfg, key as i32, &mut v), KVRELAY_OK);
            assert_eq!(v, default, "{why}");
            assert_eq!(kvrelay_agent_config_set_limit(cfg, key as i32, 2), KVRELAY_ERR_INVALID_CONFIG);
            assert_eq!(kvrelay_agent_config_set_limit(cfg, key as i32, 1 - default), KVRELAY_OK);
            assert_eq!(kvrelay_agent_config_get_limit(cfg, key as i32, &mut v), KVRELAY_OK);
            assert_eq!(v, 1 - default);
        };
        switch(kvrelay_agent_limit::KVRELAY_LIMIT_TCP_FALLBACK, 1, "falls back to TCP by default");
        // microseconds, 0 (the default) allowed, at most 10 ms
        let poll = kvrelay_agent_limit::KVRELAY_LIMIT_POLL_US as i32;
        assert_eq!(kvrelay_agent_config_get_limit(cfg, poll, &mut v), KVRELAY_OK);
        assert_eq!(v, 0, "threads sleep at once by default");
        assert_eq!(kvrelay_agent_config_set_limit(cfg, poll, 10_001), KVRELAY_ERR_INVALID_CONFIG);
        assert_eq!(kvrelay_agent_config_set_limit(cfg, poll, 50), KVRELAY_OK);
        assert_eq!(kvrelay_agent_config_get_limit(cfg, poll, &mut v), KVRELAY_OK);
        assert_eq!(v, 50, "read back in microseconds");
        // off by default: a CUDA IPC grant holds the pool and nothing else
        switch(kvrelay_agent_limit::KVRELAY_LIMIT_EXPORT_WHOLE_ALLOCATIONS, 0, "exports exactly the pool by default");
        // off by default: a fetch by name alone is refused (kvrelay_agent_submit_checked asks by content)
        switch(kvrelay_agent_limit::KVRELAY_LIMIT_UNCHECKED_FETCH, 0, "refuses fetches by name alone by default");
        kvrelay_agent_config_free(cfg);
    }
}

/// Transport names: one of `tcp`, `nixl`, `cuda-ipc`, or NIXL and CUDA IPC in order of
/// preference; anything else refused, naming what is taken.
#[test]
fn transports_are_set_by_name_one_or_a_preference() {
    let fp = fingerprint();
    let mut cfg = ptr::null_mut();
    let set = |cfg: *mut kvrelay_agent_config, t: &str| {
        // SAFETY: a live config; the name readable for its length; no library folder.
        unsafe { kvrelay_agent_config_set_transport(cfg, t.as_ptr().cast(), t.len(), ptr::null(), 0) }
    };
    let nixl = if cfg!(feature = "nixl") { KVRELAY_OK } else { KVRELAY_ERR_UNSUPPORTED };
    // SAFETY: a live out-pointer, then the config it returned, freed once.
    unsafe {
        assert_eq!(kvrelay_agent_config_new(&fp, &mut cfg), KVRELAY_OK);
        for (t, want) in [
            ("tcp", KVRELAY_OK),
            ("cuda-ipc", KVRELAY_OK),
            ("nixl", nixl),
            ("cuda-ipc,nixl", nixl),
            ("nixl,cuda-ipc", nixl),
            ("tcp,nixl", if cfg!(feature = "nixl") { KVRELAY_ERR_INVALID_CONFIG } else { nixl }),
            ("cuda-ipc,cuda-ipc", KVRELAY_ERR_INVALID_CONFIG),
            ("cuda-ipc", KVRELAY_OK),
            ("cuda-ipc,", KVRELAY_ERR_INVALID_CONFIG),
            ("carrier-pigeon", KVRELAY_ERR_INVALID_CONFIG),
        ] {
            assert_eq!(set(cfg, t), want, "transport {t:?}");
        }
        kvrelay_agent_config_free(cfg);
    }
}

#[test]
fn counters_are_read_at_the_callers_size() {
    let a = agent();
    let full = std::mem::size_of::<AgentStats>();
    assert_eq!(full % 8, 0);
    let words = full / 8;
    let read = |size: usize| -> (kvrelay_status, Vec<u64>) {
        let mut buf = vec![0xAAAA_AAAA_AAAA_AAAAu64; words + 8];
        // SAFETY: `buf` is writable for `(words + 8) * 8 >= size` bytes.
        let st = unsafe { kvrelay_agent_read_stats(a, buf.as_mut_ptr().cast(), size) };
        (st, buf)
    };
    // this header's size: every field, nothing after it
    let (st, now) = read(full);
    assert_eq!(st, KVRELAY_OK);
    assert!(now[words..].iter().all(|&w| w == 0xAAAA_AAAA_AAAA_AAAA), "nothing written past the struct");
    // every earlier header's size (tests/data/abi_sizes.txt): its fields, and not one byte past
    let table = include_str!("data/abi_sizes.txt");
    let earlier: Vec<usize> = table
        .lines()
        .filter_map(|l| l.split_once(" kvrelay_agent_stats "))
        .map(|(_, n)| n.trim().parse().unwrap())
        .filter(|&n| n < full)
        .collect();
    assert!(earlier.len() >= 3, "0.1.0, 0.2.0 and 0.3.0 had smaller counters: {earlier:?}");
    for size in earlier {
        let (st, buf) = read(size);
        assert_eq!(st, KVRELAY_OK);
        assert!(buf[size / 8..].iter().all(|&w| w == 0xAAAA_AAAA_AAAA_AAAA), "a caller of {size} bytes: stack intact");
        assert_eq!(buf[0], 0, "accepted, written");
        assert_eq!(buf[size / 8 - 1], now[size / 8 - 1], "its last field, as this header reads it");
    }
    // a later header's (more fields than this library has): zeroed, not left as garbage
    let (st, buf) = read(full + 16);
    assert_eq!(st, KVRELAY_OK);
    assert_eq!(&buf[words..words + 2], &[0, 0]);
    assert_eq!(buf[words + 2], 0xAAAA_AAAA_AAAA_AAAA);
    for bad in [0, 7, full + 3] {
        assert_eq!(read(bad).0, KVRELAY_ERR_INVALID_ARGUMENT, "size {bad}");
    }
    // SAFETY: from `agent()`, freed once.
    unsafe { kvrelay_agent_free(a) };
}

/// What the callbacks saw.
#[derive(Default)]
struct Seen {
    done: AtomicUsize,
    destroyed: AtomicUsize,
    failure: Mutex<Option<(i32, String)>>,
}

unsafe extern "C" fn on_done(ud: *mut c_void, r: *const kvrelay_fetch_result, detail: kvrelay_str) {
    // SAFETY: `ud` is the test's `Seen`, alive until after the fetch completed; `r` and `detail`
    // are valid for the call.
    let (seen, r, d) =
        unsafe { (&*(ud as *const Seen), &*r, std::slice::from_raw_parts(detail.ptr.cast::<u8>(), detail.len)) };
    assert_eq!(seen.destroyed.load(Ordering::SeqCst), 0, "destroy runs after done");
    *seen.failure.lock().unwrap() = Some((r.failure, String::from_utf8(d.to_vec()).unwrap()));
    seen.done.fetch_add(1, Ordering::SeqCst);
}

unsafe extern "C" fn on_destroy(ud: *mut c_void) {
    // SAFETY: as in `on_done`.
    let seen = unsafe { &*(ud as *const Seen) };
    seen.destroyed.fetch_add(1, Ordering::SeqCst);
}

#[test]
fn submit_hands_the_detail_to_the_callback_and_destroys_user_data_once() {
    let a = agent();
    let ep = "tcp://127.0.0.1:1";
    let names = [1u64, 2];
    let dst = [0u32];
    let params = |dst_len: usize| kvrelay_fetch_params {
        size: size_of::<kvrelay_fetch_params>(),
        endpoint: kvrelay_str { ptr: ep.as_ptr().cast(), len: ep.len() },
        names: names.as_ptr(),
        names_len: names.len(),
        held: 0,
        dst_blocks: dst.as_ptr(),
        dst_len,
        deadline_ms: 10_000,
    };
    let callbacks = |seen: &Seen, size: usize| kvrelay_fetch_callbacks {
        size,
        user_data: seen as *const Seen as *mut c_void,
        done: Some(on_done),
        destroy: Some(on_destroy),
        ready: None,
    };
    let full = std::mem::size_of::<kvrelay_fetch_callbacks>();
    // a fetch that fails (nothing listens on port 1): done with the detail, then destroy, both
    // before the result is published
    let seen = Seen::default();
    let mut f = ptr::null_mut();
    let mut r = kvrelay_fetch_result {
        size: size_of::<kvrelay_fetch_result>(),
        failure: -1,
        blocks: 9,
        bytes: 9,
        seconds: 0.0,
        withheld: 9,
    };
    // SAFETY: live agent, parameters and callbacks; `seen` outlives the fetch (waited for below).
    unsafe {
        assert_eq!(kvrelay_agent_submit(a, &params(1), &callbacks(&seen, full), &mut f), KVRELAY_OK);
        assert_eq!(kvrelay_fetch_wait(f, 20_000, &mut r), KVRELAY_OK);
        kvrelay_fetch_free(f);
    }
    assert_eq!(r.failure, kvrelay_fetch_failure::KVRELAY_FETCH_CONNECT as i32);
    assert_eq!((seen.done.load(Ordering::SeqCst), seen.destroyed.load(Ordering::SeqCst)), (1, 1));
    let (failure, detail) = seen.failure.lock().unwrap().clone().unwrap();
    assert_eq!(failure, r.failure);
    assert!(detail.contains("connect"), "{detail}");
    // refused submissions: destroy runs before the call returns, done never; a struct below
    // the first version's size is no struct at all: nothing of it is read past its `size`, so
    // the destroy that lies past it never runs
    for (p, size, destroyed) in [(params(0), full, 1), (params(1), 24, 0), (params(1), 8, 0)] {
        let seen = Seen::default();
        let mut f = ptr::null_mut();
        // SAFETY: as above; nothing is submitted.
        let st = unsafe { kvrelay_agent_submit(a, &p, &callbacks(&seen, size), &mut f) };
        assert_eq!(st, KVRELAY_ERR_INVALID_ARGUMENT, "size {size}");
        assert!(f.is_null(), "no handle on an error");
        assert_eq!((seen.done.load(Ordering::SeqCst), seen.destroyed.load(Ordering::SeqCst)), (0, destroyed));
    }
    // an older header's struct (0.2.0 to 0.3.x: 32 bytes, no `ready`): accepted, its callbacks run
    {
        let seen = Seen::default();
        let mut f = ptr::null_mut();
        // SAFETY: as above; the struct is readable for the 32 bytes it states.
        unsafe {
            assert_eq!(kvrelay_agent_submit(a, &params(1), &callbacks(&seen, 32), &mut f), KVRELAY_OK);
            assert_eq!(kvrelay_fetch_wait(f, 20_000, &mut r), KVRELAY_OK);
            kvrelay_fetch_free(f);
        }
        assert_eq!((seen.done.load(Ordering::SeqCst), seen.destroyed.load(Ordering::SeqCst)), (1, 1));
    }
    // a newer header's larger struct: accepted while its unknown field is zero; refused (its
    // destroy, which this library knows, still runs) once that field is set
    #[repr(C)]
    struct Newer {
        known: kvrelay_fetch_callbacks,
        unknown: u64,
    }
    for (unknown, want) in [(0u64, KVRELAY_OK), (7, KVRELAY_ERR_INVALID_ARGUMENT)] {
        let seen = Seen::default();
        let newer = Newer { known: callbacks(&seen, std::mem::size_of::<Newer>()), unknown };
        let mut f = ptr::null_mut();
        // SAFETY: as above; the struct is readable for the size it states.
        unsafe {
            let whole = (&newer as *const Newer).cast::<kvrelay_fetch_callbacks>();
            assert_eq!(kvrelay_agent_submit(a, &params(1), whole, &mut f), want, "unknown field {unknown}");
            if want == KVRELAY_OK {
                assert_eq!(kvrelay_fetch_wait(f, 20_000, &mut r), KVRELAY_OK);
                kvrelay_fetch_free(f);
            }
        }
        let done = usize::from(want == KVRELAY_OK);
        assert_eq!((seen.done.load(Ordering::SeqCst), seen.destroyed.load(Ordering::SeqCst)), (done, 1));
    }
    // no callbacks at all: poll or wait
    let mut f = ptr::null_mut();
    // SAFETY: as above.
    unsafe {
        assert_eq!(kvrelay_agent_submit(a, &params(1), ptr::null(), &mut f), KVRELAY_OK);
        assert_eq!(kvrelay_fetch_wait(f, 20_000, &mut r), KVRELAY_OK);
        kvrelay_fetch_free(f);
        kvrelay_agent_free(a);
    }
}

#[test]
fn the_fetch_deadline_follows_the_sources_and_saturates() {
    assert_eq!(kvrelay_fetch_deadline_ms(0), 10_000);
    assert_eq!(kvrelay_fetch_deadline_ms(100_000_000), 11_000);
    assert_eq!(kvrelay_fetch_deadline_ms(u64::MAX), u32::MAX);
}
