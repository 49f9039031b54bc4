#!/usr/bin/env bash
# Mutation testing of vdpcp's CHECKERS with cosmic-ray: the oracle (its checks, the precision model, the model
# cache), the runner, the judge of expectations, the fuzzer, the A/B judge, saved cases, implementation resolution,
# the parallel layout and the TP reference, each against the tests that reach it. Prints each module's score, the survivors (with their diffs) and the time; exits 1 when the score
# over non-equivalent mutants is below the target.
#
#   scripts/mutation.sh                    # every module below, 2 workers (hours: see docs/mutation.md)
#   scripts/mutation.sh oracle layout      # some of them
#   MUTATION_WORKERS=1 MUTATION_DIR=/tmp/m scripts/mutation.sh
#   MUTATION_FROM=/tmp/m MUTATION_DIR=/tmp/m2 scripts/mutation.sh saved   # re-run only /tmp/m's survivors
#   MUTATION_RESUME=1 MUTATION_DIR=/tmp/m scripts/mutation.sh oracle fuzz   # finish a run stopped partway
#
# MUTATION_FROM: a previous run's folder; each module whose source is unchanged since then re-runs only that
# run's survivors (against the current tests) and keeps its other results; a changed module runs in full.
# MUTATION_SURVIVORS_ONLY=1 with it: mutants that run never reached stay unrun (reported as not run).
# MUTATION_RESUME=1: MUTATION_DIR holds a run that stopped partway (cut off, or its machine went away); its
# results are kept and only the mutants it never reached run, against the current tests. A module whose source
# changed since that run began is refused: its mutants would no longer be the ones on record.
#
# Why cosmic-ray, not mutmut: the oracle runs inside rank processes forked from a warm zygote. mutmut 3 switches
# mutants in-process (trampolines, an environment variable read where the zygote was started) and records which
# tests reach a function in the pytest process, so it sees the oracle as reached by no test and its mutants never
# run where the ranks are. cosmic-ray writes each mutant to the source file and runs the test command as a fresh
# subprocess, so the zygote and every rank import the mutant. It mutates files in place, so this script runs it
# in copies of the checkout under MUTATION_DIR (one per worker), never in the checkout itself.
#
# Operators: cosmic-ray's core set, less those that only multiply runs: binary operators are replaced by their
# inverse only (+ -, * /, // /, % //, ** *, | &), comparisons by their boundary and negation (< <=, < >=, == !=,
# is is-not, in not-in), unary operators removed or negated, and VariableReplacer/Inserter (random values) left
# out. Lines marked "# pragma: no mutate" are skipped.
#
# Surviving mutants are argued equivalent, or killed by a test, in docs/mutation.md; the ones argued equivalent
# are listed in scripts/mutation-equivalent.txt as "module|operator|source line" (the line as written, stripped),
# so that the figure survives the code moving and a re-run after a merge names only the new survivors.
#
# Not part of the default CI run: it is a measurement, and takes hours.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
workers=${MUTATION_WORKERS:-2}
[ "$workers" -ge 1 ] && [ "$workers" -le 2 ] || { echo "mutation.sh: MUTATION_WORKERS must be 1 or 2" >&2; exit 2; }
work=${MUTATION_DIR:-/tmp/vdpcp-mutation-$(git -C "$here" rev-parse --short HEAD)}
target=${MUTATION_TARGET:-90}
cosmic_ray_version=8.7.0

# module -> the tests that reach it, cheapest and surest first (pytest -x stops at the first failure, so a mutant
# that the in-process tests kill costs seconds, not the distributed cases' minute).
declare -A module tests
# The oracle is a package: each of its modules is mutated against the oracle's tests ("oracle" names them all).
oracle_parts="oracle_arms oracle_unsharded oracle_weights oracle_execution oracle_split oracle_gradients oracle_telemetry oracle_failures"
oracle_tests="tests/oracle tests/unit/test_oracle_weights.py tests/distributed/test_oracle_figures.py
  tests/distributed/test_matrix.py::test_case[three-images-cp4-reference-count]
  tests/distributed/test_matrix.py::test_case[one-image-cp1-reference-count]
  tests/distributed/test_matrix.py::test_case[three-images-cp4-reference-count-zigzag]
  tests/distributed/test_matrix.py::test_case[video-and-images-cp2-reference-count]
  tests/distributed/test_matrix.py::test_case[three-images-cp2-dp2-reference-count]
  tests/distributed/test_matrix.py::test_case[three-images-cp2-tp2-reference-count]
  tests/distributed/test_matrix.py::test_case[three-images-cp2-reference-count-optout]
  tests/distributed/test_matrix.py::test_case[empty-cp2-reference-count]
  tests/mutants/test_mutants.py::test_mutant_is_killed_by_a_named_case
  tests/mutants/test_mutants.py::test_a_bug_on_one_non_zero_rank_fails_and_the_report_names_it
  tests/distributed/test_execution.py tests/distributed/test_low_precision.py
  tests/unit/test_duck_parts.py::test_a_duck_whose_stated_plan_is_not_what_ran_is_a_plan_mismatch
  tests/unit/test_model_cache.py::test_a_rank_reuses_its_model_in_the_next_case_and_a_case_that_changes_it_fails"
declare -A oracle_file=([arms]=arms [unsharded]=unsharded [weights]=compare/weights [execution]=observe/execution
  [split]=observe/split [gradients]=compare/gradients [telemetry]=observe/telemetry [failures]=failures)
for part in $oracle_parts; do
    module[$part]=vdpcp/oracle/${oracle_file[${part#oracle_}]}.py
    tests[$part]=$oracle_tests
done
module[precision]=vdpcp/oracle/compare/precision.py
tests[precision]="tests/unit/test_precision.py tests/unit/test_precision_figures.py tests/unit/test_shared_rounding.py
  tests/oracle/test_rounding.py tests/oracle/test_precision_model.py
  tests/distributed/test_low_precision.py"
module[rounding]=vdpcp/oracle/compare/rounding.py
tests[rounding]=${tests[precision]}" tests/distributed/test_shared_exact_run.py"
module[sketch]=vdpcp/oracle/compare/sketch.py
tests[sketch]="tests/unit/test_sketch.py tests/oracle/test_gradients.py tests/distributed/test_sketched_sum.py"
module[model_cache]=vdpcp/oracle/model_cache.py
tests[model_cache]="tests/unit/test_model_cache.py"
module[runner]=vdpcp/matrix/runner.py
tests[runner]="tests/unit/test_case_result_summary.py tests/unit/test_case_faults.py tests/unit/test_verdicts.py
  tests/unit/test_judge.py tests/unit/test_report.py
  tests/bounds/test_entry_points.py::test_run_case_refuses_too_for_callers_of_the_library
  tests/unit/test_duck_parts.py::test_rank_workers_preload_a_ducks_modules tests/distributed/test_oracle_figures.py
  tests/distributed/test_matrix.py::test_case[three-images-cp4-reference-count]
  tests/mutants/test_mutants.py::test_mutant_is_killed_by_a_named_case[loss-replicated]"
module[fuzz]=vdpcp/tools/fuzz.py
tests[fuzz]="tests/fuzz/test_draw_space.py tests/fuzz/test_failure_signature.py tests/fuzz/test_search_defaults.py
  tests/fuzz/test_search_report.py tests/fuzz/test_saved_folder.py tests/fuzz/test_shrink.py tests/fuzz/test_fuzz.py tests/fuzz/test_regressions.py
  tests/unit/test_verdicts.py::test_fuzz_finds_a_failure_in_a_verdict_as_the_table_says
  tests/bounds/test_entry_points.py::test_fuzz_never_draws_over_the_limit"
module[plugin]=vdpcp/pytest_plugin.py
tests[plugin]="tests/unit/test_root_conftest.py tests/harness/test_config.py tests/unit/test_options.py tests/plugin
  tests/harness/test_lifecycle.py::test_a_pytest_session_run_inside_a_test_leaves_the_callers_workers_warm
  tests/fuzz/test_replay.py::test_pytest_replay_fails_with_the_replay_report
  tests/fuzz/test_replay.py::test_pytest_replay_passes_as_specified_and_collects_nothing_else
  tests/fuzz/test_replay.py::test_replay_of_a_known_limit_is_an_xfail_with_its_reason_in_replay_and_pytest
  tests/fuzz/test_replay.py::test_pytest_replay_of_a_bad_file_is_a_usage_error
  tests/bounds/test_entry_points.py tests/unit/test_third_party.py::test_megatrons_notices_about_optional_packages_are_silenced"
  # every test that loads the plugin in a pytest of its own (pytester), and the filter lines it adds to this one
module[expectations]=vdpcp/matrix/expectations.py
tests[expectations]="tests/unit/test_judge.py tests/unit/test_mismatch_judge.py tests/distributed/test_scenarios.py"
module[ab_judge]=vdpcp/tools/ab/judge.py
tests[ab_judge]="tests/ab/test_judge.py"
module[saved]=vdpcp/matrix/saved.py
tests[saved]="tests/fuzz/test_saved_cp.py tests/fuzz/test_capture.py
  tests/fuzz/test_replay.py::test_every_case_field_round_trips_through_a_saved_file
  tests/fuzz/test_replay.py::test_a_bad_spec_file_exits_2_naming_file_and_field
  tests/fuzz/test_regressions.py::test_every_saved_regression_describes_its_case_and_failure"
module[capture]=vdpcp/tools/capture.py
tests[capture]="tests/fuzz/test_capture.py tests/fuzz/test_saved_cp.py"
module[impls]=vdpcp/impls/registry.py
tests[impls]="tests/unit/test_impls.py tests/unit/test_duck_parts.py"
module[layout]=vdpcp/feature/layout.py
tests[layout]="tests/unit/test_layout.py tests/ab/test_loss_split.py"
tp_tests="tests/distributed/test_tensor_parallel.py
  tests/distributed/test_matrix.py::test_case[three-images-cp2-tp2-reference-count]
  tests/mutants/test_mutants.py::test_mutant_is_killed_by_a_named_case[tp-backward-not-reduced]"  # reach the TP code: both below
module[tensor_parallel]=vdpcp/feature/tensor_parallel.py
tests[tensor_parallel]="$tp_tests
  tests/mutants/test_mutants.py::test_a_rank_that_skips_its_tensor_parallel_tower_is_named_not_hung"
module[reference]=vdpcp/impls/reference.py
tests[reference]="$tp_tests
  tests/mutants/test_mutants.py::test_mutant_is_killed_by_a_named_case[gather-before-project]"
module[gloo_collectives]=vdpcp/oracle/observe/gloo_collectives.py
tests[gloo_collectives]="tests/distributed/test_gloo_collectives.py"
module[traffic]=vdpcp/oracle/observe/traffic.py
tests[traffic]="tests/unit/test_traffic.py"
module[loss]=vdpcp/feature/loss.py
tests[loss]="tests/unit/test_loss.py tests/oracle"
module[pixels]=vdpcp/feature/pixels.py
tests[pixels]="tests/unit/test_loader_pixels.py"
module[bridge_release]=vdpcp/impls/bridge_release.py
tests[bridge_release]="tests/impls/test_bridge_qwen3_vl.py::test_the_functions_run_are_the_installed_packages_files
  tests/impls/test_bridge_qwen3_vl.py::test_the_old_release_is_its_own_files_and_the_two_never_mix
  tests/impls/test_bridge_qwen3_vl.py::test_a_stale_module_registered_under_a_releases_name_is_not_what_the_release_loads
  tests/impls/test_bridge_qwen3_vl.py::test_an_import_by_name_while_a_release_runs_is_refused
  tests/impls/test_bridge_qwen3_vl.py::test_an_old_release_that_is_not_installed_is_named
  tests/impls/test_bridge_exaone45.py::test_the_forward_and_the_vision_sections_functions_are_the_installed_packages_files"
ALL="expectations runner model_cache sketch plugin ab_judge saved capture impls layout reference tensor_parallel fuzz precision $oracle_parts gloo_collectives traffic loss pixels bridge_release"  # the order they run in

names=${*:-$ALL}
names=$(echo " $names " | sed "s/ oracle / $oracle_parts /g")
for name in $names; do
    [ -n "${module[$name]:-}" ] || { echo "mutation.sh: unknown module $name; expected some of: $ALL" >&2; exit 2; }
done

cd "$here"
if ! ./run python -c "import cosmic_ray" 2>/dev/null; then
    echo "mutation.sh: installing cosmic-ray $cosmic_ray_version into the environment" >&2
    ./run python -m pip install -q "cosmic-ray==$cosmic_ray_version" >&2
fi

score() { ./run python "$here/scripts/mutation_score.py" "$@"; }  # pending, shard, retry, report
in_copy() {  # W LOG COMMAND...: COMMAND in worker W's copy of the checkout, its output to LOG (fails as it fails)
    local w=$1 log=$2
    shift 2
    (cd "$work/tree$w" && "$@") >"$log" 2>&1
}
new_session() {  # NAME: the module's mutants, less the operators and the lines left out
    ./run cosmic-ray init "$work/$1.toml" "$work/$1.sqlite" && ./run cr-filter-operators "$work/$1.sqlite" "$work/$1.toml" \
        && ./run cr-filter-pragma "$work/$1.sqlite"
}
shards() {  # NAME...: each module's session, one copy per worker (the one that worker runs)
    for n in "$@"; do for w in $(seq 1 "$workers"); do echo "$work/$n.$w.sqlite"; done; done
}

started=$(date +%s)
copy_checkout() {  # the checkout as it is (tracked and untracked-but-not-ignored files), once per worker
    for w in $(seq 1 "$workers"); do
        mkdir -p "$work/tree$w"
        git ls-files -z -co --exclude-standard | tar --null -T - -cf - | tar -xf - -C "$work/tree$w"
    done
}
as_found() {  # RUN NAME: the module as run RUN found it (NAME.source.py, saved at init: a stopped run's copy may
    # still hold a mutant; runs from before it was saved have only their copy)
    if [ -f "$1/$2.source.py" ]; then echo "$1/$2.source.py"; else echo "$1/tree1/${module[$2]}"; fi
}
resume=${MUTATION_RESUME:-}
if [ -n "$resume" ]; then
    for name in $names; do
        [ -f "$work/$name.1.sqlite" ] && [ -f "$work/$name.source.py" ] \
            || { echo "mutation.sh: $work holds no run of $name to resume" >&2; exit 2; }
        cmp -s "$(as_found "$work" "$name")" "${module[$name]}" \
            || { echo "mutation.sh: ${module[$name]} changed since $work's run began; run it afresh" >&2; exit 2; }
    done
else
    rm -rf "$work"
    mkdir -p "$work"
fi
copy_checkout  # on resume, also undoes the mutant a stopped run left written in its copy

EXCLUDE='"core/ReplaceBinaryOperator_(?!(Add_Sub|Sub_Add|Mul_Div|Div_Mul|FloorDiv_Mul|Div_FloorDiv|FloorDiv_Div|Mod_FloorDiv|Pow_Mul|BitOr_BitAnd|BitAnd_BitOr)$)",
  "core/ReplaceComparisonOperator_(?!(Eq_NotEq|NotEq_Eq|Lt_LtE|LtE_Lt|Gt_GtE|GtE_Gt|Lt_GtE|GtE_Lt|LtE_Gt|Gt_LtE|Is_IsNot|IsNot_Is|In_NotIn|NotIn_In)$)",
  "core/ReplaceUnaryOperator_(?!(USub_UAdd|Delete_Not|Delete_USub|Delete_Invert)$)",
  "core/Variable(Replacer|Inserter)"'
# Each mutant's run: this checkout's tests in a fresh pytest; a hung case is killed at 60 s (the harness names
# it), a whole run at 900 s (cosmic-ray counts that as killed); no heavy preload (these tests need none).
for name in $names; do
    selection=$(echo ${tests[$name]})
    cat > "$work/$name.toml" <<EOF
[cosmic-ray]
module-path = "${module[$name]}"
timeout = 900.0
excluded-modules = []
test-command = "env VDPCP_TIMEOUT=60 VDPCP_PRELOAD=vdpcp.matrix.runner ./run python -m pytest -x -q -n 0 -p no:cacheprovider $selection"

[cosmic-ray.distributor]
name = "local"

[cosmic-ray.filters.operators-filter]
exclude-operators = [$EXCLUDE]
EOF
    [ -z "$resume" ] || continue
    cp "${module[$name]}" "$work/$name.source.py"
    from=${MUTATION_FROM:-}
    if [ -n "$from" ] && [ -f "$from/$name.sqlite" ] && cmp -s "$(as_found "$from" "$name")" "${module[$name]}"; then
        score retry ${MUTATION_SURVIVORS_ONLY:+--survivors-only} "$work/$name.sqlite" "$from"/$name.[0-9]*.sqlite
    else
        in_copy 1 "$work/$name.init.log" new_session "$name"
    fi
    count=$(score pending "$work/$name.sqlite")
    echo "$name: ${module[$name]}, $count mutants, tests: $selection"
done

# Baseline: the selections pass unmutated, or every 'killed' below would mean nothing.
for name in $names; do
    in_copy 1 "$work/$name.baseline.log" ./run cosmic-ray baseline "$work/$name.toml" || {
        echo "mutation.sh: the tests for $name fail without any mutant (see $work/$name.baseline.log)" >&2; exit 1; }
done

# Each worker takes every module's mutants in turn, one shard of each (job i to worker i mod workers), in its
# own copy of the checkout: the load evens out whatever each module's mutants cost.
for name in $names; do
    [ -z "$resume" ] || break
    for w in $(seq 1 "$workers"); do
        cp "$work/$name.sqlite" "$work/$name.$w.sqlite"
        score shard "$work/$name.$w.sqlite" "$w" "$workers"
    done
done
pids=()
for w in $(seq 1 "$workers"); do
    (
        for name in $names; do
            echo "worker $w: $name, $(score pending "$work/$name.$w.sqlite") mutants, from $(date +%T)"
            in_copy "$w" "$work/$name.$w.exec.log" ./run cosmic-ray exec "$work/$name.toml" "$work/$name.$w.sqlite"
        done
        echo "worker $w: done $(date +%T)"
    ) &
    pids+=($!)
done
for pid in "${pids[@]}"; do wait "$pid"; done

seconds=$(($(date +%s) - started))
score report --target "$target" --seconds "$seconds" --equivalent "$here/scripts/mutation-equivalent.txt" $(shards $names)
