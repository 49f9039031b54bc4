# The command line scripts/gpu-record.sh and scripts/gpu-image.sh share: [--out DIR] [STEP...], sourced by both.
# parse_steps NAME ALL ARGS...: sets out (DIR: --out, else $OUT, else reports/gpu; created) and steps (every step
# of ALL by default), and exits 2 on a step that is not in ALL, before any step runs.
parse_steps() {
    local name=$1 all=$2
    shift 2
    out=${OUT:-reports/gpu}
    if [ "${1:-}" = --out ]; then
        [ -n "${2:-}" ] || { echo "$name: --out needs a folder" >&2; exit 2; }
        out=$2
        shift 2
    fi
    steps=${*:-$all}
    local s
    for s in $steps; do
        case " $all " in *" $s "*) ;; *) echo "$name: unknown step $s; expected some of: $all" >&2; exit 2 ;; esac
    done
    mkdir -p "$out"
}
