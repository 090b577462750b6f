#!/usr/bin/env bash
# Issue 25, device job 1: the 8B models, the prefill sweep (llama.cpp alone), llamapool rag at the
# default n_ubatch and at the sweep's best, and the F16 (cuBLAS) lever. Everything goes to $OUT.
# llamapool itself runs from a snapshot of commit 89f40dc (.gpu/issue25-snap-89f40dc.tgz: src/ and
# scripts/gpu_bench.py), the last commit whose serve path ran here when the job was made.
# Made (git-ignored, carried with .gpu) by:
#   git archive --prefix=snap/ 89f40dc src scripts/gpu_bench.py scripts/gpu_env.sh | gzip -9 > .gpu/issue25-snap-89f40dc.tgz
# CPUTEST=1: the same steps on the CPU with the tiny shape (checks the script).
set -u
T0=$(date +%s)
left() { echo $(( T0 + $1 - $(date +%s) )); }   # seconds until T0 + $1
S=$PWD/scripts/prefill_sweep.py
M=${MODELS:-/tmp/m}; J=$OUT/sweep.jsonl
tar xzf .gpu/issue25-snap-89f40dc.tgz -C /tmp
if [ "${CPUTEST:-0}" = 1 ]; then
  export PYTHONPATH=/tmp/snap/src:${PYTHONPATH:-}
  SH=tiny; SW="--cpu -B 8 -P 128 --decode-steps 4"; GB="--cpu --concurrency 4 --procs 2 --requests 8"; TH=2
else
  . scripts/gpu_env.sh >/dev/null && export PYTHONPATH=/tmp/site:/tmp/snap/src
  nvidia-smi > $OUT/nvidia-smi.txt 2>&1
  nvidia-smi -q -d CLOCK,POWER > $OUT/nvidia-smi-q.txt 2>&1
  SH=8b; SW=""; GB="--requests 128"; TH=16
fi
echo "setup done at $(( $(date +%s) - T0 )) s"
timeout $(left 240) python3 $S make --dir $M --shape $SH --q4km --threads $TH --jsonl $OUT/make.jsonl > $OUT/make.log 2>&1
echo "models done at $(( $(date +%s) - T0 )) s (rc $?)"; ls -la $M
timeout $(left 330) python3 $S sweep $SW --model $M/m$SH-q8_0.gguf --label q8_0 --jsonl $J --deadline $(( T0 + 320 )) \
  ub=1024 ub=512 ub=2048 ub=4096 ub=1024,nb=2112 ub=2048,nb=8256 ub=4096,nb=8256 ub=1024,fa=0 \
  ub=1024,kv=q8_0 ub=4096,kv=q8_0 ub=1024 > $OUT/sweep-q8_0.log 2>&1
echo "q8_0 sweep done at $(( $(date +%s) - T0 )) s"
timeout $(left 390) python3 $S sweep $SW --model $M/m$SH-Q4_K_M.gguf --label Q4_K_M --jsonl $J --deadline $(( T0 + 385 )) \
  ub=1024 ub=512 ub=2048 ub=4096 ub=4096,nb=8256 ub=1024,kv=q8_0 > $OUT/sweep-Q4_K_M.log 2>&1
echo "Q4_K_M sweep done at $(( $(date +%s) - T0 )) s"
BEST=$(python3 $S best $J --label q8_0); [ "$BEST" = 1024 ] && BEST=2048
echo "llamapool rag: n_ubatch 1024 and $BEST"
timeout $(left 480) python3 /tmp/snap/scripts/gpu_bench.py $GB --out $OUT/lp-rag-q8_0 --model $M/m$SH-q8_0.gguf \
  --workloads rag --sweep n_ubatch=1024,$BEST > $OUT/lp-rag-q8_0.log 2>&1
echo "llamapool rag done at $(( $(date +%s) - T0 )) s"
if [ $(left 545) -gt 50 ]; then
  timeout $(left 510) python3 $S make --dir $M --shape $SH --f16 --threads $TH --jsonl $OUT/make.jsonl >> $OUT/make.log 2>&1
  timeout $(left 548) python3 $S sweep $SW --model $M/m$SH-F16.gguf --label F16 --jsonl $J --deadline $(( T0 + 545 )) \
    ub=1024 ub=4096 > $OUT/sweep-F16.log 2>&1
fi
echo "all done at $(( $(date +%s) - T0 )) s"
python3 $S table $J > $OUT/sweep.md; cat $OUT/sweep.md; cat $OUT/lp-rag-q8_0/summary.md 2>/dev/null
grep -h '"mode": "make"' $OUT/make.jsonl
