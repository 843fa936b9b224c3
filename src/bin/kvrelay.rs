//! `kvrelay`: the operator's command-line tool.
//!
//! ```text
//! kvrelay admit [--trusted] [--max-bytes N] [--max-depth N] [--canonical] [FILE|-]
//! kvrelay demo
//! ```
//!
//! `admit` reads one hint value (the text found under `kv_hints`) from FILE or standard input
//! and prints one JSON line: `{"outcome":"admitted","size":N,"message_id":"...","actions":K}`,
//! `{"outcome":"absent"}` or `{"outcome":"ignored","reason":"...","detail":"..."}` (`detail` for
//! `malformed` only). With `--canonical` and an admitted hint it prints only the canonical bytes.
//! Trust is on with `--trusted` or when `KVRELAY_TRUST_KV_HINTS` says so, as in the server.
//! Exit status: 0 for every outcome, 2 for usage or I/O errors.
//!
//! `demo` walks the whole flow on embedded example hints.

use std::io::{Read, Write};
use std::process::ExitCode;

use kvrelay::hints::DEFAULT_TRUST_ENV;
use kvrelay::{Admission, AdmissionConfig, BatchOutcome, Outcome};

const USAGE: &str =
    "usage: kvrelay admit [--trusted] [--max-bytes N] [--max-depth N] [--canonical] [FILE|-]\n       kvrelay demo";

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let r = match args.first().map(String::as_str) {
        Some("admit") => admit(&args[1..]),
        Some("demo") if args.len() == 1 => demo(),
        Some("-h" | "--help") => {
            println!("{USAGE}");
            Ok(())
        }
        _ => Err(USAGE.to_string()),
    };
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kvrelay: {e}");
            ExitCode::from(2)
        }
    }
}

fn number(v: Option<&String>, flag: &str) -> Result<usize, String> {
    v.and_then(|s| s.parse().ok()).ok_or_else(|| format!("{flag} needs a positive integer\n{USAGE}"))
}

fn admit(args: &[String]) -> Result<(), String> {
    let mut cfg = AdmissionConfig::default().trust_from_env(DEFAULT_TRUST_ENV);
    let mut canonical = false;
    let mut file: Option<&str> = None;
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--trusted" => cfg.trusted = true,
            "--canonical" => canonical = true,
            "--max-bytes" => cfg.max_bytes = number(it.next(), "--max-bytes")?,
            "--max-depth" => cfg.max_depth = number(it.next(), "--max-depth")?,
            f if file.is_none() && (f == "-" || !f.starts_with('-')) => file = Some(f),
            other => return Err(format!("unexpected argument {other:?}\n{USAGE}")),
        }
    }
    let edge = Admission::new(cfg).map_err(|e| e.to_string())?;
    let mut input = Vec::new();
    match file {
        None | Some("-") => std::io::stdin().read_to_end(&mut input).map(|_| ()),
        Some(path) => std::fs::read(path).map(|b| input = b),
    }
    .map_err(|e| format!("cannot read {}: {e}", file.unwrap_or("standard input")))?;
    let outcome = edge.admit(Some(&input));
    let mut out = std::io::stdout().lock();
    let r = match (&outcome, canonical) {
        (Outcome::Admitted(s), true) => out.write_all(s.canonical()),
        _ => writeln!(out, "{}", outcome_line(&outcome)),
    };
    r.and_then(|_| out.flush()).map_err(|e| format!("cannot write output: {e}"))
}

/// The one-line JSON description of an outcome (contents only where the operator asked: the
/// message id of an admitted hint).
fn outcome_line(o: &Outcome) -> String {
    let q = |s: &str| serde_json::to_string(s).expect("strings serialize");
    match o {
        Outcome::Absent => r#"{"outcome":"absent"}"#.to_string(),
        Outcome::Admitted(s) => format!(
            r#"{{"outcome":"admitted","size":{},"message_id":{},"actions":{}}}"#,
            s.canonical_len(),
            q(s.message_id()),
            s.action_count()
        ),
        Outcome::Ignored(i) => match &i.detail {
            Some(d) => format!(r#"{{"outcome":"ignored","reason":"{}","detail":{}}}"#, i.reason, q(&d.to_string())),
            None => format!(r#"{{"outcome":"ignored","reason":"{}"}}"#, i.reason),
        },
    }
}

const DEMO_HINT: &str = r#"{
  "protocol_version": "0.1",
  "message_id": "msg-123",
  "actions": [
    {"action_id": "a1", "action_type": "kv.fetch", "action_version": "1.0",
     "payload": {"source_control_endpoint": "tcp://127.0.0.1:23280", "block_hashes": [11, 22]}},
    {"action_id": "a2", "action_type": "kv.prefetch", "action_version": "9.9", "payload": {}}
  ],
  "router": {"name": "example", "score": 0.75}
}"#;

fn demo() -> Result<(), String> {
    let untrusted = Admission::new(AdmissionConfig::default()).map_err(|e| e.to_string())?;
    let edge = Admission::new(AdmissionConfig { trusted: true, ..Default::default() }).map_err(|e| e.to_string())?;
    println!("== admission (trust off by default)");
    println!("untrusted edge: {}", outcome_line(&untrusted.admit(Some(DEMO_HINT.as_bytes()))));
    let cases: [(&str, &[u8]); 5] = [
        ("example hint", DEMO_HINT.as_bytes()),
        ("null", b"null"),
        ("future version, invalid 0.1 body", br#"{"protocol_version":"9.0","actions":"not a list"}"#.as_slice()),
        ("duplicate member", br#"{"protocol_version":"0.1","protocol_version":"0.1"}"#.as_slice()),
        (
            "integer out of range",
            br#"{"protocol_version":"0.1","message_id":"m","actions":[],"x":18446744073709551616}"#.as_slice(),
        ),
    ];
    for (name, raw) in cases {
        println!("trusted edge, {name}: {}", outcome_line(&edge.admit(Some(raw))));
    }
    let Outcome::Admitted(snap) = edge.admit(Some(DEMO_HINT.as_bytes())) else {
        return Err("the demo hint was not admitted".into());
    };
    println!("\n== snapshot {snap}");
    println!("canonical bytes: {}", String::from_utf8_lossy(snap.canonical()));
    for a in snap.actions() {
        println!(
            "action {}: id={} type={} version={} payload={} bytes",
            a.index(),
            a.id(),
            a.action_type(),
            a.version(),
            a.payload().len()
        );
    }
    let mp = snap.to_msgpack();
    let back = edge.decode_msgpack(&mp).map_err(|e| format!("MessagePack round trip failed: {e}"))?;
    println!("MessagePack: {} bytes; decoded canonical bytes equal: {}", mp.len(), back == snap);
    let view = snap.action_envelope(0).expect("one action");
    println!("one-action envelope of action 0: {}", String::from_utf8_lossy(&view.to_canonical()));
    println!("\n== batched request of 3 prompts, aligned list");
    let list = format!("[{DEMO_HINT}, null, {{\"protocol_version\":\"0.1\"}}]");
    match edge.admit_batch(Some(list.as_bytes()), 3) {
        Ok(BatchOutcome::PerPrompt(v)) => {
            for (i, o) in v.iter().enumerate() {
                println!("prompt {i}: {}", outcome_line(o));
            }
        }
        other => return Err(format!("unexpected batch outcome {other:?}")),
    }
    println!("\n== metrics (trusted edge)\n{}", edge.prometheus());
    copy_demo()
}

/// Move the KV of 16 blocks out of a pool into block-major staging and back into other blocks:
/// on the GPU when one is present, else with the CPU reference engine over host memory.
fn copy_demo() -> Result<(), String> {
    use kvrelay::copy::*;
    let (layers, blocks, kv) = (4u32, 64u32, 4096u64);
    let ids: Vec<u32> = (0..16).map(|i| (i * 7 + 3) % blocks).collect();
    let others: Vec<u32> = (0..16).map(|i| blocks - 1 - i).collect();
    let pool_bytes = (2 * u64::from(layers) * u64::from(blocks) * kv) as usize;
    let pattern: Vec<u8> = (0..pool_bytes).map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8).collect();
    println!("\n== KV copy: {layers} layers, {blocks} blocks of {kv} bytes per layer and K/V, TensorRT-LLM-style pool");
    let e = |e: CopyError| e.to_string();
    match CudaDevice::open(0) {
        Ok(d) => {
            let pool = DeviceBuffer::alloc(&d, pool_bytes).map_err(e)?;
            pool.write(0, &pattern).map_err(e)?;
            let layout = KvLayout::all_layers_per_block(pool.ptr(), layers, blocks, kv).map_err(|x| x.to_string())?;
            let n = layout.staging_bytes(ids.len()) as usize;
            // SAFETY: the layout lies inside `pool`, which outlives the engine.
            let mut engine = unsafe { CudaEngine::new(&d, layout, EngineOptions::default()) }.map_err(e)?;
            let stream = CudaStream::new(&d).map_err(e)?;
            let (a, b) = (PinnedBuffer::alloc(&d, n).map_err(e)?, PinnedBuffer::alloc(&d, n).map_err(e)?);
            engine.gather(&ids, &a, &stream, None).map_err(e)?;
            engine.scatter(&a, &others, &stream, None).map_err(e)?;
            engine.gather(&others, &b, &stream, None).map_err(e)?;
            stream.synchronize().map_err(e)?;
            println!("GPU engine on device {}: gathered {} blocks ({n} bytes), scattered them into other blocks, read back byte-exact: {}", d.ordinal(), ids.len(), a.as_slice() == b.as_slice());
        }
        Err(why) => {
            let mut pool = pattern;
            let layout = KvLayout::all_layers_per_block(pool.as_mut_ptr() as u64, layers, blocks, kv)
                .map_err(|x| x.to_string())?;
            let n = layout.staging_bytes(ids.len()) as usize;
            // SAFETY: the layout lies inside `pool`, which outlives the engine and is not touched
            // otherwise while it is used.
            let mut engine = unsafe { CpuEngine::new(layout) };
            let (mut a, mut b) = (vec![0u8; n], vec![0u8; n]);
            engine.gather(&ids, &mut a).map_err(e)?;
            engine.scatter(&a, &others).map_err(e)?;
            engine.gather(&others, &mut b).map_err(e)?;
            println!("no GPU here ({why}): CPU reference engine on host memory gathered {} blocks ({n} bytes), scattered them into other blocks, read back byte-exact: {}", ids.len(), a == b);
            drop(engine);
            drop(pool);
        }
    }
    Ok(())
}
