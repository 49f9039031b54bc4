#!/usr/bin/env bash
# The GPU record (reports/gpu/README.md): each of its figures, measured on a GPU machine, one step per figure.
# Every step runs the vdpcp CLI (python3 -m vdpcp, as vdpcp need not be installed there) or pytest, writes the raw
# file the record points to, and prints its wall time and summary line.
#
#   scripts/gpu-record.sh [--out DIR] [STEP...]    # from the repository root; every step by default
#
#   job        the GPU job as .github/workflows/gpu.yml runs it (NCCL, one rank per GPU) -> gpu-job.txt, gpu-job.xml
#   suite      the whole suite with VDPCP_DEVICE=cuda exported for the job, as a runner may set it
#                                                                                       -> pytest-cuda-suite.txt
#   nccl-cp1   vdpcp check --backend nccl --cp 1, every shipped subject             -> check-nccl-cp1.txt, .json
#   bf16       the bf16 matrix at CP 2 and 4 over gloo, every rank's tensors on the GPU, per subject
#                                                                    -> bf16-reference-mcore.txt, bf16-qwen2_5_vl.txt, ...
#   real       every shipped subject at its published size (--tower real), bf16, CP 2 and 4, gloo ranks sharing the
#              GPU: verdicts, seconds per case, each rank's peak against the budget (vdpcp bench towers)
#                                                                                    -> real-bfloat16.txt, .json
#   real-f32   the same in float32, TF32 as torch defaults it                         -> real-float32.txt, .json
#              (REAL_CP: the CP sizes; REAL_S: the time limit; REAL_IMPL, REAL_K: some subjects, the case ids holding
#              REAL_K, written as real-DTYPE-REAL_K.txt, .json)
#   real-mutants  every named and generic mutant of the reference at the real size, bf16 -> real-mutants.txt, .json
#   sensitivity  the smallest planted bug each check catches, every shipped subject at --tower real, CP 2, gloo ranks
#              sharing the GPU, a rank's features and its gradient x (1 + eps), one token + eps x its norm
#              (vdpcp bench sensitivity; SENS_DTYPE: bfloat16 by default, float32 the other run; SENS_GRID: the
#              sizes, every power of ten 1e-12 .. 1e-1 by default, e.g. "1e-9 1e-3": fewer runs; SENS_K: the case,
#              multi-image by default: for automodel-shipped, whose released thresholds replicate multi-image,
#              that finds multi-image-32)
#                                                               -> sensitivity-DTYPE.txt, .json (-SENS_K: another case)
#   faults     what a faulted case costs over a passing one (vdpcp bench faults)    -> bench-faults.json
#   ab         the A/B, flag on against off, CP 2 sharing the GPU, bf16, ViT-L-sized  -> ab.txt, ab.json, ab.png
#   memory     busiest-rank memory and time of encode+project, sharded vs unsharded
#                                                    -> memory-multi-image.json/.md, memory-video.json/.md
#
# DIR: --out, else $OUT (the device tool's folder that comes back), else reports/gpu. Wheels in .whl/ (megatron-core,
# the pinned transformers, parameterized, nemo-automodel: what the machine lacks) are installed first, outside the
# checkout. On the device tool, where one call runs 10 minutes at most, split the steps over calls, e.g.:
#
#   set -o pipefail; scripts/gpu-record.sh job nccl-cp1 bf16 2>&1 | tee $OUT/gpu-record-stdout.txt   # carry: .whl
#   set -o pipefail; scripts/gpu-record.sh faults ab memory 2>&1 | tee $OUT/gpu-record-stdout-2.txt
set -u
ALL="job suite nccl-cp1 bf16 real real-f32 real-mutants sensitivity faults ab memory"
SUBJECTS="reference mcore qwen2_5_vl automodel automodel-shipped nemotron-omni bridge-qwen3-vl"
. "$(dirname "${BASH_SOURCE[0]}")/lib/args.sh"
parse_steps gpu-record.sh "$ALL" "$@"

if [ -d .whl ] && [ ! -d /tmp/site ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
fi
[ -d /tmp/site ] && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} COLUMNS=240 PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # the device tool's rule: no NVLink multicast
# cuBLAS reads it when CUDA starts: with it, each case runs under deterministic algorithms and the regrouped reference
# holds gradients bitwise (vdpcp.oracle.compare.regrouped; RankResult.deterministic says "on"). Without it, outputs only.
export CUBLAS_WORKSPACE_CONFIG=${CUBLAS_WORKSPACE_CONFIG:-:4096:8}
python3 - <<'EOF'  # what the record's first line states
import sys
from importlib.metadata import PackageNotFoundError, version

import torch


def of(name):
    try:
        return f"{name} {version(name)}"
    except PackageNotFoundError:
        return f"no {name}"


gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
print("python", sys.version.split()[0], *map(of, ("torch", "transformers", "megatron-core", "nemo-automodel")), gpus)
EOF

step() { echo "== $1 ($(date +%T))"; start=$(date +%s); }
took() { echo "rc=$1 wall=$(( $(date +%s) - start )) s"; }

job() {  # pytest names the plugin with -p: vdpcp runs from the checkout, not installed
    step "the GPU job: pytest -n 0 --backend nccl -m distributed"
    timeout 300 python3 -m pytest -p vdpcp.pytest_plugin -n 0 --backend nccl -m distributed -q -rs \
        --junitxml="$out/gpu-job.xml" >"$out/gpu-job.txt" 2>&1
    took $?; tail -4 "$out/gpu-job.txt"
}

suite() {  # every test chooses its device itself: the CPU where it needs it, whatever the job exports
    step "VDPCP_DEVICE=cuda pytest -n 16, the whole suite"
    VDPCP_DEVICE=cuda timeout "${SUITE_S:-400}" python3 -m pytest -p vdpcp.pytest_plugin -n 16 -v -rfEsx \
        >"$out/pytest-cuda-suite.txt" 2>&1
    took $?; grep -E "(FAILED|ERROR) tests/|^=+ .* in [0-9.]+s" "$out/pytest-cuda-suite.txt" | tail -12
}

nccl-cp1() {
    step "vdpcp check --backend nccl --cp 1, every shipped subject"
    timeout 150 python3 -m vdpcp check --backend nccl --cp 1 --impl $SUBJECTS \
        --json "$out/check-nccl-cp1.json" >"$out/check-nccl-cp1.txt" 2>&1
    took $?; tail -1 "$out/check-nccl-cp1.txt"
}

bf16() {  # the built-ins together, each third-party subject alone; the per-case lines carry each case's seconds
    for impl in "reference mcore" qwen2_5_vl automodel automodel-shipped nemotron-omni; do
        step "VDPCP_DEVICE=cuda vdpcp check --backend gloo --cp 2 4 --dtype bfloat16 --impl $impl"
        VDPCP_DEVICE=cuda timeout 200 python3 -m vdpcp check --backend gloo --cp 2 4 --dtype bfloat16 --impl $impl \
            >"$out/bf16-${impl// /-}.txt" 2>&1
        took $?; grep " cases: " "$out/bf16-${impl// /-}.txt" | tail -1
    done
}

towers() {  # $1: the dtype; REAL_IMPL and REAL_K narrow the selection, and a narrowed one is written under its own name
    local name=real-$1${REAL_K:+-$REAL_K}
    step "VDPCP_DEVICE=cuda vdpcp bench towers --cp ${REAL_CP:-2 4} --dtype $1 --backend gloo ${REAL_IMPL:+--impl $REAL_IMPL }${REAL_K:+-k $REAL_K }(--tower real)"
    VDPCP_DEVICE=cuda timeout "${REAL_S:-560}" python3 -m vdpcp bench towers --cp ${REAL_CP:-2 4} --dtype "$1" --backend gloo \
        ${REAL_IMPL:+--impl $REAL_IMPL} ${REAL_K:+-k "$REAL_K"} --json "$out/$name.json" >"$out/$name.txt" 2>&1
    took $?; tail -12 "$out/$name.txt"
}

real() { towers bfloat16; }

real-f32() { towers float32; }

real-mutants() {
    step "VDPCP_DEVICE=cuda vdpcp mutants --dtype bfloat16 --tower real --backend gloo"
    VDPCP_DEVICE=cuda timeout "${REAL_S:-560}" python3 -m vdpcp mutants --dtype bfloat16 --tower real --backend gloo \
        --json "$out/real-mutants.json" >"$out/real-mutants.txt" 2>&1
    took $?; grep "mutants of" "$out/real-mutants.txt" | tail -1
}

sensitivity() {  # a case other than multi-image is written under its own name
    local dtype=${SENS_DTYPE:-bfloat16}
    local name=sensitivity-$dtype${SENS_K:+-$SENS_K}
    step "VDPCP_DEVICE=cuda vdpcp bench sensitivity --tower real --cp 2 --dtype $dtype -k ${SENS_K:-multi-image} --backend gloo"
    VDPCP_DEVICE=cuda timeout "${REAL_S:-560}" python3 -m vdpcp bench sensitivity --tower real --cp 2 --dtype "$dtype" \
        -k "${SENS_K:-multi-image}" --backend gloo --mutant scale-rank-features scale-rank-grad nudge-token \
        ${REAL_IMPL:+--impl $REAL_IMPL} ${SENS_GRID:+--grid $SENS_GRID} \
        --json "$out/$name.json" >"$out/$name.txt" 2>&1
    took $?; tail -14 "$out/$name.txt"
}

faults() {  # no preload (the harness before it preloaded on GPUs) against the case imports preloaded, workers
    # re-forked or kept; the zygote tolerates the CUDA driver's thread, named cuda... (forkcheck.jsonl in the record)
    step "vdpcp bench faults, 2 gloo ranks sharing the GPU"
    timeout 300 python3 -m vdpcp bench faults --device cuda --passes 3 --repeats 2 --grace 0.1 --tolerate-threads cuda \
        --config none/off --config case/off --config case/on --json "$out/bench-faults.json" 2>&1 | tail -12
    took "${PIPESTATUS[0]}"
}

ab() {
    step "vdpcp ab --cp 2 --dtype bfloat16 --tower real, two ranks sharing the GPU over gloo"
    VDPCP_DEVICE=cuda timeout 500 python3 -m vdpcp ab --cp 2 --steps 5 --dtype bfloat16 --tower real --backend gloo \
        --timeout 400 --json "$out/ab.json" --png "$out/ab.png" >"$out/ab.txt" 2>&1
    took $?; grep "peak allocated memory\|verdict" "$out/ab.txt"
}

memory() {  # bench memory writes a folder (results.json, tables.md): the record keeps flat files
    for dataset in multi-image video; do
        seeds=4; [ "$dataset" = video ] && seeds=2
        step "vdpcp bench memory --device cuda --dataset $dataset --seeds $seeds"
        folder=$(mktemp -d)
        PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout 300 python3 -m vdpcp bench memory --device cuda \
            --dataset "$dataset" --seeds "$seeds" --out "$folder" >"$folder/stdout.txt" 2>&1
        took $?; tail -2 "$folder/stdout.txt"
        [ -f "$folder/results.json" ] && mv "$folder/results.json" "$out/memory-$dataset.json"
        [ -f "$folder/tables.md" ] && mv "$folder/tables.md" "$out/memory-$dataset.md"
        rm -rf "$folder"
    done
}

for s in $steps; do "$s"; done
echo "== done ($(date +%T)); written under $out"
