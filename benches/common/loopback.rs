//! The anchors of the transfer benchmarks (`benches/transfer.rs`, `benches/agent.rs`): plain
//! loopback TCP copies of the same bytes in 4 MiB writes, over one stream or several at once.
//! - [`loopback_copy`] and [`loopback_copy_streams`] send one 4 MiB buffer over and over and
//!   read into one 4 MiB buffer: both ends stay in the CPU caches.
//! - [`loopback_copy_between`] sends out of one large buffer and reads into another, each byte
//!   once, as a transfer between two pools does: the bytes come from DRAM and go to DRAM.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::Instant;

const CHUNK: usize = 4 << 20;

/// Write `data` to `s` in 4 MiB writes.
fn send_from(s: &mut TcpStream, data: &[u8]) {
    for c in data.chunks(CHUNK) {
        s.write_all(c).unwrap();
    }
}

/// Fill `buf` from `s`, reading at most 4 MiB at a time.
fn receive_into(s: &mut TcpStream, buf: &mut [u8]) {
    let mut got = 0;
    while got < buf.len() {
        let end = buf.len().min(got + CHUNK);
        let n = s.read(&mut buf[got..end]).unwrap();
        assert!(n > 0);
        got += n;
    }
}

/// Write `bytes` to `s` out of one 4 MiB buffer.
fn send(mut s: TcpStream, bytes: usize) {
    let buf = vec![7u8; CHUNK];
    let mut left = bytes;
    while left > 0 {
        let n = left.min(buf.len());
        send_from(&mut s, &buf[..n]);
        left -= n;
    }
}

/// Read `bytes` from `s` into one 4 MiB buffer.
fn receive(mut s: TcpStream, bytes: usize) {
    let mut buf = vec![0u8; CHUNK];
    let mut left = bytes;
    while left > 0 {
        let n = left.min(buf.len());
        receive_into(&mut s, &mut buf[..n]);
        left -= n;
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

/// `src` copied into `dst` (the same length) over `n` loopback TCP streams
/// at once, each carrying one contiguous part, every byte sent straight from `src` and read
/// straight into `dst`: bytes per second, from the first read until the last stream is done.
#[allow(dead_code)] // the transfer bench uses the cache-resident anchor only
pub fn loopback_copy_between(src: &[u8], dst: &mut [u8], n: usize) -> f64 {
    assert_eq!(src.len(), dst.len());
    // `n` equal parts (the last few bytes of an uneven length are left out)
    let n = n.max(1);
    let per = src.len() / n;
    let (src, dst) = (&src[..per * n], &mut dst[..per * n]);
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    std::thread::scope(|sc| {
        for part in src.chunks(per) {
            sc.spawn(move || send_from(&mut TcpStream::connect(addr).unwrap(), part));
        }
        // connections are accepted in any order; the parts are all as long, so any pairing of
        // a connection with a destination part moves every byte once
        let parts: Vec<&mut [u8]> = dst.chunks_mut(per).collect();
        let conns: Vec<TcpStream> = (0..parts.len()).map(|_| l.accept().unwrap().0).collect();
        let t = Instant::now();
        std::thread::scope(|rs| {
            for (mut s, part) in conns.into_iter().zip(parts) {
                rs.spawn(move || receive_into(&mut s, part));
            }
        });
        src.len() as f64 / t.elapsed().as_secs_f64()
    })
}
