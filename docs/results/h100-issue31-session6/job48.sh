#!/usr/bin/env bash
# session 6 job PP (issue 31): 8B before/after again (2 repeats, with logprobs 5); 1B logprobs rows on the final code
. scripts/gpu_env.sh
R=/tmp/r; rm -rf $R; G=/tmp/gm; mkdir -p $G $R "$OUT" /tmp/before; tar xzf .gpu/before_src.tgz -C /tmp/before
T0=$(date +%s)
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > $R/gpu.txt
( [ -f $G/r8b.gguf ] || { python3 -m llamapool.cli make-model $G/r8b.gguf.tmp --n-embd 4096 --n-layer 32 --n-head 32 --n-head-kv 8 --n-ff 14336 --n-vocab 128256 --type q8_0 && mv $G/r8b.gguf.tmp $G/r8b.gguf; }; echo "r8b $(( $(date +%s) - T0 )) s" ) > "$R/gen.log" 2>&1 &
[ -f $G/r1b.gguf ] || python3 -m llamapool.cli make-model $G/r1b.gguf --n-embd 2048 --n-layer 16 --n-head 32 --n-head-kv 8 --n-ff 8192 --n-vocab 32000 --type q8_0 > /dev/null
timeout 120 python3 scripts/bench_sampling.py --gpu --model $G/r1b.gguf --src after=src --repeats 1 \
  --concurrency 64 --requests 128 --prompt-tokens 128 --gen-tokens 128 --threads 8 \
  --rows plain,logprobs5,sdk_plain,sdk_logprobs20,json,plain_beside_short,plain_beside_json --out "$R/lp1b.jsonl" > "$R/lp1b.log" 2>&1
echo "lp1b $(( $(date +%s) - T0 )) s"; tail -2 "$R/lp1b.log"
wait
timeout 300 python3 scripts/bench_sampling.py --gpu --model $G/r8b.gguf --src before=/tmp/before/src --src after=src --repeats 2 \
  --concurrency 64 --requests 128 --prompt-tokens 128 --gen-tokens 128 --threads 8 \
  --rows plain,json,plain_beside_short,plain_beside_json,logprobs5 --out "$R/sampling8b.jsonl" > "$R/sampling8b.log" 2>&1
echo "sampling8b $(( $(date +%s) - T0 )) s"; grep -E "^(before|after) " "$R/sampling8b.log"
for f in lp1b sampling8b; do python3 - $f <<'PY'
import json, sys
for l in open(f'/tmp/r/{sys.argv[1]}.jsonl'):
    d=json.loads(l)
    if 'src' not in d: continue
    print(sys.argv[1], d['src'], d['repeat'], {k:(v['tok_s'], v['steps'], v['host_ms_step'], v['decode_ms_step']) for k,v in d.items() if isinstance(v, dict) and 'tok_s' in v}, d.get('ratios'))
PY
done
cat $R/gen.log
tar czf "$OUT/jobPP.tgz" -C /tmp r 2>/dev/null
