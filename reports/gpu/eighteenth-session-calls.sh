#!/usr/bin/env bash
# Eighteenth session's device calls. Seven H200 calls (needs_h200, `REAL_S=545 scripts/gpu-record.sh --out $OUT real`,
# later with 530, 520 and 500) started no machine: two before the H100 calls below, five after. The two calls on one
# H100 80GB, the machine warm between them, carry [".whl", "scratch"], from the working tree at 1683ba1 (312d4a0's
# docs aside). scratch/noturns was a copy of vdpcp/ with one line changed, in vdpcp/oracle/arms.py:
#   TURNS_ABOVE = 0.8 * 139.8 / 79.19  # scratch: an H200's turn decisions on an H100
# so that the same estimates decide turns as on an H200 (139.8 GiB) where the checkout decides them for this card
# (79.19 GiB). The cases run (three-images at CP 4, count, zigzag and loader; CP 4 x DP 2 left out, as
# -k three-images-cp4-SUBJECT does not match its id) peaked at 36-51 GiB summed over their four ranks in the
# seventeenth session's record, inside the card without turns. `cd` into the copy, since `python3 -m` puts the current
# folder first on sys.path; each run printed the TURNS_ABOVE and the folder it imported.
#
# First call: bash scratch/turns.sh, this (qwen2_5_vl's files did not come back: the tool's count of files):
[ -d /tmp/site ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export CUBLAS_WORKSPACE_CONFIG=:4096:8 VDPCP_DEVICE=cuda COLUMNS=240 PYTHONUNBUFFERED=1
root=$PWD
for impl in qwen2_5_vl nemotron-omni bridge-qwen3-vl; do
  for arm in turns h200; do
    if [ $arm = h200 ]; then cd $root/scratch/noturns; else cd $root; fi
    export PYTHONPATH=$PWD:/tmp/site
    python3 -c "import vdpcp.oracle.arms as a, os; print('$impl $arm', a.TURNS_ABOVE, os.path.dirname(a.__file__))"
    timeout 90 python3 -m vdpcp bench towers --cp 4 --dtype bfloat16 --backend gloo --impl $impl -k three-images-cp4-$impl \
        --json $OUT/turns-$impl-$arm.json > $OUT/turns-$impl-$arm.txt 2>&1
  done
done
cd $root
# Second call: bash scratch/turns2.sh, the same runs for "qwen2_5_vl turns", "qwen2_5_vl h200", then Nemotron Omni's
# in the reverse order, "nemotron-omni h200", "nemotron-omni turns", text only (> $OUT/turns2-$impl-$arm.txt).
