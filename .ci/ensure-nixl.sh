# Sourced by .ci/test.sh: the NIXL libraries and libclang of the `nixl` feature, installed the
# way a user installs them (scripts/nixl-env.sh), into target/ci-tools/nixl.
KVRELAY_NIXL_TOOLS="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/target/ci-tools/nixl" \
  source "$(dirname "${BASH_SOURCE[0]}")/../scripts/nixl-env.sh"
