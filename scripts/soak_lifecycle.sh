#!/usr/bin/env bash
# Runs tests/harness/test_lifecycle.py RUNS times in a row (default 50) while one busy loop per CPU
# saturates the machine, and reports how many runs passed; exits non-zero unless all did.
# Each run starts with SIGINT ignored, as a background job of a script does: the condition under which
# the interrupt test once lost its Ctrl-C. About 20-40 s a run on 2 loaded cores.
# Usage: scripts/soak_lifecycle.sh [RUNS]
set -uo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
runs=${1:-50}
cpus=$(nproc)
logs=$(mktemp -d -t vdpcp-soak-XXXXXX)

load=()
stop_load() { kill "${load[@]}" 2>/dev/null; wait "${load[@]}" 2>/dev/null; }
trap stop_load EXIT
trap 'exit 130' INT TERM  # pytest ignores Ctrl-C here, so stop after the run in progress
for _ in $(seq "$cpus"); do
    timeout 3h python3 -c 'while True: pass' &  # bounded: the load ends even if this script is SIGKILLed
    load+=($!)
done

passed=0 start=$SECONDS
for i in $(seq "$runs"); do
    if (trap '' INT; exec "$here/run" pytest -q -n 0 tests/harness/test_lifecycle.py) >"$logs/run-$i.txt" 2>&1; then
        passed=$((passed + 1))
        rm "$logs/run-$i.txt"
    else
        echo "run $i FAILED; its output: $logs/run-$i.txt"
    fi
    echo "run $i: $passed/$i passed, load average $(cut -d' ' -f1 /proc/loadavg), $((SECONDS - start)) s"
done
echo "soak: $passed/$runs runs of test_lifecycle.py passed in $((SECONDS - start)) s, with $cpus busy loops on $cpus CPUs"
[ "$passed" -eq "$runs" ]
