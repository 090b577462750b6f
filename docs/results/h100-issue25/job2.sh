#!/usr/bin/env bash
# Issue 25, device job 2: llamapool against llama-server and llama.cpp alone (the ceiling) at 8B, rag and
# short, q8_0 and Q4_K_M, at the defaults (n_ubatch 1024, max_batch_tokens auto = 4096) and at the
# sweep's best (n_ubatch 4096, max_batch_tokens 8192); then the lever the sweep pointed at, F16 weights
# (dense cuBLAS GEMMs instead of the quantised MMQ kernels), rag side by side.
# llamapool runs from the snapshot of commit 89f40dc (see job1.sh). All output: $OUT/all.tgz + job2.log.
# CPUTEST=1: the same steps on the CPU with the tiny shape and no peer (checks the script).
set -u
T0=$(date +%s)
left() { echo $(( T0 + $1 - $(date +%s) )); }
S=$PWD/scripts/prefill_sweep.py
M=${MODELS:-/tmp/m}; W=/tmp/w25; rm -rf $W; mkdir -p $W
pack() { tar czf $OUT/all.tgz -C $W . ; }
tar xzf .gpu/issue25-snap-89f40dc.tgz -C /tmp
GBP=/tmp/snap/scripts/gpu_bench.py
if [ "${CPUTEST:-0}" = 1 ]; then
  export PYTHONPATH=/tmp/snap/src:${PYTHONPATH:-}
  SH=tiny; GB="--cpu --concurrency 4 --procs 2 --requests 8"; PEER=""; TH=2
else
  . scripts/gpu_env.sh >/dev/null && export PYTHONPATH=/tmp/site:/tmp/snap/src
  nvidia-smi > $W/nvidia-smi.txt 2>&1
  SH=8b; GB="--requests 128"; PEER="--llama-server /tmp/lsa/llama-server"; TH=16
fi
BEST="n_ubatch = 4096;max_batch_tokens = 8192"
echo "setup done at $(( $(date +%s) - T0 )) s"
timeout $(left 200) python3 $S make --dir $M --shape $SH --q4km --f16 --threads $TH --jsonl $W/make.jsonl > $W/make.log 2>&1
echo "models done at $(( $(date +%s) - T0 )) s"; ls -la $M; pack
for Q in q8_0 Q4_K_M; do
  [ $Q = q8_0 ] && END1=290 END2=340 || END1=460 END2=505
  timeout $(left $END1) python3 $GBP $GB $PEER --out $W/$Q-default --model $M/m$SH-$Q.gguf --workloads rag short \
    --ceiling-ubatch 1024 > $W/$Q-default.log 2>&1
  echo "$Q default side by side done at $(( $(date +%s) - T0 )) s"; pack
  timeout $(left $END2) python3 $GBP $GB --out $W/$Q-best --model $M/m$SH-$Q.gguf --workloads rag short \
    --no-peer --no-ceiling --extra "$BEST" > $W/$Q-best.log 2>&1
  echo "$Q best (llamapool: $BEST) done at $(( $(date +%s) - T0 )) s"; pack
done
if [ $(left 588) -gt 40 ]; then
  timeout $(left 588) python3 $GBP $GB $PEER --out $W/F16-default --model $M/m$SH-F16.gguf --workloads rag short \
    --ceiling-ubatch 1024 > $W/F16-default.log 2>&1
  echo "F16 side by side done at $(( $(date +%s) - T0 )) s"; pack
fi
for d in $W/*/; do echo "== $d"; cat $d/summary.md 2>/dev/null; done
echo "all done at $(( $(date +%s) - T0 )) s"
