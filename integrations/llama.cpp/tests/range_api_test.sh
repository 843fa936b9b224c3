#!/usr/bin/env bash
# Builds and runs range_api_test.cpp (libllama's position-range KV API, llama-kv-range.patch) on a
# real model, against the libllama that build.sh built, with the test under AddressSanitizer +
# UBSan. libllama itself is not instrumented, but every byte the range calls move on the CPU goes
# through memcpy, which the sanitizer runtime checks against both the caller's buffer and the KV
# tensors' allocations.
#
#   bash integrations/llama.cpp/tests/range_api_test.sh MODEL.gguf
#
# Environment: LLAMA_SERVER_OUT, build.sh's output folder (default: target/llama-server).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../../.." && pwd)"
out="${LLAMA_SERVER_OUT:-$root/target/llama-server}"
[ $# -eq 1 ] || { echo "usage: $0 MODEL.gguf" >&2; exit 2; }
work="$out/llama.cpp"
build="$out/build"
for f in "$build/src/libllama.a" "$build/ggml/src/libggml.a" "$work/include/llama.h"; do
  [ -f "$f" ] || { echo "range_api_test.sh: $f is missing: run integrations/llama.cpp/build.sh first" >&2; exit 1; }
done
grep -q llama_kv_range_get "$work/include/llama.h" || {
  echo "range_api_test.sh: $work carries no llama-kv-range.patch: run build.sh again" >&2
  exit 1
}
omp=()
if grep -q "libgomp" "$build/tools/server/CMakeFiles/llama-server.dir/link.txt" 2>/dev/null; then omp=(-fopenmp); fi
san=(-fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer)
g++ -std=c++17 -O1 -g "${san[@]}" -Wall -Wextra -Werror -I"$work/include" -I"$work/ggml/include" \
  "$here/range_api_test.cpp" -o "$out/range_api_test" \
  "$build/src/libllama.a" "$build/ggml/src/libggml.a" "$build/ggml/src/libggml-cpu.a" "$build/ggml/src/libggml-base.a" \
  "${omp[@]}" -ldl -lm -lpthread
ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
  "$out/range_api_test" "$1"
