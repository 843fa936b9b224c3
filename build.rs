//! The shared library's SONAME names its ABI epoch (DESIGN.md, "C ABI conventions"): while the
//! major version is 0 an epoch is `major.minor`, so `libkvrelay.so.0.3` for every 0.3.x. Within
//! an epoch the ABI only grows (tests/header.rs holds the struct sizes to that); an executor
//! linked against another epoch's library names another file and fails to load instead of
//! meeting structs of another shape.
fn main() {
    let major = std::env::var("CARGO_PKG_VERSION_MAJOR").expect("cargo sets the version");
    let minor = std::env::var("CARGO_PKG_VERSION_MINOR").expect("cargo sets the version");
    let epoch = if major == "0" { format!("0.{minor}") } else { major };
    let os = std::env::var("CARGO_CFG_TARGET_OS").unwrap_or_default();
    if os != "macos" && os != "windows" && os != "ios" {
        println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libkvrelay.so.{epoch}");
    }
    println!("cargo:rerun-if-changed=build.rs");
}
