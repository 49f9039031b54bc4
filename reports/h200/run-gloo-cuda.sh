#!/usr/bin/env bash
# Second one-GPU call: the whole matrix on gloo with every rank's tensors on the one H200 (VDPCP_DEVICE=cuda),
# less the cases a known upstream limit fails (gloo-known-limits.txt: each costs a pool rebuild with a fresh
# megatron import, about 9 s here, which the first call's 190 s could not fit). pytest writes the JUnit XML;
# check_table.py the table, in parallel with it. Record under $OUT (packed in one archive: 8 files come back).
set -u
pip install -q --no-deps --target /tmp/deps .devdeps/*.whl
export PYTHONPATH=/tmp/deps:$PWD VDPCP_DEVICE=cuda
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # the machine's rule
mkdir -p /tmp/rec
(for _ in $(seq 50); do echo "$(date +%T) $(nvidia-smi --query-compute-apps=pid --format=csv,noheader | wc -l)"; sleep 10; done) >/tmp/rec/gpu-procs.txt &
sampler=$!
timeout 420 python3 -m pytest -n 2 -q tests/distributed --backend gloo --junitxml=/tmp/rec/pytest-gloo-cuda.xml \
    $(cat reports/h200/gloo-known-limits.txt) >/tmp/rec/pytest-gloo-cuda.txt 2>&1 &
tests=$!
timeout 420 python3 reports/h200/check_table.py --backend gloo --skip-known-limits >/tmp/rec/check-gloo-cuda-float64.md 2>/tmp/table.err
echo "table rc=$?"; tail -4 /tmp/rec/check-gloo-cuda-float64.md | cut -c1-600; tail -3 /tmp/table.err
wait $tests; echo "pytest rc=$?"; tail -8 /tmp/rec/pytest-gloo-cuda.txt
kill $sampler
tar czf "$OUT/gloo-cuda-record.tgz" -C /tmp/rec .
