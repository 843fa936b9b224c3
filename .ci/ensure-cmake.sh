# Sourced by .ci/test.sh and c_examples/run_demo.sh: puts a CMake on PATH, installing it from
# the Python package index into target/ci-tools when the machine has none (fresh machines of this kind have no CMake).
if ! command -v cmake >/dev/null 2>&1; then
  _kvrelay_tools="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/target/ci-tools/py"
  if [ ! -x "$_kvrelay_tools/cmake/data/bin/cmake" ]; then
    python3 -m pip install --quiet --disable-pip-version-check --target "$_kvrelay_tools" cmake
  fi
  export PATH="$_kvrelay_tools/cmake/data/bin:$PATH"
fi
