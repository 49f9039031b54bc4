#!/usr/bin/env bash
# Issue 20, item 3 (cheap faulted cases), on the one-GPU kind nvidia-h200, in about 4 minutes:
#  1. why the rank zygote refuses its preload where CUDA is visible: in fresh processes (OMP/MKL/OpenBLAS pinned
#     to one thread, as the zygote's), which import or call starts an OS thread, its name, the statement that
#     started it (python -m vdpcp.harness.forkcheck), and whether children forked after it can still run a CUDA
#     tensor op, a gloo all_gather/all_reduce of CUDA tensors between two siblings, and a one-rank NCCL group.
#     Controls: bare torch (nothing started, must pass) and torch.cuda.init() in the parent (must fail: proves
#     the check can see a poisoned fork). With and without PYTORCH_NVML_BASED_CUDA_CHECK=1.
#  2. what a faulted case costs over a passing one (vdpcp bench faults, 2 gloo ranks sharing the GPU, the case
#     importing what vdpcp's cases import; every rank raising, or one rank raising with 0.1 s grace): today
#     (no preload, re-fork after any fault), (a) the zygote preloads the case imports anyway (with its NVML-based
#     availability check, tolerating the threads found in 1) and re-forks, (b) no preload but workers kept after
#     a sound fault, and (a)+(b).
# Run from the repository root on the device: `bash reports/h200/faulted-cost.sh`, with `.whl` carried (the
# megatron-core 0.19.2 and transformers 5.23.0 wheels, as for run-gpu-job.sh). Writes three files under $OUT
# (faulted-cost.txt, the whole log; forkcheck.jsonl; bench-faults.json) and prints a summary at the end.
# On a CPU machine `DEVICE=cpu FORKCHECK_S=600 BENCH_S=900 bash reports/h200/faulted-cost.sh` runs the same logic
# without the CUDA parts (a slow machine needs the longer limits: part 1 runs 8 fresh processes at once).
set -u
start=$(date +%s)
DEVICE=${DEVICE:-cuda} FORKCHECK_S=${FORKCHECK_S:-75} BENCH_S=${BENCH_S:-140}
OUT=${OUT:-$(mktemp -d)}
work=$(mktemp -d)
if [ ! -d /tmp/site ] && ls .whl/*.whl >/dev/null 2>&1; then  # the carried wheels, as run-gpu-job.sh installs them
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
fi
[ -d /tmp/site ] && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} COLUMNS=200 PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # the machine's rule
exec > >(tee "$OUT/faulted-cost.txt") 2>&1
step() { echo "== $1 ($(( $(date +%s) - start )) s)"; }

step "versions"
python3 -c "import sys; from importlib.metadata import version as v; print(sys.version.split()[0], *(f'{n} {v(n)}' \
for n in ('torch', 'transformers', 'megatron-core')))" 2>&1 | tail -1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null || echo "no GPU"

step "1. which import starts a thread, and can a child forked after it use the GPU"
fork="--fork --device $DEVICE --repeats 3 --child-timeout 30"
variants=()
variant() {  # name, environment (or -), then the forkcheck arguments; all at once, each in a fresh process
    local name=$1 env=$2; shift 2
    ( [ "$env" = - ] || export "$env"
      timeout -k 5 "$FORKCHECK_S" python3 -m vdpcp.harness.forkcheck $fork "$@" >"$work/$name.json" 2>"$work/$name.err"
      echo "rc=$?" >"$work/$name.rc" ) &
    variants+=($!)
}
variant bare -
variant is_available - --then "torch.cuda.is_available()"
variant is_available_nvml PYTORCH_NVML_BASED_CUDA_CHECK=1 --then "torch.cuda.is_available()"
variant runtime_device_count - --then "torch._C._cuda_getDeviceCount()"
variant nvml_device_count - --then "torch.cuda.device_count()"
variant control_cuda_init - --then "torch.cuda.init()"
modules=$(python3 -c "from vdpcp.bench.faults import case_modules; print(' '.join(case_modules()))" 2>/dev/null | tail -1)
echo "the case imports: $modules"
variant case_imports - $modules
variant case_imports_nvml PYTORCH_NVML_BASED_CUDA_CHECK=1 $modules
wait "${variants[@]}"  # these only: a bare wait would wait for the log's tee too
for name in bare is_available is_available_nvml runtime_device_count nvml_device_count control_cuda_init \
            case_imports case_imports_nvml; do
    python3 - "$name" "$work" >>"$OUT/forkcheck.jsonl" <<'EOF'
import json, pathlib, sys
name, work = sys.argv[1], pathlib.Path(sys.argv[2])
try:
    report = json.loads(work.joinpath(f"{name}.json").read_text().strip().splitlines()[-1])
except (IndexError, ValueError):
    report = {"error": (work.joinpath(f"{name}.rc").read_text().strip() + " "
                        + work.joinpath(f"{name}.err").read_text()[-600:]).strip()}
print(json.dumps({"variant": name, **report}))
EOF
done
cat "$OUT/forkcheck.jsonl"
# The zygote preloads with PYTORCH_NVML_BASED_CUDA_CHECK=1 (vdpcp/harness/process.py), so the `case` rows below
# tolerate the OS threads the case imports leave under that setting: their names, less the digits they end in.
tolerate=$(python3 - "$OUT/forkcheck.jsonl" <<'EOF'
import json, re, sys
rows = {r["variant"]: r for r in map(json.loads, open(sys.argv[1]))}
names = rows.get("case_imports_nvml", {}).get("threads_after", [])
print(",".join(sorted({re.sub(r"[0-9]+$", "", n) or n for n in names})))
EOF
)
echo "the zygote's preload tolerates threads named ${tolerate:-(none needed)}"

step "2. what a faulted case costs over a passing one: vdpcp bench faults"
# The grace is the known-limit cases' (vdpcp.expectations.KNOWN_LIMIT_GRACE_S): it keeps the re-fork visible in the
# one-rank column; an unexpected fault gets the harness's 3 s, which adds 2.9 s to that column in every row.
timeout -k 10 "$BENCH_S" python3 -m vdpcp bench faults --device "$DEVICE" --passes 3 --repeats 2 --grace 0.1 --tolerate-threads "$tolerate" \
    --config none/off --config none/on --config case/off --config case/on --json "$OUT/bench-faults.json"
echo "rc=$?"

step "summary"
python3 - "$OUT" "$tolerate" <<'EOF'
import json, pathlib, sys
out, tolerate = pathlib.Path(sys.argv[1]), sys.argv[2]
rows = [json.loads(line) for line in out.joinpath("forkcheck.jsonl").read_text().splitlines() if line.strip()]
print("\n1. threads, and children forked after them (ok / failed, of each check)\n")
print("| parent did | OS threads after | first appeared at | children marked bad fork | child tensor ops | gloo pair (tensors on the device) | NCCL, 1 rank |")
print("|---|---|---|---|---|---|---|")
for r in rows:
    if "error" in r:
        print(f"| {r['variant']} | error: {r['error'][:200]} | | | | | |")
        continue
    did = (" ".join(r.get("modules", [])) or "import torch") + (f"; {r['then']}" if r.get("then") else "")
    did = r["variant"] + ": " + did.replace("megatron.core.", "mcore.").replace("transformers.models.", "")[:110]
    first = r["appeared"][0] if r.get("appeared") else None
    where = f"{first['while'].split('site-packages/')[-1]} `{first['statement'][:60]}`" if first else "-"
    children = r.get("children", {})
    def cell(prefix):
        found = [v for k, v in children.items() if k.startswith(prefix)]
        if not found:
            return "-"
        bad = [v.get("error", "") for v in found if not v["ok"]]
        return f"{len(found) - len(bad)}/{len(found)} ok" + (f": {bad[0][:80]}" if bad else "")
    threads = ", ".join(r.get("threads_after", [])) or "none"
    extra = f" (then raised {r['then_error'][:60]})" if r.get("then_error") else ""
    bad = sorted({str(c["bad_fork"]).lower() for c in children.values() if "bad_fork" in c}) or ["-"]
    env = "".join(f" [{k}={v}]" for k, v in r.get("env", {}).items())
    print(f"| {did}{env}{extra} | {threads} | {where} | {'/'.join(bad)} | {cell('tensor op')} | {cell('gloo pair')} | {cell('nccl')} |")
bench = out / "bench-faults.json"
if bench.exists():
    b = json.loads(bench.read_text())
    print(f"\n2. a faulted case's cost over a passing one ({b['world_size']} gloo ranks, tensors on {b['device']}; "
          f"one rank raising leaves the others {b['grace_s']:g} s of grace; target: at most +1 s; the `case` preload "
          f"tolerated threads named {tolerate or '(none needed)'})\n")
    print("| zygote preload | after a sound fault | first case | passing case | every rank raises | one rank raises |")
    print("|---|---|---|---|---|---|")
    for r in b["rows"]:
        if "pass_s" not in r:
            print(f"| {r['preload']} | {r['reuse']} | error: {r.get('error', '')[:150]} | | | |")
            continue
        cells = [f"+{r[f]['extra_s']:.2f} s (max +{r[f]['max_extra_s']:.2f}, {r[f]['workers']})" if f in r else "-"
                 for f in ("every", "one")]
        reuse = "kept if sound" if r["reuse"] == "on" else "re-forked"
        print(f"| {r['preload']} | {reuse} | {r['first_case_s']:.2f} s | {r['pass_s']:.3f} s | {cells[0]} | {cells[1]} |"
              + (f" error: {r['error'][:100]}" if "error" in r else ""))
else:
    print("\n2. no figures: vdpcp bench faults wrote none (see its output above)")
EOF
step "done"
rm -rf "$work"
