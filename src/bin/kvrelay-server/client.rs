//! A minimal blocking HTTP/1.1 client for loopback (the demo, the tests and the load
//! benchmark include this file): one request per connection, `Connection: close`, fixed-length
//! or chunked bodies, a deadline on every read and write.
#![allow(dead_code)] // each includer uses a different part

use std::io::{self, BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

/// A response.
#[derive(Debug, Clone)]
pub struct Reply {
    /// Status code.
    pub status: u16,
    /// Headers, names lowercased.
    pub headers: Vec<(String, String)>,
    /// The body, de-chunked.
    pub body: Vec<u8>,
}

impl Reply {
    /// The body as text (lossy).
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    /// A header's value.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(k, _)| k == name).map(|(_, v)| v.as_str())
    }

    /// The body parsed as JSON (`Null` when it is not JSON).
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).unwrap_or(serde_json::Value::Null)
    }
}

/// Deadline of every read and write.
pub const TIMEOUT: Duration = Duration::from_secs(60);

/// Send one request and read the whole response.
pub fn request(addr: SocketAddr, method: &str, path: &str, body: Option<&[u8]>) -> io::Result<Reply> {
    let mut s = send(addr, method, path, body)?;
    read_reply(&mut s)
}

/// `POST` a JSON body.
pub fn post(addr: SocketAddr, path: &str, body: &serde_json::Value) -> io::Result<Reply> {
    request(addr, "POST", path, Some(body.to_string().as_bytes()))
}

/// `GET`.
pub fn get(addr: SocketAddr, path: &str) -> io::Result<Reply> {
    request(addr, "GET", path, None)
}

/// Open a connection and send a request without reading the answer.
pub fn send(addr: SocketAddr, method: &str, path: &str, body: Option<&[u8]>) -> io::Result<TcpStream> {
    let mut s = TcpStream::connect_timeout(&addr, TIMEOUT)?;
    s.set_read_timeout(Some(TIMEOUT))?;
    s.set_write_timeout(Some(TIMEOUT))?;
    let body = body.unwrap_or(b"");
    let head = format!(
        "{method} {path} HTTP/1.1\r\nhost: {addr}\r\nconnection: close\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes())?;
    s.write_all(body)?;
    s.flush()?;
    Ok(s)
}

/// [`request`] whose whole response (status line, headers, body) may be at most `max` bytes:
/// larger is an `InvalidData` error, found before the body is allocated when its length is
/// declared. For answers from peers that may be hostile.
pub fn request_limited(
    addr: SocketAddr,
    method: &str,
    path: &str,
    body: Option<&[u8]>,
    max: usize,
) -> io::Result<Reply> {
    let mut s = send(addr, method, path, body)?;
    read_reply_limited(&mut s, max)
}

/// Read a whole response from a connection.
pub fn read_reply(s: &mut TcpStream) -> io::Result<Reply> {
    read_reply_limited(s, usize::MAX)
}

fn too_large(max: usize) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, format!("a response larger than {max} bytes"))
}

/// [`read_reply`], at most `max` bytes in all.
pub fn read_reply_limited(s: &mut TcpStream, max: usize) -> io::Result<Reply> {
    let mut r = BufReader::new(Read::take(s, (max as u64).saturating_add(1)));
    let mut line = String::new();
    r.read_line(&mut line)?;
    let status = line
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, "bad status line"))?;
    let mut headers = Vec::new();
    loop {
        line.clear();
        r.read_line(&mut line)?;
        let l = line.trim_end();
        if l.is_empty() {
            break;
        }
        if let Some((k, v)) = l.split_once(':') {
            headers.push((k.trim().to_ascii_lowercase(), v.trim().to_string()));
        }
    }
    let find = |n: &str| headers.iter().find(|(k, _)| k == n).map(|(_, v)| v.clone());
    let mut body = Vec::new();
    if find("transfer-encoding").is_some_and(|v| v.eq_ignore_ascii_case("chunked")) {
        loop {
            line.clear();
            r.read_line(&mut line)?;
            let n = usize::from_str_radix(line.trim().split(';').next().unwrap_or(""), 16)
                .map_err(|_| io::Error::new(io::ErrorKind::InvalidData, "bad chunk size"))?;
            if n == 0 {
                break;
            }
            if n > max - body.len().min(max) {
                return Err(too_large(max));
            }
            let start = body.len();
            body.resize(start + n, 0);
            r.read_exact(&mut body[start..])?;
            line.clear();
            r.read_line(&mut line)?;
        }
    } else if let Some(n) = find("content-length").and_then(|v| v.parse::<usize>().ok()) {
        if n > max {
            return Err(too_large(max));
        }
        body.resize(n, 0);
        r.read_exact(&mut body)?;
    } else {
        r.read_to_end(&mut body)?;
        if body.len() > max {
            return Err(too_large(max));
        }
    }
    Ok(Reply { status, headers, body })
}

/// The `data:` payloads of a server-sent-event body, in order.
pub fn sse_data(body: &str) -> Vec<String> {
    body.lines().filter_map(|l| l.strip_prefix("data:")).map(|d| d.trim_start().to_string()).collect()
}
