#!/usr/bin/env bash
# session 6 job NN (issue 31): the daemon at 8B: before (keeping) / after (on_refusal, held masks) / nohold (on_refusal, retry only)
. scripts/gpu_env.sh
R=/tmp/r; rm -rf $R; G=/tmp/gm; mkdir -p $G $R "$OUT" /tmp/before /tmp/nohold; tar xzf .gpu/before_src.tgz -C /tmp/before; tar xzf .gpu/nohold_src.tgz -C /tmp/nohold
T0=$(date +%s)
[ -f $G/r8b.gguf ] || { python3 -m llamapool.cli make-model $G/r8b.gguf --n-embd 4096 --n-layer 32 --n-head 32 --n-head-kv 8 --n-ff 14336 --n-vocab 128256 --type q8_0 > /dev/null; }
echo "gen $(( $(date +%s) - T0 )) s"
timeout 400 python3 scripts/bench_sampling.py --gpu --model $G/r8b.gguf --src before=/tmp/before/src --src after=src --src nohold=/tmp/nohold/src --repeats 1 \
  --concurrency 64 --requests 128 --prompt-tokens 128 --gen-tokens 128 --threads 8 \
  --rows plain,json,plain_beside_short,plain_beside_json --out "$R/sampling8b.jsonl" > "$R/sampling8b.log" 2>&1
echo "sampling8b $(( $(date +%s) - T0 )) s"; tail -4 "$R/sampling8b.log"
python3 - <<'PY'
import json
for l in open('/tmp/r/sampling8b.jsonl'):
    d=json.loads(l)
    if 'src' not in d: continue
    print(d['src'], {k:(v['tok_s'], v['steps'], v['host_ms_step'], v['decode_ms_step']) for k,v in d.items() if isinstance(v, dict) and 'tok_s' in v})
PY
tar czf "$OUT/jobNN.tgz" -C /tmp r 2>/dev/null
