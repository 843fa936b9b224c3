#!/usr/bin/env bash
# Builds llama.cpp's llama-server twice from one pinned tree: as it is, and with kvrelay embedded
# (llama-kv-range.patch: libllama's position-range KV API; kvrelay.patch: the server's hooks; plus
# src/kvrelay_llama*.{hpp,cpp}). From a clone of kvrelay:
#
#   bash integrations/llama.cpp/build.sh                  # both servers into target/llama-server/bin
#   bash integrations/llama.cpp/build.sh --check-patch    # only: do both patches apply, without fuzz?
#   bash integrations/llama.cpp/build.sh --regen-patch    # rewrite both patches from the working copy
#
# Steps: (1) fetch-llama-cpp.sh fetches the pinned tree (pristine, never modified here) and it is
# copied once into OUT/llama.cpp, the working copy; (2) kvrelay is built with CMake (cargo on
# PATH) and installed into OUT/kvrelay-prefix, unless KVRELAY_PREFIX names an install; (3)
# llama-kv-range.patch is applied (libllama gains functions the unpatched server never calls, so
# libllama is built once for both servers), the working copy is configured once in OUT/build and
# the unpatched llama-server (the server's code as upstream ships it) is built and copied to
# OUT/bin/llama-server-unpatched; (4) kvrelay.patch is applied (each patch is checked first: it
# must apply without fuzz; skipped when applied already), the integration's sources are copied into
# tools/server/, the build is reconfigured with kvrelay_DIR, and llama-server is rebuilt (only the
# server's objects recompile) and copied to OUT/bin/llama-server-kvrelay. Both binaries link
# ggml, llama and kvrelay statically (BUILD_SHARED_LIBS=OFF), so each is one self-contained file.
#
# Environment:
#   LLAMA_SERVER_OUT   output folder (default: target/llama-server of the clone)
#   JOBS               parallel compile jobs (default: nproc)
#   KVRELAY_PREFIX     an existing kvrelay install (its lib/cmake/kvrelay is used; nothing is built)
#   LLAMA_CPP_DIR      a llama.cpp tree to use instead of fetching the pinned one: a folder holding
#                      tools/server/server.cpp, or a .tar/.tar.gz/.tar.xz of one (its top folder
#                      or its root holding tools/); extracted into OUT/llama.cpp-src
#   LLAMA_CPP_COMMIT   the build commit llama-server reports and kvrelay's block names depend on
#                      (default: the pin in fetch-llama-cpp.sh; unset for a git checkout)
#   LLAMA_CMAKE_ARGS   extra arguments for llama.cpp's configure (e.g. "-DGGML_CUDA=ON")
#   CMAKE_GENERATOR    CMake's own variable; Ninja is used when ninja is on PATH and it is unset
#   KVRELAY_TEST_HOOKS 1: the kvrelay server is the test build, with the integration's fault hooks
#                      compiled in (KVRELAY_LLAMA_TEST_HOOKS: forced block-name collisions, turned
#                      on by KVRELAY_LLAMA_TEST_NAME_COLLISIONS=1 at run time); default 0
# Needs bash, cmake (the system's, else .ci/ensure-cmake.sh installs one), a C/C++ compiler,
# patch (or git), and for step 2 cargo.
set -euo pipefail

me="build.sh"
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../.." && pwd)"
# applied in this order: libllama's range API (include/, src/), then the server's hooks
# (tools/server/, common/)
patches=("$here/llama-kv-range.patch" "$here/kvrelay.patch")
sources=(kvrelay_llama.hpp kvrelay_llama_state.hpp kvrelay_llama_flags.cpp kvrelay_llama_start.cpp
  kvrelay_llama_fetch.cpp kvrelay_llama_slots.cpp kvrelay_llama_routes.cpp kvrelay_llama_kv.hpp kvrelay_llama_kv.cpp)
out="${LLAMA_SERVER_OUT:-$root/target/llama-server}"
jobs="${JOBS:-$(nproc)}"

log() { echo "$me: $*"; }
die() {
  echo "$me: error: $*" >&2
  exit 1
}

mode=build
case "${1:-}" in
  "") ;;
  --check-patch) mode=check ;;
  --regen-patch) mode=regen ;;
  -h | --help)
    sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d' | sed 's/^# \{0,1\}//'
    exit 0
    ;;
  *) die "unknown argument '$1' (try --help)" ;;
esac
[ $# -le 1 ] || die "one argument at most (try --help)"

mkdir -p "$out"
out="$(cd "$out" && pwd -P)"

# --- the pristine tree --------------------------------------------------------------------------

pristine_tree() {
  local d="${LLAMA_CPP_DIR:-}"
  if [ -z "$d" ]; then
    bash "$here/fetch-llama-cpp.sh" >&2
    echo "$root/target/ci-tools/llama.cpp-src/llama.cpp"
  elif [ -d "$d" ]; then
    [ -f "$d/tools/server/server.cpp" ] || die "LLAMA_CPP_DIR=$d holds no tools/server/server.cpp"
    (cd "$d" && pwd)
  elif [ -f "$d" ]; then
    local dest="$out/llama.cpp-src" stamp
    stamp="$(sha256sum "$d" | cut -d' ' -f1)"
    if [ ! -f "$dest/.kvrelay-tarball" ] || [ "$(cat "$dest/.kvrelay-tarball")" != "$stamp" ]; then
      log "extracting $d" >&2
      rm -rf "$dest" "$dest.tmp"
      mkdir -p "$dest.tmp"
      tar -xf "$d" -C "$dest.tmp"
      local found
      found="$(find "$dest.tmp" -maxdepth 4 -path '*/tools/server/server.cpp' -print -quit)"
      [ -n "$found" ] || die "$d holds no llama.cpp tree (tools/server/server.cpp)"
      mv "${found%/tools/server/server.cpp}" "$dest"
      rm -rf "$dest.tmp"
      echo "$stamp" >"$dest/.kvrelay-tarball"
    fi
    echo "$dest"
  else
    die "LLAMA_CPP_DIR=$d is neither a folder nor a file"
  fi
}

# --- the patch ----------------------------------------------------------------------------------

# run_patch TREE PATCH ARGS...: patch(1) with one of the integration's patches, or git apply where
# patch is missing. Never fuzz (-F0; git apply has none): context must match exactly, only line
# offsets are allowed.
run_patch() {
  local tree="$1" patch_file="$2"
  shift 2
  if command -v patch >/dev/null 2>&1; then
    (cd "$tree" && patch -p1 -F0 -f --no-backup-if-mismatch "$@" -i "$patch_file")
  elif command -v git >/dev/null 2>&1; then
    local args=()
    for a in "$@"; do
      case "$a" in
        --dry-run) args+=(--check) ;;
        -R) args+=(-R) ;;
        -s) ;;
      esac
    done
    # the ceiling keeps git from treating an enclosing repository as the tree's
    (cd "$tree" && GIT_CEILING_DIRECTORIES="$(dirname "$tree")" git apply -p1 "${args[@]}" "$patch_file")
  else
    die "neither patch nor git is installed"
  fi
}

# one_applies TREE PATCH / one_applied TREE PATCH
one_applies() { run_patch "$1" "$2" --dry-run -s >/dev/null 2>&1; }
one_applied() { run_patch "$1" "$2" -R --dry-run -s >/dev/null 2>&1; }
# patch_applied TREE: every patch is applied in TREE
patch_applied() {
  local p
  for p in "${patches[@]}"; do one_applied "$1" "$p" || return 1; done
}

# check_patch TREE PATCH: succeeds when PATCH applies to TREE without fuzz; else says why, loudly.
check_patch() {
  local tree="$1" p="$2" report
  if report="$(run_patch "$tree" "$p" --dry-run 2>&1)"; then
    log "$(basename "$p") applies to $tree without fuzz"
    if grep -q offset <<<"$report"; then
      log "(with line offsets: $(grep -c offset <<<"$report") hunk(s) moved; regenerate the patch to silence this)"
    fi
    return 0
  fi
  echo "$report" >&2
  echo "$me: error: $(basename "$p") does not apply to $tree without fuzz (see above)." >&2
  echo "$me: to move it to this tree: integrations/llama.cpp/README.md, \"A newer llama.cpp\"." >&2
  return 1
}

if [ "$mode" = check ]; then
  tree="$(pristine_tree)"
  for p in "${patches[@]}"; do
    if one_applies "$tree" "$p"; then
      check_patch "$tree" "$p"
    elif one_applied "$tree" "$p"; then
      log "$tree is patched already; $(basename "$p") reverses from it exactly, so it applies to the pristine tree"
    else
      check_patch "$tree" "$p" || exit 1
    fi
  done
  exit 0
fi

pristine="$(pristine_tree)"
work="$out/llama.cpp"

if [ "$mode" = regen ]; then
  [ -d "$work" ] || die "no working copy at $work: run build.sh first, then edit it"
  tmp="$(mktemp -d)"
  trap 'rm -rf "$tmp"' EXIT
  ln -s "$pristine" "$tmp/a"
  ln -s "$work" "$tmp/b"
  excludes=(--exclude='*.orig' --exclude='*.rej')
  for f in "${sources[@]}"; do excludes+=(--exclude="$f"); done
  # regen PATCH DIRS...: the working copy's changes to DIRS, as PATCH
  regen() {
    local patch_file="$1" d rc
    shift
    : >"$tmp/new.patch"
    for d in "$@"; do
      set +e
      (cd "$tmp" && LC_ALL=C diff -ruN "${excludes[@]}" "a/$d" "b/$d") >>"$tmp/new.patch"
      rc=$?
      set -e
      [ "$rc" -le 1 ] || die "diff failed"
    done
    # diff names its options in each file's first line: keep the plain "diff -ruN a/F b/F"
    # and no timestamps, so that regenerating an unchanged patch gives the same bytes
    sed -i -E -e 's|^diff -ruN .* (a/[^ ]+) (b/[^ ]+)$|diff -ruN \1 \2|' -e 's/^(---|\+\+\+) ([^\t]+)\t.*$/\1 \2/' "$tmp/new.patch"
    [ -s "$tmp/new.patch" ] || die "the working copy's $* do not differ from $pristine"
    cp "$tmp/new.patch" "$patch_file"
    log "wrote $patch_file ($(grep -c '^@@' "$patch_file") hunks)"
  }
  regen "${patches[0]}" include src
  regen "${patches[1]}" tools/server common
  exit 0
fi

# --- tools --------------------------------------------------------------------------------------

if ! command -v cmake >/dev/null 2>&1; then
  # shellcheck source=/dev/null
  source "$root/.ci/ensure-cmake.sh"
fi
command -v cmake >/dev/null 2>&1 || die "cmake not found"
log "cmake: $(command -v cmake) ($(cmake --version | head -n1)); $jobs jobs; output in $out"

# --- (1) the working copy -----------------------------------------------------------------------

source_id="$pristine $(cat "$pristine/.fetched-from" 2>/dev/null || true) $(cat "$pristine/.kvrelay-tarball" 2>/dev/null || true)"
if [ ! -f "$work/.kvrelay-source" ] || [ "$(cat "$work/.kvrelay-source")" != "$source_id" ]; then
  log "copying $pristine to $work"
  rm -rf "$work" "$work.tmp" "$out/build"
  cp -a "$pristine" "$work.tmp"
  echo "$source_id" >"$work.tmp/.kvrelay-source"
  mv "$work.tmp" "$work"
fi

# --- (2) kvrelay ---------------------------------------------------------------------------------

t0=$SECONDS
if [ -n "${KVRELAY_PREFIX:-}" ]; then
  prefix="$(cd "$KVRELAY_PREFIX" 2>/dev/null && pwd)" || die "KVRELAY_PREFIX=$KVRELAY_PREFIX does not exist"
  log "using the kvrelay install at $prefix"
else
  prefix="$out/kvrelay-prefix"
  command -v cargo >/dev/null 2>&1 || die "building kvrelay needs cargo on PATH (or set KVRELAY_PREFIX to an install)"
  log "building kvrelay into $prefix"
  cmake -S "$root" -B "$out/kvrelay-build" -DCMAKE_BUILD_TYPE=Release -DKVRELAY_BUILD_EXAMPLES=OFF
  cmake --build "$out/kvrelay-build" -j "$jobs"
  cmake --install "$out/kvrelay-build" --prefix "$prefix"
fi
kvrelay_dir=""
for d in lib lib64; do
  if [ -f "$prefix/$d/cmake/kvrelay/kvrelayConfig.cmake" ]; then kvrelay_dir="$prefix/$d/cmake/kvrelay"; fi
done
[ -n "$kvrelay_dir" ] || die "$prefix holds no kvrelay CMake package (lib/cmake/kvrelay/kvrelayConfig.cmake)"
t_kvrelay=$((SECONDS - t0))

# --- (3) llama.cpp, unpatched -------------------------------------------------------------------

build="$out/build"
commit="${LLAMA_CPP_COMMIT-$(sed -n 's/^COMMIT=\([0-9a-f]*\).*/\1/p' "$here/fetch-llama-cpp.sh")}"
read -r -a extra <<<"${LLAMA_CMAKE_ARGS:-}"
llama_args=(
  -DCMAKE_BUILD_TYPE=Release
  -DGGML_NATIVE=OFF
  -DLLAMA_BUILD_TESTS=OFF
  -DLLAMA_BUILD_EXAMPLES=OFF
  -DLLAMA_BUILD_UI=OFF
  -DLLAMA_USE_PREBUILT_UI=OFF
  "${extra[@]}"
  -DBUILD_SHARED_LIBS=OFF
)
# A git checkout reports its own commit. The pinned sdist's tree is not one (its .git is a dangling
# submodule link, which also keeps git from finding a repository around OUT): name the pin.
if [ -n "${LLAMA_CPP_COMMIT+x}" ] || [ "$(git -C "$work" rev-parse --show-toplevel 2>/dev/null || true)" != "$work" ]; then
  if [ -n "$commit" ]; then llama_args+=("-DLLAMA_BUILD_COMMIT=$commit" -DLLAMA_BUILD_NUMBER=0); fi
fi
generator=()
if [ -z "${CMAKE_GENERATOR:-}" ] && [ ! -f "$build/CMakeCache.txt" ] && command -v ninja >/dev/null 2>&1; then
  generator=(-G Ninja)
fi

build_server() { # build_server NAME
  cmake --build "$build" --target llama-server -j "$jobs"
  mkdir -p "$out/bin"
  cp "$build/bin/llama-server" "$out/bin/$1.tmp"
  mv "$out/bin/$1.tmp" "$out/bin/$1"
  log "built $out/bin/$1"
}

t0=$SECONDS
# apply PATCH: applies it to the working copy unless it is applied already
apply() {
  if one_applied "$work" "$1"; then
    log "$(basename "$1") is applied in $work already"
  else
    check_patch "$work" "$1" || exit 1
    run_patch "$work" "$1" -s
    log "applied $(basename "$1")"
  fi
}

if patch_applied "$work" && [ -x "$out/bin/llama-server-unpatched" ]; then
  log "the working copy is patched and $out/bin/llama-server-unpatched exists: not rebuilding it"
else
  if one_applied "$work" "${patches[1]}"; then
    log "reverting $(basename "${patches[1]}") in the working copy to build the unpatched server"
    run_patch "$work" "${patches[1]}" -R -s
  fi
  apply "${patches[0]}"
  cmake -S "$work" -B "$build" "${generator[@]}" "${llama_args[@]}"
  build_server llama-server-unpatched
fi
t_unpatched=$((SECONDS - t0))

# --- (4) llama.cpp with kvrelay ------------------------------------------------------------------

t0=$SECONDS
for p in "${patches[@]}"; do apply "$p"; done
for f in "${sources[@]}"; do
  if ! cmp -s "$here/src/$f" "$work/tools/server/$f"; then
    cp "$here/src/$f" "$work/tools/server/$f"
  fi
done
hooks=OFF
if [ "${KVRELAY_TEST_HOOKS:-0}" = 1 ]; then hooks=ON; fi
cmake -S "$work" -B "$build" "${generator[@]}" "${llama_args[@]}" "-Dkvrelay_DIR=$kvrelay_dir" \
  "-DKVRELAY_LLAMA_TEST_HOOKS=$hooks"
build_server llama-server-kvrelay
t_patched=$((SECONDS - t0))

log "done in $((t_kvrelay + t_unpatched + t_patched)) s (kvrelay ${t_kvrelay} s, unpatched ${t_unpatched} s, kvrelay server ${t_patched} s):"
log "  $out/bin/llama-server-unpatched"
log "  $out/bin/llama-server-kvrelay"
