#!/usr/bin/env bash
# The main job on embedded defaults: the test server's demo on the real model (llama.cpp running
# SmolLM2-135M-Instruct on the CPU, installed with CMake and libclang by scripts/llama-env.sh:
# an answer, the same answer from reused KV, from KV fetched from a second instance, and from a
# partial fetch, with each time to first token beside a cold prefill's), the same demo on the
# reference engine (hints admitted and ignored by each reason, every answer checked against a
# cold run), then the C++ batch manager over the C ABI (built with CMake) on host memory, and the
# KV agent's two-process example (c_examples/agent_fetch.c).
set -euo pipefail
cd "$(dirname "$0")/.."
source .ci/ensure-llama.sh
echo "== kvrelay-server demo on a real model (llama.cpp, $(basename "$KVRELAY_MODEL_FILE"))"
cargo run --quiet --release --locked --features server,llama --bin kvrelay-server -- demo --engine llama
echo
echo "== kvrelay-server demo on the reference engine"
cargo run --quiet --release --locked --features server,llama --bin kvrelay-server -- demo
echo
echo "== batch_manager (C++ over the C ABI)"
source .ci/ensure-cmake.sh
cmake -S . -B target/demo-build -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build target/demo-build -j 2 --target batch_manager agent_fetch >/dev/null
target/demo-build/batch_manager
echo
echo "== agent_fetch (two processes: one serves its KV pool, the other admits, orchestrates, fetches)"
target/demo-build/agent_fetch
