#!/usr/bin/env bash
# vdpcp inside a GPU runner's own training image, as a user installs it there: the image's Python, torch and
# transformers kept; vdpcp's wheel and what the image lacks (megatron-core, parameterized, nemo-automodel and
# megatron-bridge without their dependencies, pydantic) installed with plain pip from wheels in .whl/, since the
# runner reaches no index. Then, from a folder outside the checkout:
#
#   scripts/gpu-image.sh [--out DIR] [STEP...]     # every step by default; DIR: --out, else $OUT, else reports/gpu
#
#   install  pip install vdpcp[transformers,radio] + the code under test; pip's freeze before and after -> image-pip.txt
#   matrix   every current shipped subject's default matrix at CP 2, gloo ranks sharing the GPU, each rank's tensors
#            on it (VDPCP_DEVICE=cuda), float64                                     -> image-matrix-cp2.txt, .json
#   real     every current shipped subject at its published size, bf16, CP 2 (vdpcp bench towers)
#                                                                                   -> image-real-cp2.txt, .json
#   section  the released megatron-bridge 0.6.2 Qwen3-VL vision section as a Bridge engineer plugs it in
#            (tests/impls/bridge_qwen3_vl_section.py), at its published size, bf16, CP 2: as shipped, and declaring
#            that its merges copy                                        -> image-section-cp2.txt, .json, -copy.*
#   (IMAGE_IMPL: other subjects than the current shipped ones; IMAGE_K: only case ids holding it)
set -u
ALL="install matrix real section"
. "$(dirname "${BASH_SOURCE[0]}")/lib/args.sh"
parse_steps gpu-image.sh "$ALL" "$@"
out=$(cd "$out" && pwd)
wheels=$(cd .whl && pwd) || { echo "gpu-image.sh: no .whl/ folder of wheels" >&2; exit 2; }
impls=${IMAGE_IMPL:-reference mcore qwen2_5_vl automodel automodel-shipped nemotron-omni bridge-qwen3-vl}
match=${IMAGE_K:+-k $IMAGE_K}
export COLUMNS=240 PYTHONUNBUFFERED=1 CUBLAS_WORKSPACE_CONFIG=:4096:8
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # no NVLink multicast on these machines
elsewhere=$(mktemp -d)  # not the checkout: the installed vdpcp alone
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | sed 's/^/card: /'

for step in $steps; do
    start=$(date +%s)
    case $step in
    install)
        python3 -m pip freeze --all > "$out/image-pip-before.txt"
        python3 -m pip install -q --no-index --find-links "$wheels" "$(ls "$wheels"/vdpcp-*.whl)[transformers,radio]" pydantic \
            || exit 1
        python3 -m pip install -q --no-index --no-deps --find-links "$wheels" nemo-automodel megatron-bridge || exit 1
        python3 -m pip freeze --all > "$out/image-pip-after.txt"
        python3 - "$out/image-pip-before.txt" "$out/image-pip-after.txt" <<'EOF' | tee "$out/image-pip.txt"
import sys
def read(path):
    return dict(line.strip().split("==", 1) for line in open(path) if "==" in line)
before, after = read(sys.argv[1]), read(sys.argv[2])
changed = {k: (v, after.get(k)) for k, v in before.items() if after.get(k) != v}
print("added:", ", ".join(f"{k}=={v}" for k, v in sorted(after.items()) if k not in before))
print("changed:", ", ".join(f"{k} {a} -> {b}" for k, (a, b) in sorted(changed.items())) or "nothing")
print("kept: torch", before.get("torch"), "transformers", before.get("transformers"))
sys.exit(1 if changed else 0)
EOF
        ;;
    matrix)
        # shellcheck disable=SC2086
        (cd "$elsewhere" && VDPCP_DEVICE=cuda vdpcp check --impl $impls --cp 2 --backend gloo $match \
            --json "$out/image-matrix-cp2.json") > "$out/image-matrix-cp2.txt" 2>&1
        echo "matrix: exit $?"; grep -E "^[0-9]+ cases|vdpcp harness|left out" "$out/image-matrix-cp2.txt"
        ;;
    real)
        # shellcheck disable=SC2086
        (cd "$elsewhere" && VDPCP_DEVICE=cuda vdpcp bench towers --impl $impls --cp 2 --dtype bfloat16 --backend gloo \
            $match --json "$out/image-real-cp2.json") > "$out/image-real-cp2.txt" 2>&1
        echo "real: exit $?"; tail -5 "$out/image-real-cp2.txt"
        ;;
    section)
        cp tests/impls/bridge_qwen3_vl_section.py "$elsewhere/"
        for object in section section_merges_copy; do
            name=image-section-cp2${object#section}; name=${name/_merges_copy/-copy}
            # shellcheck disable=SC2086
            (cd "$elsewhere" && VDPCP_DEVICE=cuda vdpcp bench towers --impl "bridge_qwen3_vl_section:$object" --cp 2 \
                --dtype bfloat16 --backend gloo $match --json "$out/$name.json") > "$out/$name.txt" 2>&1
            echo "section $object: exit $?"; tail -3 "$out/$name.txt"
        done
        ;;
    *) echo "gpu-image.sh: unknown step $step; expected some of: $ALL" >&2; exit 2 ;;
    esac
    echo "$step: $(( $(date +%s) - start )) s"
done
