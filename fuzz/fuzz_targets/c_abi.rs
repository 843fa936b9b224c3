//! The C ABI driven by arbitrary argument sequences through the exported functions: hints of
//! arbitrary bytes, NULL pointers with arbitrary lengths, size queries with arbitrary
//! capacities, action indexes past the end, batches of any size, and retain/release sequences
//! on the snapshots the sequence holds. Every call must return a documented status and honour
//! the header's contract (the size query stores the needed size; nothing else is written when
//! the buffer is too small); the handle accounting must balance.
#![no_main]

use std::ptr;

use kvrelay::ffi::admission::*;
use kvrelay::ffi::kvrelay_status;
use kvrelay::ffi::policy::*;
use kvrelay::ffi::snapshot::*;
use kvrelay::ffi::types::*;
use libfuzzer_sys::fuzz_target;

use kvrelay_status::*;

struct Input<'a>(&'a [u8]);

impl<'a> Input<'a> {
    fn byte(&mut self) -> Option<u8> {
        let (&b, rest) = self.0.split_first()?;
        self.0 = rest;
        Some(b)
    }
    fn small(&mut self) -> usize {
        self.byte().map_or(0, usize::from)
    }
    fn bytes(&mut self) -> &'a [u8] {
        let n = self.small().min(self.0.len());
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        a
    }
}

fn outcome() -> kvrelay_outcome {
    kvrelay_outcome { kind: -1, reason: -1, ..Default::default() }
}

/// A size-query call: `(NULL, 0)` first, then a buffer of `cap` bytes filled with a marker;
/// checks the convention and returns the bytes when they fit.
fn query(cap: usize, f: impl Fn(*mut u8, usize, *mut usize) -> kvrelay_status) -> Option<Vec<u8>> {
    let mut need = usize::MAX;
    let st = f(ptr::null_mut(), 0, &mut need);
    if st != KVRELAY_OK && st != KVRELAY_ERR_BUFFER_TOO_SMALL {
        return None;
    }
    assert_ne!(need, usize::MAX, "the size query stored no size");
    let mut buf = vec![0xa5u8; cap];
    let mut got = usize::MAX;
    let st = f(buf.as_mut_ptr(), cap, &mut got);
    assert_eq!(got, need, "the size changed between two queries of an immutable snapshot");
    if cap < need {
        assert_eq!(st, KVRELAY_ERR_BUFFER_TOO_SMALL);
        assert!(buf.iter().all(|&b| b == 0xa5), "a too-small buffer was written");
        None
    } else {
        assert_eq!(st, KVRELAY_OK);
        buf.truncate(need);
        Some(buf)
    }
}

fuzz_target!(|data: &[u8]| {
    let mut inp = Input(data);
    let mut adm: *mut kvrelay_admission = ptr::null_mut();
    let mut cfg: *mut kvrelay_admission_config = ptr::null_mut();
    // SAFETY (whole target): every pointer passed is NULL, a live handle this target holds, or
    // a buffer of the length passed with it.
    unsafe {
        assert_eq!(kvrelay_admission_config_new(&mut cfg), KVRELAY_OK);
        kvrelay_admission_config_set_trusted(cfg, inp.byte().unwrap_or(1) != 0);
        let max_bytes = 64 + inp.small() * 64;
        kvrelay_admission_config_set_max_bytes(cfg, max_bytes);
        assert_eq!(kvrelay_admission_new(cfg, &mut adm), KVRELAY_OK);
        kvrelay_admission_config_free(cfg);
        let mut caps_b: *mut kvrelay_capabilities_builder = ptr::null_mut();
        kvrelay_capabilities_builder_new(&mut caps_b);
        let (f, t, v) = ("fam", "kv.fetch", "1.0");
        kvrelay_capabilities_builder_add(
            caps_b,
            f.as_ptr().cast(),
            f.len(),
            t.as_ptr().cast(),
            t.len(),
            v.as_ptr().cast(),
            v.len(),
        );
        let mut caps: *mut kvrelay_capabilities = ptr::null_mut();
        assert_eq!(kvrelay_capabilities_build(caps_b, &mut caps), KVRELAY_OK);

        let mut held: Vec<*mut kvrelay_snapshot> = Vec::new();
        let mut steps = 0;
        while let Some(op) = inp.byte() {
            steps += 1;
            if steps > 64 {
                break;
            }
            let pick = |held: &Vec<*mut kvrelay_snapshot>, k: usize| {
                if held.is_empty() {
                    ptr::null_mut()
                } else {
                    held[k % held.len()]
                }
            };
            match op % 10 {
                0 => {
                    let b = inp.bytes();
                    let (mut o, mut s) = (outcome(), ptr::null_mut());
                    assert_eq!(kvrelay_admit(adm, b.as_ptr(), b.len(), &mut o, &mut s), KVRELAY_OK);
                    assert!((0..=2).contains(&o.kind) && (0..=4).contains(&o.reason));
                    assert_eq!(o.kind == 1, !s.is_null());
                    if !s.is_null() {
                        held.push(s);
                    }
                }
                1 => {
                    let n = inp.small();
                    let (mut o, mut s) = (outcome(), ptr::null_mut());
                    let st = kvrelay_admit(adm, ptr::null(), n, &mut o, &mut s);
                    assert_eq!(st, if n == 0 { KVRELAY_OK } else { KVRELAY_ERR_INVALID_ARGUMENT });
                    assert!(s.is_null());
                    // NULL out-parameters
                    assert_eq!(kvrelay_admit(adm, b"{}".as_ptr(), 2, ptr::null_mut(), &mut s), KVRELAY_ERR_NULL);
                }
                2 => {
                    let s = pick(&held, inp.small());
                    if !s.is_null() {
                        held.push(kvrelay_snapshot_retain(s));
                    }
                }
                3 => {
                    if !held.is_empty() {
                        let k = inp.small() % held.len();
                        kvrelay_snapshot_release(held.swap_remove(k));
                    }
                }
                4 => {
                    let s = pick(&held, inp.small());
                    let cap = inp.small() * 8;
                    if !s.is_null() {
                        let doc = query(cap, |b, c, l| kvrelay_snapshot_decode(s, b, c, l));
                        let mut canon = kvrelay_bytes { ptr: ptr::null(), len: 0 };
                        assert_eq!(kvrelay_snapshot_canonical(s, &mut canon), KVRELAY_OK);
                        if let Some(d) = doc {
                            assert_eq!(d, std::slice::from_raw_parts(canon.ptr, canon.len));
                        }
                    }
                }
                5 => {
                    let s = pick(&held, inp.small());
                    if !s.is_null() {
                        if let Some(mp) = query(1 << 20, |b, c, l| kvrelay_snapshot_msgpack(s, b, c, l)) {
                            let (mut o, mut back) = (outcome(), ptr::null_mut());
                            assert_eq!(
                                kvrelay_admission_decode_msgpack(adm, mp.as_ptr(), mp.len(), &mut o, &mut back),
                                KVRELAY_OK
                            );
                            if !back.is_null() {
                                held.push(back);
                            }
                        }
                    }
                }
                6 => {
                    let s = pick(&held, inp.small());
                    let i = inp.small();
                    if !s.is_null() {
                        let mut n = 0usize;
                        kvrelay_snapshot_action_count(s, &mut n);
                        let mut a = kvrelay_action::default();
                        let st = kvrelay_snapshot_action(s, i, &mut a);
                        assert_eq!(st, if i < n { KVRELAY_OK } else { KVRELAY_ERR_OUT_OF_RANGE });
                        let cap = inp.small() * 4;
                        let env = query(cap, |b, c, l| kvrelay_snapshot_action_envelope(s, i, b, c, l));
                        if let Some(env) = env {
                            let (mut o, mut one) = (outcome(), ptr::null_mut());
                            kvrelay_admit(adm, env.as_ptr(), env.len(), &mut o, &mut one);
                            kvrelay_snapshot_release(one);
                        }
                    }
                }
                7 => {
                    let prompts = inp.small() % 9;
                    let b = inp.bytes();
                    let mut o = vec![outcome(); prompts];
                    let mut s = vec![ptr::null_mut(); prompts];
                    let mut shared = false;
                    let st = kvrelay_admit_batch(
                        adm,
                        b.as_ptr(),
                        b.len(),
                        prompts,
                        o.as_mut_ptr(),
                        s.as_mut_ptr(),
                        &mut shared,
                    );
                    assert!(
                        st == KVRELAY_OK
                            || st == KVRELAY_ERR_BATCH_LENGTH_MISMATCH
                            || (prompts == 0 && st != KVRELAY_ERR_PANIC)
                    );
                    held.extend(s.into_iter().filter(|p| !p.is_null()));
                }
                8 => {
                    let s = pick(&held, inp.small());
                    let cap = inp.small() % 4;
                    let mut out = vec![kvrelay_candidate { action_index: usize::MAX, families: 0 }; cap];
                    let mut n = usize::MAX;
                    let mut counts = kvrelay_candidate_counts::default();
                    let st = kvrelay_collect_candidates(s, caps, out.as_mut_ptr(), cap, &mut n, &mut counts);
                    if s.is_null() {
                        assert_eq!(st, KVRELAY_ERR_NULL);
                    } else {
                        assert!(st == KVRELAY_OK || st == KVRELAY_ERR_BUFFER_TOO_SMALL, "{st:?}");
                    }
                }
                _ => {
                    let mut c = kvrelay_counters::default();
                    assert_eq!(kvrelay_admission_counters(adm, &mut c), KVRELAY_OK);
                    query(inp.small() * 16, |b, cap, l| kvrelay_admission_prometheus(adm, b.cast(), cap, l));
                }
            }
        }
        for s in held {
            kvrelay_snapshot_release(s);
        }
        kvrelay_capabilities_free(caps);
        kvrelay_admission_free(adm);
    }
});
