# Thirteenth session's device calls (reports/gpu/README.md), from the repository root on an H100 80GB.
# First call, carry [".whl"], at b8c00b6:
#   set -o pipefail; REAL_S=550 scripts/gpu-record.sh --out $OUT real 2>&1 | tee $OUT/gpu-record-stdout.txt
# Second call, carry [".whl", "scratch/carry"] (scratch/carry held this script and base-b8c00b6.tar.gz, 'git archive b8c00b6'),
# the working tree at 93c2321: bash scratch/carry/gpu-b.sh 2>&1 | tee $OUT/stdout.txt
#!/usr/bin/env bash
# GPU call (thirteenth session, second): the fingerprint as bits x odd position weights against the splitmix64 hash
# (b8c00b6), alone on real towers and in the three-images cases of four subjects at CP 2 and 4, base and new.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export CUBLAS_WORKSPACE_CONFIG=:4096:8 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 VDPCP_DEVICE=cuda PYTHONUNBUFFERED=1 COLUMNS=240
nvidia-smi --query-gpu=name,power.limit --format=csv,noheader
mkdir -p /tmp/base && tar xzf scratch/carry/base-b8c00b6.tar.gz -C /tmp/base
fp() {  # $1: checkout
PYTHONPATH=$1:/tmp/site timeout 90 python3 - <<'PY' 2>&1 | grep -v -i warn
import time, torch
from vdpcp.oracle import model_cache
from vdpcp.matrix.case import Case
from vdpcp.impls import resolve
from vdpcp.matrix.scenarios import REAL_SCENARIOS
spec = next(s.spec for s in REAL_SCENARIOS if s.spec.name == "three-images")
for name in ("reference", "qwen2_5_vl"):
    m = resolve(name).build_model(Case(spec, 1, name, dtype="bfloat16", tower="real"), torch.bfloat16, torch.device("cuda"))
    n = sum(p.numel() for p in m.parameters())
    before = model_cache.fingerprint(m)
    t = []
    for _ in range(5):
        torch.cuda.synchronize(); s = time.perf_counter(); model_cache.fingerprint(m); torch.cuda.synchronize(); t.append(time.perf_counter() - s)
    p = max(m.parameters(), key=lambda p: p.numel())
    with torch.no_grad():
        model_cache._flat(p.data)[p.numel() - 7] += 1  # its bit pattern one up: one step
    moved = (model_cache.fingerprint(m) != before).sum().item()
    same_on_cpu = "-" if not hasattr(model_cache, "_SPAN") else torch.equal(model_cache.fingerprint(m.cpu()), model_cache.fingerprint(m.cuda()))
    print(f"{name}: {n / 1e6:.0f}M parameters in {len(list(m.parameters()))} tensors; fingerprint {min(t)*1e3:.1f}-{max(t)*1e3:.1f} ms; "
          f"one element of {p.numel()} moved one step via .data: {moved} tensor(s) changed; CPU figure equal: {same_on_cpu}; "
          f"CUDA memory after {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB peak")
    del m; torch.cuda.empty_cache(); torch.cuda.reset_peak_memory_stats()
PY
}
echo "== fingerprint base $(date +%T)"; fp /tmp/base | tee $OUT/fingerprint-base.txt
echo "== fingerprint new $(date +%T)"; fp $PWD | tee $OUT/fingerprint-new.txt
B="python3 -m vdpcp bench towers --cp 2 4 --dtype bfloat16 --backend gloo --impl reference qwen2_5_vl automodel bridge-qwen3-vl -k three-images"
run() { echo "== $1 $(date +%T)"; (cd $2 && PYTHONPATH=$2:/tmp/site timeout 230 $B --json $OUT/$1.json 2>&1) > $OUT/$1.txt; echo "rc=$?"; tail -12 $OUT/$1.txt; }
run base /tmp/base
run new $PWD
echo "== done $(date +%T)"
