#!/usr/bin/env bash
# Measures the README's two commands as a new user meets them: in a fresh clone of this checkout's committed
# state, after `./run true` (which builds the environment, or reuses the one for this pyproject.toml).
# For each command, one row: wall time, exit code, the largest single process's peak RSS (/usr/bin/time -v
# sees one process only) and the peak rise of system memory used (`free -m` every 0.5 s, minus the level
# before the command), which counts every rank, worker and zygote. Each command's output goes to a log.
# MEASURE_COMMANDS (one command a line) replaces the README's two, e.g. to try this script quickly:
#   MEASURE_COMMANDS='./run pytest -q tests/unit/test_spec.py' scripts/measure_readme_commands.sh
# The real measurement takes about 8 minutes on 2 cores and uses all of them: run it on a quiet machine.
set -uo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
commands=${MEASURE_COMMANDS:-$'./run vdpcp check\n./run pytest -n auto'}
clone=$(mktemp -d -t vdpcp-readme-clone-XXXXXX)
logs=$(mktemp -d -t vdpcp-readme-logs-XXXXXX)
trap 'rm -rf "$clone"' EXIT
git clone --quiet "$repo" "$clone"
cd "$clone" || exit 1

used_mb() { free -m | awk '/^Mem:/ {print $3}'; }

rows=()
measure() {  # measure COMMAND: run it in the clone and add its row
    local command=$1 n=$((${#rows[@]} + 1))
    local samples="$logs/memory-$n.txt" rusage="$logs/time-$n.txt" baseline
    baseline=$(used_mb)
    (while :; do used_mb; sleep 0.5; done) >"$samples" &
    local sampler=$! start=$EPOCHREALTIME
    /usr/bin/time -v -o "$rusage" bash -c "$command" >"$logs/output-$n.log" 2>&1
    local code=$? end=$EPOCHREALTIME
    kill "$sampler"
    wait "$sampler" 2>/dev/null
    local peak rss_kb
    peak=$( (cat "$samples"; used_mb) | sort -n | tail -1)
    rss_kb=$(awk -F': ' '/Maximum resident set size/ {print $2}' "$rusage")
    rows+=("$(awk -v c="$command" -v s="$start" -v e="$end" -v x="$code" -v r="$rss_kb" -v p="$peak" -v b="$baseline" \
        'BEGIN { printf "%-40s %8.1f %5s %12.2f %14.2f", c, e - s, x, r / 1048576, (p - b) / 1024 }')")
}

measure "./run true"
while IFS= read -r command; do
    [ -n "$command" ] && measure "$command"
done <<<"$commands"

printf '%-40s %8s %5s %12s %14s\n' "command (fresh clone, $(nproc) CPUs)" "wall s" "exit" "max RSS GB" "sys mem +GB"
printf '%s\n' "${rows[@]}"
echo "outputs and samples: $logs"
