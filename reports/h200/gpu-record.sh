#!/usr/bin/env bash
# Issue 20 on the one-GPU kind (nvidia-h200: Python 3.12.3, torch 2.11.0+cu130, transformers 5.17): the GPU record,
# in two device calls of under 10 minutes each, from the repository root with `.whl` carried (megatron-core 0.19.2,
# transformers 5.23.0, parameterized, nemo-automodel 0.7.0: see reports/h200/README.md).
#   PHASE=1: what a faulted case costs (reports/h200/faulted-cost.sh), the GPU job as gpu.yml runs it (NCCL, one
#            rank per GPU, -m distributed), and `vdpcp check --backend nccl --cp 1` for every shipped subject;
#   PHASE=A: the GPU job and CP=1 on NCCL again (after the zygote learned to tolerate the CUDA driver's thread), the
#            gloo-on-CUDA matrix (every rank's tensors on the one GPU) in bf16 at CP 2 and 4 for the built-ins, and
#            vdpcp bench faults; PHASE=B: the same bf16 matrix for the third-party subjects. Each with its wall time;
#            the per-case lines give each case's seconds, so a faulted case's cost over a passing one. PHASE=C (a later
#            session): the GPU job, CP=1 on NCCL and the built-ins' bf16 matrix once MCore's groups (NCCL's too) are
#            destroyed after each case and a gloo limit of the backward is confirmed once per CP size.
# Writes under $OUT; prints a summary line per step.
set -u
PHASE=${PHASE:-1}
if [ ! -d /tmp/site ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
fi
export PYTHONPATH=/tmp/site:$PWD COLUMNS=240 PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # the machine's rule
IMPLS="reference mcore qwen2_5_vl automodel automodel-shipped"
step() { echo "== $1 ($(date +%T))"; }
python3 -c "import torch, megatron.core, transformers, nemo_automodel; print(torch.__version__, transformers.__version__, torch.cuda.get_device_name())"

job() {  # the GPU job as gpu.yml runs it, and CP=1 on NCCL for every shipped subject
    step "the GPU job: pytest -n 0 --backend nccl -m distributed"
    start=$(date +%s)
    timeout 170 python3 -m pytest -p vdpcp.pytest_plugin -n 0 --backend nccl -m distributed -q -rs \
        --junitxml="$OUT/gpu-job.xml" >"$OUT/gpu-job.txt" 2>&1
    echo "rc=$? wall=$(( $(date +%s) - start )) s"; tail -3 "$OUT/gpu-job.txt"
    grep -c "needs 2 GPUs\|needs 4 GPUs\|needs 8 GPUs" "$OUT/gpu-job.txt"

    step "vdpcp check --backend nccl --cp 1, every shipped subject"
    start=$(date +%s)
    timeout 100 python3 -m vdpcp check --backend nccl --cp 1 --impl $IMPLS \
        --json "$OUT/check-nccl-cp1.json" >"$OUT/check-nccl-cp1.txt" 2>&1
    echo "rc=$? wall=$(( $(date +%s) - start )) s"; tail -1 "$OUT/check-nccl-cp1.txt"
}

bf16() {  # the gloo-on-CUDA matrix in bf16 at CP 2 and 4; the per-case lines carry each case's seconds
    for impl in "$@"; do
        step "VDPCP_DEVICE=cuda vdpcp check --backend gloo --cp 2 4 --dtype bfloat16 --impl $impl"
        start=$(date +%s)
        VDPCP_DEVICE=cuda timeout "${BF16_S:-110}" python3 -m vdpcp check --backend gloo --cp 2 4 --dtype bfloat16 --impl $impl \
            >"$OUT/bf16-${impl// /-}.txt" 2>&1
        echo "rc=$? wall=$(( $(date +%s) - start )) s"; tail -1 "$OUT/bf16-${impl// /-}.txt"
    done
}

case "$PHASE" in
    1)  # the first call, before the zygote tolerated the CUDA driver's thread (reports/h200/issue20/README.md)
        step "faulted-cost.sh"; bash reports/h200/faulted-cost.sh | tail -40; job ;;
    A)  job; bf16 "reference mcore"
        step "vdpcp bench faults (preload as vdpcp now does it on GPUs; workers kept or re-forked)"
        timeout 100 python3 -m vdpcp bench faults --device cuda --passes 3 --repeats 2 --grace 0.1 \
            --config none/off --config none/on --config case/off --config case/on --json "$OUT/bench-faults.json" 2>&1 | tail -12 ;;
    B)  BF16_S=150 bf16 qwen2_5_vl automodel automodel-shipped ;;
    C)  # after rank workers destroy the process groups MCore made (NCCL groups too) and a gloo limit that stops
        # only the backward is confirmed once per CP size: the GPU job, CP=1 on NCCL, the built-ins' bf16 matrix
        job; bf16 "reference mcore" ;;
esac
step done
