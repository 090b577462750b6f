#!/usr/bin/env bash
# The device job for issues 43 and 46 (one H200): build llama-cpp-python with CUDA (sm_90) and
# patches/llama.cpp (0001: GGML_CUDA_CUBLAS_MIN_BATCH; 0002: GGML_CUDA_DETERMINISTIC) through
# scripts/llama-cpp-build.sh, the path `make install` takes, while the random q8_0 models are written (the
# 1B body and Llama-3.1-8B's shape for determinism_gpu.py, an 8B `--peaked` one for spec_copy.py); then
#   1. scripts/determinism_gpu.py       (issue 46: deterministic off and on, side by side);
#   2. scripts/spec_copy.py --draft-1b  (issue 43's table, SPEC_ARGS added: e.g. "--shapes 8b --streams 0";
#      llama-server runs against this build's libraries with both variables unset, i.e. stock llama.cpp).
# If the build fails, it is built again with 0001 alone for step 2, and step 1 is skipped.
# Run from the checkout with .gpu/ holding ../shared/device's slim sdist, wheels/,
# extra-wheels/ and llama-server add-on; start it with setsid so it outlives one device call:
#   setsid bash scripts/gpu_patched_job.sh > /tmp/j.out 2>&1 < /dev/null &
# Everything goes to /tmp/j (job.log: the timeline; spec/, det/: each script's --out; DONE at the end).
set -u
T0=$(date +%s); J=/tmp/j; M=/tmp/m; W=$PWD
mkdir -p $J $M
el() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a $J/job.log; }
unset GGML_CUDA_CUBLAS_MIN_BATCH GGML_CUDA_DETERMINISTIC
python3 -m pip install -q --no-index --no-deps --target /tmp/site .gpu/wheels/*.whl .gpu/extra-wheels/*.whl > $J/pip.log 2>&1
mkdir -p /tmp/lsa && tar xJf .gpu/llama-server-*-addon.tar.xz -C /tmp/lsa
export PYTHONPATH=/tmp/site:$W/src PYTHONUNBUFFERED=1
nvidia-smi > $J/gpu.txt 2>&1; echo "cores: $(nproc)" >> $J/gpu.txt
el "setup done"

( t=$(date +%s)
  LLAMA_SDIST=$(ls $W/.gpu/llama_cpp_python-*-slim.tar.gz) LLAMA_CPP_CACHE=/tmp/lcb PIP_BUILD_ARGS=--no-build-isolation \
  CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) \
  CMAKE_ARGS="-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_NATIVE=off -DGGML_AVX2=on -DGGML_FMA=on -DGGML_F16C=on" \
  bash scripts/llama-cpp-build.sh wheel /tmp/wh > $J/build.log 2>&1
  echo "build rc=$? in $(( $(date +%s) - t )) s" >> $J/build.log ) &
BPID=$!
D8="--n-embd 4096 --n-layer 32 --n-head 32 --n-head-kv 8 --n-ff 14336 --n-vocab 128256 --type q8_0"
D1="--n-embd 2048 --n-layer 16 --n-head 32 --n-head-kv 8 --n-ff 8192 --n-vocab 32000 --type q8_0"
python3 -m llamapool.cli make-model $M/8b-peaked.gguf --peaked $D8 > $J/make-peaked.log 2>&1 &
MPID=$!
( for m in "1b $D1" "8b $D8"; do set -- $m; n=$1; shift
    python3 -m llamapool.cli make-model $M/$n.gguf "$@" && touch $M/$n.gguf.done; done ) > $J/make.log 2>&1
el "models: $(tr '\n' ' ' < $J/make.log)"
wait $MPID; el "peaked 8B written"
wait $BPID
el "$(tail -1 $J/build.log)"
PATCHED=1
if ! ls /tmp/wh/llama_cpp_python-*.whl > /dev/null 2>&1; then  # without 0002: spec_copy still runs
  el "BUILD FAILED: building again with 0001 alone; determinism skipped"; tail -30 $J/build.log >> $J/job.log
  mkdir -p /tmp/p1 && cp patches/llama.cpp/0001-*.patch /tmp/p1/ && PATCHED=0
  LLAMA_CPP_PATCHES=/tmp/p1 LLAMA_SDIST=$(ls $W/.gpu/llama_cpp_python-*-slim.tar.gz) LLAMA_CPP_CACHE=/tmp/lcb1 \
  PIP_BUILD_ARGS=--no-build-isolation CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) \
  CMAKE_ARGS="-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_NATIVE=off -DGGML_AVX2=on -DGGML_FMA=on -DGGML_F16C=on" \
  bash scripts/llama-cpp-build.sh wheel /tmp/wh > $J/build1.log 2>&1; el "build without 0002 rc=$?"
fi
python3 -m pip install -q --no-deps --target /tmp/site /tmp/wh/llama_cpp_python-*.whl >> $J/pip.log 2>&1
python3 -c "
import llama_cpp.llama_cpp as r; from pathlib import Path; from llamapool import llama_patches as p
d = Path(r._lib._name).parent
print('patch 0002 in the build:', p.deterministic_unsupported({p.DETERMINISTIC_ENV: '1'}, d) == '')" >> $J/job.log 2>&1

if [ $PATCHED = 1 ]; then
  timeout 480 python3 scripts/determinism_gpu.py --out $J/det --models $M --deadline 200 > $J/det.log 2>&1
  el "determinism_gpu rc=$?"
  cat $J/det/summary.md >> $J/job.log 2>&1
fi
timeout 460 python3 scripts/spec_copy.py --out $J/spec --logs /tmp/jlogs/spec --llama-server /tmp/lsa/llama-server \
  --model-8b $M/8b-peaked.gguf --draft-1b --deadline 400 ${SPEC_ARGS:-} > $J/spec.log 2>&1
el "spec_copy rc=$?"
for f in /tmp/jlogs/spec/*.log $J/det/logs/*.log; do [ -f "$f" ] && { echo "== $f"; tail -15 "$f"; }; done > $J/logs_tail.txt 2>&1
el "all done"
touch $J/DONE
