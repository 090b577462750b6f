source scripts/gpu_env.sh >/dev/null 2>&1
sed -e 's#^here=.*#here=$PWD/.gpu#' -e 's/-DGGML_F16C=on"/-DGGML_F16C=on -DGGML_CUDA_FORCE_CUBLAS=on"/' .gpu/build_cuda_wheel.sh > /tmp/bcu.sh
t0=$(date +%s); bash /tmp/bcu.sh > $OUT/build.log 2>&1; echo "build rc=$? in $(( $(date +%s)-t0 )) s"
mkdir -p /tmp/site2 && python3 -m pip install -q --no-deps --target /tmp/site2 /tmp/wh/*.whl > /dev/null 2>&1; ls /tmp/site2 | head -3
t0=$(date +%s); PYTHONPATH=/tmp/site:src python3 scripts/prefill_sweep.py make --dir /tmp/m --shape 8b --jsonl $OUT/o.jsonl > $OUT/make.log 2>&1; echo "make rc=$? in $(( $(date +%s)-t0 )) s"; ls /tmp/m
M=$(ls /tmp/m/*q8_0*.gguf | head -1)
PYTHONPATH=/tmp/site:src python3 scripts/prefill_sweep.py sweep --model $M --label q8_0-default --jsonl $OUT/o.jsonl ub=1024 ub=4096,nb=8256 > $OUT/s1.log 2>&1; echo "s1 rc=$?"
PYTHONPATH=/tmp/site2:/tmp/site:src python3 scripts/prefill_sweep.py sweep --model $M --label q8_0-force-cublas --jsonl $OUT/o.jsonl ub=1024 ub=4096,nb=8256 > $OUT/s2.log 2>&1; echo "s2 rc=$?"
PYTHONPATH=src python3 scripts/prefill_sweep.py table $OUT/o.jsonl 2>&1 | tail -8
