#!/usr/bin/env bash
# Source on the GPU machine (see ../shared/device/README.md): unpacks the CUDA build of llama_cpp
# and the wheels from .gpu/ into /tmp/site once, and puts them and src/ on PYTHONPATH; unpacks the
# llama-server add-on into /tmp/lsa when .gpu/ has it.
if [ ! -d /tmp/site/llama_cpp ]; then
  mkdir -p /tmp/site && tar xJf .gpu/llama_cpp-0.3.36-cuda-sm90.tar.xz -C /tmp/site &&
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .gpu/wheels/*.whl
  # what the GPU machine lacks for chat templates and the HTTP gateway, fetched beforehand with:
  # pip download -d .gpu/extra-wheels --python-version 3.12 --platform manylinux2014_x86_64 \
  #   --only-binary=:all: jinja2 markupsafe starlette uvicorn httptools anyio sniffio idna typing_extensions h11 click
  if ls .gpu/extra-wheels/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .gpu/extra-wheels/*.whl
  fi
fi
# the peer, llama-server, when the add-on is there (gpu_bench.py --llama-server /tmp/lsa/llama-server)
if [ ! -x /tmp/lsa/llama-server ] && ls .gpu/llama-server-*-addon.tar.xz >/dev/null 2>&1; then
  mkdir -p /tmp/lsa && tar xJf .gpu/llama-server-*-addon.tar.xz -C /tmp/lsa
fi
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1
