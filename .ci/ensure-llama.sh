# Sourced by .ci/test.sh and c_examples/run_demo.sh: the real model of the `llama` feature
# (SmolLM2-135M-Instruct), libclang and CMake, installed the way a user installs them
# (scripts/llama-env.sh), into target/ci-tools/llm.
KVRELAY_LLAMA_TOOLS="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/target/ci-tools/llm" \
  source "$(dirname "${BASH_SOURCE[0]}")/../scripts/llama-env.sh"
