#!/usr/bin/env bash
# Source on the GPU machine (see ../shared/device/README.md): unpacks the CUDA build of llama_cpp
# and the wheels from .gpu/ into /tmp/site once, and puts them and src/ on PYTHONPATH; unpacks the
# llama-server add-on into /tmp/lsa when .gpu/ has it.
if [ ! -d /tmp/site/llama_cpp ]; then
  mkdir -p /tmp/site && tar xJf .gpu/llama_cpp-0.3.36-cuda-sm90.tar.xz -C /tmp/site &&
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .gpu/wheels/*.whl
fi
# the peer, llama-server, when the add-on is there (gpu_bench.py --llama-server /tmp/lsa/llama-server)
if [ ! -x /tmp/lsa/llama-server ] && ls .gpu/llama-server-*-addon.tar.xz >/dev/null 2>&1; then
  mkdir -p /tmp/lsa && tar xJf .gpu/llama-server-*-addon.tar.xz -C /tmp/lsa
fi
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1
