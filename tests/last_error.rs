//! `kvrelay_last_error_message`: the detail of the last failing call on this thread.

use std::ffi::c_char;
use std::ptr;

use kvrelay::ffi::admission::*;
use kvrelay::ffi::boundary::kvrelay_last_error_message;
use kvrelay::ffi::copy::*;
use kvrelay::ffi::kvrelay_status::*;

fn last() -> String {
    let mut need = 0usize;
    // SAFETY: (NULL, 0) size query; `need` writable.
    let st = unsafe { kvrelay_last_error_message(ptr::null_mut(), 0, &mut need) };
    assert!(st == KVRELAY_ERR_BUFFER_TOO_SMALL || (st == KVRELAY_OK && need == 1), "{st:?}");
    let mut buf = vec![0u8; need];
    let mut got = 0usize;
    // SAFETY: `buf` writable for `need` bytes.
    let st = unsafe { kvrelay_last_error_message(buf.as_mut_ptr().cast::<c_char>(), buf.len(), &mut got) };
    assert_eq!(st, KVRELAY_OK);
    assert_eq!((got, buf.last()), (need, Some(&0)), "NUL-terminated, size as queried");
    String::from_utf8(buf[..need - 1].to_vec()).unwrap()
}

#[test]
fn failures_say_why_and_only_on_their_thread() {
    assert_eq!(last(), "", "empty before the first failure");
    let mut cfg = ptr::null_mut();
    // SAFETY: every pointer passed below is NULL, a live handle made here, or a local.
    unsafe {
        assert_eq!(kvrelay_admission_config_new(&mut cfg), KVRELAY_OK);
        assert_eq!(kvrelay_admission_config_set_max_bytes(cfg, 0), KVRELAY_OK);
        let mut adm = ptr::null_mut();
        assert_eq!(kvrelay_admission_new(cfg, &mut adm), KVRELAY_ERR_INVALID_CONFIG);
        let m = last();
        eprintln!("config refusal: {m}");
        assert!(m.starts_with("configuration value refused") || m.contains("max_bytes"), "{m}");
        assert!(m.contains("max_bytes"), "the detail names the refused value: {m}");

        // a successful call leaves it; a size query's BUFFER_TOO_SMALL leaves it
        assert_eq!(kvrelay_admission_config_set_max_bytes(cfg, 1024), KVRELAY_OK);
        assert!(last().contains("max_bytes"));
        let mut need = 0;
        let mut out = ptr::null_mut();
        assert_eq!(kvrelay_admission_new(cfg, &mut out), KVRELAY_OK);
        assert_eq!(kvrelay_admission_prometheus(out, ptr::null_mut(), 0, &mut need), KVRELAY_ERR_BUFFER_TOO_SMALL);
        assert!(last().contains("max_bytes"));
        kvrelay_admission_free(out);

        // a layout refusal says which rule
        let seg = kvrelay_kv_segment { base: 17, block_stride: 32, bytes_per_block: 16 };
        let mut layout = ptr::null_mut();
        assert_eq!(kvrelay_kv_layout_new(4, &seg, 1, ptr::null(), 0, &mut layout), KVRELAY_ERR_INVALID_LAYOUT);
        let m = last();
        eprintln!("layout refusal: {m}");
        assert!(m.len() > "invalid layout".len() && m.contains(':'), "a layout detail: {m}");

        // no CUDA driver here (or no such device): the status's message at least
        let st = kvrelay_cuda_available(9999);
        if st != KVRELAY_OK {
            assert!(!last().is_empty());
        }
        kvrelay_admission_config_free(cfg);
    }
    let here = last();
    let other = std::thread::spawn(last).join().unwrap();
    assert_eq!(other, "", "another thread has its own last error");
    assert_eq!(last(), here);
}
