# Twelfth session's device call (reports/gpu/README.md), from the repository root with carry [".whl", "scratch/carry"]
# (scratch/carry held this script and base-c23b2a3.tar.gz, 'git archive c23b2a3'). It ran on an H100 80GB.
# run: bash scratch/carry/gpu-a.sh 2>&1 | tee $OUT/stdout.txt
#!/usr/bin/env bash
# GPU call (twelfth session, first): the exact run in float32 against TF32 on real towers (scripts/exact_math.py);
# the fingerprint's cost on real towers; bf16 CP 2 three-images cases of four subjects, base (c23b2a3) and the working
# tree (TF32 exact run); the reference's real-size sensitivity with the planted instruments on the working tree.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export CUBLAS_WORKSPACE_CONFIG=:4096:8 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 VDPCP_DEVICE=cuda PYTHONUNBUFFERED=1 COLUMNS=240
nvidia-smi --query-gpu=name --format=csv,noheader
mkdir -p /tmp/base && tar xzf scratch/carry/base-c23b2a3.tar.gz -C /tmp/base
echo "== exact math $(date +%T)"
PYTHONPATH=$PWD:/tmp/site timeout 120 python3 scripts/exact_math.py reference qwen2_5_vl automodel > $OUT/exact-math.txt 2>&1; echo "rc=$?"; grep -v Warning $OUT/exact-math.txt | grep -v warn | tail -16
echo "== fingerprint $(date +%T)"
PYTHONPATH=$PWD:/tmp/site timeout 60 python3 - <<'PY' 2>&1 | grep -v -i warn | tee $OUT/fingerprint.txt
import time, torch
from vdpcp.oracle import model_cache
from vdpcp.matrix.case import Case
from vdpcp.impls import resolve
from vdpcp.matrix.scenarios import REAL_SCENARIOS
spec = next(s.spec for s in REAL_SCENARIOS if s.spec.name == "three-images")
for name in ("reference", "qwen2_5_vl"):
    m = resolve(name).build_model(Case(spec, 1, name, dtype="bfloat16", tower="real"), torch.bfloat16, torch.device("cuda"))
    n = sum(p.numel() for p in m.parameters())
    model_cache.fingerprint(m)
    t = []
    for _ in range(3):
        torch.cuda.synchronize(); s = time.perf_counter(); model_cache.fingerprint(m); torch.cuda.synchronize(); t.append(time.perf_counter() - s)
    print(f"{name}: {n / 1e6:.0f}M parameters in {len(list(m.parameters()))} tensors; fingerprint {min(t):.3f}-{max(t):.3f} s")
    del m; torch.cuda.empty_cache()
PY
B="python3 -m vdpcp bench towers --cp 2 --dtype bfloat16 --backend gloo --impl reference qwen2_5_vl automodel bridge-qwen3-vl -k three-images"
run() { echo "== $1 $(date +%T)"; (cd $2 && PYTHONPATH=$2:/tmp/site timeout 135 $B --json $OUT/$1.json 2>&1) > $OUT/$1.txt; echo "rc=$?"; tail -7 $OUT/$1.txt; }
run base /tmp/base
run new $PWD
echo "== sensitivity $(date +%T)"
PYTHONPATH=$PWD:/tmp/site timeout 110 python3 -m vdpcp bench sensitivity --tower real --cp 2 --dtype bfloat16 -k multi-image --backend gloo --impl reference --mutant scale-rank-grad scale-rank-features --grid 1e-9 1e-3 --json $OUT/sens-planted.json > $OUT/sens-planted.txt 2>&1; echo "rc=$?"; tail -4 $OUT/sens-planted.txt
echo "== done $(date +%T)"
