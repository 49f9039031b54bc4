#!/usr/bin/env bash
# Fourteenth session's device call (reports/gpu/README.md), from the repository root on one H200, at 38e93d5,
# carry [".whl", "scratch/carry"] (this script as scratch/carry/gpu-a.sh): bash scratch/carry/gpu-a.sh 2>&1 | tee $OUT/stdout.txt
# Many earlier tries that session got no machine (none could be started), and they spent most of its device time.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=$PWD:/tmp/site CUBLAS_WORKSPACE_CONFIG=:4096:8 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 VDPCP_DEVICE=cuda PYTHONUNBUFFERED=1 COLUMNS=240
nvidia-smi --query-gpu=name,power.limit --format=csv,noheader
echo "== micro $(date +%T)"
timeout 100 python3 - <<'PY' 2>&1 | grep -v -i warn | tee $OUT/micro.txt
import copy, time, torch
from vdpcp.oracle import model_cache
from vdpcp.matrix.case import Case
from vdpcp.impls import resolve
from vdpcp.matrix.scenarios import REAL_SCENARIOS
spec = next(s.spec for s in REAL_SCENARIOS if s.spec.name == "three-images")
def t(f, n=3):
    out = []
    for _ in range(n):
        torch.cuda.synchronize(); s = time.perf_counter(); r = f(); torch.cuda.synchronize(); out.append(time.perf_counter() - s); del r
    return f"{min(out)*1e3:.0f}-{max(out)*1e3:.0f} ms"
for name in ("reference", "qwen2_5_vl", "nemotron-omni"):
    try:
        m = resolve(name).build_model(Case(spec, 1, name, dtype="bfloat16", tower="real"), torch.bfloat16, torch.device("cuda"))
    except Exception as e:
        print(name, "build failed", e); continue
    ps = list(m.parameters()); n = sum(p.numel() for p in ps)
    e32 = copy.deepcopy(m).to(torch.float32); q = list(e32.parameters())
    def refresh():
        with torch.no_grad():
            torch._foreach_copy_(q, ps)
    print(f"{name}: {n/1e6:.0f}M params, {len(ps)} tensors, {sum(1 for _ in m.modules())} modules; deepcopy {t(lambda: copy.deepcopy(m))}; "
          f"deepcopy+to(fp32) {t(lambda: copy.deepcopy(m).to(torch.float32))}; foreach_copy_ into a kept fp32 copy {t(refresh)}; "
          f"fingerprint {t(lambda: model_cache.fingerprint(m))}")
    del m, e32, q, ps; torch.cuda.empty_cache()
PY
echo "== profile $(date +%T)"
B="python3 -m vdpcp bench towers --cp 2 --dtype bfloat16 --backend gloo --impl reference qwen2_5_vl nemotron-omni -k three-images"
timeout 170 /tmp/site/bin/py-spy record --subprocesses --rate 50 --format raw -o $OUT/profile.raw -- $B --json $OUT/profile.json > $OUT/profile.txt 2>&1; echo "rc=$?"
tail -15 $OUT/profile.txt
echo "== done $(date +%T)"
