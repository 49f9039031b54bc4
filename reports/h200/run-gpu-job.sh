#!/usr/bin/env bash
# Issue 10 on the one-GPU kind (nvidia-h200: one H200, Python 3.12.3, torch 2.11, transformers 5.17, no
# megatron-core): the GPU job as .github/workflows/gpu.yml runs it (NCCL, one rank per GPU, the distributed
# cases only), its wall time, and the check table at CP=1 on NCCL; then the CP=2 matrix over gloo with every
# rank's tensors on the GPU (VDPCP_DEVICE=cuda). megatron-core 0.19.2, parameterized and the pinned transformers
# travel as wheels in .whl/ (see the device tool's notes); vdpcp runs from the checkout (PYTHONPATH), so its
# pytest plugin is named with -p and its implementations resolve by their shipped names. Writes under $OUT.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit
export PYTHONPATH=/tmp/site:$PWD COLUMNS=240 PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # the machine's rule
python3 -c "import torch, megatron.core, transformers; print(torch.__version__, transformers.__version__, torch.cuda.get_device_name())"
step() { echo "== $1 ($(date +%T))"; }

step "the GPU job: pytest -n 0 --backend nccl -m distributed"
start=$(date +%s)
timeout 300 python3 -m pytest -p vdpcp.pytest_plugin -n 0 --backend nccl -m distributed -q -rs \
    --junitxml="$OUT/gpu-job.xml" >"$OUT/gpu-job.txt" 2>&1
echo "rc=$? wall=$(( $(date +%s) - start )) s"; tail -4 "$OUT/gpu-job.txt"
grep -c "needs 2 GPUs\|needs 4 GPUs\|needs 8 GPUs" "$OUT/gpu-job.txt"

step "vdpcp check --backend nccl --cp 1, every shipped implementation"
timeout 120 python3 -m vdpcp check --backend nccl --cp 1 --impl reference mcore qwen2_5_vl \
    --json "$OUT/check-nccl-cp1.json" --junit-xml "$OUT/check-nccl-cp1.xml" >"$OUT/check-nccl-cp1.txt" 2>&1
echo "rc=$?"; tail -1 "$OUT/check-nccl-cp1.txt"

step "vdpcp check --backend gloo --cp 2, ranks' tensors on the GPU"
VDPCP_DEVICE=cuda timeout 150 python3 -m vdpcp check --backend gloo --cp 2 \
    --json "$OUT/check-gloo-cuda-cp2.json" >"$OUT/check-gloo-cuda-cp2.txt" 2>&1
echo "rc=$?"; tail -1 "$OUT/check-gloo-cuda-cp2.txt"
step done
