#!/usr/bin/env bash
# Issue 30, the device job (one H100, one job): build llama-cpp-python with CUDA (sm_90) and
# patches/llama.cpp through scripts/llama-cpp-build.sh (the path `make install CUDA=1` takes), make the
# random 8B and 1B models, then llamapool at prefill_cublas_min_rows = N (0: llama.cpp's stock kernel
# choice, the same build) against llama-server (the add-on built from the same llama.cpp, run against this
# build's libraries with GGML_CUDA_CUBLAS_MIN_BATCH unset, i.e. stock) and llama.cpp alone (prefill_sweep).
# Run from a folder holding src/, scripts/, patches/, pyproject.toml and the bundle of shared/device
# (the slim sdist, wheels/, extra-wheels/, the llama-server add-on); started with setsid so it outlives
# one device call; everything goes to /tmp/j (job.log: the timeline).
set -u
T0=$(date +%s)
J=/tmp/j; M=/tmp/m; W=$PWD
mkdir -p $J $M
el() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a $J/job.log; }
late() { [ $(( $(date +%s) - T0 )) -gt "$1" ] && { el "SKIPPED (past ${1} s): $2"; return 0; }; return 1; }
python3 -m pip install -q --no-index --no-deps --target /tmp/site wheels/*.whl extra-wheels/*.whl > $J/pip.log 2>&1
export PYTHONPATH=/tmp/site:$W/src PYTHONUNBUFFERED=1
unset GGML_CUDA_CUBLAS_MIN_BATCH
mkdir -p /tmp/lsa && tar xJf llama-server-*-addon.tar.xz -C /tmp/lsa
nvidia-smi > $J/nvidia-smi.txt 2>&1; nproc >> $J/nvidia-smi.txt
el "setup done"

# 1. the build (background) while the q8_0 models are written (numpy and gguf only)
( t=$(date +%s)
  LLAMA_SDIST=$(ls $W/llama_cpp_python-*-slim.tar.gz) LLAMA_CPP_CACHE=/tmp/lcb PIP_BUILD_ARGS=--no-build-isolation \
  CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) \
  CMAKE_ARGS="-DLLAVA_BUILD=off -DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_NATIVE=off -DGGML_AVX2=on -DGGML_FMA=on -DGGML_F16C=on" \
  bash scripts/llama-cpp-build.sh wheel /tmp/wh > $J/build.log 2>&1
  echo "build rc=$? in $(( $(date +%s) - t )) s" >> $J/build.log ) &
BPID=$!
python3 - > $J/make.log 2>&1 <<'EOF'
import time
from llamapool.modelgen import make_model
for name, shape in (("m8b-q8_0", dict(n_embd=4096, n_layer=32, n_head=32, n_head_kv=8, n_ff=14336, n_vocab=128256)),
                    ("m1b-q8_0", dict(n_embd=2048, n_layer=16, n_head=32, n_head_kv=8, n_ff=8192, n_vocab=32000))):
    t = time.monotonic()
    make_model(f"/tmp/m/{name}.gguf", qtype="q8_0", **shape)
    print(name, round(time.monotonic() - t, 1), "s", flush=True)
EOF
el "models: $(tr '\n' ' ' < $J/make.log)"
wait $BPID
el "$(tail -1 $J/build.log)"
python3 -m pip install -q --no-deps --target /tmp/site /tmp/wh/llama_cpp_python-*.whl >> $J/pip.log 2>&1
python3 -c "
import llama_cpp.llama_cpp as r; from pathlib import Path; from llamapool import llama_patches as p
d = Path(r._lib._name).parent; print('cuda libs', [str(x) for x in p.cuda_libraries(d)])
print('patched:', p.cublas_rows_ignored({p.CUBLAS_MIN_BATCH_ENV: '128'}, d) == '')" >> $J/job.log 2>&1
ls -la /tmp/site/llama_cpp/lib >> $J/build.log

GB="python3 scripts/gpu_bench.py --requests 128 --no-ceiling"
PEER="--llama-server /tmp/lsa/llama-server"
K=prefill_cublas_min_rows
run() { local name=$1; shift; timeout 300 "$@" > $J/$name.log 2>&1; el "$name rc=$?"; }
# 2. 8B q8_0: side by side at the default (128), then the sweep of N, one stream, llama.cpp alone
Q8=$M/m8b-q8_0.gguf
run q8-side $GB --out $J/q8-side --model $Q8 --workloads rag short $PEER
run q8-rag-sweep $GB --out $J/q8-rag-sweep --model $Q8 --workloads rag --sweep $K=0,256,512,64
run q8-short-sweep $GB --out $J/q8-short-sweep --model $Q8 --workloads short --sweep $K=0,512
run q8-one $GB --out $J/q8-one --model $Q8 --workloads short --concurrency 1 --procs 1 --requests 12 --sweep $K=0,128
# 3. 8B Q4_K_M (requantised from the q8_0 one)
late 760 "Q4_K_M" || {
  python3 scripts/prefill_sweep.py make --dir $M --shape 8b --q4km --threads $(nproc) --jsonl $J/make.jsonl >> $J/make.log 2>&1
  el "Q4_K_M made"
  Q4=$M/m8b-Q4_K_M.gguf
  run q4-side $GB --out $J/q4-side --model $Q4 --workloads rag short $PEER
  late 900 "Q4_K_M sweep" || run q4-rag-sweep $GB --out $J/q4-rag-sweep --model $Q4 --workloads rag short --sweep $K=0
}
# 4. llama.cpp alone: prefill of 64 x 1,024 tokens, stock against N = 128 (one process each: read once)
late 960 "prefill_sweep" || {
  run pf-stock python3 scripts/prefill_sweep.py sweep --model $Q8 --label q8_0-stock --jsonl $J/prefill.jsonl ub=1024
  run pf-128 env GGML_CUDA_CUBLAS_MIN_BATCH=128 python3 scripts/prefill_sweep.py sweep --model $Q8 --label q8_0-N128 \
    --jsonl $J/prefill.jsonl ub=1024
}
# 5. 1B spot checks
late 1000 "1B" || run 1b-side $GB --out $J/1b-side --model $M/m1b-q8_0.gguf --workloads rag short $PEER
late 1060 "1B sweep" || run 1b-sweep $GB --out $J/1b-sweep --model $M/m1b-q8_0.gguf --workloads rag short --sweep $K=0
grep -l "does nothing" $J/*/logs/*.log > $J/unpatched-warnings.txt 2>&1
for d in $J/*/; do echo "== $d"; cat $d/summary.md 2>/dev/null; done >> $J/job.log
python3 scripts/prefill_sweep.py table $J/prefill.jsonl >> $J/job.log 2>&1
el "all done"
touch $J/DONE
