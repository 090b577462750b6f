#!/usr/bin/env bash
# The device job for issue 51 (one H200): `llamapool bench --scenario agent` against llamapool with the host
# KV tier on and off, and against llama-server (same llama.cpp build, --cache-ram 0 and 32768), on a random
# q8_0 model of Llama-3.1-8B's shape (or the 1B body: SHAPE=1b), 16 slots of 8192 tokens; then short and
# rag at 16 streams with the tier on and off. Phases, so that it fits the device's 10-minute calls:
#   bash scripts/gpu_agent_job.sh build        # llama-cpp-python with CUDA and patches/llama.cpp (the path
#                                              # `make install CUDA=1` takes) while the model is written
#   bash scripts/gpu_agent_job.sh llamapool    # unpack, write the model, llamapool on/off (+ short, rag)
#   bash scripts/gpu_agent_job.sh peer         # llama-server, both cache settings
#   setsid bash scripts/gpu_agent_job.sh all > /tmp/j.out 2>&1 < /dev/null &   # the three, outliving a call
# Needs .gpu/ (../shared/device's CUDA llama_cpp bundle, slim sdist, wheels, extra-wheels, llama-server
# add-on). KV_ON: the tier's size when on (default 32GiB; "auto" is 0 on GPU workers); VARIANTS: more
# llamapool runs of the agent workload (the tier on), e.g. "step" (target_step = "off"), "reload" (a rolling
# reload once half the turns are done: --reload-at 0.5).
# Rows go to $OUT (one JSON line a run, labelled by file name), the logs' tails to $OUT/logs.
set -u
PHASE=${1:-llamapool}; SHAPE=${SHAPE:-8b}; SESSIONS=${SESSIONS:-32}; TURNS=${TURNS:-6}
OUT=${OUT:-/tmp/agent-out}; M=/tmp/m; T0=$(date +%s)
mkdir -p "$OUT/logs" $M
el() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a "$OUT/job.log"; }
if [ "$PHASE" = all ]; then
  for p in build llamapool peer; do bash "$0" $p; done; touch "$OUT/DONE"; exit 0
fi
. scripts/gpu_env.sh
if [ "$SHAPE" = 8b ]; then
  SHAPE_ARGS="--n-embd 4096 --n-layer 32 --n-head 32 --n-head-kv 8 --n-ff 14336 --n-vocab 128256 --type q8_0"; NV=128256
else
  SHAPE_ARGS="--n-embd 2048 --n-layer 16 --n-head 32 --n-head-kv 8 --n-ff 8192 --n-vocab 32000 --type q8_0"; NV=32000
fi
MODEL=$M/$SHAPE.gguf
make_model() {
  [ -f $MODEL ] || { python3 -m llamapool.cli make-model ${MODEL%.gguf}.part.gguf $SHAPE_ARGS > "$OUT/logs/make.log" 2>&1 &&
    mv ${MODEL%.gguf}.part.gguf $MODEL; el "model $SHAPE written"; }
}
if [ "$PHASE" = build ]; then
  make_model &
  MPID=$!; t=$(date +%s)
  LLAMA_SDIST=$(ls $PWD/.gpu/llama_cpp_python-*-slim.tar.gz) LLAMA_CPP_CACHE=/tmp/lcb PIP_BUILD_ARGS=--no-build-isolation \
  CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) \
  CMAKE_ARGS="-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_NATIVE=off -DGGML_AVX2=on -DGGML_FMA=on -DGGML_F16C=on" \
  bash scripts/llama-cpp-build.sh wheel /tmp/wh > "$OUT/logs/build.log" 2>&1
  el "patched build rc=$? in $(( $(date +%s) - t )) s"
  if ls /tmp/wh/llama_cpp_python-*.whl > /dev/null 2>&1; then
    rm -rf /tmp/site/llama_cpp && python3 -m pip install -q --no-deps --target /tmp/site --upgrade /tmp/wh/llama_cpp_python-*.whl \
      > "$OUT/logs/pip.log" 2>&1; el "patched llama_cpp installed rc=$?"
  else
    tail -30 "$OUT/logs/build.log" >> "$OUT/job.log"; el "BUILD FAILED: the stock bundle stays"
  fi
  wait $MPID; exit 0
fi
make_model
AGENT="--scenario agent --sessions $SESSIONS --turns $TURNS --shared-tokens 1024 --new-tokens 768 --out-tokens 32 -c 16 --n-vocab $NV --no-progress"

serve() {  # serve LABEL KV_HOST [extra model keys]: a daemon of its own, ready
  local label=$1 kv=$2; shift 2
  mkdir -p /tmp/lp-$label
  cat > /tmp/lp-$label/c.toml <<EOF
[server]
runtime_dir = "/tmp/lp-$label/run"
drain_timeout = 60.0
[workers]
devices = "auto"
slots = 16
[model]
path = "$MODEL"
ctx_per_slot = 8192
kv_host = "$kv"
$*
EOF
  python3 -m llamapool.cli serve --config /tmp/lp-$label/c.toml > /tmp/lp-$label/daemon.log 2>&1 &
  echo $! > /tmp/lp-$label/pid
  for _ in $(seq 600); do grep -q "ready (READY=1)" /tmp/lp-$label/daemon.log && break; sleep 0.2; done
  el "llamapool $label ready"
}
unserve() {
  local label=$1
  kill -TERM "$(cat /tmp/lp-$label/pid)"; wait "$(cat /tmp/lp-$label/pid)" 2>/dev/null
  grep -E "kv|KV|error|Error" /tmp/lp-$label/daemon.log | tail -20 > "$OUT/logs/$label.log"
  tail -30 /tmp/lp-$label/daemon.log >> "$OUT/logs/$label.log"
}

if [ "$PHASE" = llamapool ]; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt" 2>&1; nproc >> "$OUT/gpu.txt"
  for mode in on off ${VARIANTS:-}; do  # a variant: "step" (the tier on, target_step = "off")
    kv=$([ $mode = off ] && echo 0 || echo "${KV_ON:-32GiB}")
    serve $mode $kv "$([ $mode = step ] && echo 'target_step = "off"')"
    timeout 200 python3 -m llamapool.cli bench --config /tmp/lp-$mode/c.toml $AGENT $([ $mode = reload ] && echo "--reload-at 0.5") \
      --out "$OUT/agent-$SHAPE-lp-$mode.jsonl" \
      > "$OUT/logs/agent-$mode.txt" 2>&1; el "agent $mode rc=$?"
    [ $mode = step ] || [ $mode = reload ] && { unserve $mode; continue; }
    for w in short rag; do
      timeout 90 python3 -m llamapool.cli bench --config /tmp/lp-$mode/c.toml -w $w -c 16 -n 64 --no-progress \
        --out "$OUT/$w-$SHAPE-lp-$mode.jsonl" > "$OUT/logs/$w-$mode.txt" 2>&1; el "$w $mode rc=$?"
    done
    unserve $mode
  done
fi

if [ "$PHASE" = peer ]; then
  for cram in 0 32768; do
    LD_LIBRARY_PATH=/tmp/lsa:/tmp/site/llama_cpp/lib /tmp/lsa/llama-server -m $MODEL -ngl 99 -np 16 -c $((16 * 8192)) \
      -fa on -t 8 --cache-ram $cram --no-webui --port 8080 > /tmp/ls-$cram.log 2>&1 &
    LS=$!
    for _ in $(seq 600); do curl -sf http://127.0.0.1:8080/health > /dev/null && break; sleep 0.2; done
    el "llama-server --cache-ram $cram ready"
    timeout 240 python3 -m llamapool.cli bench --http http://127.0.0.1:8080 --api llama $AGENT \
      --out "$OUT/agent-$SHAPE-llama-server-cram$cram.jsonl" > "$OUT/logs/agent-ls-$cram.txt" 2>&1
    el "agent llama-server cache-ram $cram rc=$?"
    kill $LS; wait $LS 2>/dev/null
    tail -5 /tmp/ls-$cram.log > "$OUT/logs/ls-$cram.log"
  done
fi
el "phase $PHASE done"
