#!/usr/bin/env bash
# Issue 46 on a GPU, the device job: build llama-cpp-python with CUDA (sm_90) and patches/llama.cpp (0002:
# GGML_CUDA_DETERMINISTIC) through scripts/llama-cpp-build.sh while the random 1B and 8B q8_0 models are
# written, then scripts/determinism_gpu.py (deterministic off and on, side by side). Run from the checkout
# with .gpu/ holding ../shared/device's slim sdist, wheels/ and extra-wheels/; start it with setsid so it
# outlives one device call (build ~4.5 min on 16 cores, 8B model 0.5-4 min); everything goes to /tmp/j.
#   setsid bash scripts/determinism_gpu_job.sh > /tmp/j.out 2>&1 < /dev/null & sleep 540; cat /tmp/j/job.log
set -u
T0=$(date +%s); J=/tmp/j; M=/tmp/m; W=$PWD
mkdir -p $J $M
el() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a $J/job.log; }
python3 -m pip install -q --no-index --no-deps --target /tmp/site .gpu/wheels/*.whl .gpu/extra-wheels/*.whl > $J/pip.log 2>&1
export PYTHONPATH=/tmp/site:$W/src PYTHONUNBUFFERED=1
nvidia-smi > $J/nvidia-smi.txt 2>&1; nproc >> $J/nvidia-smi.txt
( LLAMA_SDIST=$(ls $W/.gpu/llama_cpp_python-*-slim.tar.gz) LLAMA_CPP_CACHE=/tmp/lcb PIP_BUILD_ARGS=--no-build-isolation \
  CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) \
  CMAKE_ARGS="-DLLAVA_BUILD=off -DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_NATIVE=off -DGGML_AVX2=on -DGGML_FMA=on -DGGML_F16C=on" \
  bash scripts/llama-cpp-build.sh wheel /tmp/wh > $J/build.log 2>&1; echo "build rc=$?" >> $J/build.log ) &
BPID=$!
python3 - > $J/make.log 2>&1 <<'PY'
import sys, time
sys.path.insert(0, "scripts")
from pathlib import Path
from gpu_bench import GPU_SHAPE, SHAPE_8B
from llamapool.modelgen import make_model
for name, dims in (("1b", GPU_SHAPE), ("8b", SHAPE_8B)):
    t = time.monotonic()
    make_model(f"/tmp/m/{name}.gguf", **dims)
    Path(f"/tmp/m/{name}.gguf.done").touch()
    print(name, round(time.monotonic() - t, 1), "s", flush=True)
PY
el "models: $(tr '\n' ' ' < $J/make.log)"
wait $BPID
el "$(tail -1 $J/build.log)"
python3 -m pip install -q --no-deps --target /tmp/site /tmp/wh/llama_cpp_python-*.whl >> $J/pip.log 2>&1
python3 -c "
import llama_cpp.llama_cpp as r; from pathlib import Path; from llamapool import llama_patches as p
d = Path(r._lib._name).parent
print('patch 0002 in the build:', p.deterministic_unsupported({p.DETERMINISTIC_ENV: '1'}, d) == '')" >> $J/job.log 2>&1
timeout 900 python3 scripts/determinism_gpu.py --out $J/det --models $M --deadline 1200 > $J/det.log 2>&1
el "determinism_gpu rc=$?"
cat $J/det/summary.md >> $J/job.log 2>&1
el "all done"
