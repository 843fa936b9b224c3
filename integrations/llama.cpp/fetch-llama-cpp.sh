#!/usr/bin/env bash
# Fetches the llama.cpp source tree that kvrelay's llama-server integration builds against: the
# copy vendored in the `llama-cpp-python` 0.3.36 source distribution on the Python package index
# (llama.cpp commit 0c1e570, ggml 0.25.3, sequence-state format 3), pinned by size and sha256.
#
#   integrations/llama.cpp/fetch-llama-cpp.sh [DIR]      # DIR defaults to target/ci-tools/llama.cpp-src
#
# Leaves the tarball in DIR and its vendor/llama.cpp/ in DIR/llama.cpp, less docs/ and models/ except
# models/templates/ (chat templates the server's pytest suite reads; the rest is 117 MB of vocab files).
# A second run with the tree present only prints where it is. The file's URL is read from the
# index's simple page for the project, as pip resolves it (no `pip download`: for a source
# distribution that runs its build backend). Behind a mirror, set PIP_INDEX_URL (or pip's
# `global.index-url`) to its simple index. Needs bash, curl, python3, sha256sum and GNU tar.
set -euo pipefail

# The index: PIP_INDEX_URL, else pip's configured global.index-url, else pip's own default.
DEFAULT_INDEX_URL="$(python3 -c 'from pip._internal.models.index import PyPI; print(PyPI.simple_url)' 2>/dev/null || true)"

PROJECT=llama-cpp-python
VERSION=0.3.36
COMMIT=0c1e570   # the llama.cpp commit it vendors (build.sh builds with LLAMA_BUILD_COMMIT=$COMMIT)
FILE="llama_cpp_python-${VERSION}.tar.gz"
SIZE=76589250
SHA256=832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e
INNER="llama_cpp_python-${VERSION}/vendor/llama.cpp"

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
dir="${1:-$root/target/ci-tools/llama.cpp-src}"
tree="$dir/llama.cpp"
stamp="$tree/.fetched-from"
layout="$FILE $SHA256 (no docs/, models/templates/ only)"
me="fetch-llama-cpp.sh"

if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$layout" ] && [ -f "$tree/tools/server/server.cpp" ]; then
  echo "$me: llama.cpp (from $FILE) is at $tree"
  exit 0
fi

mkdir -p "$dir"
tarball="$dir/$FILE"
curl_cert=()
if [ -n "${PIP_CERT:-}" ] && [ -f "$PIP_CERT" ]; then curl_cert=(--cacert "$PIP_CERT"); fi

sha_of() { sha256sum "$1" | cut -d' ' -f1; }

if [ -f "$tarball" ] && [ "$(sha_of "$tarball")" != "$SHA256" ]; then
  echo "$me: cached $tarball has another sha256; fetching it again" >&2
  rm -f "$tarball"
fi

if [ ! -f "$tarball" ]; then
  index="${PIP_INDEX_URL:-}"
  if [ -z "$index" ]; then
    index="$(python3 -m pip config get global.index-url 2>/dev/null || true)"
  fi
  if [ -z "$index" ]; then index="$DEFAULT_INDEX_URL"; fi
  if [ -z "$index" ]; then
    echo "$me: no package index known (pip not importable): set PIP_INDEX_URL to a simple index" >&2
    exit 1
  fi
  page="${index%/}/${PROJECT}/"
  echo "$me: resolving $FILE from $page"
  html="$(curl -fsSL --retry 3 "${curl_cert[@]}" -H 'Accept: text/html' "$page")"
  # The link whose file name is $FILE, made absolute against the page, without its #fragment.
  url="$(PAGE="$page" WANT="$FILE" python3 -c '
import html.parser, os, sys, urllib.parse
page, want = os.environ["PAGE"], os.environ["WANT"]
found = []
class P(html.parser.HTMLParser):
    def handle_starttag(self, tag, attrs):
        if tag != "a":
            return
        href = dict(attrs).get("href") or ""
        full = urllib.parse.urljoin(page, href)
        path = urllib.parse.urlsplit(full).path
        if urllib.parse.unquote(path.rsplit("/", 1)[-1]) == want:
            found.append(urllib.parse.urldefrag(full)[0])
P().feed(sys.stdin.read())
if not found:
    sys.exit("no link to %s on %s" % (want, page))
print(found[0])
' <<<"$html")"
  echo "$me: downloading $url ($SIZE bytes)"
  part="$tarball.part.$$"
  trap 'rm -f "$part"' EXIT
  curl -fL --retry 3 "${curl_cert[@]}" -o "$part" "$url"
  got_size="$(stat -c %s "$part")"
  got_sha="$(sha_of "$part")"
  if [ "$got_size" != "$SIZE" ] || [ "$got_sha" != "$SHA256" ]; then
    echo "$me: refusing $url: $got_size bytes, sha256 $got_sha (want $SIZE bytes, sha256 $SHA256)" >&2
    exit 1
  fi
  mv "$part" "$tarball"
  trap - EXIT
fi
echo "$me: $tarball: sha256 $SHA256 verified"

tmp="$dir/.llama.cpp.extract.$$"
rm -rf "$tmp"
mkdir -p "$tmp"
trap 'rm -rf "$tmp"' EXIT
tar -xzf "$tarball" -C "$tmp" --strip-components=3 \
  --exclude="$INNER/models" --exclude="$INNER/docs" "$INNER"
tar -xzf "$tarball" -C "$tmp" --strip-components=3 "$INNER/models/templates"
echo "$layout" >"$tmp/.fetched-from"
rm -rf "$tree"
mv "$tmp" "$tree"
trap - EXIT
echo "$me: llama.cpp (from $FILE) is at $tree"
