#!/usr/bin/env bash
# The main job on embedded defaults: the test server's demo (kvrelay-server on loopback: reuse,
# hints admitted and ignored by each reason, every answer checked against a cold run), then the
# C++ batch manager over the C ABI (built with CMake, which is installed if missing) on host memory,
# and the KV agent's two-process example (c_examples/agent_fetch.c).
set -euo pipefail
cd "$(dirname "$0")/.."
echo "== kvrelay-server demo"
cargo run --quiet --release --locked --features server --bin kvrelay-server -- demo
echo
echo "== batch_manager (C++ over the C ABI)"
source .ci/ensure-cmake.sh
cmake -S . -B target/demo-build -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build target/demo-build -j 2 --target batch_manager agent_fetch >/dev/null
target/demo-build/batch_manager
echo
echo "== agent_fetch (two processes: one serves its KV pool, the other admits, orchestrates, fetches)"
target/demo-build/agent_fetch
