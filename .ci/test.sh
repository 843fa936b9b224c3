#!/usr/bin/env bash
# The one test command (README "Tests"). Installs what a fresh machine lacks, then runs every test.
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TERM_COLOR=never
echo "== cargo fmt --check"
cargo fmt --all -- --check
echo "== Rust tests (unit, integration, conformance, property, doc)"
cargo test --locked
echo "== benches compile"
cargo build --locked --release --benches
