#!/usr/bin/env bash
# The one test command (README "Two commands"). Installs what a fresh machine lacks (CMake, from
# the Python package index, into target/ci-tools, and the openai client for the server check), then runs every test:
# Rust (unit, integration, conformance, property, header freshness, the test server over HTTP),
# the portable scanner's run, a fuzz smoke, the official openai client against the test server, the C/C++ programs built with -Wall -Wextra -Werror as C and as
# C++, the same programs under AddressSanitizer + UBSan (leak checker on) against a debug build
# of the library, a consumer project that finds the installed package, and llama.cpp's
# llama-server with kvrelay embedded (integrations/llama.cpp) built against that package. The server is built
# with its NIXL transport (feature `nixl`; .ci/ensure-nixl.sh installs the NIXL libraries and
# libclang), and the cross-instance transfer tests run a second time over NIXL/UCX. The server's
# real-model engine (feature `llama`: llama.cpp, built once per profile by cargo) runs
# SmolLM2-135M-Instruct, installed by .ci/ensure-llama.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
export CARGO_TERM_COLOR=never
# a clean build each run: incremental compilation only costs here, and line tables (file and line
# in backtraces) are all the debug information a failing test needs; both cut the test builds'
# compile and link time
export CARGO_INCREMENTAL=0
export CARGO_PROFILE_DEV_DEBUG=line-tables-only

echo "== the repository is self-contained (nothing reads outside it)"
if grep -rnI --exclude-dir=target --exclude-dir=.git -e '\.\./shared' . ; then
  echo "the lines above read outside the repository; vendor what they need" >&2
  exit 1
fi

echo "== cargo fmt --check"
cargo fmt --all -- --check

echo "== NIXL libraries and libclang (the nixl feature)"
source .ci/ensure-nixl.sh

echo "== CMake, and the real model (the llama feature)"
source .ci/ensure-cmake.sh
cmake --version | head -n 1
source .ci/ensure-llama.sh

echo "== clippy and docs (warnings are errors), with and without the NIXL transport"
cargo clippy --locked --all-targets --features server,nixl,llama -- -D warnings
cargo clippy --locked --all-targets --features server -- -D warnings
RUSTDOCFLAGS="-D warnings" cargo doc --locked --no-deps --features server,nixl,llama
# the default features too (what a user of the library, and docs.rs, builds)
RUSTDOCFLAGS="-D warnings" cargo doc --locked --no-deps

echo "== Rust tests (the library, the test server over real HTTP on loopback, the real model)"
cargo test --locked --features server,nixl,llama

echo "== the cross-instance transfer tests again over NIXL (UCX over TCP on loopback)"
KVRELAY_TEST_KV_TRANSPORT=nixl UCX_TLS=tcp UCX_NET_DEVICES=lo cargo test --locked --features server,nixl,llama --test transfer

echo "== the portable scanner (what non-x86-64 hosts run): admission, property and conformance tests"
RUSTFLAGS="--cfg kvrelay_portable" CARGO_TARGET_DIR="$root/target/portable" \
  cargo test --locked --test admission --test properties --test conformance

echo "== fuzz smoke (each target a few seconds; long runs: README \"Fuzzing\")"
bash .ci/fuzz-smoke.sh

echo "== the official openai Python client against kvrelay-server (reference engine, then the real model)"
# the test build's server (the Rust tests above built it with these features; llama.cpp in it is
# optimized in test builds too): no second, release build of the server and llama.cpp
server="$root/target/debug/kvrelay-server"
test -x "$server" || { echo "the Rust tests did not build $server" >&2; exit 1; }
oa="$root/target/ci-tools/openai"
if ! PYTHONPATH="$oa" python3 -c "import openai" 2>/dev/null; then
  python3 -m pip install --quiet --disable-pip-version-check --target "$oa" openai
fi
PYTHONPATH="$oa" timeout 300 python3 tests/openai_client.py "$server"
PYTHONPATH="$oa" timeout 300 python3 tests/openai_client.py "$server" --engine llama --model-file "$KVRELAY_MODEL_FILE"

echo "== behind Dynamo's KV router (ai-dynamo-runtime 1.6.1, in-process; reference engine, then the real model)"
source .ci/ensure-dynamo.sh
PYTHONPATH="$KVRELAY_DYNAMO_PYTHONPATH" timeout 300 python3 tests/dynamo_router.py "$server"
PYTHONPATH="$KVRELAY_DYNAMO_PYTHONPATH" timeout 300 python3 tests/dynamo_router.py "$server" --engine llama --model-file "$KVRELAY_MODEL_FILE"

# the benches are type-checked by clippy --all-targets above (with every feature); building them
# in release would build the server and llama.cpp a second time for no further check

b=$root/target/ci-build
rm -rf "$b"

echo "== C and C++ examples and ABI tests (release library, -Wall -Wextra -Werror)"
cmake -S . -B "$b/release" -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$b/release" -j 2
ctest --test-dir "$b/release" --output-on-failure

echo "== the same under AddressSanitizer + UBSan (debug library: tracks live handles)"
san="-fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer"
cmake -S . -B "$b/asan" -DCMAKE_BUILD_TYPE=Debug -DKVRELAY_CARGO_PROFILE=debug \
  -DCMAKE_C_FLAGS="$san" -DCMAKE_CXX_FLAGS="$san" -DCMAKE_EXE_LINKER_FLAGS="-fsanitize=address,undefined" >/dev/null
cmake --build "$b/asan" -j 2
for exe in admit admit_cxx batch_manager readme_example abi_edge_cases abi_edge_cases_cxx policy_matrix policy_matrix_cxx copy_engine copy_engine_cxx agent_fetch agent_cxx names_events names_events_cxx; do
  # capture first: with pipefail, `ldd | grep -q` fails when grep exits early and ldd gets SIGPIPE
  libs=$(ldd "$b/asan/$exe")
  for rt in libasan libubsan; do
    if ! grep -q "$rt" <<<"$libs"; then
      echo "sanitizer runtime $rt is not linked into $exe" >&2
      exit 1
    fi
  done
done
echo "sanitizer runtimes linked into every example"
ASAN_OPTIONS=detect_leaks=1:abort_on_error=1:strict_string_checks=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
  ctest --test-dir "$b/asan" --output-on-failure

echo "== install, then a separate project: find_package(kvrelay CONFIG REQUIRED)"
cmake --install "$b/release" --prefix "$b/prefix" >/dev/null
pc="$b/prefix/lib/pkgconfig/kvrelay.pc"
rel=$(sed -n 's|^prefix=${pcfiledir}/||p' "$pc")
test -n "$rel" && test -f "$b/prefix/lib/pkgconfig/$rel/include/kvrelay.h" \
  || { echo "kvrelay.pc does not point at the install prefix" >&2; exit 1; }
if command -v pkg-config >/dev/null 2>&1; then
  PKG_CONFIG_PATH="$b/prefix/lib/pkgconfig" pkg-config --cflags --libs kvrelay
fi
test -f "$b/prefix/lib/cmake/kvrelay/kvrelayConfigVersion.cmake"
cmake -S tests/consumer -B "$b/consumer" -DCMAKE_PREFIX_PATH="$b/prefix" >/dev/null
cmake --build "$b/consumer" -j 2
"$b/consumer/consumer"
LD_LIBRARY_PATH="$b/prefix/lib" "$b/consumer/consumer_shared"

echo "== the shared library's SONAME names its ABI epoch; a program linked against it needs that epoch"
soname=$(sed -n 's/^soname=//p' "$pc")
test "$soname" = "libkvrelay.so.$(sed -n 's/^version = "\([0-9]*\.[0-9]*\)\..*/\1/p' Cargo.toml)" \
  || { echo "kvrelay.pc names the SONAME $soname, not this version's epoch" >&2; exit 1; }
dyn=$(readelf -d "$b/prefix/lib/$soname")
grep -q "Library soname: \[$soname\]" <<<"$dyn" || { echo "the installed library's SONAME is not $soname" >&2; exit 1; }
needed=$(readelf -d "$b/consumer/consumer_shared")
grep -q "Shared library: \[$soname\]" <<<"$needed" || { echo "consumer_shared does not need $soname" >&2; exit 1; }
# a library of another epoch installed instead (here: the epoch's name taken away, the
# development name left) is refused at load, whatever the run path says
mv "$b/prefix/lib/$soname" "$b/prefix/lib/$soname.away"
if LD_LIBRARY_PATH="$b/prefix/lib" "$b/consumer/consumer_shared" 2>"$b/other-epoch.err"; then
  echo "consumer_shared loaded without a library of its epoch" >&2; exit 1
fi
mv "$b/prefix/lib/$soname.away" "$b/prefix/lib/$soname"
grep -q "$soname" "$b/other-epoch.err" || { cat "$b/other-epoch.err" >&2; exit 1; }
echo "SONAME $soname: a program built against this epoch loads only a library of it"

echo "== a program linked through the package binds every function at load: one the library lacks stops it before main"
grep -Eq "FLAGS.*BIND_NOW|FLAGS_1.*NOW" <<<"$needed" || { echo "consumer_shared does not bind at load (-z now)" >&2; exit 1; }
# a stand-in for a later release of this epoch (its SONAME, one function more) to link a program
# against with the package's flags; run against the real library, it must stop before main
stub="$b/later-release"
mkdir -p "$stub/lib"
printf 'int kvrelay_from_a_later_release(void) { return 1; }\n' > "$stub/later.c"
cc -shared -fPIC -Wl,-soname,"$soname" -o "$stub/lib/$soname" "$stub/later.c"
ln -sf "$soname" "$stub/lib/libkvrelay.so"
printf '#include <stdio.h>\nint kvrelay_from_a_later_release(void);\nint main(void) { puts("main ran"); return kvrelay_from_a_later_release(); }\n' > "$stub/main.c"
libs=$(sed -n 's/^Libs: //p' "$pc" | sed "s|\${libdir}|$stub/lib|")
# shellcheck disable=SC2086
cc -o "$stub/needs_later" "$stub/main.c" $libs
if LD_LIBRARY_PATH="$b/prefix/lib" "$stub/needs_later" > "$stub/out" 2> "$stub/err"; then
  echo "a program needing a function this library lacks ran" >&2; exit 1
fi
grep -q "kvrelay_from_a_later_release" "$stub/err" || { cat "$stub/err" >&2; exit 1; }
if grep -q "main ran" "$stub/out"; then echo "the missing function stopped the program only at its call" >&2; exit 1; fi
echo "a missing function stops a program linked through the package at load"

# the servers' cache of model file digests stays in the build folder, not the user's home
export KVRELAY_CACHE_DIR="$b/kvrelay-cache"
echo "== llama.cpp's llama-server with kvrelay embedded (integrations/llama.cpp): the patch applies to the pinned tree without fuzz; both servers build from one tree against the installed package; the smoke test"
bash integrations/llama.cpp/build.sh --check-patch
# the integration's KV state and block store, on their own, under AddressSanitizer + UBSan
g++ -std=c++17 -g -fsanitize=address,undefined -fno-sanitize-recover=all -Wall -Wextra -Werror -Iinclude \
  -Iintegrations/llama.cpp/src integrations/llama.cpp/tests/kv_unit_test.cpp integrations/llama.cpp/src/kvrelay_llama_kv.cpp \
  -o "$b/kv_unit_test"
"$b/kv_unit_test"
# the test build: the integration's fault hooks compiled in (forced block-name collisions, off unless asked for)
LLAMA_SERVER_OUT="$root/target/llama-server" KVRELAY_PREFIX="$b/prefix" KVRELAY_TEST_HOOKS=1 JOBS=2 bash integrations/llama.cpp/build.sh
timeout 900 python3 integrations/llama.cpp/tests/smoke_test.py --server "$root/target/llama-server/bin/llama-server-kvrelay" \
  --unpatched "$root/target/llama-server/bin/llama-server-unpatched" --model "$KVRELAY_MODEL_FILE" --threads 1
echo "== libllama's position-range KV API (llama-kv-range.patch) on SmolLM2, under AddressSanitizer + UBSan: imported positions give the source's logits exactly (V transposed and not), refusals change nothing"
LLAMA_SERVER_OUT="$root/target/llama-server" bash integrations/llama.cpp/tests/range_api_test.sh "$KVRELAY_MODEL_FILE"
echo "== only new KV leaves a slot, only missing KV enters one: a 30-turn conversation exports its blocks once, a slot of 60 blocks imports the one fetched block (flash attention off and on)"
for fa in off on; do
  timeout 600 python3 integrations/llama.cpp/tests/range_kv_test.py --server "$root/target/llama-server/bin/llama-server-kvrelay" \
    --model "$KVRELAY_MODEL_FILE" --threads 1 --flash-attn "$fa"
done
echo "== two kvrelay llama-servers: B fetches A's KV by a hint and answers exactly as a cold server (partial prefix, untrusted endpoint, foreign names, killed source), flash attention off and on"
for fa in off on; do
  timeout 900 python3 integrations/llama.cpp/tests/two_instance_test.py --server "$root/target/llama-server/bin/llama-server-kvrelay" \
    --model "$KVRELAY_MODEL_FILE" --threads 1 --flash-attn "$fa"
done
echo "== a frozen trusted source costs a hinted request at most the prefill it would save, once (late), then is skipped for a growing period (backoff)"
timeout 600 python3 integrations/llama.cpp/tests/bounded_fetch_test.py --server "$root/target/llama-server/bin/llama-server-kvrelay" \
  --model "$KVRELAY_MODEL_FILE" --threads 1
echo "== a fetching server's memory is bounded by its store once llama-server's own prompt cache is off (--cache-ram 0)"
timeout 600 python3 integrations/llama.cpp/tests/rss_test.py --server "$root/target/llama-server/bin/llama-server-kvrelay" \
  --model "$KVRELAY_MODEL_FILE" --threads 1
echo "== requests waiting for their KV take HTTP threads of their own: /health, /metrics, /v1/models and unhinted requests answer meanwhile"
timeout 600 python3 integrations/llama.cpp/tests/responsive_test.py --server "$root/target/llama-server/bin/llama-server-kvrelay" \
  --model "$KVRELAY_MODEL_FILE" --threads 1
echo "== concurrent requests for one new prefix share one fetch (single flight): the source sends the blocks once"
timeout 600 python3 integrations/llama.cpp/tests/single_flight_test.py --server "$root/target/llama-server/bin/llama-server-kvrelay" \
  --model "$KVRELAY_MODEL_FILE" --threads 1
echo "== a slot exports only KV a cold prefill gives: the prompt cache, --cache-reuse and slot restore change cells, a server that fetches them answers as a cold one"
timeout 600 python3 integrations/llama.cpp/tests/exactness_test.py --server "$root/target/llama-server/bin/llama-server-kvrelay" \
  --model "$KVRELAY_MODEL_FILE" --threads 1
echo "== the device store (KV on a GPU: blocks move device to device): skips here without a GPU, saying why"
timeout 300 python3 integrations/llama.cpp/tests/device_store_test.py --server "$root/target/llama-server/bin/llama-server-kvrelay" \
  --model "$KVRELAY_MODEL_FILE" --threads 1
echo "== a block name that collides never brings other tokens' KV into a slot, on one server and across two (the test build's forced collisions)"
timeout 600 python3 integrations/llama.cpp/tests/collision_test.py --server "$root/target/llama-server/bin/llama-server-kvrelay" \
  --model "$KVRELAY_MODEL_FILE" --threads 1
echo "== servers that differ in one KV-changing setting (control vector, RoPE base and scale, --override-kv, LoRA scale, another GGUF of one name and size) never exchange a block"
KVRELAY_CACHE_DIR="$b/kvrelay-cache" timeout 900 python3 integrations/llama.cpp/tests/identity_test.py \
  --server "$root/target/llama-server/bin/llama-server-kvrelay" --model "$KVRELAY_MODEL_FILE" --threads 1
echo "== what a kvrelay llama-server tells and takes at its edges: no membership answer untrusted, the KV port's key, nothing pinned after an over-long or empty hinted prompt"
timeout 600 python3 integrations/llama.cpp/tests/integrity_test.py --server "$root/target/llama-server/bin/llama-server-kvrelay" \
  --model "$KVRELAY_MODEL_FILE" --threads 1
echo "== the official openai client against kvrelay llama-servers: a hint in extra_body fetches, streamed and not, with the cold answer"
PYTHONPATH="$oa" timeout 600 python3 integrations/llama.cpp/tests/openai_client_test.py --server "$root/target/llama-server/bin/llama-server-kvrelay" \
  --model "$KVRELAY_MODEL_FILE" --threads 1
echo "== Dynamo's KV router in front of two kvrelay llama-servers (KV events, SelectionService, the KvRouter runtime path)"
PYTHONPATH="$KVRELAY_DYNAMO_PYTHONPATH" timeout 900 python3 integrations/llama.cpp/tests/dynamo_test.py --server "$root/target/llama-server/bin/llama-server-kvrelay" \
  --model "$KVRELAY_MODEL_FILE" --threads 1
echo "== the KV events' sockets with a key: only a peer with the key's subscriber token reads them (ZMQ PLAIN), the others counted as refused"
PYTHONPATH="$KVRELAY_DYNAMO_PYTHONPATH" timeout 300 python3 integrations/llama.cpp/tests/events_key_test.py --server "$root/target/llama-server/bin/llama-server-kvrelay" \
  --model "$KVRELAY_MODEL_FILE" --threads 1
echo "== llama-server's own pytest suite on the unpatched build and the kvrelay build with its KV path off and on (hints trusted), the same local model: the same tests must pass, fail and skip on all three"
MODEL="$KVRELAY_MODEL_FILE" LLAMA_SERVER_OUT="$root/target/llama-server" bash integrations/llama.cpp/tests/upstream_suite.sh

echo "== the Python package: pip install ./python (cargo builds the library it carries), then its pytest suite"
pyk="$root/target/ci-tools/pykvrelay"
rm -rf "$pyk"
python3 -m pip install --quiet --disable-pip-version-check --root-user-action=ignore --target "$pyk" ./python
pt="$root/target/ci-tools/pytest"
if ! PYTHONPATH="$pt" python3 -c "import pytest" 2>/dev/null; then
  python3 -m pip install --quiet --disable-pip-version-check --root-user-action=ignore --target "$pt" pytest
fi
# from outside the clone's python/ so that the installed package (not its sources) is imported;
# installed here, the package's compiled helper for the per-request calls must have been built
(cd "$root/target" && KVRELAY_REQUIRE_FAST=1 PYTHONPATH="$pyk:$pt" timeout 600 python3 -m pytest -q -p no:cacheprovider "$root/python/tests")

echo "== the Python package's types: mypy --strict (python/pyproject.toml [tool.mypy])"
my="$root/target/ci-tools/mypy"
if ! PYTHONPATH="$my" python3 -c "import mypy" 2>/dev/null; then
  python3 -m pip install --quiet --disable-pip-version-check --root-user-action=ignore --target "$my" mypy
fi
(cd "$root/python" && PYTHONPATH="$my" python3 -m mypy --cache-dir "$root/target/ci-tools/mypy-cache")

echo "== the Python tests again with AddressSanitizer preloaded (debug library: C-side misuse of the buffers the package hands over)"
(cd "$root/target" && LD_PRELOAD="$(gcc -print-file-name=libasan.so)" ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 PYTHONMALLOC=malloc \
  KVRELAY_LIBRARY="$root/target/debug/libkvrelay.so" PYTHONPATH="$root/python/src:$pt" \
  timeout 600 python3 -m pytest -q -p no:cacheprovider "$root/python/tests")

echo "== all tests passed"
