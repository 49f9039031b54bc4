#!/usr/bin/env bash
# Sixteenth session's device calls: two, on one H100 80GB, the machine warm between them, carry [".whl"], from the
# working tree at 058bcb8 (the device's copy reported its git HEAD as b69661d; the files were the working tree's).
# Eighteen earlier calls that session got no machine (H200 with needs_h200, then H100). The first call's limit was
# set by the device time left: REAL_S=440 cut the bf16 selection after 149 of its 163 cases.
# First call:
#   set -o pipefail; nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; git log --oneline -1
#   REAL_S=440 scripts/gpu-record.sh --out $OUT real > $OUT/gpu-record-stdout.txt 2>&1
# Second call (gpu-record.sh had installed the wheels into /tmp/site):
export PYTHONPATH=$PWD:/tmp/site CUBLAS_WORKSPACE_CONFIG=:4096:8 VDPCP_DEVICE=cuda COLUMNS=240
timeout 250 python3 -m vdpcp bench towers --cp 2 --dtype float32 --backend gloo --impl reference mcore \
    --json $OUT/real-float32-cp2-ref-mcore.json > $OUT/real-float32-cp2-ref-mcore.txt 2>&1
