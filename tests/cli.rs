//! The `kvrelay` command line, end to end.

use std::io::Write;
use std::process::{Command, Output, Stdio};

fn run(args: &[&str], stdin: &[u8]) -> Output {
    let mut c = Command::new(env!("CARGO_BIN_EXE_kvrelay"))
        .args(args)
        .env_remove("KVRELAY_TRUST_KV_HINTS")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    c.stdin.take().unwrap().write_all(stdin).unwrap();
    c.wait_with_output().unwrap()
}

fn line(o: &Output) -> serde_json::Value {
    assert_eq!(o.status.code(), Some(0), "stderr: {}", String::from_utf8_lossy(&o.stderr));
    let s = std::str::from_utf8(&o.stdout).unwrap();
    assert_eq!(s.lines().count(), 1, "{s}");
    serde_json::from_str(s).unwrap()
}

const HINT: &str = "{ \"protocol_version\": \"0.1\", \"message_id\": \"m-1\",\n \"actions\": [{\"action_id\":\"a\",\"action_type\":\"kv.fetch\",\"action_version\":\"1.0\",\"payload\":{\"block_hashes\":[1, 2]}}] }\n";

#[test]
fn admit_outcomes() {
    let v = line(&run(&["admit", "--trusted"], HINT.as_bytes()));
    assert_eq!(v, serde_json::json!({"outcome":"admitted","size":156,"message_id":"m-1","actions":1}));
    // key order as documented
    let o = run(&["admit", "--trusted", "-"], HINT.as_bytes());
    assert!(String::from_utf8_lossy(&o.stdout).starts_with(r#"{"outcome":"admitted","size":"#));
    assert_eq!(line(&run(&["admit"], HINT.as_bytes())), serde_json::json!({"outcome":"ignored","reason":"untrusted"}));
    assert_eq!(line(&run(&["admit", "--trusted"], b"null")), serde_json::json!({"outcome":"absent"}));
    let v = line(&run(
        &["admit", "--trusted"],
        b"{\"protocol_version\":\"0.1\",\"message_id\":\"top-secret\",\"actions\":[1]}",
    ));
    assert_eq!(v["reason"], "malformed");
    assert_eq!(v["detail"], "action is not an object in actions[0]");
    assert!(!v.to_string().contains("top-secret"));
    let v = line(&run(&["admit", "--trusted", "--max-bytes", "100"], HINT.as_bytes()));
    assert_eq!(v, serde_json::json!({"outcome":"ignored","reason":"oversized"}));
    let deep = HINT.replace("[1, 2]", "[[[1]]]");
    assert_eq!(line(&run(&["admit", "--trusted", "--max-depth", "6"], deep.as_bytes()))["reason"], "malformed");
    assert_eq!(line(&run(&["admit", "--trusted", "--max-depth", "7"], deep.as_bytes()))["outcome"], "admitted");
}

#[test]
fn canonical_output_and_files() {
    let dir = std::env::temp_dir().join(format!("kvrelay-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let f = dir.join("hint.json");
    std::fs::write(&f, HINT).unwrap();
    let o = run(&["admit", "--trusted", "--canonical", f.to_str().unwrap()], b"");
    assert_eq!(o.status.code(), Some(0));
    let canon = o.stdout;
    assert_eq!(canon.len(), 156); // Python: len(json.dumps(json.loads(HINT), separators=(",", ":")))
    assert!(canon.starts_with(br#"{"protocol_version":"0.1","message_id":"m-1","actions":[{"#));
    // admitting the canonical bytes again gives the same bytes
    let again = run(&["admit", "--trusted", "--canonical"], &canon);
    assert_eq!(again.stdout, canon);
    // --canonical on a dropped hint prints the outcome line
    assert_eq!(line(&run(&["admit", "--canonical"], HINT.as_bytes()))["reason"], "untrusted");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn usage_and_io_errors_exit_2() {
    for args in [
        &["admit", "--max-bytes"][..],
        &["admit", "--max-bytes", "x"],
        &["admit", "--bogus"],
        &["frobnicate"],
        &[],
        &["admit", "a", "b"],
        &["admit", "--trusted", "--max-depth", "0"],
    ] {
        let o = run(args, b"");
        assert_eq!(o.status.code(), Some(2), "{args:?}");
        assert!(!o.stderr.is_empty());
        assert!(o.stdout.is_empty());
    }
    let o = run(&["admit", "/nonexistent/kvrelay/hint.json"], b"");
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("cannot read"));
}

#[test]
fn trust_from_the_environment() {
    let o = Command::new(env!("CARGO_BIN_EXE_kvrelay"))
        .args(["admit", "-"])
        .env("KVRELAY_TRUST_KV_HINTS", "1")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut o = o;
    o.stdin.take().unwrap().write_all(HINT.as_bytes()).unwrap();
    let out = o.wait_with_output().unwrap();
    assert_eq!(line(&out)["outcome"], "admitted");
}

#[test]
fn demo_runs() {
    let o = Command::new(env!("CARGO_BIN_EXE_kvrelay")).arg("demo").output().unwrap();
    assert_eq!(o.status.code(), Some(0));
    let s = String::from_utf8(o.stdout).unwrap();
    assert!(s.contains("decoded canonical bytes equal: true"), "{s}");
    assert!(s.contains("kvrelay_kv_hints_ignored_total{reason=\"unknown_version\"} 1"), "{s}");
    assert!(s.contains("read back byte-exact: true"), "{s}");
}
