#!/usr/bin/env bash
# Builds the fuzz targets (fuzz/, libFuzzer with AddressSanitizer; stable toolchain through
# RUSTC_BOOTSTRAP=1, no cargo-fuzz install needed) and runs each for a bounded smoke, seeded with
# the vendored JSONTestSuite documents and fuzz/seeds. FUZZ_SECONDS (default 10) per target.
# Long runs: see the README ("Fuzzing").
set -euo pipefail
cd "$(dirname "$0")/../fuzz"
secs=${FUZZ_SECONDS:-10}
target=$(rustc -vV | sed -n 's/^host: //p')
export RUSTC_BOOTSTRAP=1
export RUSTFLAGS="-Cpasses=sancov-module -Cllvm-args=-sanitizer-coverage-level=4 -Cllvm-args=-sanitizer-coverage-inline-8bit-counters -Cllvm-args=-sanitizer-coverage-pc-table -Cllvm-args=-sanitizer-coverage-trace-compares --cfg fuzzing -Zsanitizer=address -Cdebug-assertions"
cargo build --locked --release --target "$target" --target-dir ../target/fuzz --bins
bin=../target/fuzz/$target/release
corpus=../target/fuzz/corpus
for t in admission msgpack c_abi agent_peer agent_source; do
  mkdir -p "$corpus/$t"
  if [ "$t" = agent_peer ]; then
    cp -n seeds_agent/* "$corpus/$t/" 2>/dev/null || true
  elif [ "$t" = agent_source ]; then
    cp -n seeds_source/* "$corpus/$t/" 2>/dev/null || true
  else
    cp -n seeds/* "$corpus/$t/" 2>/dev/null || true
  fi
  if [ "$t" = admission ] || [ "$t" = c_abi ]; then
    cp -n ../tests/data/JSONTestSuite/test_parsing/* "$corpus/$t/" 2>/dev/null || true
  fi
  echo "== fuzz $t for ${secs}s"
  log=../target/fuzz/$t.log
  rc=0
  mkdir -p ../target/fuzz/artifacts
  "$bin/$t" -artifact_prefix="../target/fuzz/artifacts/$t-" -max_total_time="$secs" -max_len=65536 -rss_limit_mb=2048 -print_final_stats=1 "$corpus/$t" >"$log" 2>&1 || rc=$?
  grep -E "^(#[0-9]+ +DONE|stat::number_of_executed_units|stat::peak_rss_mb)" "$log" || true
  if [ "$rc" -ne 0 ]; then
    tail -n 60 "$log"
    echo "fuzz target $t failed (exit $rc); the crashing input is in target/fuzz/artifacts/" >&2
    exit 1
  fi
done
