# What kvrelay's `nixl` feature needs, for users and CI alike: source it from a clone,
#   source scripts/nixl-env.sh          # installs what is missing, exports the variables
#   cargo build --release --features server,nixl
# or run it (`bash scripts/nixl-env.sh`) to install and print the exports.
#
# Installs from the Python package index, when absent, into $KVRELAY_NIXL_TOOLS (default: target/nixl-tools of the
# clone):
# - the NIXL native libraries (libnixl_capi.so, libnixl, its plugins, UCX 1.23) from the
#   nixl-cu13 wheel, pinned with the nixl-sys crate in Cargo.toml (their C ABI is not checked at
#   build time), without dependencies: only the shared libraries are used;
# - libclang for nixl-sys's bindgen, from the libclang wheel; the C headers bindgen needs beside
#   it (stdbool.h, stddef.h) come from the machine's gcc.
# Exports LIBCLANG_PATH and BINDGEN_EXTRA_CLANG_ARGS (building) and KVRELAY_NIXL_LIB_DIR
# (running: the server's --nixl-lib-dir). Needs python3 with pip and gcc; nothing is installed
# system-wide.
_kvrelay_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
_kvrelay_nixl="${KVRELAY_NIXL_TOOLS:-$_kvrelay_root/target/nixl-tools}"
_kvrelay_nixl_lib="$_kvrelay_nixl/.nixl_cu13.mesonpy.libs"
if [ ! -f "$_kvrelay_nixl_lib/libnixl_capi.so" ] || [ ! -f "$_kvrelay_nixl/clang/native/libclang.so" ]; then
  # platform wheels of one CPython: only their shared libraries are used, so they are fetched
  # for that platform whatever the local Python is
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
if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  printf 'export LIBCLANG_PATH=%q\nexport BINDGEN_EXTRA_CLANG_ARGS=%q\nexport KVRELAY_NIXL_LIB_DIR=%q\n' \
    "$LIBCLANG_PATH" "$BINDGEN_EXTRA_CLANG_ARGS" "$KVRELAY_NIXL_LIB_DIR"
fi
unset _kvrelay_root _kvrelay_nixl _kvrelay_nixl_lib
