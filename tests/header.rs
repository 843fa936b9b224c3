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
