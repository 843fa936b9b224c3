//! Peer authentication with a pre-shared key: a mutual challenge-response on the first
//! exchange (HMAC-SHA-256 over both sides' fresh 32-byte nonces, a different label per
//! direction). Neither side sends the key or anything derived from it alone; a recorded
//! exchange cannot be replayed (the other side's nonce is new every time). The key is never
//! logged: [`Psk`]'s `Debug` prints its length only.

use hmac::{Hmac, Mac};
use sha2::Sha256;

/// Bytes of a nonce and of a proof.
pub const NONCE: usize = 32;

/// Shortest key accepted (bytes).
pub const MIN_KEY: usize = 16;
/// Longest key accepted (bytes).
pub const MAX_KEY: usize = 4096;

/// A pre-shared key.
#[derive(Clone, PartialEq, Eq)]
pub struct Psk(Vec<u8>);

impl std::fmt::Debug for Psk {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Psk({} bytes)", self.0.len())
    }
}

impl Drop for Psk {
    fn drop(&mut self) {
        // best effort: the bytes do not outlive the key in this allocation
        for b in self.0.iter_mut() {
            // SAFETY: `b` is a valid, aligned &mut u8; a volatile write keeps the store.
            unsafe { std::ptr::write_volatile(b, 0) };
        }
    }
}

impl Psk {
    /// A key of [`MIN_KEY`]..=[`MAX_KEY`] bytes (surrounding ASCII whitespace trimmed, so a
    /// key file may end with a newline).
    pub fn new(bytes: &[u8]) -> Result<Psk, String> {
        let b = bytes.trim_ascii();
        if b.len() < MIN_KEY || b.len() > MAX_KEY {
            return Err(format!("a pre-shared key must be {MIN_KEY}..={MAX_KEY} bytes, this one has {}", b.len()));
        }
        Ok(Psk(b.to_vec()))
    }

    /// The key in file `path`.
    pub fn from_file(path: &std::path::Path) -> Result<Psk, String> {
        let meta = std::fs::metadata(path).map_err(|e| format!("key file: {e}"))?;
        if meta.len() > MAX_KEY as u64 + 64 {
            return Err("key file: larger than a key".into());
        }
        let b = std::fs::read(path).map_err(|e| format!("key file: {e}"))?;
        let k = Psk::new(&b);
        let mut b = b;
        b.iter_mut().for_each(|x| *x = 0);
        k
    }

    /// The key in environment variable `name` (unset or empty is an error).
    pub fn from_env(name: &str) -> Result<Psk, String> {
        match std::env::var_os(name) {
            Some(v) if !v.is_empty() => Psk::new(v.as_encoded_bytes()),
            _ => Err(format!("environment variable {name} is unset or empty")),
        }
    }

    fn mac(&self, label: &[u8], client: &[u8; NONCE], server: &[u8; NONCE]) -> Hmac<Sha256> {
        let mut m = <Hmac<Sha256> as Mac>::new_from_slice(&self.0).expect("HMAC takes any key length");
        m.update(label);
        m.update(client);
        m.update(server);
        m
    }

    /// A credential derived from the key for one purpose named by `label` (HMAC-SHA-256 of
    /// `label` under the key): it grants what that purpose grants and reveals nothing of the key
    /// or of a credential derived under another label.
    pub fn derive(&self, label: &[u8]) -> [u8; NONCE] {
        let mut m = <Hmac<Sha256> as Mac>::new_from_slice(&self.0).expect("HMAC takes any key length");
        m.update(label);
        m.finalize().into_bytes().into()
    }

    /// What the server sends to prove it holds the key.
    pub fn server_proof(&self, client: &[u8; NONCE], server: &[u8; NONCE]) -> [u8; NONCE] {
        self.mac(b"kvrelay-agent/v1 server", client, server).finalize().into_bytes().into()
    }

    /// What the client sends.
    pub fn client_proof(&self, client: &[u8; NONCE], server: &[u8; NONCE]) -> [u8; NONCE] {
        self.mac(b"kvrelay-agent/v1 client", client, server).finalize().into_bytes().into()
    }

    /// Check the server's proof (constant time).
    pub fn check_server(&self, client: &[u8; NONCE], server: &[u8; NONCE], proof: &[u8]) -> bool {
        self.mac(b"kvrelay-agent/v1 server", client, server).verify_slice(proof).is_ok()
    }

    /// Check the client's proof (constant time).
    pub fn check_client(&self, client: &[u8; NONCE], server: &[u8; NONCE], proof: &[u8]) -> bool {
        self.mac(b"kvrelay-agent/v1 client", client, server).verify_slice(proof).is_ok()
    }
}

/// A fresh random nonce from the operating system.
pub fn nonce() -> std::io::Result<[u8; NONCE]> {
    let mut n = [0u8; NONCE];
    getrandom::fill(&mut n).map_err(|e| std::io::Error::other(e.to_string()))?;
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proofs_check_only_with_the_same_key_and_nonces() {
        let k = Psk::new(b"0123456789abcdef-key").unwrap();
        let other = Psk::new(b"0123456789abcdef-kez").unwrap();
        let (c, s) = (nonce().unwrap(), nonce().unwrap());
        assert_ne!(c, s);
        let p = k.client_proof(&c, &s);
        assert!(k.check_client(&c, &s, &p));
        assert!(!other.check_client(&c, &s, &p));
        assert!(!k.check_client(&s, &c, &p));
        assert!(!k.check_server(&c, &s, &p), "the two directions use different labels");
        assert!(k.check_server(&c, &s, &k.server_proof(&c, &s)));
        assert!(Psk::new(b"short").is_err());
        assert_eq!(format!("{k:?}"), "Psk(20 bytes)");
        assert_eq!(Psk::new(b"  0123456789abcdef-key\n").unwrap(), k);
    }
}
