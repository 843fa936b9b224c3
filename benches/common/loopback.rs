//! The anchor of the transfer benchmarks (`benches/transfer.rs`, `benches/agent.rs`): a plain
//! loopback TCP copy of the same bytes, one stream, 4 MiB writes.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::Instant;

/// Write `bytes` to `s` in 4 MiB writes.
fn send(mut s: TcpStream, bytes: usize) {
    let buf = vec![7u8; 4 << 20];
    let mut left = bytes;
    while left > 0 {
        let n = left.min(buf.len());
        s.write_all(&buf[..n]).unwrap();
        left -= n;
    }
}

/// Read `bytes` from `s` (into a 4 MiB buffer).
fn receive(mut s: TcpStream, bytes: usize) {
    let mut buf = vec![0u8; 4 << 20];
    let mut got = 0;
    while got < bytes {
        let n = s.read(&mut buf).unwrap();
        assert!(n > 0);
        got += n;
    }
}

/// A plain loopback TCP copy of `bytes` in 4 MiB writes: bytes per second.
pub fn loopback_copy(bytes: usize) -> f64 {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let w = std::thread::spawn(move || {
        send(TcpStream::connect(addr).unwrap(), bytes);
    });
    let (s, _) = l.accept().unwrap();
    let t = Instant::now();
    receive(s, bytes);
    let secs = t.elapsed().as_secs_f64();
    w.join().unwrap();
    bytes as f64 / secs
}

/// `n` plain loopback TCP copies at once, `bytes / n` each (the anchor of a fetch over `n`
/// streams): bytes per second, from the first read until the last stream is done.
#[allow(dead_code)] // the transfer bench uses one stream only
pub fn loopback_copy_streams(bytes: usize, n: usize) -> f64 {
    if n <= 1 {
        return loopback_copy(bytes);
    }
    let per = bytes / n;
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let writers: Vec<_> =
        (0..n).map(|_| std::thread::spawn(move || send(TcpStream::connect(addr).unwrap(), per))).collect();
    let conns: Vec<TcpStream> = (0..n).map(|_| l.accept().unwrap().0).collect();
    let t = Instant::now();
    let readers: Vec<_> = conns.into_iter().map(|s| std::thread::spawn(move || receive(s, per))).collect();
    for r in readers {
        r.join().unwrap();
    }
    let secs = t.elapsed().as_secs_f64();
    for w in writers {
        w.join().unwrap();
    }
    (per * n) as f64 / secs
}
