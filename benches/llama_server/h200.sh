#!/usr/bin/env bash
# llama-server with kvrelay built with CUDA on the lent H200, then benches/llama_server/ttft.py
# there: fetched against cold time to first token on a 1B-parameter-shaped random model.
#
# Here (the development machine), after integrations/llama.cpp/build.sh:
#   mkdir -p .gpu && (cd target/llama-server && tar --exclude=llama.cpp/models --exclude=llama.cpp/docs \
#     --exclude=llama.cpp/tools/server/webui --exclude=llama.cpp/tools/server/tests -cJf ../../.gpu/llama.tar.xz llama.cpp \
#     && tar -cJf ../../.gpu/kvrelay-prefix.tar.xz kvrelay-prefix)
# On the device (the first call carries .gpu; the build stays in .gpu/work while the machine is
# warm, for later calls that do not carry .gpu: carrying it again replaces the folder, build and all):
#   bash benches/llama_server/h200.sh [UBATCH...]      # default: 32 (the bit-exact setting)
#   bash benches/llama_server/h200.sh --build-only     # the server and the model, no bench
#   bash benches/llama_server/h200.sh --two-instance   # two_instance_test.py, flash attention off and on
#   bash benches/llama_server/h200.sh --device         # device_store_test.py (CUDA IPC, TCP), flash attention off and on
#   FA=on SIZES=1024,4096 bash benches/llama_server/h200.sh --device-bench   # ttft.py: device store over CUDA IPC,
#                                                      # over TCP, and the host store (VARIANTS="cuda-ipc tcp host";
#                                                      # cuda-ipc-nocheck: CUDA IPC without --kv-import-check)
#   bash benches/llama_server/h200.sh --range          # range_api_test (-ngl 99), range_kv_test (fa off, on)
#   FA=on SIZES=1024,4096,16384 bash benches/llama_server/h200.sh 32   # ttft.py with -fa on, those sizes
#   MODEL_ARGS="--layers 32 --embd 4096 --heads 32 --heads-kv 8 --ff 14336" MODEL_NAME=random-8b ...  # the 8B shape
#   KV_FETCH=faster STREAM=1 bash benches/llama_server/h200.sh 32   # B decides; streamed requests
# Writes ttft-ub<N>.log per ubatch size, and the build's and the servers' tails, into $OUT.
set -euo pipefail
out="${OUT:-/tmp}"
w="$PWD/.gpu/work"
mkdir -p "$w"
if [ ! -x "$w/build/bin/llama-server" ]; then
  tar -xJf .gpu/llama.tar.xz -C "$w"
  tar -xJf .gpu/kvrelay-prefix.tar.xz -C "$w"
  # the prefix was installed elsewhere: its CMake files locate the library relative to themselves
  cmake -S "$w/llama.cpp" -B "$w/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
    -DBUILD_SHARED_LIBS=OFF -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DLLAMA_BUILD_COMMIT=0c1e570 \
    -DLLAMA_BUILD_NUMBER=0 -Dkvrelay_DIR="$w/kvrelay-prefix/lib/cmake/kvrelay" >"$out/configure.log" 2>&1 \
    || { tail -40 "$out/configure.log"; exit 1; }
  t0=$(date +%s)
  cmake --build "$w/build" --target llama-server -j "$(nproc)" >"$out/build.log" 2>&1 || { tail -60 "$out/build.log"; exit 1; }
  echo "h200.sh: llama-server built with CUDA in $(( $(date +%s) - t0 )) s"
fi
if [ ! -x "$w/range_api_test" ]; then
  # libllama's position-range KV API test, linked against the CUDA build's static libraries
  mapfile -t libs < <(find "$w/build/src" "$w/build/ggml" -name 'lib*.a' | sort)
  g++ -std=c++17 -O2 -I"$w/llama.cpp/include" -I"$w/llama.cpp/ggml/include" \
    integrations/llama.cpp/tests/range_api_test.cpp -o "$w/range_api_test" -Wl,--start-group "${libs[@]}" -Wl,--end-group \
    -L"${CUDA_HOME:-/usr/local/cuda}/lib64" -lcudart -lcublas -lcublasLt -lcuda $(ldconfig -p | grep -q libnccl && echo -lnccl) \
    -fopenmp -ldl -lpthread -lm -lrt
fi
model="$w/${MODEL_NAME:-random-1b}.gguf"
# shellcheck disable=SC2086
[ -f "$model" ] || python3 benches/llama_server/random_gguf.py "$model" ${MODEL_ARGS:-}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
[ "${1:-}" = "--build-only" ] && exit 0
if [ "${1:-}" = "--range" ]; then
  # the range API with the KV cache on the GPU (ggml-cuda's 2-D copies), then the server's byte counters
  # every part runs whatever an earlier one gave; the status says whether all passed
  rc=0
  "$w/range_api_test" "$model" 99 >"$out/range-api.log" 2>&1 || rc=1
  tail -5 "$out/range-api.log"
  for fa in off on; do
    python3 integrations/llama.cpp/tests/range_kv_test.py --server "$w/build/bin/llama-server" --model "$model" \
      --threads 4 --flash-attn "$fa" --server-args "-ngl 99 -c 4096" >>"$out/range-kv.log" 2>&1 || rc=1
  done
  grep -E "^FAIL|all checks passed|failed" "$out/range-kv.log" || true
  exit $rc
fi
if [ "${1:-}" = "--device" ]; then
  # the device store: blocks between the KV cache and a pool on the GPU, and between servers over
  # CUDA IPC and TCP (pinned staging), flash attention off and on
  rc=0
  for fa in off on; do
    echo "## --flash-attn $fa" >>"$out/device-store.log"
    KVRELAY_REQUIRE_GPU=1 python3 integrations/llama.cpp/tests/device_store_test.py --server "$w/build/bin/llama-server" \
      --model "$model" --threads 4 --flash-attn "$fa" --transports "${TRANSPORTS:-cuda-ipc,tcp}" \
      --server-args "-c 4096" --log-dir "$w/device-logs-$fa" >>"$out/device-store.log" 2>&1 || rc=1
  done
  grep -E "^## |^FAIL|all checks passed|check\(s\) failed|SKIP" "$out/device-store.log" || true
  if [ $rc -ne 0 ]; then
    for f in "$w"/device-logs-*/B-*.log "$w"/device-logs-*/A.log; do
      echo "== $f"; grep -iE "kvrelay|error|warn" "$f" | tail -15
    done
  fi
  exit $rc
fi
if [ "${1:-}" = "--device-bench" ]; then
  # ttft.py once per store and transport, each run with its own cold anchor: the device store over
  # CUDA IPC, the device store over TCP (pinned staging), and the pinned host store (the path
  # before the device store)
  for v in ${VARIANTS:-cuda-ipc tcp host}; do
    case "$v" in
      host) args="--kv-store host" ;;
      cuda-ipc-nocheck) args="--kv-transport cuda-ipc --kv-import-check off" ;;
      *) args="--kv-transport $v" ;;
    esac
    f="$out/ttft-${MODEL_NAME:-random-1b}-fa${FA:-on}-$v.log"
    echo "# benches/llama_server/ttft.py, $(nvidia-smi --query-gpu=name --format=csv,noheader) (CUDA, -ngl 99), $(date -u +%Y-%m-%dT%H:%MZ), ${MODEL_NAME:-random-1b}, -fa ${FA:-on}, store/transport: $v ($args)" >"$f"
    python3 benches/llama_server/ttft.py --server "$w/build/bin/llama-server" --model "$model" --threads 4 \
      --sizes "${SIZES:-1024,4096}" --rounds "${ROUNDS:-4}" --flash-attn "${FA:-on}" --ubatch "${UBATCH:-32}" \
      --server-args "-ngl 99 --kv-pool-mib ${POOL_MIB:-4096} $args ${EXTRA_ARGS:-}" >>"$f" 2>&1 || echo "ttft.py failed ($v)" >>"$f"
    grep -E "^\| [0-9]|failed|Error" "$f" | sed "s/^/$v: /"
  done
  exit 0
fi
if [ "${1:-}" = "--two-instance" ]; then
  rc=0
  for fa in off on; do
    echo "## --flash-attn $fa" >>"$out/two-instance.log"
    python3 integrations/llama.cpp/tests/two_instance_test.py --server "$w/build/bin/llama-server" --model "$model" \
      --threads 4 --flash-attn "$fa" --server-args "-ngl 99 -c 4096" >>"$out/two-instance.log" 2>&1 || rc=1
  done
  grep -E "^## |^FAIL|all checks passed|check\(s\) failed" "$out/two-instance.log" || true
  exit $rc
fi
for ub in "${@:-32}"; do
  echo "# benches/llama_server/ttft.py, H200 (CUDA, -ngl 99), $(date -u +%Y-%m-%dT%H:%MZ), ${MODEL_NAME:-random-1b} model, ubatch $ub, -fa ${FA:-off}" \
    | tee "$out/ttft-ub$ub-fa${FA:-off}-${MODEL_NAME:-random-1b}.log"
  python3 benches/llama_server/ttft.py --server "$w/build/bin/llama-server" --model "$model" --threads 4 \
    --sizes "${SIZES:-256,1024,2048,4096}" --rounds "${ROUNDS:-6}" --ubatch "$ub" --flash-attn "${FA:-off}" \
    --server-args "-ngl 99 ${SERVER_ARGS:-}" \
    --kv-fetch "${KV_FETCH:-always}" ${STREAM:+--stream} 2>&1 | tee -a "$out/ttft-ub$ub-fa${FA:-off}-${MODEL_NAME:-random-1b}.log"
done
