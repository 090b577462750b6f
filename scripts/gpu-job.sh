#!/usr/bin/env bash
# The GPU machine's job (the device tool's `run`; ../shared/device/README.md says what .gpu/ holds): every
# figure of docs/benchmarks.md that was measured there is one `llamapool bench` command below.
#
#   . scripts/gpu-job.sh                      # only the environment: unpacks .gpu/ into /tmp/site (llama_cpp
#                                             # with CUDA, wheels) and /tmp/lsa (llama-server), sets PYTHONPATH
#   bash scripts/gpu-job.sh build             # llama-cpp-python with CUDA and patches/llama.cpp, the path
#                                             # `make install CUDA=1` takes (~4 min on 16 cores)
#   bash scripts/gpu-job.sh side-by-side      # llamapool, then llama-server, same model and requests
#   bash scripts/gpu-job.sh speculation       # the copy task, speculation on vs off (a peaked model)
#   bash scripts/gpu-job.sh churn             # the busy model beside seven on-demand ones (issue 52)
#   bash scripts/gpu-job.sh agent             # the agent scenario, host KV tier on and off, and llama-server
#
# Settings (environment): SHAPE (1b, 8b or tiny: a random q8_0 model of Llama-3.2-1B's body or Llama-3.1-8B's
# shape, written on the machine, default 8b), C (streams, default 64), WORKLOADS (side-by-side: default
# "short rag"), SECONDS_PHASE (churn: default 30), OUT (default /tmp/out: one JSON-lines file a command,
# the services' logs under OUT/logs). Carry .gpu/ (`make gpu-kit`: ../shared/device's files and the msgspec
# wheel) and nothing large.
# Without .gpu/ (a check of the job elsewhere, e.g. SHAPE=tiny PY=.venv/bin/python on a CPU) it runs in the
# caller's environment.
set -u
PY=${PY:-python3}
if [ -d .gpu ] && [ ! -d /tmp/site/llama_cpp ]; then
  mkdir -p /tmp/site && tar xJf .gpu/llama_cpp-0.3.36-cuda-sm90.tar.xz -C /tmp/site &&
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .gpu/wheels/*.whl .gpu/extra-wheels/*.whl
fi
if [ ! -x /tmp/lsa/llama-server ] && ls .gpu/llama-server-*-addon.tar.xz > /dev/null 2>&1; then
  mkdir -p /tmp/lsa && tar xJf .gpu/llama-server-*-addon.tar.xz -C /tmp/lsa
fi
if [ -d .gpu ]; then export PYTHONPATH=/tmp/site:$PWD/src; else export PYTHONPATH=$PWD/src; fi
export PYTHONUNBUFFERED=1
[ "$#" -eq 0 ] && return 0 2> /dev/null

PHASE=$1; SHAPE=${SHAPE:-8b}; C=${C:-64}; OUT=${OUT:-/tmp/out}; M=/tmp/m
mkdir -p "$OUT/logs" $M
LP="$PY -m llamapool.cli"
T0=$(date +%s)
el() { echo "[$(($(date +%s) - T0)) s] $*" | tee -a "$OUT/job.log"; }
if [ "$SHAPE" = tiny ]; then
  SHAPE_ARGS=""; NV=512  # make-model's defaults: checks the job, its figures mean nothing
elif [ "$SHAPE" = 8b ]; then
  SHAPE_ARGS="--n-embd 4096 --n-layer 32 --n-head 32 --n-head-kv 8 --n-ff 14336 --n-vocab 128256 --type q8_0"; NV=128256
else
  SHAPE_ARGS="--n-embd 2048 --n-layer 16 --n-head 32 --n-head-kv 8 --n-ff 8192 --n-vocab 32000 --type q8_0"; NV=32000
fi
model() {  # model NAME [--peaked]: $M/NAME.gguf of SHAPE, written once
  [ -f $M/$1.gguf ] || { $LP make-model $M/$1.part.gguf $SHAPE_ARGS ${2:-} > "$OUT/logs/make-$1.log" 2>&1 &&
    mv $M/$1.part.gguf $M/$1.gguf && el "model $1 ($SHAPE) written"; }
}
config() {  # config NAME SLOTS CTX [more [model] lines]: $M/NAME.toml, one model on the GPUs
  local name=$1 slots=$2 ctx=$3; shift 3
  printf '[server]\nruntime_dir = "/tmp/lp-%s"\nqueue_timeout = 600.0\n[workers]\nslots = %s\n[model]\npath = "%s"\nctx_per_slot = %s\n%s\n' \
    "$name" "$slots" "$M/$SHAPE.gguf" "$ctx" "$*" > $M/$name.toml
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt" 2>&1
git log -1 --format='%H %cs' >> "$OUT/gpu.txt" 2> /dev/null

case $PHASE in
build)
  LLAMA_SDIST=$(ls $PWD/.gpu/llama_cpp_python-*-slim.tar.gz) LLAMA_CPP_CACHE=/tmp/lcb PIP_BUILD_ARGS=--no-build-isolation \
    CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) \
    CMAKE_ARGS="-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_NATIVE=off -DGGML_AVX2=on -DGGML_FMA=on -DGGML_F16C=on" \
    bash scripts/llama-cpp-build.sh wheel /tmp/wh > "$OUT/logs/build.log" 2>&1
  el "patched build rc=$?"
  rm -rf /tmp/site/llama_cpp && python3 -m pip install -q --no-deps --target /tmp/site --upgrade /tmp/wh/llama_cpp_python-*.whl
  el "patched llama_cpp installed rc=$?" ;;
side-by-side)
  model $SHAPE; config sbs $C 1160
  for w in ${WORKLOADS:-short rag}; do
    timeout 400 $LP bench --config $M/sbs.toml --peer-server /tmp/lsa/llama-server --peer-logs "$OUT/logs/sbs-$w" \
      -w $w -c $C --procs 4 --no-progress --out "$OUT/side-by-side-$SHAPE-$w.jsonl" > "$OUT/logs/sbs-$w.txt" 2>&1
    el "side-by-side $w rc=$?"
  done ;;
speculation)
  model $SHAPE-peaked --peaked
  printf '[server]\nruntime_dir = "/tmp/lp-spec"\n[workers]\nslots = %s\n[model]\npath = "%s"\nctx_per_slot = 1024\n%s\n' \
    $C $M/$SHAPE-peaked.gguf "$([ $SHAPE = tiny ] && echo 'speculative = "ngram"')" > $M/spec.toml  # "auto" is off on a CPU
  $LP serve --config $M/spec.toml > "$OUT/logs/spec-daemon.log" 2>&1 & PID=$!
  for _ in $(seq 900); do grep -q "ready (READY=1)" "$OUT/logs/spec-daemon.log" && break; sleep 0.2; done
  timeout 400 $LP bench --config $M/spec.toml --scenario speculation -c 1 $C --rounds 2 --gen-tokens 256 --no-progress \
    --out "$OUT/speculation-$SHAPE.jsonl" > "$OUT/logs/spec.txt" 2>&1
  el "speculation rc=$?"; kill -TERM $PID; wait $PID ;;
churn)
  model $SHAPE
  { printf '[server]\nruntime_dir = "/tmp/lp-churn"\nqueue_timeout = 600.0\n[pool]\nmin_residency = 10.0\nscale_up_wait = 600.0\n'
    printf '[[models]]\nname = "busy"\npath = "%s"\nreplicas = [1, 1]\nslots = 64\nctx_per_slot = 1160\n' $M/$SHAPE.gguf
    for i in 1 2 3 4 5 6 7; do
      ln -sf $M/$SHAPE.gguf $M/m$i.gguf
      printf '[[models]]\nname = "m%s"\npath = "%s"\nload = "on_demand"\nslots = 128\nctx_per_slot = 1160\n' $i $M/m$i.gguf
    done; } > $M/churn.toml
  $LP serve --config $M/churn.toml > "$OUT/logs/churn-daemon.log" 2>&1 & PID=$!
  for _ in $(seq 900); do grep -q "ready (READY=1)" "$OUT/logs/churn-daemon.log" && break; sleep 0.2; done
  timeout 400 $LP bench --config $M/churn.toml --scenario pool-churn --busy busy --light m1 m2 m3 m4 m5 m6 m7 -c $C \
    --seconds ${SECONDS_PHASE:-30} --light-every 0.4 --zipf 1.0 --no-progress --out "$OUT/churn-$SHAPE.jsonl" \
    > "$OUT/logs/churn.txt" 2>&1
  el "churn rc=$?"; kill -TERM $PID; wait $PID; grep -E "placement" "$OUT/logs/churn-daemon.log" | tail -40 > "$OUT/logs/placement.txt" ;;
agent)
  model $SHAPE
  AGENT="--scenario agent --sessions 32 --turns 6 --shared-tokens 1024 --new-tokens 768 --out-tokens 32 -c 16 --no-progress"
  for kv in 32GiB 0; do
    config agent-$kv 16 8192 "kv_host = \"$kv\""
    $LP serve --config $M/agent-$kv.toml > "$OUT/logs/agent-$kv-daemon.log" 2>&1 & PID=$!
    for _ in $(seq 900); do grep -q "ready (READY=1)" "$OUT/logs/agent-$kv-daemon.log" && break; sleep 0.2; done
    timeout 200 $LP bench --config $M/agent-$kv.toml $AGENT --out "$OUT/agent-$SHAPE-kv-$kv.jsonl" > "$OUT/logs/agent-$kv.txt" 2>&1
    el "agent kv_host=$kv rc=$?"
    for w in short rag; do  # the tier must never make these slower (issue 51)
      timeout 90 $LP bench --config $M/agent-$kv.toml -w $w -c 16 -n 64 --no-progress --out "$OUT/$w-$SHAPE-kv-$kv.jsonl" \
        > "$OUT/logs/$w-$kv.txt" 2>&1; el "$w kv_host=$kv rc=$?"
    done
    if [ "$kv" != 0 ]; then  # a rolling reload once half the turns are done: returning TTFT 30 s before and after
      timeout 240 $LP bench --config $M/agent-$kv.toml $AGENT --reload-at 0.5 --out "$OUT/agent-$SHAPE-kv-$kv-reload.jsonl" \
        > "$OUT/logs/agent-$kv-reload.txt" 2>&1; el "agent kv_host=$kv --reload-at 0.5 rc=$?"
    fi
    kill -TERM $PID; wait $PID
  done
  for cram in 0 32768; do
    LD_LIBRARY_PATH=/tmp/lsa:/tmp/site/llama_cpp/lib /tmp/lsa/llama-server -m $M/$SHAPE.gguf -ngl 99 -np 16 -c $((16 * 8192)) \
      -fa on -t 8 --cache-ram $cram --no-webui --port 8080 > "$OUT/logs/ls-$cram.log" 2>&1 & LS=$!
    for _ in $(seq 900); do curl -sf http://127.0.0.1:8080/health > /dev/null && break; sleep 0.2; done
    timeout 240 $LP bench --http http://127.0.0.1:8080 --api llama $AGENT --n-vocab $NV --out "$OUT/agent-$SHAPE-llama-server-cram$cram.jsonl" \
      > "$OUT/logs/agent-ls-$cram.txt" 2>&1
    el "agent llama-server --cache-ram $cram rc=$?"; kill $LS; wait $LS
  done ;;
*) echo "gpu-job.sh: unknown phase $PHASE (build, side-by-side, speculation, churn, agent)" >&2; exit 2 ;;
esac
