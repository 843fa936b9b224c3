//! Shared by the benchmarks that run `kvrelay-server` processes: which binary, and the address
//! a `serve` child reports.

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::process::Child;

/// The server binary cargo built for this target, or `KVRELAY_SERVER_BIN` (a binary carried to
/// another machine, e.g. the GPU machine).
pub fn server_bin() -> std::path::PathBuf {
    std::env::var_os("KVRELAY_SERVER_BIN").map_or_else(|| env!("CARGO_BIN_EXE_kvrelay-server").into(), Into::into)
}

/// Read the `listening on ADDR` line a `serve` child prints once it is ready (its stdout must
/// be piped; it is taken).
pub fn listening_addr(child: &mut Child) -> SocketAddr {
    let mut line = String::new();
    BufReader::new(child.stdout.take().expect("the server's stdout is piped"))
        .read_line(&mut line)
        .expect("first line");
    line.trim().strip_prefix("listening on ").expect("listening line").parse().expect("an address")
}
