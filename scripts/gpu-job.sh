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
#   bash scripts/gpu-job.sh patch-cuda        # llama.cpp's libraries with patches/llama.cpp, over the bundle's (~4 min)
#   bash scripts/gpu-job.sh images            # the image workload, llamapool then llama-server (same GGUF pair)
#   bash scripts/gpu-job.sh lora              # 64 streams on the base model, then spread over 4 adapters
#   PHASES="patch-cuda agent images,SHAPE=1b" bash scripts/gpu-job.sh all   # phases in order, each with its own
#                                             # settings after commas; one log
#
# Settings (environment): SHAPE (1b, 8b or tiny: a random q8_0 model of Llama-3.2-1B's body or Llama-3.1-8B's
# shape, written on the machine, default 8b), C (streams, default 64), WORKLOADS (side-by-side: default
# "short rag"), SECONDS_PHASE (churn: default 30), OUT (default /tmp/out: one JSON-lines file a command,
# the services' logs under OUT/logs); agent: SESSIONS, TURNS (default 32, 6), KV (the kv_host values, default
# "32GiB 0"), MBT (max_batch_tokens values tried with the first KV, default 0: auto), PEER (0: no llama-server), CTX (slot size),
# EXTRA (0: only the agent runs, not short/rag/reload). Carry .gpu/
# (`make gpu-kit`: ../shared/device's files and the msgspec wheel) and nothing large.
# Without .gpu/ or nvidia-smi (a check of the job elsewhere, e.g. SHAPE=tiny PY=.venv/bin/python on a CPU) it runs in the
# caller's environment.
set -u
PY=${PY:-python3}
GPU=$([ -d .gpu ] && command -v nvidia-smi > /dev/null && echo 1)  # a CPU check ignores .gpu/
if [ -n "$GPU" ] && [ ! -d /tmp/site/llama_cpp ]; then
  mkdir -p /tmp/site && tar xJf .gpu/llama_cpp-0.3.36-cuda-sm90.tar.xz -C /tmp/site &&
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .gpu/wheels/*.whl .gpu/extra-wheels/*.whl
fi
if [ -n "$GPU" ] && [ ! -x /tmp/lsa/llama-server ] && ls .gpu/llama-server-*-addon.tar.xz > /dev/null 2>&1; then
  mkdir -p /tmp/lsa && tar xJf .gpu/llama-server-*-addon.tar.xz -C /tmp/lsa
fi
if [ -d /tmp/site/llama_cpp/lib ] && [ -e /tmp/lsa/libmtmd.so.0 ] && [ ! -e /tmp/site/llama_cpp/lib/libmtmd.so ]; then
  cp -P /tmp/lsa/libmtmd.so* /tmp/site/llama_cpp/lib/  # images: the add-on's libmtmd (same llama.cpp) for llama_cpp
fi
if [ -n "$GPU" ]; then export PYTHONPATH=/tmp/site:$PWD/src; else export PYTHONPATH=$PWD/src; fi
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
  { printf '[server]\nruntime_dir = "/tmp/lp-%s"\nqueue_timeout = 600.0\n[metrics]\nlisten = "127.0.0.1:9464"\n[workers]\nslots = %s\n[model]\npath = "%s"\nctx_per_slot = %s\n' \
    "$name" "$slots" "$M/$SHAPE.gguf" "$ctx"; printf '%s\n' "$@"; } > $M/$name.toml
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
agent)  # the 8B default: 32 sessions of 6 turns in 8k slots; 1b: 48 sessions of 16 turns in 16k slots (to 14k tokens)
  model $SHAPE
  [ "$SHAPE" = 1b ] && { : "${SESSIONS:=48}" "${TURNS:=16}" "${CTX:=16384}"; }
  AGENT="--scenario agent --sessions ${SESSIONS:-32} --turns ${TURNS:-6} --shared-tokens 1024 --new-tokens 768 --out-tokens 32 -c 16 --no-progress"
  first=1
  for kv in ${KV:-32GiB 0}; do
    for mbt in $([ $first = 1 ] && echo ${MBT:-0} || echo 0); do
      tag=$SHAPE-kv-$kv$([ "$mbt" != 0 ] && echo "-mbt$mbt")
      config agent-$kv-$mbt 16 ${CTX:-8192} "kv_host = \"$kv\"" "max_batch_tokens = $mbt"
      $LP serve --config $M/agent-$kv-$mbt.toml > "$OUT/logs/agent-$tag-daemon.log" 2>&1 & PID=$!
      for _ in $(seq 900); do grep -q "ready (READY=1)" "$OUT/logs/agent-$tag-daemon.log" && break; sleep 0.2; done
      timeout 200 $LP bench --config $M/agent-$kv-$mbt.toml $AGENT --out "$OUT/agent-$tag.jsonl" > "$OUT/logs/agent-$tag.txt" 2>&1
      el "agent kv_host=$kv max_batch_tokens=$mbt rc=$?"
      curl -s http://127.0.0.1:9464/metrics > "$OUT/logs/metrics-agent-$tag.txt"
      if [ "$mbt" = 0 ] && [ "${EXTRA:-1}" = 1 ]; then
        for w in short rag; do  # the tier must never make these slower (issue 51)
          timeout 90 $LP bench --config $M/agent-$kv-$mbt.toml -w $w -c 16 -n 64 --no-progress --out "$OUT/$w-$tag.jsonl" \
            > "$OUT/logs/$w-$tag.txt" 2>&1; el "$w kv_host=$kv rc=$?"
        done
      fi
      if [ "$kv" != 0 ] && [ "$mbt" = 0 ] && [ "${EXTRA:-1}" = 1 ]; then  # a rolling reload once half the turns are done: returning TTFT 30 s before and after
        timeout 240 $LP bench --config $M/agent-$kv-$mbt.toml $AGENT --reload-at 0.5 --reload-pid $PID \
          --out "$OUT/agent-$tag-reload.jsonl" > "$OUT/logs/agent-$tag-reload.txt" 2>&1
        el "agent kv_host=$kv --reload-at 0.5 rc=$?"
      fi
      kill -TERM $PID; wait $PID
    done
    first=0
  done
  [ "${PEER:-1}" = 0 ] && exit 0
  for cram in 0 32768; do
    LD_LIBRARY_PATH=/tmp/lsa:/tmp/site/llama_cpp/lib /tmp/lsa/llama-server -m $M/$SHAPE.gguf -ngl 99 -np 16 -c $((16 * ${CTX:-8192})) \
      -fa on -t 8 --cache-ram $cram --no-webui --port 8080 > "$OUT/logs/ls-$SHAPE-$cram.log" 2>&1 & LS=$!
    for _ in $(seq 900); do curl -sf http://127.0.0.1:8080/health > /dev/null && break; sleep 0.2; done
    timeout 240 $LP bench --http http://127.0.0.1:8080 --api llama $AGENT --n-vocab $NV --out "$OUT/agent-$SHAPE-llama-server-cram$cram.jsonl" \
      > "$OUT/logs/agent-ls-$SHAPE-$cram.txt" 2>&1
    el "agent llama-server --cache-ram $cram rc=$?"; kill $LS; wait $LS
  done ;;
patch-cuda)  # llama.cpp's libraries (libggml*, libllama) from the slim sdist with patches/llama.cpp, over the bundle's:
  # one build's whole set (a libllama built apart from the bundle's libggml crashed at model load, 2026-12-03)
  src=$(LLAMA_SDIST=$(ls $PWD/.gpu/llama_cpp_python-*-slim.tar.gz) LLAMA_CPP_CACHE=/tmp/lcb bash scripts/llama-cpp-build.sh source 2> "$OUT/logs/patch.log")
  { cmake -S "$src/vendor/llama.cpp" -B /tmp/bc -G Ninja -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=on -DGGML_CUDA=on \
      -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_NATIVE=off -DGGML_AVX2=on -DGGML_FMA=on -DGGML_F16C=on -DLLAMA_CURL=off \
      -DLLAMA_BUILD_TESTS=off -DLLAMA_BUILD_EXAMPLES=off -DLLAMA_BUILD_TOOLS=off -DLLAMA_BUILD_SERVER=off &&
    cmake --build /tmp/bc --target ggml-cuda llama -j "$(nproc)"; } > "$OUT/logs/build-cuda.log" 2>&1
  el "libggml-cuda and libllama with patches rc=$?"
  for name in libggml-base libggml-cpu libggml-cuda libggml libllama; do
    lib=$(find /tmp/bc -name "$name.so.*" -type f | head -1)
    [ -n "$lib" ] && for f in /tmp/site/llama_cpp/lib/$name.so*; do [ -L "$f" ] || cp "$lib" "$f"; done
  done
  grep -c GGML_CUDA_CUBLAS_MIN_BATCH /tmp/site/llama_cpp/lib/libggml-cuda.so* | tee -a "$OUT/job.log" ;;
images)  # 64 streams, an image each (the projector's size) and a 64-word question, 64 tokens out
  V=$M/vision-$SHAPE
  TOWER=$([ "$SHAPE" = tiny ] && echo tiny || echo siglip-so400m)  # Gemma 3's tower: 896 px, 256 tokens an image
  [ -f $V/mmproj.gguf ] || { $LP make-model $V --vision --vision-tower $TOWER $SHAPE_ARGS \
    > "$OUT/logs/make-vision.log" 2>&1 && el "vision model ($SHAPE) written"; }
  PX=$([ "$SHAPE" = tiny ] && echo 64 || echo 896)
  printf '[server]\nruntime_dir = "/tmp/lp-img"\nqueue_timeout = 600.0\n[metrics]\nlisten = "127.0.0.1:9464"\n[workers]\nslots = %s\n[model]\npath = "%s"\nmmproj = "%s"\nctx_per_slot = 1024\n' \
    $C $V/model.gguf $V/mmproj.gguf > $M/img.toml
  PEERARGS=$([ -x /tmp/lsa/llama-server ] && echo "--peer-server /tmp/lsa/llama-server --peer-logs $OUT/logs/img")
  [ -z "$PEERARGS" ] && { $LP serve --config $M/img.toml > "$OUT/logs/img-daemon0.log" 2>&1 & PID=$!; sleep 1
    for _ in $(seq 900); do grep -q "ready (READY=1)" "$OUT/logs/img-daemon0.log" && break; sleep 0.2; done; }
  timeout 400 $LP bench --config $M/img.toml $PEERARGS -w image \
    --image-px $PX -c $C -n ${N:-$((4 * C))} --no-progress --out "$OUT/images-$SHAPE.jsonl" > "$OUT/logs/images.txt" 2>&1
  el "images rc=$?"; [ -z "$PEERARGS" ] && { kill -TERM $PID; wait $PID; }
  $LP serve --config $M/img.toml > "$OUT/logs/img-daemon.log" 2>&1 & PID=$!  # a returning image: prefilled 0 times
  for _ in $(seq 900); do grep -q "ready (READY=1)" "$OUT/logs/img-daemon.log" && break; sleep 0.2; done
  for r in 1 2; do timeout 120 $LP bench --config $M/img.toml -w image --image-px $PX -c $C -n $C --seed 7 --no-progress \
    --out "$OUT/images-$SHAPE-again.jsonl" > "$OUT/logs/images-again-$r.txt" 2>&1; el "images again $r rc=$?"
    sleep 3; curl -s http://127.0.0.1:9464/metrics | grep -E "^llamapool_(prompt_tokens|kv_host)" > "$OUT/logs/images-again-$r-metrics.txt"; done
  kill -TERM $PID; wait $PID ;;
lora)  # the base model's 64 streams, then the same spread over four adapters (one adapter set a step)
  model $SHAPE
  for i in 1 2 3 4; do [ -f $M/$SHAPE-lora$i.gguf ] || $LP make-model $M/$SHAPE-lora$i.gguf --lora $M/$SHAPE.gguf --seed $i \
    > "$OUT/logs/make-lora$i.log" 2>&1; done
  config lora $C 1160 "$(for i in 1 2 3 4; do printf '[[model.lora]]\nname = "a%s"\npath = "%s"\n' $i $M/$SHAPE-lora$i.gguf; done)"
  $LP serve --config $M/lora.toml > "$OUT/logs/lora-daemon.log" 2>&1 & PID=$!
  for _ in $(seq 900); do grep -q "ready (READY=1)" "$OUT/logs/lora-daemon.log" && break; sleep 0.2; done
  for models in "" "a1" "a1 a2 a3 a4" ""; do
    timeout 120 $LP bench --config $M/lora.toml -w short -c $C -n $((4 * C)) ${models:+--model $models} --no-progress \
      --out "$OUT/lora-$SHAPE.jsonl" > "$OUT/logs/lora-${models// /-}.txt" 2>&1; el "lora models=[$models] rc=$?"
  done
  kill -TERM $PID; wait $PID ;;
models)  # the SHAPE's model (all: written beside the CUDA build)
  model $SHAPE ;;
all)  # PHASES in order, each "phase[,VAR=value...]"; the models they name are written while patch-cuda builds
  shapes=$(for item in ${PHASES:-patch-cuda agent images lora churn}; do
    v=$(echo "$item" | tr ',' '\n' | sed -n 's/^SHAPE=//p'); echo "${v:-$SHAPE}"; done | awk '!seen[$0]++')
  { for s in $shapes; do SHAPE=$s bash "$0" models; done; } & GEN=$!
  for item in ${PHASES:-patch-cuda agent images lora churn}; do
    ph=${item%%,*}; vars=$([ "$ph" = "$item" ] || echo "${item#*,}" | tr ',' ' ')
    [ "$ph" = patch-cuda ] || wait $GEN; el "phase $item"; env $vars bash "$0" "$ph"
  done ;;
*) echo "gpu-job.sh: unknown phase $PHASE (build, patch-cuda, side-by-side, speculation, churn, agent, images, lora, all)" >&2; exit 2 ;;
esac
