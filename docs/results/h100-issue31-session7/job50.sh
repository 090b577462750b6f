#!/usr/bin/env bash
# session 7 job RR (issue 31): 8B, head (6c406af) / new (2cecab5) / v4 (executor of 4 threads)
. scripts/gpu_env.sh
R=/tmp/r; rm -rf $R; G=/tmp/gm; mkdir -p $G $R "$OUT" /tmp/t/head /tmp/t/v4
tar xzf .gpu/head_src.tgz -C /tmp/t/head; tar xzf .gpu/v4_src.tgz -C /tmp/t/v4
T0=$(date +%s)
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > $R/gpu.txt; nproc >> $R/gpu.txt
[ -f $G/r8b.gguf ] || setsid nohup bash -c "python3 -m llamapool.cli make-model $G/r8b.gguf.tmp --n-embd 4096 --n-layer 32 --n-head 32 --n-head-kv 8 --n-ff 14336 --n-vocab 128256 --type q8_0 && mv $G/r8b.gguf.tmp $G/r8b.gguf; echo done \$(date +%s) > $G/r8b.done" > $G/gen.log 2>&1 < /dev/null &
[ -f $G/r1b.gguf ] || python3 -m llamapool.cli make-model $G/r1b.gguf --n-embd 2048 --n-layer 16 --n-head 32 --n-head-kv 8 --n-ff 8192 --n-vocab 32000 --type q8_0 > /dev/null
echo "gen1b $(( $(date +%s) - T0 )) s"
[ -f $G/r8b.gguf ] || { python3 -m llamapool.cli make-model $G/r8b.gguf --n-embd 4096 --n-layer 32 --n-head 32 --n-head-kv 8 --n-ff 14336 --n-vocab 128256 --type q8_0 > /dev/null; }
for i in $(seq 120); do [ -f $G/r8b.gguf ] && break; sleep 1; done
echo "gen8b $(( $(date +%s) - T0 )) s"
timeout 480 python3 scripts/bench_sampling.py --gpu --model $G/r8b.gguf --src head=/tmp/t/head/src --src new=src --src v4=/tmp/t/v4/src --repeats 2 \
  --concurrency 64 --requests 192 --prompt-tokens 128 --gen-tokens 128 --threads 8 \
  --rows plain,json,plain_beside_short,plain_beside_json --out "$R/s1b.jsonl" > "$R/s1b.log" 2>&1
echo "s8b $(( $(date +%s) - T0 )) s"; grep -E "^(head|new|v4) " "$R/s1b.log"
python3 - <<'PY'
import json
for l in open('/tmp/r/s1b.jsonl'):
    d=json.loads(l)
    if 'src' not in d: continue
    print(d['src'], d['repeat'], {k:(v['tok_s'], v['steps'], v['host_ms_step'], v['decode_ms_step'], v['cpu_us_token']['worker']) for k,v in d.items() if isinstance(v, dict) and 'tok_s' in v}, d.get('ratios'))
PY
cat $G/gen.log; ls -la $G
tar czf "$OUT/jobRR.tgz" -C /tmp r 2>/dev/null
