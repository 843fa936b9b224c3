//! The shared library's SONAME names its ABI epoch (DESIGN.md, "C ABI conventions"): while the
//! major version is 0 an epoch is `major.minor`, so `libkvrelay.so.0.4` for every 0.4.x. Within
//! an epoch the ABI only grows (tests/header.rs holds the structs' sizes and offsets to that); an
//! executor linked against another epoch's library names another file and fails to load instead
//! of meeting structs of another shape. Within an epoch, an executor linked through the CMake
//! package or `kvrelay.pc` binds every function at load (`-z now`), so one built against a later
//! 0.4.x that calls a function an older 0.4 library lacks fails at load, not at its first call
//! (README, "The 0.4 epoch", says why that is not done with symbol version nodes).
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
