//! Peer authentication with a pre-shared key: a mutual challenge-response on the first
//! exchange (HMAC-SHA-256 over both sides' fresh 32-byte nonces, a different label per
//! direction). Neither side sends the key or anything derived from it alone; a recorded
//! exchange cannot be replayed (the other side's nonce is new every time). The key is never
//! logged: [`Psk`]'s `Debug` prints its length only.
//!
//! **The per-user key** ([`per_user_key`]): an agent given no key uses one its user holds
//! alone, created on first use (32 random bytes as hex, mode 0600, in a folder of mode 0700)
//! at [`per_user_key_path`]: `$KVRELAY_KEY_FILE` when set, else
//! `$XDG_CACHE_HOME/kvrelay/agent.key`, else `~/.cache/kvrelay/agent.key` (the home from
//! `$HOME`, else the user database). So the agents of one user on one host authenticate each
//! other with no configuration, and a process of another user, which cannot read the file,
//! proves nothing and gets nothing: no name, no byte, no GPU grant. The cache folder rather
//! than `$XDG_RUNTIME_DIR`: a server started by a service manager often has no runtime folder
//! (or another one) where the same user's shell has one, and two agents of one user must find
//! the same file. Across hosts, or between users, give every agent the deployment's key.
//!
//! **Key files** are refused when a user other than the owner may read or write them (mode
//! bits `0o066`): such a key proves nothing about who holds it. The per-user file must also be
//! owned by this process's user, and so must its folder, which nobody else may write.

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

    /// The key in file `path`. Refused when the file is not a regular file, or when users
    /// other than its owner may read or write it (mode bits `0o066`: `chmod 600` it).
    pub fn from_file(path: &std::path::Path) -> Result<Psk, String> {
        let meta = std::fs::metadata(path).map_err(|e| format!("key file: {e}"))?;
        check_key_file(&meta, None)?;
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

/// Refuse a key file that is no regular file, that others may read or write, or (with
/// `owner`) that another user owns.
fn check_key_file(meta: &std::fs::Metadata, owner: Option<u32>) -> Result<(), String> {
    use std::os::unix::fs::MetadataExt;
    if !meta.is_file() {
        return Err("key file: not a regular file".into());
    }
    if meta.mode() & 0o066 != 0 {
        return Err(format!(
            "key file: mode {:03o} lets other users read or write it; a key must be its owner's alone (chmod 600)",
            meta.mode() & 0o777
        ));
    }
    if let Some(uid) = owner {
        if meta.uid() != uid {
            return Err(format!("key file: owned by uid {}, not by this process's user ({uid})", meta.uid()));
        }
    }
    Ok(())
}

/// The environment variable that names the per-user key file.
pub const KEY_FILE_ENV: &str = "KVRELAY_KEY_FILE";

/// Where the per-user key lives ([module docs](self)): `$KVRELAY_KEY_FILE`, else
/// `$XDG_CACHE_HOME/kvrelay/agent.key` (an absolute `XDG_CACHE_HOME` only), else
/// `<home>/.cache/kvrelay/agent.key`.
pub fn per_user_key_path() -> Result<std::path::PathBuf, String> {
    key_path_from(|n| std::env::var_os(n), home_of_user)
}

/// [`per_user_key_path`] over an environment `env` and a user database `home`.
fn key_path_from(
    env: impl Fn(&str) -> Option<std::ffi::OsString>,
    home: impl FnOnce() -> Option<std::path::PathBuf>,
) -> Result<std::path::PathBuf, String> {
    use std::path::PathBuf;
    let set = |n: &str| env(n).filter(|v| !v.is_empty()).map(PathBuf::from);
    if let Some(p) = set(KEY_FILE_ENV) {
        return Ok(p);
    }
    if let Some(d) = set("XDG_CACHE_HOME").filter(|d| d.is_absolute()) {
        return Ok(d.join("kvrelay").join("agent.key"));
    }
    let home = set("HOME").filter(|d| d.is_absolute()).or_else(home).ok_or_else(|| {
        format!("no per-user key: no HOME, XDG_CACHE_HOME or {KEY_FILE_ENV}; set one, or give the agent a key")
    })?;
    Ok(home.join(".cache").join("kvrelay").join("agent.key"))
}

/// This process's user's home folder from the user database.
fn home_of_user() -> Option<std::path::PathBuf> {
    use std::os::unix::ffi::OsStrExt;
    let mut buf = vec![0 as libc::c_char; 16 * 1024];
    // SAFETY: an all-zero `passwd` is a valid value of a plain C struct (null pointers, zeros).
    let mut pw: libc::passwd = unsafe { std::mem::zeroed() };
    let mut out: *mut libc::passwd = std::ptr::null_mut();
    // SAFETY: `pw`, `buf` (its length passed) and `out` are valid for writes for the call;
    // getpwuid_r writes only into them.
    let rc = unsafe { libc::getpwuid_r(libc::geteuid(), &mut pw, buf.as_mut_ptr(), buf.len(), &mut out) };
    if rc != 0 || out.is_null() || pw.pw_dir.is_null() {
        return None;
    }
    // SAFETY: on success `pw_dir` points at a NUL-terminated string inside `buf`, alive here.
    let dir = unsafe { std::ffi::CStr::from_ptr(pw.pw_dir) };
    let p = std::path::PathBuf::from(std::ffi::OsStr::from_bytes(dir.to_bytes()));
    p.is_absolute().then_some(p)
}

/// The per-user key ([module docs](self)): read from [`per_user_key_path`], created there on
/// first use. Errors say why (a file or folder others may use, another user's file, no home).
pub fn per_user_key() -> Result<Psk, String> {
    load_or_create(&per_user_key_path()?)
}

/// Read the key at `path`, or create it (with its folder, mode 0700, when missing). Two
/// processes creating it at once agree: the key is written to a file of its own, then linked
/// into place, which fails when another process's key got there first (that one is read).
/// The file and its folder must be this user's and no one else's.
pub fn load_or_create(path: &std::path::Path) -> Result<Psk, String> {
    use std::io::Write;
    use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt};
    let at = |e: std::io::Error| format!("per-user key {}: {e}", path.display());
    // SAFETY: geteuid has no preconditions and cannot fail.
    let uid = unsafe { libc::geteuid() };
    let dir = path.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(std::path::Path::new("."));
    std::fs::DirBuilder::new().recursive(true).mode(0o700).create(dir).map_err(at)?;
    let dm = std::fs::metadata(dir).map_err(at)?;
    if dm.uid() != uid || dm.mode() & 0o022 != 0 {
        return Err(format!(
            "per-user key {}: its folder is owned by uid {} with mode {:03o}; it must be this user's ({uid}) and \
             writable by no one else",
            path.display(),
            dm.uid(),
            dm.mode() & 0o777
        ));
    }
    let read = || -> Result<Option<Psk>, String> {
        match std::fs::symlink_metadata(path) {
            Ok(m) => {
                check_key_file(&m, Some(uid)).map_err(|e| format!("per-user {e} ({})", path.display()))?;
                Psk::from_file(path).map(Some)
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(at(e)),
        }
    };
    if let Some(k) = read()? {
        return Ok(k);
    }
    let mut raw = [0u8; 32];
    getrandom::fill(&mut raw).map_err(|e| format!("per-user key: no randomness: {e}"))?;
    let mut hex = [0u8; 65];
    for (i, b) in raw.iter().enumerate() {
        const D: &[u8; 16] = b"0123456789abcdef";
        hex[2 * i] = D[usize::from(b >> 4)];
        hex[2 * i + 1] = D[usize::from(b & 15)];
    }
    hex[64] = b'\n';
    raw.fill(0);
    let tmp = dir.join(format!(
        ".agent.key.{}.{:016x}",
        std::process::id(),
        u64::from_le_bytes(nonce().map_err(at)?[..8].try_into().unwrap())
    ));
    let made = (|| {
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&tmp)?;
        f.write_all(&hex)?;
        f.sync_all()?;
        match std::fs::hard_link(&tmp, path) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Ok(()), // another's is there: read it
            Err(e) => Err(e),
        }
    })();
    hex.fill(0);
    let _ = std::fs::remove_file(&tmp);
    made.map_err(at)?;
    read()?.ok_or_else(|| format!("per-user key {}: created, then gone", path.display()))
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

    /// A folder of its own under the target folder's temp space (removed first).
    fn scratch(name: &str) -> std::path::PathBuf {
        let d = std::env::temp_dir().join(format!("kvrelay-auth-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        d
    }

    #[test]
    fn the_per_user_key_path_follows_the_documented_order() {
        use std::ffi::OsString;
        let env = |pairs: &'static [(&'static str, &'static str)]| {
            move |n: &str| pairs.iter().find(|p| p.0 == n).map(|p| OsString::from(p.1))
        };
        let none = || None;
        let p = |s: &str| std::path::PathBuf::from(s);
        static ALL: [(&str, &str); 3] = [("KVRELAY_KEY_FILE", "/k/f"), ("XDG_CACHE_HOME", "/x"), ("HOME", "/h")];
        assert_eq!(key_path_from(env(&ALL), none).unwrap(), p("/k/f"));
        static XDG: [(&str, &str); 3] = [("KVRELAY_KEY_FILE", ""), ("XDG_CACHE_HOME", "/x"), ("HOME", "/h")];
        assert_eq!(key_path_from(env(&XDG), none).unwrap(), p("/x/kvrelay/agent.key"));
        // a relative XDG_CACHE_HOME is ignored, as the XDG rules say
        static REL: [(&str, &str); 2] = [("XDG_CACHE_HOME", "x"), ("HOME", "/h")];
        assert_eq!(key_path_from(env(&REL), none).unwrap(), p("/h/.cache/kvrelay/agent.key"));
        assert_eq!(key_path_from(env(&[]), || Some(p("/db"))).unwrap(), p("/db/.cache/kvrelay/agent.key"));
        let e = key_path_from(env(&[]), none).unwrap_err();
        assert!(e.contains("KVRELAY_KEY_FILE"), "{e}");
    }

    #[test]
    fn the_per_user_key_is_made_once_for_its_user_alone_and_shared_by_racing_creators() {
        use std::os::unix::fs::PermissionsExt;
        let d = scratch("made");
        let path = d.join("sub").join("agent.key");
        let keys: Vec<Psk> = std::thread::scope(|s| {
            let h: Vec<_> = (0..8).map(|_| s.spawn(|| load_or_create(&path).unwrap())).collect();
            h.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert!(keys.iter().all(|k| *k == keys[0]), "every racing creator reads the one key that won");
        assert_eq!(keys[0].0.len(), 64, "32 random bytes as hex");
        let mode = |p: &std::path::Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(&path), 0o600);
        assert_eq!(mode(path.parent().unwrap()), 0o700);
        assert_eq!(std::fs::read_dir(path.parent().unwrap()).unwrap().count(), 1, "no temporary file left");
        assert_eq!(load_or_create(&path).unwrap(), keys[0], "read again, not made again");
        // another folder: another key
        assert_ne!(load_or_create(&d.join("other.key")).unwrap(), keys[0]);
        // a key file others may read is refused, here and wherever a key file is read
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        let e = load_or_create(&path).unwrap_err();
        assert!(e.contains("644") && e.contains("chmod 600"), "{e}");
        assert!(Psk::from_file(&path).unwrap_err().contains("644"));
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o620)).unwrap();
        assert!(Psk::from_file(&path).is_err(), "writable by the group");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o400)).unwrap();
        assert_eq!(Psk::from_file(&path).unwrap(), keys[0], "read-only for its owner is fine");
        // a folder others may write (where they could swap the file) is refused
        std::fs::set_permissions(path.parent().unwrap(), std::fs::Permissions::from_mode(0o777)).unwrap();
        assert!(load_or_create(&path).unwrap_err().contains("writable by no one else"));
        // a link in the key's place is not followed
        let l = d.join("link");
        std::fs::create_dir_all(&l).unwrap();
        std::os::unix::fs::symlink(&path, l.join("agent.key")).unwrap();
        assert!(load_or_create(&l.join("agent.key")).unwrap_err().contains("not a regular file"));
        std::fs::remove_dir_all(&d).unwrap();
    }
}
