#!/usr/bin/env bash
# session 7 job UU (issue 31): the engine in-process, JSON only, where a step's time goes (graph_mask_check.py, with retry_only)
. scripts/gpu_env.sh
R=/tmp/r; rm -rf $R; G=/tmp/gm; mkdir -p $G $R "$OUT"
T0=$(date +%s)
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > $R/gpu.txt; nproc >> $R/gpu.txt
[ -f $G/r8b.gguf ] || setsid nohup bash -c "python3 -m llamapool.cli make-model $G/r8b.gguf.tmp --n-embd 4096 --n-layer 32 --n-head 32 --n-head-kv 8 --n-ff 14336 --n-vocab 128256 --type q8_0 && mv $G/r8b.gguf.tmp $G/r8b.gguf" > $G/gen.log 2>&1 < /dev/null &
[ -f $G/r1b.gguf ] || python3 -m llamapool.cli make-model $G/r1b.gguf --n-embd 2048 --n-layer 16 --n-head 32 --n-head-kv 8 --n-ff 8192 --n-vocab 32000 --type q8_0 > /dev/null
echo "gen1b $(( $(date +%s) - T0 )) s"
timeout 200 python3 scripts/graph_mask_check.py $G/r1b.gguf --concurrency 64 --gen-tokens 128 --kinds json > $R/mask1b.json 2> $R/mask1b.log
echo "mask1b $(( $(date +%s) - T0 )) s rc $?"
for i in $(seq 150); do [ -f $G/r8b.gguf ] && break; sleep 1; done
timeout 300 python3 scripts/graph_mask_check.py $G/r8b.gguf --concurrency 64 --gen-tokens 128 --kinds json > $R/mask8b.json 2> $R/mask8b.log
echo "mask8b $(( $(date +%s) - T0 )) s"
for f in mask1b mask8b; do python3 - $f <<'PY'
import json, sys
try:
    d = json.load(open(f'/tmp/r/{sys.argv[1]}.json'))
except Exception as e:
    print(sys.argv[1], 'no result', e); raise SystemExit
print(sys.argv[1], 'same', d['same_text_as_keeping'], d['same_text_mixed'], 'retries', d['retries'])
for k in d['tok_s']:
    print(f"  {k:22s} {d['tok_s'][k]:8.1f} tok/s  {d['ms_step'][k]:7.3f} ms  gap/call/wait/after {d['gap_call_wait_after_ms'][k]}")
print({k: v for k, v in d.items() if k.endswith('_of_plain')})
PY
done
tail -3 $R/mask1b.log $R/mask8b.log
tar czf "$OUT/jobUU.tgz" -C /tmp r 2>/dev/null
