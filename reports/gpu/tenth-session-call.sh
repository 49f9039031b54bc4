#!/usr/bin/env bash
# GPU call: the reference at the real size, bf16 CP 2, the working tree then the base (7b3dc03) on one machine;
# then the reference's real-size sensitivity on the working tree.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export CUBLAS_WORKSPACE_CONFIG=:4096:8 NCCL_NVLS_ENABLE=0 VDPCP_DEVICE=cuda PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
mkdir -p /tmp/base && tar xzf scratch/base-7b3dc03.tar.gz -C /tmp/base
B="python3 -m vdpcp bench towers --cp 2 --dtype bfloat16 --backend gloo --impl reference"
echo "== new reference $(git rev-parse --short HEAD)"; PYTHONPATH=$PWD:/tmp/site timeout 75 $B 2>&1 | tee $OUT/ref-new.txt | tail -4
echo "== base reference 7b3dc03"; (cd /tmp/base && PYTHONPATH=/tmp/base:/tmp/site timeout 75 $B 2>&1) | tee $OUT/ref-base.txt | tail -4
echo "== new sensitivity"; PYTHONPATH=$PWD:/tmp/site timeout 70 python3 -m vdpcp bench sensitivity --tower real --cp 2 --dtype bfloat16 -k multi-image --backend gloo --impl reference --grid 1e-9 1e-3 2>&1 | tee $OUT/sens-new.txt | tail -5
