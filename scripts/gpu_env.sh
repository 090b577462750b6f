#!/usr/bin/env bash
# Source on the GPU machine (see ../shared/device/README.md): unpacks the CUDA build of llama_cpp
# and the wheels from .gpu/ into /tmp/site once, and puts them and src/ on PYTHONPATH.
if [ ! -d /tmp/site/llama_cpp ]; then
  mkdir -p /tmp/site && tar xJf .gpu/llama_cpp-0.3.36-cuda-sm90.tar.xz -C /tmp/site &&
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .gpu/wheels/*.whl
fi
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1
