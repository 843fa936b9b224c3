#!/usr/bin/env bash
# From a clone of kvrelay, one command: builds llama.cpp's llama-server with kvrelay (build.sh:
# the pinned tree, the patch, kvrelay installed and found with find_package) and runs the
# two-instance flow on SmolLM2-135M on the CPU (tests/two_instance_test.py): instance A serves
# its KV blocks, instance B fetches them by a kv.fetch hint built from A's /v1/kv/lookup and
# answers exactly as a cold server, a longer prompt fetches only the blocks B lacks, and an
# untrusted endpoint, foreign block names and a killed source fall back to a cold prefill.
#
#   bash integrations/llama.cpp/demo.sh        # about 10 min on 2 cores the first time (the build)
#
# Needs what build.sh needs (cargo, a C++17 compiler, Python); CMake and the model are installed
# into target/ci-tools when missing (.ci/ensure-cmake.sh, .ci/ensure-llama.sh).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../.." && pwd)"
cd "$root"
source .ci/ensure-cmake.sh
source .ci/ensure-llama.sh
bash "$here/build.sh"
python3 "$here/tests/two_instance_test.py" --server "$root/target/llama-server/bin/llama-server-kvrelay" \
  --model "$KVRELAY_MODEL_FILE" --threads 1
