#!/usr/bin/env bash
# session 6 job MM (issue 31): constrained greedy rows "on_refusal" at 1B: the engine's three ways, and the daemon before/after
. scripts/gpu_env.sh
R=/tmp/r; rm -rf $R; G=/tmp/gm; mkdir -p $G $R "$OUT" /tmp/before; tar xzf .gpu/before_src.tgz -C /tmp/before
T0=$(date +%s)
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > $R/gpu.txt
( [ -f $G/r8b.gguf ] || { python3 -m llamapool.cli make-model $G/r8b.gguf.tmp --n-embd 4096 --n-layer 32 --n-head 32 --n-head-kv 8 --n-ff 14336 --n-vocab 128256 --type q8_0 && mv $G/r8b.gguf.tmp $G/r8b.gguf; }; echo "r8b $(( $(date +%s) - T0 )) s" ) > "$R/gen.log" 2>&1 &
[ -f $G/r1b.gguf ] || python3 -m llamapool.cli make-model $G/r1b.gguf --n-embd 2048 --n-layer 16 --n-head 32 --n-head-kv 8 --n-ff 8192 --n-vocab 32000 --type q8_0 > /dev/null
echo "gen1b $(( $(date +%s) - T0 )) s"
timeout 170 python3 scripts/graph_mask_check.py $G/r1b.gguf --concurrency 64 > $R/mask1b.log 2>&1
echo "mask1b $(( $(date +%s) - T0 )) s"; tail -2 $R/mask1b.log
timeout 330 python3 scripts/bench_sampling.py --gpu --model $G/r1b.gguf --src before=/tmp/before/src --src after=src --repeats 1 \
  --concurrency 64 --requests 128 --prompt-tokens 128 --gen-tokens 128 --threads 8 \
  --rows plain,json,plain_beside_short,plain_beside_json --out "$R/sampling1b.jsonl" > "$R/sampling1b.log" 2>&1
echo "sampling1b $(( $(date +%s) - T0 )) s"; tail -14 "$R/sampling1b.log"
cat $R/gen.log
tar czf "$OUT/jobMM.tgz" -C /tmp r 2>/dev/null; ls -la "$OUT"
