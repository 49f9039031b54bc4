# Eleventh session's device calls, in order (reports/gpu/README.md). Each ran from the repository root with
# carry [".whl"] (and "scratch/carry", which held these scripts and base-8aad205.tar.gz, 'git archive 8aad205').

# call 1, at 8aad205 (the py-spy profile it also took, qwen-cp2.raw, is not kept: 3.6 MB)
set -o pipefail; REAL_CP=2 REAL_S=420 scripts/gpu-record.sh real 2>&1 | tee $OUT/stdout.txt

# call 2, at 87854b5: bash scratch/carry/gpu-b.sh
#!/usr/bin/env bash
# GPU call (eleventh session): bf16 CP 2 three-images cases of four subjects at the real size, on one machine:
# the base (8aad205), the working tree, and the working tree with the cache kept after each case; then the
# reference's real-size sensitivity on the working tree.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export CUBLAS_WORKSPACE_CONFIG=:4096:8 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 VDPCP_DEVICE=cuda PYTHONUNBUFFERED=1 COLUMNS=240
nvidia-smi --query-gpu=name --format=csv,noheader
mkdir -p /tmp/base /tmp/keep && tar xzf scratch/carry/base-8aad205.tar.gz -C /tmp/base
cp -r vdpcp fixtures pyproject.toml /tmp/keep/ && python3 - <<'PY'
p = "/tmp/keep/vdpcp/oracle/arms.py"; s = open(p).read()
old = '        clock.lap("release")\n        _give_back(ctx)\n'
assert old in s; open(p, "w").write(s.replace(old, '        clock.lap("release")\n'))
PY
B="python3 -m vdpcp bench towers --cp 2 --dtype bfloat16 --backend gloo --impl reference qwen2_5_vl automodel bridge-qwen3-vl -k three-images"
run() { echo "== $1 $(date +%T)"; (cd $2 && PYTHONPATH=$2:/tmp/site timeout 135 $B --json $OUT/$1.json 2>&1) > $OUT/$1.txt; echo "rc=$?"; tail -7 $OUT/$1.txt; }
run base /tmp/base
run new $PWD
run keep /tmp/keep
echo "== sensitivity $(date +%T)"
PYTHONPATH=$PWD:/tmp/site timeout 100 python3 -m vdpcp bench sensitivity --tower real --cp 2 --dtype bfloat16 -k multi-image --backend gloo --impl reference --grid 1e-9 1e-3 > $OUT/sens.txt 2>&1; echo "rc=$?"; tail -6 $OUT/sens.txt
echo "== done $(date +%T)"

# call 3: bash scratch/carry/gpu-c.sh
#!/usr/bin/env bash
# GPU call (eleventh session, second): the scale-rank-grad instrument on a finer grid, base (8aad205) and the working
# tree; then the reference in float32, -k images, on the working tree.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export CUBLAS_WORKSPACE_CONFIG=:4096:8 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 VDPCP_DEVICE=cuda PYTHONUNBUFFERED=1 COLUMNS=240
nvidia-smi --query-gpu=name --format=csv,noheader
mkdir -p /tmp/base && tar xzf scratch/carry/base-8aad205.tar.gz -C /tmp/base
S="python3 -m vdpcp bench sensitivity --tower real --cp 2 --dtype bfloat16 -k multi-image --backend gloo --impl reference --mutant scale-rank-grad --grid 1e-9 1e-8 1e-7 1e-3"
echo "== sensitivity new $(date +%T)"; PYTHONPATH=$PWD:/tmp/site timeout 70 $S > $OUT/sens-grad-new.txt 2>&1; echo "rc=$?"; tail -3 $OUT/sens-grad-new.txt
echo "== sensitivity base $(date +%T)"; (cd /tmp/base && PYTHONPATH=/tmp/base:/tmp/site timeout 70 $S) > $OUT/sens-grad-base.txt 2>&1; echo "rc=$?"; tail -3 $OUT/sens-grad-base.txt
echo "== float32 new $(date +%T)"; PYTHONPATH=$PWD:/tmp/site timeout 80 python3 -m vdpcp bench towers --cp 2 --dtype float32 --backend gloo --impl reference -k images --json $OUT/f32-new.json > $OUT/f32-new.txt 2>&1; echo "rc=$?"; tail -5 $OUT/f32-new.txt
echo "== done $(date +%T)"

# call 4, at 549ad6c (the instrument counting the elements it moved), carry [".whl"]
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1; export PYTHONPATH=$PWD:/tmp/site CUBLAS_WORKSPACE_CONFIG=:4096:8 NCCL_NVLS_ENABLE=0 VDPCP_DEVICE=cuda PYTHONUNBUFFERED=1 COLUMNS=240; nvidia-smi --query-gpu=name --format=csv,noheader; git log -1 --format=%h; timeout 110 python3 -m vdpcp bench sensitivity --tower real --cp 2 --dtype bfloat16 -k multi-image --backend gloo --impl reference --mutant scale-rank-grad scale-rank-features --grid 1e-9 1e-3 --json $OUT/sens-planted.json 2>&1 | tee $OUT/sens-planted.txt
