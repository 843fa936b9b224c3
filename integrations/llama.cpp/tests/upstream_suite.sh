#!/usr/bin/env bash
# llama-server's own pytest suite (tools/server/tests of the pinned tree) on the unpatched build,
# the kvrelay build with its KV path off, and the kvrelay build with its KV path on and hints
# trusted (LLAMA_ARG_KV_LISTEN and LLAMA_ARG_KV_HINTS_TRUSTED in the environment of the servers
# the suite starts), with a local model (upstream_local_model.py); the outcomes are compared test
# by test: exactly the same tests must pass, fail and skip on all three. Exits 1 when they differ,
# and when the unpatched build passes fewer than MIN_PASSED tests (a set-up that fails every test
# alike, such as a relative MODEL path, must not read as equal). Part of the test command
# (.ci/test.sh), after the smoke test.
#
#   MODEL=/path/model.gguf bash integrations/llama.cpp/tests/upstream_suite.sh [pytest files...]
#
# Environment: MODEL (a llama GGUF; required), MIN_PASSED (default 75: the pinned tree with
# SmolLM2-135M passes 81 of the default files' tests), LLAMA_SERVER_OUT (where build.sh put the two
# servers; default target/llama-server), PYTEST_DEPS (a folder for the suite's Python packages;
# default target/ci-tools/llama-server-pytest, installed there once). Default files: the suite's
# tests that need only the tinyllama2 preset and no download (the others are not runnable here).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../../.." && pwd)"
: "${MODEL:?MODEL must name a llama GGUF}"
MODEL="$(cd "$(dirname "$MODEL")" && pwd)/$(basename "$MODEL")"  # the suite runs in its own folder
min_passed="${MIN_PASSED:-75}"
out="${LLAMA_SERVER_OUT:-$root/target/llama-server}"
deps="${PYTEST_DEPS:-$root/target/ci-tools/llama-server-pytest}"
tests_dir="$out/llama.cpp/tools/server/tests"
[ -d "$tests_dir" ] || { echo "upstream_suite.sh: no $tests_dir: run integrations/llama.cpp/build.sh first" >&2; exit 1; }
if ! PYTHONPATH="$deps" python3 -c "import aiohttp, pytest, filelock, openai, prometheus_client, requests, wget" 2>/dev/null; then
  python3 -m pip install --quiet --disable-pip-version-check --root-user-action=ignore --target "$deps" \
    "aiohttp~=3.9" "pytest~=8.3.3" filelock numpy openai prometheus-client requests wget
fi
files=("$@")
[ ${#files[@]} -gt 0 ] || files=(unit/test_basic.py unit/test_tokenize.py unit/test_completion.py
  unit/test_chat_completion.py unit/test_metrics.py)
logs="$(mktemp -d)"
for run in unpatched kvrelay kvrelay-kv-on; do
  b="${run%-kv-on}"
  kv_env=()
  if [ "$run" = kvrelay-kv-on ]; then kv_env=(LLAMA_ARG_KV_LISTEN=127.0.0.1:0 LLAMA_ARG_KV_HINTS_TRUSTED=1); fi
  # the suite's servers listen on 127.0.0.1 at PORT (8080 unless set): a free one, so that another
  # job on the machine does not collide with it
  port="$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
  (cd "$tests_dir" && env "${kv_env[@]}" PORT="$port" KVRELAY_UPSTREAM_MODEL="$MODEL" \
    LLAMA_SERVER_BIN_PATH="$out/bin/llama-server-$b" PYTHONPATH="$here:$deps" timeout 1800 python3 -m pytest \
    -p no:cacheprovider -p upstream_local_model -m "not slow" -rA -q "${files[@]}" >"$logs/$run.log" 2>&1) || true
  # -a: the log is text, but may hold NUL bytes (pytest truncates its capture file between a
  # test's phases while a server it started still writes at its old offset: a hole of NULs),
  # which would make grep print "binary file matches" instead of the outcome lines
  grep -a -E "^(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)" "$logs/$run.log" | sed 's/ - .*//' | sort >"$logs/$run.outcomes"
  printf '%-14s %s (%s)\n' "$run:" "$(tail -n 1 "$logs/$run.log")" \
    "$(awk '{print $1}' "$logs/$run.outcomes" | sort | uniq -c | tr '\n' ' ')"
done
passed="$(grep -c '^PASSED' "$logs/unpatched.outcomes" || true)"
if [ "$passed" -lt "$min_passed" ]; then
  echo "upstream_suite.sh: the unpatched build passed $passed tests, fewer than $min_passed: the set-up is broken; logs in $logs" >&2
  exit 1
fi
status=0
for run in kvrelay kvrelay-kv-on; do
  if ! diff "$logs/unpatched.outcomes" "$logs/$run.outcomes"; then
    echo "upstream_suite.sh: $run's outcomes differ from the unpatched build's (above); logs in $logs" >&2
    status=1
  fi
done
[ "$status" = 0 ] || exit 1
echo "upstream_suite.sh: the same tests pass, fail and skip on the unpatched build, kvrelay off and kvrelay's KV path on ($passed passed of $(wc -l <"$logs/unpatched.outcomes") outcomes); logs in $logs"
