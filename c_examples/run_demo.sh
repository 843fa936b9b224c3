#!/usr/bin/env bash
# The main job on embedded defaults: the Rust demo of the whole admission flow, then the C++
# batch manager (built with CMake, which is installed if missing) on host memory.
set -euo pipefail
cd "$(dirname "$0")/.."
source .ci/ensure-cmake.sh
echo "== kvrelay demo (Rust API)"
cargo run --quiet --release --locked --bin kvrelay -- demo
echo
echo "== batch_manager (C++ over the C ABI)"
cmake -S . -B target/demo-build -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build target/demo-build -j 2 --target batch_manager >/dev/null
target/demo-build/batch_manager
