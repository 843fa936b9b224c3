# Sourced by .ci/test.sh: Dynamo's KV router (ai-dynamo-runtime, its in-process SelectionService
# and KvRouter) with pyzmq and msgpack, for tests/dynamo_router.py, installed from the Python
# package index into target/ci-tools/dynamo when missing (about 75 MB to download; the wheel's
# own dependencies, pydantic and uvloop, come with it). Exports KVRELAY_DYNAMO_PYTHONPATH.
_kvrelay_dynamo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/target/ci-tools/dynamo"
if ! PYTHONPATH="$_kvrelay_dynamo" python3 -c "import dynamo._core, zmq, msgpack" 2>/dev/null; then
  python3 -m pip install --quiet --disable-pip-version-check --root-user-action=ignore \
    --target "$_kvrelay_dynamo" --upgrade ai-dynamo-runtime==1.6.1 pyzmq msgpack
fi
export KVRELAY_DYNAMO_PYTHONPATH="$_kvrelay_dynamo"
unset _kvrelay_dynamo
