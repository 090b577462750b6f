#!/usr/bin/env bash
# session 6 job OO (issue 31): the daemon before (keeping) / after (on_refusal with narrow masks applied), 1B and 8B, 2 repeats
. scripts/gpu_env.sh
R=/tmp/r; rm -rf $R; G=/tmp/gm; mkdir -p $G $R "$OUT" /tmp/before; tar xzf .gpu/before_src.tgz -C /tmp/before
T0=$(date +%s)
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > $R/gpu.txt
( [ -f $G/r8b.gguf ] || { python3 -m llamapool.cli make-model $G/r8b.gguf.tmp --n-embd 4096 --n-layer 32 --n-head 32 --n-head-kv 8 --n-ff 14336 --n-vocab 128256 --type q8_0 && mv $G/r8b.gguf.tmp $G/r8b.gguf; }; echo "r8b $(( $(date +%s) - T0 )) s" ) > "$R/gen.log" 2>&1 &
[ -f $G/r1b.gguf ] || python3 -m llamapool.cli make-model $G/r1b.gguf --n-embd 2048 --n-layer 16 --n-head 32 --n-head-kv 8 --n-ff 8192 --n-vocab 32000 --type q8_0 > /dev/null
echo "gen1b $(( $(date +%s) - T0 )) s"
for m in 1b 8b; do
  [ $m = 8b ] && wait
  timeout 250 python3 scripts/bench_sampling.py --gpu --model $G/r$m.gguf --src before=/tmp/before/src --src after=src --repeats 2 \
    --concurrency 64 --requests 128 --prompt-tokens 128 --gen-tokens 128 --threads 8 \
    --rows plain,json,plain_beside_short,plain_beside_json --out "$R/sampling$m.jsonl" > "$R/sampling$m.log" 2>&1
  echo "sampling$m $(( $(date +%s) - T0 )) s"; grep -E "^(before|after) " "$R/sampling$m.log"
  python3 - $m <<'PY'
import json, sys
for l in open(f'/tmp/r/sampling{sys.argv[1]}.jsonl'):
    d=json.loads(l)
    if 'src' not in d: continue
    print(d['src'], d['repeat'], {k:(v['tok_s'], v['steps'], v['host_ms_step'], v['decode_ms_step']) for k,v in d.items() if isinstance(v, dict) and 'tok_s' in v})
PY
done
cat $R/gen.log
tar czf "$OUT/jobOO.tgz" -C /tmp r 2>/dev/null
