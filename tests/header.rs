//! `include/kvrelay.h` is generated from `src/ffi` by cbindgen and committed: this test
//! regenerates it and fails when the committed copy is stale. `KVRELAY_BLESS=1` rewrites it.
//! It also checks that the version macros agree with Cargo.toml.

use std::path::PathBuf;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

#[test]
fn header_is_current() {
    let config = cbindgen::Config::from_file(root().join("cbindgen.toml")).unwrap();
    let mut generated = Vec::new();
    cbindgen::Builder::new().with_crate(root()).with_config(config).generate().expect("cbindgen").write(&mut generated);
    let path = root().join("include/kvrelay.h");
    if std::env::var_os("KVRELAY_BLESS").is_some() {
        std::fs::write(&path, &generated).unwrap();
    }
    let committed = std::fs::read(&path).unwrap_or_default();
    assert!(
        committed == generated,
        "include/kvrelay.h is stale: run `KVRELAY_BLESS=1 cargo test --test header` and commit it"
    );
}

#[test]
fn version_macros_match_cargo_toml() {
    let h = std::fs::read_to_string(root().join("include/kvrelay.h")).unwrap();
    for (name, want) in [
        ("KVRELAY_VERSION_MAJOR", env!("CARGO_PKG_VERSION_MAJOR")),
        ("KVRELAY_VERSION_MINOR", env!("CARGO_PKG_VERSION_MINOR")),
        ("KVRELAY_VERSION_PATCH", env!("CARGO_PKG_VERSION_PATCH")),
    ] {
        let line = format!("#define {name} {want}\n");
        assert!(h.contains(&line), "header lacks {line:?}");
    }
    // SAFETY: kvrelay_version returns a static NUL-terminated string.
    let v = unsafe { std::ffi::CStr::from_ptr(kvrelay::ffi::status::kvrelay_version()) };
    assert_eq!(v.to_str().unwrap(), env!("CARGO_PKG_VERSION"));
}

#[test]
fn readme_embeds_the_compiled_c_example() {
    let readme = std::fs::read_to_string(root().join("README.md")).unwrap();
    let example = std::fs::read_to_string(root().join("c_examples/readme_example.c")).unwrap();
    assert!(
        readme.contains(&format!("```c\n{example}```")),
        "README's C example must be c_examples/readme_example.c verbatim (ctest compiles and runs that file)"
    );
}

#[test]
fn ci_runs_the_readme_test_command() {
    let readme = std::fs::read_to_string(root().join("README.md")).unwrap();
    let ci = std::fs::read_to_string(root().join(".ci/run")).unwrap();
    assert!(readme.contains("| all the tests | `bash .ci/test.sh` |"));
    assert!(ci.contains("bash .ci/test.sh"));
}

#[test]
fn header_exports_only_prefixed_names() {
    let h = std::fs::read_to_string(root().join("include/kvrelay.h")).unwrap();
    let mut bad = Vec::new();
    for line in h.lines() {
        let t = line.trim_start();
        let name = if let Some(r) = t.strip_prefix("#define ") {
            r.split_whitespace().next()
        } else if let Some(r) = t.strip_prefix("typedef ") {
            r.trim_end_matches(';').split_whitespace().last()
        } else if t.starts_with("KVRELAY_") || t.starts_with("kvrelay_") {
            None
        } else if t.chars().next().is_some_and(|c| c.is_ascii_uppercase()) && t.contains(" = ") {
            t.split_whitespace().next() // an enumerator
        } else {
            None
        };
        if let Some(n) = name {
            let n = n.trim_start_matches('*');
            if !(n.starts_with("kvrelay_") || n.starts_with("KVRELAY_") || n == "{") {
                bad.push(n.to_string());
            }
        }
    }
    assert!(bad.is_empty(), "names without the kvrelay prefix in the header: {bad:?}");
}

/// The C enums stay literal in the header (cbindgen reads them as written); they must agree with
/// the one list each table is generated from: `KVRELAY_REASON_X = n` is `Reason` `n - 1` with
/// label `x`, and every discard code has the name the library's list gives it.
#[test]
fn c_enums_agree_with_the_rust_lists() {
    let h = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/include/kvrelay.h")).unwrap();
    // SAFETY: both name functions return static NUL-terminated strings for any value.
    let c_str = |p: *const std::ffi::c_char| unsafe { std::ffi::CStr::from_ptr(p) }.to_str().unwrap();
    let mut seen = 0;
    for line in h.lines().map(str::trim) {
        let Some(rest) = line.strip_prefix("KVRELAY_REASON_") else { continue };
        let (name, value) = rest.trim_end_matches(',').split_once(" = ").unwrap();
        let value: i32 = value.parse().unwrap();
        assert_eq!(
            c_str(kvrelay::ffi::types::kvrelay_reason_name(value)),
            name.to_ascii_lowercase(),
            "KVRELAY_REASON_{name}"
        );
        if value > 0 {
            assert_eq!(kvrelay::Reason::ALL[value as usize - 1].as_str(), name.to_ascii_lowercase());
        }
        seen += 1;
    }
    assert_eq!(seen, kvrelay::Reason::ALL.len() + 1);
    for d in kvrelay::policy::Discard::ALL {
        assert_eq!(c_str(kvrelay::ffi::policy::kvrelay_discard_name(d as i32)), d.as_str());
    }
    assert_eq!(c_str(kvrelay::ffi::policy::kvrelay_discard_name(99)), "unknown");
    // KVRELAY_DISCARD_X = n is the discard with code n and label x
    let mut discards = 0;
    for line in h.lines().map(str::trim) {
        let Some(rest) = line.strip_prefix("KVRELAY_DISCARD_") else { continue };
        let (name, value) = rest.trim_end_matches(',').split_once(" = ").unwrap();
        assert_eq!(
            c_str(kvrelay::ffi::policy::kvrelay_discard_name(value.parse().unwrap())),
            name.to_ascii_lowercase()
        );
        discards += 1;
    }
    assert_eq!(discards, kvrelay::policy::Discard::ALL.len() + 1);
    assert_eq!(c_str(kvrelay::ffi::types::kvrelay_reason_name(99)), "unknown");
    // every status the header defines has its own message
    let mut statuses = 0;
    for line in h.lines().map(str::trim).filter(|l| l.starts_with("KVRELAY_OK =") || l.starts_with("KVRELAY_ERR_")) {
        let (name, value) = line.trim_end_matches(',').split_once(" = ").unwrap();
        let msg = c_str(kvrelay::ffi::status::kvrelay_status_message(value.parse().unwrap()));
        assert_ne!(msg, "unknown kvrelay status", "{name} has no message");
        statuses += 1;
    }
    assert!(statuses >= 16, "{statuses} statuses found in the header");
}

/// The agent's C enums are generated from nowhere but their Rust tables: every
/// `KVRELAY_FETCH_X = n` is `FailReason` `n` with label `x` (0 is `ok`), every
/// `KVRELAY_LIMIT_X = n` is `LimitKey` `n` with label `x`, and nothing is missing either way.
#[cfg(feature = "agent")]
#[test]
fn agent_enums_agree_with_their_tables() {
    use kvrelay::agent::{FailReason, LimitKey};
    use kvrelay::ffi::agent::{kvrelay_agent_limit_name, kvrelay_fetch_failure_name};
    let h = std::fs::read_to_string(root().join("include/kvrelay.h")).unwrap();
    // SAFETY: both name functions return static NUL-terminated strings for any value.
    let c_str = |p: *const std::ffi::c_char| unsafe { std::ffi::CStr::from_ptr(p) }.to_str().unwrap();
    let entries = |prefix: &str| -> Vec<(String, i32)> {
        h.lines()
            .map(str::trim)
            .filter_map(|l| l.strip_prefix(prefix))
            .filter_map(|rest| rest.trim_end_matches(',').split_once(" = "))
            .map(|(n, v)| (n.to_ascii_lowercase(), v.parse().unwrap()))
            .collect()
    };
    let fetch = entries("KVRELAY_FETCH_");
    assert_eq!(fetch.len(), FailReason::ALL.len() + 1, "{fetch:?}");
    for (name, v) in &fetch {
        assert_eq!(c_str(kvrelay_fetch_failure_name(*v)), name, "KVRELAY_FETCH_{name}");
        if *v > 0 {
            assert_eq!(FailReason::ALL.iter().find(|r| **r as i32 == *v).map(|r| r.as_str()), Some(name.as_str()));
        }
    }
    let limits = entries("KVRELAY_LIMIT_");
    assert_eq!(limits.len(), LimitKey::ALL.len(), "{limits:?}");
    for (name, v) in &limits {
        assert_eq!(c_str(kvrelay_agent_limit_name(*v)), name, "KVRELAY_LIMIT_{name}");
        assert_eq!(LimitKey::from_i32(*v).map(|k| k.as_str()), Some(name.as_str()));
    }
    assert_eq!(c_str(kvrelay_agent_limit_name(0)), "unknown");
    assert_eq!(c_str(kvrelay_fetch_failure_name(99)), "unknown");
    // the README's list of fetch failures is the table's, in its order
    let readme =
        std::fs::read_to_string(root().join("README.md")).unwrap().split_whitespace().collect::<Vec<_>>().join(" ");
    let list = FailReason::ALL.iter().map(|r| format!("`{}`", r.as_str())).collect::<Vec<_>>().join(", ");
    assert!(readme.contains(&format!("the test server's: {list})")), "README's fetch failures differ from {list}");
}

/// What a C program of `lines` (statements of `main`, including the header) prints, one row a
/// line: compiled by the C compiler (`CC`, else `cc`) against `include/`, run, its folder
/// removed. `what` names the program and its folder.
fn abi_rows(what: &str, lines: &[String]) -> Vec<String> {
    let dir = std::env::temp_dir().join(format!("kvrelay-abi-{what}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut prog = String::from("#include <stddef.h>\n#include <stdio.h>\n#include \"kvrelay.h\"\nint main(void) {\n");
    lines.iter().for_each(|l| prog.push_str(l));
    prog.push_str("  return 0;\n}\n");
    std::fs::write(dir.join(format!("{what}.c")), prog).unwrap();
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let built = std::process::Command::new(&cc)
        .args(["-std=c11", "-I"])
        .arg(root().join("include"))
        .arg(dir.join(format!("{what}.c")))
        .arg("-o")
        .arg(dir.join(what))
        .status()
        .unwrap_or_else(|e| panic!("the C compiler `{cc}` (set CC): {e}"));
    assert!(built.success(), "compiling the {what} table's program failed");
    let out = std::process::Command::new(dir.join(what)).output().unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    String::from_utf8(out.stdout).unwrap().lines().map(str::to_string).collect()
}

/// Every struct of the header, compiled by the C compiler, has the size `tests/data/abi_sizes.txt`
/// records for this version. A struct whose size changes (or a new struct) fails here until the
/// version in Cargo.toml changes and rows for the new version are added: an executor built
/// against an earlier header must never meet a struct of another size under the same version.
/// `KVRELAY_BLESS=1` prints the rows of the current header.
#[test]
fn struct_sizes_change_only_with_the_version() {
    let h = std::fs::read_to_string(root().join("include/kvrelay.h")).unwrap();
    let names: Vec<&str> =
        h.lines().filter_map(|l| l.strip_prefix("typedef struct ")).filter_map(|r| r.strip_suffix(" {")).collect();
    assert!(names.len() >= 10, "{names:?}");
    let lines: Vec<String> = names.iter().map(|n| format!("  printf(\"{n} %zu\\n\", sizeof(struct {n}));\n")).collect();
    let version = env!("CARGO_PKG_VERSION");
    let now: Vec<String> = abi_rows("sizes", &lines).into_iter().map(|l| format!("{version} {l}")).collect();
    if std::env::var_os("KVRELAY_BLESS").is_some() {
        println!("{}", now.join("\n"));
    }
    let table = std::fs::read_to_string(root().join("tests/data/abi_sizes.txt")).unwrap();
    let recorded: Vec<&str> = table.lines().filter(|l| l.split_whitespace().next() == Some(version)).collect();
    assert!(
        !recorded.is_empty(),
        "tests/data/abi_sizes.txt has no rows for version {version}: add them (KVRELAY_BLESS=1 prints them)"
    );
    let mut want: Vec<&str> = recorded.iter().map(|l| l.trim()).collect();
    let mut got: Vec<&str> = now.iter().map(String::as_str).collect();
    want.sort_unstable();
    got.sort_unstable();
    assert_eq!(
        got, want,
        "struct sizes differ from those recorded for {version}: a struct's size may change only with a new \
         version (bump it in Cargo.toml and add its rows; never edit the rows of a released version)"
    );
}

/// Within an ABI epoch (the SONAME's `major.minor` while the major version is 0), an executor
/// built against any earlier header of the epoch must run against this library unchanged. So
/// across the rows of `tests/data/abi_sizes.txt` of one epoch: a struct never disappears; a
/// struct the caller hands over with its size (a `size_t size` first field) or lends with a
/// size argument (the counters read by `_read_stats`) only grows; every other struct keeps its
/// size. A new epoch (a new SONAME) may change anything.
#[test]
fn structs_are_frozen_within_an_epoch_or_grow_with_their_size() {
    let h = std::fs::read_to_string(root().join("include/kvrelay.h")).unwrap();
    let table = std::fs::read_to_string(root().join("tests/data/abi_sizes.txt")).unwrap();
    // structs whose first field is `size_t size`
    let mut growable: Vec<String> = Vec::new();
    let lines: Vec<&str> = h.lines().collect();
    for (i, l) in lines.iter().enumerate() {
        if let Some(name) = l.strip_prefix("typedef struct ").and_then(|r| r.strip_suffix(" {")) {
            let first = lines[i + 1..].iter().map(|l| l.trim()).find(|l| !l.starts_with("//"));
            if first == Some("size_t size;") {
                growable.push(name.to_string());
            }
        }
    }
    // structs the library writes at the caller's size: `(struct X *out, size_t size)`
    let flat = h.split_whitespace().collect::<Vec<_>>().join(" ");
    for read in ["kvrelay_agent_stats", "kvrelay_kv_events_stats"] {
        assert!(flat.contains(&format!("{read} *out, size_t size)")), "{read} is read at the caller's size");
        growable.push(read.to_string());
    }
    assert!(growable.iter().any(|g| g == "kvrelay_fetch_callbacks") && growable.iter().any(|g| g == "kvrelay_naming"));
    let epoch = |v: &str| v.rsplit_once('.').map(|(e, _)| e.to_string()).unwrap();
    let version_key = |v: &str| v.split('.').map(|p| p.parse::<u32>().unwrap()).collect::<Vec<_>>();
    let mut rows: Vec<(Vec<u32>, String, String, usize)> = table
        .lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            assert_eq!(f.len(), 3, "row `{l}`");
            (version_key(f[0]), f[0].to_string(), f[1].to_string(), f[2].parse().unwrap())
        })
        .collect();
    rows.sort();
    let mut versions: Vec<(Vec<u32>, String)> = rows.iter().map(|r| (r.0.clone(), r.1.clone())).collect();
    versions.dedup();
    let mut bad = Vec::new();
    for pair in versions.windows(2) {
        let ((_, old), (_, new)) = (&pair[0], &pair[1]);
        if epoch(old) != epoch(new) {
            continue;
        }
        for (_, _, name, size) in rows.iter().filter(|r| &r.1 == old) {
            let later = rows.iter().find(|r| &r.1 == new && &r.2 == name).map(|r| r.3);
            match later {
                None => bad.push(format!("{name} of {old} is gone in {new}")),
                Some(s) if growable.contains(name) && s < *size => bad.push(format!("{name} shrank in {new}")),
                Some(s) if !growable.contains(name) && s != *size => bad.push(format!(
                    "{name} ({size} bytes in {old}, {s} in {new}) has no size field: frozen for the epoch"
                )),
                Some(_) => {}
            }
        }
    }
    assert!(bad.is_empty(), "ABI changes within an epoch: {bad:?}");
}

/// `(struct, field)` of every field of every struct of the header, in order: the lines between
/// `typedef struct NAME {` and its `}`, comments left out; a function pointer's field is the
/// name in `(*name)`, any other the last word before `;` (an array's bounds left out).
fn header_fields(h: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut lines = h.lines();
    while let Some(l) = lines.next() {
        let Some(name) = l.strip_prefix("typedef struct ").and_then(|r| r.strip_suffix(" {")) else { continue };
        let mut decl = String::new();
        for l in lines.by_ref() {
            if l.starts_with('}') {
                break;
            }
            let t = l.trim();
            if t.is_empty() || t.starts_with("//") {
                continue;
            }
            decl.push(' ');
            decl.push_str(t);
            if !decl.ends_with(';') {
                continue;
            }
            let field = match decl.find("(*") {
                Some(at) => decl[at + 2..].split(')').next().unwrap().to_string(),
                None => {
                    let bare = decl.split('[').next().unwrap().trim_end_matches(';');
                    bare.split_whitespace().last().unwrap().trim_start_matches('*').to_string()
                }
            };
            out.push((name.to_string(), field));
            decl.clear();
        }
    }
    out
}

/// Every field of every struct of the header sits at the offset `tests/data/abi_offsets.txt`
/// records for this version (the C compiler's `offsetof`), and within an ABI epoch a field of
/// any recorded version keeps its offset in every later one: a field moved, retyped to another
/// size, removed or put before another fails here, even where the struct's size stays the same.
/// `KVRELAY_BLESS=1` prints the rows of the current header.
#[test]
fn field_offsets_change_only_with_the_version_and_never_within_an_epoch() {
    let h = std::fs::read_to_string(root().join("include/kvrelay.h")).unwrap();
    let fields = header_fields(&h);
    assert!(fields.len() >= 100, "{} fields", fields.len());
    assert!(fields.contains(&("kvrelay_block_holder".into(), "returned".into())), "function pointers are fields");
    assert!(fields.contains(&("kvrelay_outcome".into(), "detail".into())), "arrays are fields");
    let lines: Vec<String> =
        fields.iter().map(|(s, f)| format!("  printf(\"{s} {f} %zu\\n\", offsetof(struct {s}, {f}));\n")).collect();
    let version = env!("CARGO_PKG_VERSION");
    let now: Vec<String> = abi_rows("offsets", &lines).into_iter().map(|l| format!("{version} {l}")).collect();
    if std::env::var_os("KVRELAY_BLESS").is_some() {
        println!("{}", now.join("\n"));
    }
    let table = std::fs::read_to_string(root().join("tests/data/abi_offsets.txt")).unwrap();
    let rows: Vec<Vec<&str>> = table
        .lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            assert_eq!(f.len(), 4, "row `{l}`");
            f
        })
        .collect();
    let mut want: Vec<String> = rows.iter().filter(|r| r[0] == version).map(|r| r.join(" ")).collect();
    assert!(
        !want.is_empty(),
        "tests/data/abi_offsets.txt has no rows for version {version}: add them (KVRELAY_BLESS=1 prints them)"
    );
    let mut got = now.clone();
    want.sort_unstable();
    got.sort_unstable();
    let only_now: Vec<&String> = got.iter().filter(|r| !want.contains(r)).collect();
    let only_recorded: Vec<&String> = want.iter().filter(|r| !got.contains(r)).collect();
    assert!(
        only_now.is_empty() && only_recorded.is_empty(),
        "field offsets differ from those recorded for {version}: a layout may change only with a new version \
         (bump it in Cargo.toml and add its rows; never edit the rows of a released version); now {only_now:?}, \
         recorded {only_recorded:?}"
    );
    // within an epoch, every field of an earlier version is where it was
    let key = |v: &str| v.split('.').map(|p| p.parse::<u32>().unwrap()).collect::<Vec<_>>();
    let epoch = |v: &str| v.rsplit_once('.').map(|(e, _)| e.to_string()).unwrap();
    let mut versions: Vec<&str> = rows.iter().map(|r| r[0]).collect();
    versions.sort_by_key(|v| key(v));
    versions.dedup();
    let mut bad = Vec::new();
    for pair in versions.windows(2) {
        let (old, new) = (pair[0], pair[1]);
        if epoch(old) != epoch(new) {
            continue;
        }
        for r in rows.iter().filter(|r| r[0] == old) {
            match rows.iter().find(|n| n[0] == new && n[1] == r[1] && n[2] == r[2]) {
                None => bad.push(format!("{}.{} of {old} is gone in {new}", r[1], r[2])),
                Some(n) if n[3] != r[3] => {
                    bad.push(format!("{}.{} moved from {} to {} in {new}", r[1], r[2], r[3], n[3]))
                }
                Some(_) => {}
            }
        }
    }
    assert!(bad.is_empty(), "field layouts changed within an epoch: {bad:?}");
}
