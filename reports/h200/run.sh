#!/usr/bin/env bash
# The one-GPU run of issue 7, as sent to the device tool's nvidia-h200 machine (Python 3.12.3, torch 2.11,
# no megatron-core: its wheel and parameterized's are carried in .devdeps/). Writes the record under $OUT:
#   nccl-cp1.{txt,xml}       vdpcp check at CP=1 on NCCL (one GPU, one rank)
#   gloo-cuda.{txt,xml}      vdpcp check, the whole matrix on gloo, every rank's tensors on the one GPU
#   pytest-gloo-cuda.xml     pytest tests/distributed on gloo with CUDA tensors (matrix + group mismatch + no-op)
#   bf16-gloo-cuda.md        the matrix again at bf16 (reports/h200/check_table.py)
#   gpu-procs.txt            processes on the GPU, sampled, to show the gloo ranks really ran there
set -u
pip install -q --no-deps --target /tmp/deps .devdeps/*.whl
export PYTHONPATH=/tmp/deps:$PWD COLUMNS=220
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # the machine's rule
python3 -c "import torch, megatron.core; print(torch.__version__, torch.cuda.get_device_name())"
(for _ in $(seq 60); do echo "$(date +%T) $(nvidia-smi --query-compute-apps=pid --format=csv,noheader | wc -l)"; sleep 10; done) >"$OUT/gpu-procs.txt" &
sampler=$!
step() { echo "== $1 ($(date +%T))"; }

step "CP=1 on NCCL"
timeout 90 python3 -m vdpcp check --cp 1 --backend nccl --junit-xml "$OUT/nccl-cp1.xml" >"$OUT/nccl-cp1.txt" 2>/tmp/nccl.err
echo "rc=$?"; tail -3 "$OUT/nccl-cp1.txt"; tail -5 /tmp/nccl.err

step "matrix on gloo, CUDA tensors"
VDPCP_DEVICE=cuda timeout 190 python3 -m vdpcp check --backend gloo --junit-xml "$OUT/gloo-cuda.xml" >"$OUT/gloo-cuda.txt" 2>/tmp/gloo.err
echo "rc=$?"; tail -3 "$OUT/gloo-cuda.txt"; tail -5 /tmp/gloo.err

step "pytest tests/distributed on gloo, CUDA tensors"
VDPCP_DEVICE=cuda timeout 140 python3 -m pytest -n 2 -q tests/distributed --backend gloo --junitxml="$OUT/pytest-gloo-cuda.xml" 2>&1 | tail -15

step "matrix at bf16 on gloo, CUDA tensors"
VDPCP_DEVICE=cuda timeout 100 python3 reports/h200/check_table.py --backend gloo --dtype bfloat16 >"$OUT/bf16-gloo-cuda.md" 2>/tmp/bf16.err
echo "rc=$?"; tail -2 "$OUT/bf16-gloo-cuda.md"; tail -5 /tmp/bf16.err

kill "$sampler"
step done
