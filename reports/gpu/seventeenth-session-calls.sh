#!/usr/bin/env bash
# Seventeenth session's device calls that ran: two, on one H100 80GB, the machine warm between them, carry
# [".whl", "scratch"], from the working tree at 17524ab. Before them: two H200 calls (needs_h200) and one H100 call got
# no machine or lost it mid-run.
# First call:
#   set -o pipefail; nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
#   REAL_S=545 scripts/gpu-record.sh --out $OUT real > $OUT/gpu-record-stdout.txt 2>&1
# Second call: bash scratch/call2.sh, which was this (gpu-record.sh had installed the wheels into /tmp/site). Its
# "base" runs were meant to run 232f58a's vdpcp from scratch/base, but `python3 -m` puts the current folder first on
# sys.path, ahead of PYTHONPATH, so every run imported the checkout's vdpcp (the probe printed "base True"): four runs
# of one code, kept as a measure of the run-to-run spread, not as an A/B.
export CUBLAS_WORKSPACE_CONFIG=:4096:8 VDPCP_DEVICE=cuda COLUMNS=240 PYTHONUNBUFFERED=1
i=0
for run in base head base head; do
  i=$((i+1))
  if [ $run = base ]; then export PYTHONPATH=$PWD/scratch/base:$PWD:/tmp/site; else export PYTHONPATH=$PWD:/tmp/site; fi
  python3 -c "import vdpcp.oracle.observe.reads as r; print('$run', hasattr(r, '_names'))"
  timeout 120 python3 -m vdpcp bench towers --cp 2 --dtype bfloat16 --backend gloo -k three-images \
      --json $OUT/three-images-cp2-$i-$run.json > $OUT/three-images-cp2-$i-$run.txt 2>&1
done
export PYTHONPATH=$PWD:/tmp/site
timeout 250 python3 -m vdpcp bench towers --cp 2 --dtype float32 --backend gloo --impl reference mcore nemotron-omni \
    --json $OUT/real-float32-cp2.json > $OUT/real-float32-cp2.txt 2>&1
