# Sourced by .ci/test.sh: what the `nixl` feature needs on a fresh machine, installed from PyPI
# into target/ci-tools/nixl when absent:
# - the NIXL native libraries (libnixl_capi.so, libnixl, its plugins, UCX) from the nixl-cu13
#   wheel, pinned with the nixl-sys crate in Cargo.toml (their C ABI is not checked at build
#   time), installed without dependencies: only the shared libraries are used;
# - libclang for nixl-sys's bindgen, from the libclang wheel; the C headers it needs beside it
#   (stdbool.h, stddef.h) come from the machine's gcc.
# Exports LIBCLANG_PATH, BINDGEN_EXTRA_CLANG_ARGS and KVRELAY_NIXL_LIB_DIR.
_kvrelay_nixl="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/target/ci-tools/nixl"
_kvrelay_nixl_lib="$_kvrelay_nixl/.nixl_cu13.mesonpy.libs"
if [ ! -f "$_kvrelay_nixl_lib/libnixl_capi.so" ] || [ ! -f "$_kvrelay_nixl/clang/native/libclang.so" ]; then
  # The wheels are platform wheels of one CPython; only their shared libraries are used, so
  # they are fetched for that platform whatever the local Python is.
  python3 -m pip install --quiet --disable-pip-version-check --root-user-action=ignore --no-deps --upgrade --target "$_kvrelay_nixl" \
    --only-binary=:all: --python-version 3.11 --implementation cp --platform manylinux_2_28_x86_64 \
    nixl-cu13==1.5.1
  python3 -m pip install --quiet --disable-pip-version-check --root-user-action=ignore --no-deps --upgrade --target "$_kvrelay_nixl/libclang-wheel" \
    --only-binary=:all: libclang==18.1.1
  mkdir -p "$_kvrelay_nixl/clang/native"
  cp "$_kvrelay_nixl/libclang-wheel/clang/native/libclang.so" "$_kvrelay_nixl/clang/native/libclang.so"
fi
export LIBCLANG_PATH="$_kvrelay_nixl/clang/native"
export BINDGEN_EXTRA_CLANG_ARGS="-I$(gcc -print-file-name=include)"
export KVRELAY_NIXL_LIB_DIR="$_kvrelay_nixl_lib"
