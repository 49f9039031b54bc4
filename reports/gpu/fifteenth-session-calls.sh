#!/usr/bin/env bash
# Fifteenth session's device call: the one-pass gradient figures (201195a) and the reused own-share sketch (21a5026)
# against 4848fe6, alone on a real tower's gradients and in the three-images cases of three subjects at CP 2 and 4.
# Three calls on one H100 80GB (no H200 came), at 26d6ec6, carry [".whl", "scratch/carry"] (this script as
# scratch/carry/gpu-a.sh, and base-4848fe6.tar.gz, 'git archive 4848fe6'). Several earlier tries got no machine.
# First call: bash scratch/carry/gpu-a.sh 2>&1 | tee $OUT/stdout.txt  (its micro lines ran the new code twice: the
#   here-document imported vdpcp from the working directory; the third call ran them again from each checkout)
# Second call, the machine still warm: REAL_S=520 scripts/gpu-record.sh --out $OUT real
# Third call: the micro function below for /tmp/base and $PWD, then
#   python3 -m vdpcp bench towers --cp 2 --dtype float32 --backend gloo --impl reference mcore nemotron-omni --json $OUT/real-float32-cp2.json
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export CUBLAS_WORKSPACE_CONFIG=:4096:8 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 VDPCP_DEVICE=cuda PYTHONUNBUFFERED=1 COLUMNS=240
nvidia-smi --query-gpu=name,power.limit --format=csv,noheader
mkdir -p /tmp/base && tar xzf scratch/carry/base-4848fe6.tar.gz -C /tmp/base
micro() (  # $1: checkout (a subshell: its cd stays inside)
cd $1 && PYTHONPATH=$1:/tmp/site timeout 90 python3 - <<'PY' 2>&1 | grep -v -i warn
import time, torch
from vdpcp.oracle.compare import precision
from vdpcp.matrix.case import Case
from vdpcp.impls import resolve
from vdpcp.matrix.scenarios import REAL_SCENARIOS
spec = next(s.spec for s in REAL_SCENARIOS if s.spec.name == "three-images")
m = resolve("qwen2_5_vl").build_model(Case(spec, 1, "qwen2_5_vl", dtype="bfloat16", tower="real"), torch.bfloat16, torch.device("cuda"))
g = torch.Generator(device="cuda").manual_seed(0)
named = [(n, torch.randn(p.shape, generator=g, device="cuda").to(p.dtype), torch.randn(p.shape, generator=g, device="cuda").to(p.dtype)) for n, p in m.named_parameters()]
del m
def t(f, n=5):
    out = []
    for _ in range(n):
        torch.cuda.synchronize(); s = time.perf_counter(); r = f(); torch.cuda.synchronize(); out.append(time.perf_counter() - s)
    return r, f"{min(out)*1e3:.0f}-{max(out)*1e3:.0f} ms"
if hasattr(precision, "peak_and_norms"):
    r, took = t(lambda: precision.peak_and_norms(iter(named)))
    print(f"one pass (peak_and_norms): {took}; figures {r}")
else:
    r, took = t(lambda: (precision.max_abs_each(iter(named)), *precision.squared_norms(iter(named))))
    print(f"two passes (max_abs_each, squared_norms): {took}; figures {r}")
print(f"{sum(a.numel() for _, a, _ in named)/1e6:.0f}M elements in {len(named)} tensors; CUDA peak {torch.cuda.max_memory_allocated()/2**30:.2f} GiB")
PY
)
echo "== micro base $(date +%T)"; micro /tmp/base | tee $OUT/micro-base.txt
echo "== micro new $(date +%T)"; micro $PWD | tee $OUT/micro-new.txt
B="python3 -m vdpcp bench towers --cp 2 4 --dtype bfloat16 --backend gloo --impl reference qwen2_5_vl nemotron-omni -k three-images"
run() { echo "== $1 $(date +%T)"; (cd $2 && PYTHONPATH=$2:/tmp/site timeout 220 $B --json $OUT/$1.json 2>&1) > $OUT/$1.txt; echo "rc=$?"; tail -14 $OUT/$1.txt; }
run base /tmp/base
run new $PWD
echo "== done $(date +%T)"
