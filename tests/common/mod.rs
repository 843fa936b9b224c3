//! The harness of the server tests: start `kvrelay-server serve` as a child process with its
//! own settings and environment, talk to it over loopback, read its metrics and logs.
#![allow(dead_code)] // each test file uses a different part

#[path = "../../src/bin/kvrelay-server/client.rs"]
pub mod client;

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

/// A `kvrelay-server serve` child process, killed on drop.
pub struct Server {
    pub child: Child,
    pub addr: SocketAddr,
    pub log: PathBuf,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Start a server with hint trust on or off and extra flags.
pub fn start(trusted: bool, args: &[&str]) -> Server {
    start_env(trusted, args, &[])
}

/// [`start`] with extra environment variables.
pub fn start_env(trusted: bool, args: &[&str], env: &[(&str, &str)]) -> Server {
    static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let log = std::env::temp_dir().join(format!("kvrelay-server-test-{}-{n}.log", std::process::id()));
    let mut cmd = Command::new(server_bin());
    cmd.args(["serve", "--listen", "127.0.0.1:0"]);
    // The whole suite again over another transport (the test command runs it with `nixl`),
    // unless the test picks one itself.
    if let (Some(t), false) = (test_transport(), args.contains(&"--kv-transport")) {
        cmd.args(["--kv-transport", &t]);
    }
    cmd.args(args)
        .env("KVRELAY_PREFILL_TOKENS_PER_S", "0") // a flag overrides it
        .env("KVRELAY_TRUST_KV_HINTS", if trusted { "1" } else { "0" })
        .env("KVRELAY_LOG", "info")
        .envs(env.iter().copied())
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(&log).unwrap());
    let mut child = cmd.spawn().expect("start kvrelay-server");
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
    let addr = line
        .trim()
        .strip_prefix("listening on ")
        .unwrap_or_else(|| {
            let said = std::fs::read_to_string(&log).unwrap_or_default();
            let tail: String =
                said.lines().rev().take(20).collect::<Vec<_>>().into_iter().rev().collect::<Vec<_>>().join("\n");
            panic!("unexpected first line {line:?}; the server's log ends:\n{tail}")
        })
        .parse()
        .unwrap();
    Server { child, addr, log }
}

impl Server {
    pub fn post(&self, path: &str, body: &Value) -> client::Reply {
        client::post(self.addr, path, body).unwrap()
    }
    pub fn complete(&self, body: Value) -> Value {
        let r = self.post("/v1/completions", &body);
        assert_eq!(r.status, 200, "{}", r.text());
        r.json()
    }
    pub fn metrics(&self) -> String {
        client::get(self.addr, "/metrics").unwrap().text()
    }
    /// The value of a series (exact name with labels), 0 when absent.
    pub fn metric(&self, series: &str) -> f64 {
        self.metrics()
            .lines()
            .find_map(|l| l.strip_prefix(series).and_then(|v| v.strip_prefix(' ')).map(|v| v.parse().unwrap()))
            .unwrap_or(0.0)
    }
    pub fn logs(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap()
    }
}

/// The text of the first choice.
pub fn text(v: &Value) -> String {
    v["choices"][0]["text"].as_str().unwrap().to_string()
}
pub fn cached(v: &Value) -> u64 {
    v["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().expect("cached_tokens always present")
}

pub fn prompt(seed: &str, words: usize) -> String {
    (0..words).map(|i| format!("{seed}{i} ")).collect()
}

/// A cold run of `p`: a salt nobody else uses, so nothing is reused.
pub fn cold(s: &Server, p: &str) -> String {
    static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let salt = format!("cold-{}", N.fetch_add(1, std::sync::atomic::Ordering::Relaxed));
    let v = s.complete(json!({"prompt": p, "cache_salt": salt}));
    assert_eq!(cached(&v), 0);
    text(&v)
}

pub fn blocks(s: &Server, state: &str) -> f64 {
    s.metric(&format!("kvrelay_server_kv_blocks{{state=\"{state}\"}}"))
}

pub fn wait_until(what: &str, mut f: impl FnMut() -> bool) {
    let t = Instant::now();
    while !f() {
        assert!(t.elapsed() < Duration::from_secs(20), "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Blocks a source counted as sent: `kvrelay_server_kv_transfer_blocks_total{direction="sent"}`.
pub fn sent(s: &Server) -> f64 {
    s.metric("kvrelay_server_kv_transfer_blocks_total{direction=\"sent\"}")
}

/// Blocks `s` sent since `before`, once that reaches `want` (or after the wait's bound). A
/// transport that lets the reader pull in place (NIXL, CUDA IPC) counts a block when the
/// reader's DONE reaches the source, which can be after the reader's request has answered.
pub fn sent_since(s: &Server, before: f64, want: f64) -> f64 {
    let t = Instant::now();
    while sent(s) - before < want && t.elapsed() < Duration::from_secs(20) {
        std::thread::sleep(Duration::from_millis(20));
    }
    sent(s) - before
}

/// The server binary cargo built for this target, or `KVRELAY_SERVER_BIN` (a binary carried to
/// another machine, e.g. the GPU machine).
pub fn server_bin() -> std::path::PathBuf {
    std::env::var_os("KVRELAY_SERVER_BIN").map_or_else(|| env!("CARGO_BIN_EXE_kvrelay-server").into(), Into::into)
}

/// The transport the suite runs over (`KVRELAY_TEST_KV_TRANSPORT`; unset: each server's default,
/// tcp).
pub fn test_transport() -> Option<String> {
    std::env::var("KVRELAY_TEST_KV_TRANSPORT").ok().filter(|t| !t.is_empty())
}
