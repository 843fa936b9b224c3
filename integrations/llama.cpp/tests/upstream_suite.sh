#!/usr/bin/env bash
# llama-server's own pytest suite (tools/server/tests of the pinned tree) on the unpatched and the
# kvrelay build, with a local model (upstream_local_model.py), then the two outcomes compared test
# by test: exactly the same tests must pass, fail and skip on both. Prints the counts of each and
# exits 1 when the outcomes differ. Part of the test command (.ci/test.sh), after the smoke test.
#
#   MODEL=/path/model.gguf bash integrations/llama.cpp/tests/upstream_suite.sh [pytest files...]
#
# Environment: MODEL (a llama GGUF; required), LLAMA_SERVER_OUT (where build.sh put the two
# servers; default target/llama-server), PYTEST_DEPS (a folder for the suite's Python packages;
# default target/ci-tools/llama-server-pytest, installed there once). Default files: the suite's
# tests that need only the tinyllama2 preset and no download (the others are not runnable here).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../../.." && pwd)"
: "${MODEL:?MODEL must name a llama GGUF}"
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
for b in unpatched kvrelay; do
  # the suite's servers listen on 127.0.0.1 at PORT (8080 unless set): a free one, so that another
  # job on the machine does not collide with it
  port="$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
  (cd "$tests_dir" && PORT="$port" KVRELAY_UPSTREAM_MODEL="$MODEL" LLAMA_SERVER_BIN_PATH="$out/bin/llama-server-$b" \
    PYTHONPATH="$here:$deps" timeout 1800 python3 -m pytest -p no:cacheprovider -p upstream_local_model \
    -m "not slow" -rA -q "${files[@]}" >"$logs/$b.log" 2>&1) || true
  grep -E "^(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)" "$logs/$b.log" | sed 's/ - .*//' | sort >"$logs/$b.outcomes"
  printf '%-9s %s (%s)\n' "$b:" "$(tail -n 1 "$logs/$b.log")" "$(awk '{print $1}' "$logs/$b.outcomes" | sort | uniq -c | tr '\n' ' ')"
done
if diff "$logs/unpatched.outcomes" "$logs/kvrelay.outcomes"; then
  echo "upstream_suite.sh: the same tests pass, fail and skip on both builds ($(wc -l <"$logs/kvrelay.outcomes") outcomes); logs in $logs"
else
  echo "upstream_suite.sh: the outcomes differ (above); logs in $logs" >&2
  exit 1
fi
