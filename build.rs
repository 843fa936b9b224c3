//! Two things about the shared library, both for the loader's sake (DESIGN.md, "C ABI
//! conventions"; README, "C ABI"):
//!
//! - **Its SONAME names its ABI epoch**: while the major version is 0 an epoch is
//!   `major.minor`, so `libkvrelay.so.0.4` for every 0.4.x. Within an epoch the ABI only grows
//!   (tests/header.rs holds the structs' sizes and offsets to that); an executor linked against
//!   another epoch's library names another file and fails to load instead of meeting structs of
//!   another shape.
//! - **Its symbols carry version nodes** (`src/ffi/symbols.map`, a GNU version script): an
//!   executor records the node of every function it calls, so one built against 0.4.1 and run
//!   against a 0.4.0 library that lacks a 0.4.1 function fails at load ("version
//!   `KVRELAY_0.4.1' not found"), not at its first call. rustc passes its own anonymous version
//!   script for a cdylib; a second, named one is accepted by lld (rustc's default linker on
//!   x86-64 Linux) but refused by GNU ld, so the nodes are given with `.symver` directives
//!   (`, remove`: the static library and the rlib keep plain names) and the script is passed
//!   only when a probe link with this build's rustc, target, flags and linker succeeds; when it
//!   does not, the library is built without nodes and a warning says so.
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

fn main() {
    let major = std::env::var("CARGO_PKG_VERSION_MAJOR").expect("cargo sets the version");
    let minor = std::env::var("CARGO_PKG_VERSION_MINOR").expect("cargo sets the version");
    let epoch = if major == "0" { format!("0.{minor}") } else { major };
    let os = std::env::var("CARGO_CFG_TARGET_OS").unwrap_or_default();
    if os != "macos" && os != "windows" && os != "ios" {
        println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libkvrelay.so.{epoch}");
    }
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rustc-check-cfg=cfg(kvrelay_symver)");
    symbol_versions(&os);
}

/// The version nodes of `src/ffi/symbols.map`, in order, each with its symbols.
fn parse_map(text: &str) -> Vec<(String, Vec<String>)> {
    let mut nodes: Vec<(String, Vec<String>)> = Vec::new();
    let body: String = text.lines().map(|l| l.split('#').next().unwrap_or("")).collect::<Vec<_>>().join("\n");
    let mut rest = body.as_str();
    while let Some(open) = rest.find('{') {
        let name = rest[..open].trim().trim_start_matches(';').trim().to_string();
        let close = rest[open..].find('}').expect("symbols.map: a node without its closing brace") + open;
        let syms = rest[open + 1..close]
            .split(';')
            .map(|s| s.trim().trim_start_matches("global:").trim())
            .filter(|s| !s.is_empty())
            .map(str::to_string)
            .collect();
        nodes.push((name, syms));
        // past the closing brace, the inherited node's name and the semicolon
        rest = &rest[close + 1..];
        rest = rest.find(';').map_or("", |i| &rest[i + 1..]);
    }
    nodes
}

/// The name of the directives file of the module at path `s` (`src/ffi/agent/fetch.rs` ->
/// `agent_fetch`): each module gives its own functions their nodes, so that the directives and
/// the definitions meet in one object (an assembler gives a node only to a symbol its object
/// defines, and rustc puts a module's items in one codegen unit).
fn module_key(s: &str) -> String {
    let rel = s.rsplit_once("src/ffi/").map_or(s, |(_, r)| r);
    rel.trim_end_matches(".rs").replace('/', "_")
}

/// The exported functions of `src/ffi` (`#[no_mangle] pub ... extern "C" fn kvrelay_*`), each
/// with the feature its file needs (`None`: always built).
fn exported(dir: &Path, out: &mut BTreeMap<String, (Option<&'static str>, String)>) {
    let mut entries: Vec<PathBuf> =
        std::fs::read_dir(dir).expect("src/ffi is readable").map(|e| e.expect("a directory entry").path()).collect();
    entries.sort();
    for p in entries {
        if p.is_dir() {
            exported(&p, out);
            continue;
        }
        if p.extension().is_none_or(|e| e != "rs") {
            continue;
        }
        println!("cargo:rerun-if-changed={}", p.display());
        let s = p.to_string_lossy().replace('\\', "/");
        let feature = if s.contains("src/ffi/agent/") {
            Some("agent")
        } else if s.ends_with("src/ffi/events.rs") {
            Some("events")
        } else {
            None
        };
        let text = std::fs::read_to_string(&p).expect("a source file is readable");
        let mut after_no_mangle = false;
        for line in text.lines() {
            let l = line.trim();
            if l == "#[no_mangle]" {
                after_no_mangle = true;
                continue;
            }
            if after_no_mangle && l.starts_with("pub ") {
                if let Some(i) = l.find("fn kvrelay_") {
                    let name: String =
                        l[i + 3..].chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_').collect();
                    out.insert(name, (feature, module_key(&s)));
                }
            }
            if !l.starts_with("#[") && !l.starts_with("//") {
                after_no_mangle = false;
            }
        }
    }
}

fn symbol_versions(os: &str) {
    let root = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets the manifest dir"));
    let map_path = root.join("src/ffi/symbols.map");
    println!("cargo:rerun-if-changed={}", map_path.display());
    let nodes = parse_map(&std::fs::read_to_string(&map_path).expect("src/ffi/symbols.map is readable"));
    let mut defined = BTreeMap::new();
    exported(&root.join("src/ffi"), &mut defined);
    // the map and the code agree, whatever this build's features: every function listed once,
    // every listed name a function
    let mut listed: BTreeMap<&str, &str> = BTreeMap::new();
    for (node, syms) in &nodes {
        for s in syms {
            if let Some(other) = listed.insert(s, node) {
                panic!("src/ffi/symbols.map lists {s} twice ({other} and {node})");
            }
            if !defined.contains_key(s.as_str()) {
                panic!("src/ffi/symbols.map lists {s}, which no #[no_mangle] function of src/ffi defines");
            }
        }
    }
    if let Some(missing) = defined.keys().find(|d| !listed.contains_key(d.as_str())) {
        let last = nodes.last().map_or("KVRELAY_<version>", |n| n.0.as_str());
        panic!(
            "{missing} is exported but not in src/ffi/symbols.map: list it under the node of the release that adds it \
             (a new node for a new release, inheriting {last})"
        );
    }
    if os != "linux" {
        return;
    }
    let built = |s: &str| match defined.get(s).and_then(|d| d.0) {
        None => true,
        Some(f) => std::env::var_os(format!("CARGO_FEATURE_{}", f.to_uppercase())).is_some(),
    };
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    // the version script of this build's symbols, and the directives that give each its node
    let mut script = String::new();
    // every module's file, empty where it exports nothing
    let mut asm: BTreeMap<String, String> = defined.values().map(|d| (d.1.clone(), String::new())).collect();
    let mut previous: Option<&str> = None;
    for (node, syms) in &nodes {
        script.push_str(&format!("{node} {{\n  global:\n"));
        for s in syms.iter().filter(|s| built(s)) {
            script.push_str(&format!("    {s};\n"));
            let file = asm.get_mut(&defined[s.as_str()].1).expect("every module has its file");
            file.push_str(&format!(".symver {s}, {s}@@{node}, remove\n"));
        }
        match previous {
            None => script.push_str("};\n"),
            Some(p) => script.push_str(&format!("}} {p};\n")),
        }
        previous = Some(node);
    }
    let script_path = out.join("kvrelay.map");
    std::fs::write(&script_path, script).expect("OUT_DIR is writable");
    for (module, text) in &asm {
        std::fs::write(out.join(format!("symver_{module}.s")), text).expect("OUT_DIR is writable");
    }
    if probe(&out) {
        println!("cargo:rustc-cfg=kvrelay_symver");
        println!("cargo:rustc-cdylib-link-arg=-Wl,--version-script={}", script_path.display());
    } else {
        println!(
            "cargo:warning=the linker refused a second version script (GNU ld does; lld, rustc's default on x86-64 \
             Linux, does not): libkvrelay is built without symbol version nodes, so an executor that calls a function \
             this library lacks fails at that call, not at load"
        );
    }
}

/// Whether this build's rustc, target, flags and linker link a cdylib with a named version
/// script beside rustc's own, and give a symbol its node.
fn probe(out: &Path) -> bool {
    let dir = out.join("symver-probe");
    let _ = std::fs::create_dir_all(&dir);
    let src = dir.join("probe.rs");
    let map = dir.join("probe.map");
    let ok = std::fs::write(
        &src,
        "#[no_mangle] pub extern \"C\" fn kvrelay_probe() -> i32 { 1 }\n\
         std::arch::global_asm!(\".symver kvrelay_probe, kvrelay_probe@@KVRELAY_PROBE, remove\");\n",
    )
    .and_then(|_| std::fs::write(&map, "KVRELAY_PROBE { global: kvrelay_probe; };\n"));
    if ok.is_err() {
        return false;
    }
    let rustc = std::env::var("RUSTC").unwrap_or_else(|_| "rustc".into());
    let mut cmd = Command::new(rustc);
    cmd.arg("--crate-type=cdylib").arg("--crate-name=kvrelay_probe").arg("--edition=2021").arg("-o");
    cmd.arg(dir.join("libkvrelay_probe.so")).arg(&src);
    if let Ok(t) = std::env::var("TARGET") {
        cmd.arg("--target").arg(t);
    }
    if let Ok(flags) = std::env::var("CARGO_ENCODED_RUSTFLAGS") {
        cmd.args(flags.split('\x1f').filter(|f| !f.is_empty()));
    }
    if let Ok(linker) = std::env::var("RUSTC_LINKER") {
        cmd.arg(format!("-Clinker={linker}"));
    }
    cmd.arg(format!("-Clink-arg=-Wl,--version-script={}", map.display()));
    matches!(cmd.output(), Ok(o) if o.status.success())
}
